"""Capture overhead under DDP (2 ranks, gloo on CPU) against stock DDP, in the same run.

Model and batch are bench/overhead.py's (a 4-layer GPT-2, n_embd 256, batch 4 x seq 64 per
rank), one thread per rank. Each rank holds two DDP replicas of the same weights: one never
captured (stock DDP: its reducer has no hook), one captured every step with the default
options (FLOPs and timing on; its bucket all-reduces go through backlens's hook and are
recorded). Steps run in interleaved rounds, shuffled the same way on both ranks; the median
ratio to stock is printed per rank. For comparison, the same rounds also time the
single-process default capture against plain PyTorch on a third copy without DDP
(bench/overhead.py's ``capture_default``), under the same load.

    python bench/distributed.py [--rounds 20]

Target: the DDP ratio is at most the single-process ratio + 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from overhead import make_model, time_rounds  # noqa: E402

import backlens as bl  # noqa: E402

WORLD_SIZE = 2


def rank_main(rank: int, port: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if Path("/sys/class/net/lo").exists():
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        stock_model, ids = make_model()
        captured_model, _ = make_model()
        plain_model, _ = make_model()
        ids = ids.roll(rank, 0)  # each rank its own batch
        stock, captured = DDP(stock_model), DDP(captured_model)
        collectives = []

        def stock_step():
            stock(ids).logits.sum().backward()
            stock.zero_grad(set_to_none=True)

        def captured_step():
            cap = bl.capture(captured, ids)
            cap.output.logits.sum().backward()
            collectives.append(len(cap.passes[0].collectives))
            cap.close()
            captured.zero_grad(set_to_none=True)

        def plain_step():
            plain_model(ids).logits.sum().backward()
            plain_model.zero_grad(set_to_none=True)

        def captured_plain_step():
            cap = bl.capture(plain_model, ids)
            cap.output.logits.sum().backward()
            cap.close()
            plain_model.zero_grad(set_to_none=True)

        ratios = time_rounds(stock_step, {"DDP default capture": captured_step, "plain": plain_step,
                                          "plain default capture": captured_plain_step}, rounds)
        result = {"ratio": ratios["DDP default capture"][0], "stock_ms": ratios["plain_ms"][0],
                  "single_ratio": ratios["plain default capture"][0] / ratios["plain"][0],
                  "collectives_per_pass": max(collectives)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(f"GPT-2 4 layers, n_embd 256, batch 4 x seq 64 per rank, torch {torch.__version__}, "
          f"{WORLD_SIZE} ranks (gloo, CPU), 1 thread each")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(free_port(), args.rounds, out), nprocs=WORLD_SIZE)
        results = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        print(f"[rank {rank}] stock DDP median {result['stock_ms']:.1f} ms; default capture "
              f"{result['ratio']:.3f}x stock DDP ({result['collectives_per_pass']} collectives per pass); "
              f"same rounds, no DDP: default capture {result['single_ratio']:.3f}x plain")
    worst = max(r["ratio"] - r["single_ratio"] for r in results)
    verdict = "meets" if worst <= 0.05 else "misses"
    print(f"DDP capture overhead minus single-process overhead, worst rank: {worst:+.3f}: {verdict} the "
          "target (<= +0.05)")


if __name__ == "__main__":
    main()
