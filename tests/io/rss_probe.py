"""Run as a script: peak RSS growth while a capture saves ~200 MB+ of gradients.

Usage: python rss_probe.py disk|memory PATH. Prints one JSON line:
{"saved_bytes", "disk_bytes", "peak_growth_bytes"}. A warm-up capture first
loads everything backlens and torch import lazily, so only the saving is measured.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

import backlens as bl
from backlens.io.disk_store import to_disk


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(mode: str, path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])
    x = torch.randn(64, 512)
    warm = bl.capture(model, x, save_grads=True, storage=to_disk(path.with_name(path.name + "-warm"), overwrite=True))
    warm.output.sum().backward()
    warm.close()
    del warm
    model.zero_grad(set_to_none=False)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
        base = status("VmRSS:")
    except OSError:
        base = status("VmHWM:")

    cap = bl.capture(model, x, save_grads=True, storage=to_disk(path) if mode == "disk" else None)
    loss = cap.output.sum()
    for k in range(1, 12):
        # A different scale per pass, so no pass repeats another's values
        # (equal tensors would be stored once and prove nothing).
        (loss * k).backward(retain_graph=True)
    saved = sum(t.numel() * t.element_size() for call in cap.grad_fn_calls
                for side in (call.grad_inputs, call.grad_outputs) if side for t in side if t is not None)
    cap.close()
    peak = status("VmHWM:")
    disk = sum(f.stat().st_size for f in path.glob("*")) if path.exists() else 0
    print(json.dumps({"saved_bytes": saved, "disk_bytes": disk, "peak_growth_bytes": peak - base}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
