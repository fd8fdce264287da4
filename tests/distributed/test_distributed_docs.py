"""docs/distributed.md's train.py runs under torchrun on 2 ranks and does what the page says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rank_launch import WORLD_SIZE, free_port, loopback_env

import backlens as bl

PAGE = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
TIMEOUT = 180


def test_the_pages_train_py_runs_under_torchrun_and_its_run_loads_as_a_rank_set(tmp_path):
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
                 if block.startswith("# train.py")]
    (tmp_path / "train.py").write_text(script)
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={WORLD_SIZE}",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}", "train.py", str(run)],
        cwd=tmp_path, env=loopback_env(free_port()), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all_reduce_1:1 all_reduce" in done.stdout and "<GradCheck: the 4 all-reduced" in done.stdout
    ranks = bl.load(run)
    assert [cap.rank for cap in ranks.ranks] == list(range(WORLD_SIZE))
    assert ranks.check_grads()
