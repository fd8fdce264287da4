"""Saving and loading bundles against plain PyTorch (torch.save / torch.load of the same tensors).

A capture keeping every gradient of an 8-layer 1024-wide MLP over three passes
(about 450 MB of gradients, stored once each when equal) is saved with ``cap.save``, loaded with
``bl.load`` (checking every sha256 up front, and with ``verify=False``), and
every saved gradient is read back (each tensor is read into its own memory and
checked against its sha256 on first use). Plain PyTorch does the same with
``torch.save`` of the same tensors and ``torch.load(mmap=False)``. Printed:
seconds and the ratio to plain, median of a few rounds, in one process.

    python bench/bundles.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import backlens as bl


def make_capture():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.randn(256, 1024)
    cap = bl.capture(model, x, save_grads=True, flops=False)
    loss = cap.output.pow(2).mean()
    for k in range(1, 4):
        (loss * k).backward(retain_graph=True)
    return cap


def saved_tensors(cap) -> list[torch.Tensor]:
    out = []
    for call in cap.grad_fn_calls:
        for side in (call.grad_inputs, call.grad_outputs):
            out.extend(t for t in side or () if t is not None)
    return out


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main(rounds: int) -> None:
    cap = make_capture()
    tensors = saved_tensors(cap)
    megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    root = Path(tempfile.mkdtemp())
    results: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            shutil.rmtree(root / "b", ignore_errors=True)
            results.setdefault("plain save", []).append(timed(lambda: torch.save(tensors, root / "plain.pt")))
            results.setdefault("cap.save", []).append(timed(lambda: cap.save(root / "b")))
            results.setdefault("plain load", []).append(
                timed(lambda: torch.load(root / "plain.pt", mmap=False, weights_only=True)))
            results.setdefault("bl.load (verify)", []).append(timed(lambda: bl.load(root / "b")))
            results.setdefault("bl.load (verify=False)", []).append(timed(lambda: bl.load(root / "b", verify=False)))

            def read_all():
                loaded = bl.load(root / "b", verify=False)
                for call in loaded.grad_fn_calls:
                    call.grad_inputs, call.grad_outputs  # noqa: B018

            results.setdefault("bl.load + read every gradient", []).append(timed(read_all))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(times) for name, times in results.items()}
    print(f"{megabytes:.0f} MB of saved gradients, torch {torch.__version__}")
    for name, seconds in median.items():
        plain = median["plain save"] if "save" in name else median["plain load"]
        print(f"  {name:32s} {seconds:7.3f} s   {seconds / plain:5.2f}x plain   {megabytes / seconds:7.0f} MB/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    main(parser.parse_args().rounds)
