"""Cost of finding the first non-finite gradient: backlens vs torch's anomaly mode.

    python bench/nonfinite.py [--rounds 10]

Same model and protocol as bench/overhead.py (4-layer GPT-2 config, batch 4 x 64,
one thread, interleaved rounds, median ratio to plain fwd+bwd).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from overhead import make_model

import backlens as bl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    model, ids = make_model()

    def plain():
        model(ids).logits.sum().backward()
        model.zero_grad(set_to_none=True)

    def backlens_nonfinite():
        with bl.capture(model, ids, flops=False, timing=False, detect_nonfinite=True) as cap:
            cap.output.logits.sum().backward()
        model.zero_grad(set_to_none=True)

    def anomaly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                model(ids).logits.sum().backward()
        model.zero_grad(set_to_none=True)

    variants = {"plain": plain, "bl.capture(detect_nonfinite=True)": backlens_nonfinite,
                "torch.autograd.detect_anomaly()": anomaly}
    samples = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    base = statistics.median(samples["plain"])
    print(f"plain fwd+bwd median {base * 1e3:.1f} ms")
    for name in list(variants)[1:]:
        print(f"  {name:<36} {statistics.median(samples[name]) / base:.2f}x plain")


if __name__ == "__main__":
    main()
