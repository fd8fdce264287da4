"""Gradient monitor overhead against plain PyTorch training, in the same process.

Model: the 4-layer GPT-2 of bench/overhead.py (n_embd 256, 4 heads, vocab
1000, 3.4M parameters), batch 4 x seq 64, one thread. A step is a full
training step: forward, backward, AdamW step, zero_grad. Every variant
trains the same model and optimizer; each round runs every variant for a few
steps, in a shuffled order, its monitor made (and a first step run) before
its steps are timed and closed after. Printed: median step time ratios to
plain, in the process's CPU time (one thread: the step's own work; on a
shared machine wall time also counts other processes' turns), and in wall time.

    python bench/monitor.py [--rounds 20] [--steps 3]

Targets (monitor recording every step, every=1):
  gradient stats (norm, absmax, nonfinite)             <= 1.02x plain
  default stats (with the update ratio ‖Δw‖/‖w‖)       <= 1.07x plain
  gradient stats with outputs=True                     <= 1.05x plain
and each faster than the same gradient stats by hand (a norm, max |g| and
non-finite count per parameter, each read with .item()).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overhead import make_model  # noqa: E402

import backlens as bl  # noqa: E402

GRAD_STATS = ("norm", "absmax", "nonfinite")


def by_hand_stats(model: torch.nn.Module) -> list[tuple[float, float, int]]:
    """The usual hand-written logging: a norm, max |g| and non-finite count per parameter, each an .item()."""
    out = []
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            out.append((grad.norm().item(), grad.abs().max().item(), int((~torch.isfinite(grad)).sum().item())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, ids = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(after_backward=None) -> None:
        model(ids, labels=ids).loss.backward()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    variants = {
        "plain": None,
        "gradient stats (norm, absmax, nonfinite)": {"stats": GRAD_STATS},
        "default stats (with update_ratio)": {},
        "gradient stats, outputs=True": {"stats": GRAD_STATS, "outputs": True},
        "gradient stats by hand (.item() per param)": "by hand",
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):  # warm every path
        train_step()
    order = list(variants.items())
    shuffle = random.Random(0).shuffle
    for _ in range(args.rounds):
        shuffle(order)
        for name, options in order:
            monitor = bl.monitor(model, optimizer, every=1, **options) if isinstance(options, dict) else None
            hook = by_hand_stats if options == "by hand" else None
            train_step(hook)  # untimed: a monitor's first step allocates its buffers
            for _step in range(args.steps):
                start, wall = time.process_time(), time.perf_counter()
                train_step(hook)
                samples[name].append(time.process_time() - start)
                walls[name].append(time.perf_counter() - wall)
            if monitor is not None:
                monitor.close()
    base, base_wall = statistics.median(samples["plain"]), statistics.median(walls["plain"])
    print(f"GPT-2 4 layers (3.4M parameters), batch 4 x seq 64, AdamW, torch {torch.__version__}, 1 thread; "
          f"{args.rounds} rounds x {args.steps} steps, medians")
    print(f"  {'plain training step':<46} {base * 1e3:.1f} ms CPU, {base_wall * 1e3:.1f} ms wall")
    targets = {"gradient stats (norm, absmax, nonfinite)": 1.02, "default stats (with update_ratio)": 1.07,
               "gradient stats, outputs=True": 1.05}
    by_hand = statistics.median(samples["gradient stats by hand (.item() per param)"]) / base
    for name, values in samples.items():
        if name == "plain":
            continue
        ratio, wall = statistics.median(values) / base, statistics.median(walls[name]) / base_wall
        target = f"(target <= {targets[name]:.2f}x; by hand {by_hand:.3f}x)" if name in targets else ""
        print(f"  {name:<46} {ratio:.3f}x plain CPU, {wall:.3f}x wall {target}")


if __name__ == "__main__":
    main()
