"""Live tracing: what a trace costs, beside the interleaving peer (nnsight).

Two measurements (API.md §2):

1. **Overhead on a real model.** A 4-layer GPT-2 config (n_embd 256, 4 heads,
   vocab 1000), batch 4 x seq 64, one intra-op thread: a trace that reads all
   four blocks' outputs and saves their gradients in a ``with loss.backward():``
   block, against plain forward + backward with a tensor hook on each block's
   output. Rounds interleave the two (order alternating), and the median of
   the per-round ratios is printed. Target: <= 1.03x, and no higher than the
   peer's ratio for the same body, measured in the same run.

2. **Fixed cost per trace on a tiny model**, against the peer: trace time minus
   the plain equivalent, for a forward-only body, a forward + backward-block
   body, and a body that edits a layer. Target: each no higher than the peer's.

The peer runs in its own virtual environment, created by this script under
/tmp (torch pinned first, so pip never fetches a CUDA build); it is never a
dependency of backlens. Its figures are measured in a subprocess running this
same file, and the two sides alternate so drift in the machine hits both.

    python bench/live.py                 # both
    python bench/live.py --skip-peer     # no nnsight
    python bench/live.py --rounds 40

Timing figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_VENV = Path(os.environ.get("BACKLENS_PEER_VENV", "/tmp/backlens-nnsight-venv"))
TORCH_PIN = "torch==2.13.0"
PEER_PIN = os.environ.get("BACKLENS_PEER_SPEC", "nnsight")


# -- shared timing helpers ----------------------------------------------------


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _tiny():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.randn(2, 4)


def _plain_bodies(model, x):
    def forward():
        model(x)

    def forward_backward():
        h = model[0](x)
        h.register_hook(lambda grad: None)
        model[2](model[1](h)).sum().backward()

    def forward_edit():
        h = model[0](x) * 2
        model[2](model[1](h))

    return {"forward": forward, "forward+backward": forward_backward, "forward edit": forward_edit}


def fixed_costs(wrapped, model, x, repeats: int) -> dict[str, float]:
    """Median trace time minus median plain time, per body, in microseconds.

    ``wrapped`` is a backlens lens or an nnsight model: both spell these
    bodies the same way.
    """

    def forward():
        with wrapped.trace(x):
            out = wrapped.output.save()  # noqa: F841

    def forward_backward():
        with wrapped.trace(x):
            h = wrapped[0].output
            loss = wrapped.output.sum()
            with loss.backward():
                g = h.grad.save()  # noqa: F841

    def forward_edit():
        with wrapped.trace(x):
            wrapped[0].output = wrapped[0].output * 2
            out = wrapped.output.save()  # noqa: F841

    traced = {"forward": forward, "forward+backward": forward_backward, "forward edit": forward_edit}
    plain = _plain_bodies(model, x)
    result = {}
    for name in traced:
        for _ in range(100):  # warm caches, pools and allocators
            traced[name]()
            plain[name]()
        trace_us = _median_us(traced[name], repeats)
        plain_us = _median_us(plain[name], repeats)
        result[name] = trace_us - plain_us
        result[name + " plain"] = plain_us
    return result


# -- the two roles ------------------------------------------------------------


def peer_role(repeats: int) -> None:
    """Run inside the peer's venv: print nnsight's fixed costs as JSON."""
    import torch
    from nnsight import NNsight

    torch.set_num_threads(1)
    model, x = _tiny()
    print(json.dumps(fixed_costs(NNsight(model), model, x, repeats)))


def ours_fixed(repeats: int) -> dict[str, float]:
    import torch

    import backlens.live as bl

    torch.set_num_threads(1)
    model, x = _tiny()
    return fixed_costs(bl.wrap(model), model, x, repeats)


def gpt2_overhead(wrap, rounds: int) -> dict[str, float]:
    """GPT-2 forward + backward reading all four blocks' output gradients, traced vs plain.

    ``wrap(model)`` makes the lens (backlens) or the envoy (nnsight): both
    spell the body the same way.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(config).eval()
    x = torch.randint(0, 1000, (4, 64))
    lens = wrap(model)
    blocks = list(model.transformer.h)

    def plain():
        kept = {}
        handles = []
        for i, block in enumerate(blocks):

            def hook(module, args, output, i=i):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden.register_hook(lambda grad: kept.__setitem__(i, grad))

            handles.append(block.register_forward_hook(hook))
        try:
            out = model(x)
        finally:
            for handle in handles:
                handle.remove()
        out.logits.sum().backward()
        model.zero_grad(set_to_none=True)
        return [kept[i] for i in range(len(blocks))]

    def traced():
        kept = {}
        with lens.trace(x):
            hidden = [lens.transformer.h[i].output for i in range(4)]
            loss = lens.output.logits.sum()
            with loss.backward():
                kept["grads"] = [h.grad.save() for h in reversed(hidden)]
        model.zero_grad(set_to_none=True)
        return list(reversed(kept["grads"]))

    same = all(torch.equal(a, b) for a, b in zip(plain(), traced()))
    for _ in range(3):
        plain()
        traced()
    ratios, plain_ms, traced_ms = [], [], []
    for r in range(rounds):
        order = (plain, traced) if r % 2 == 0 else (traced, plain)
        timing = {}
        for fn in order:
            start = time.perf_counter()
            fn()
            timing[fn] = time.perf_counter() - start
        ratios.append(timing[traced] / timing[plain])
        plain_ms.append(timing[plain] * 1e3)
        traced_ms.append(timing[traced] * 1e3)
    return {
        "median ratio": statistics.median(ratios),
        "plain ms": statistics.median(plain_ms),
        "traced ms": statistics.median(traced_ms),
        "same gradients": float(same),
    }


def _ours_wrap(model):
    import backlens.live as bl

    return bl.wrap(model)


def _peer_wrap(model):
    from nnsight import NNsight

    return NNsight(model)


# -- the peer's environment ---------------------------------------------------


def ensure_peer() -> Path | None:
    python = PEER_VENV / "bin" / "python"
    check = [str(python), "-c", "import nnsight, torch, transformers"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {PEER_VENV} for nnsight (once) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, TORCH_PIN], check=True)  # first: the CPU wheel, never CUDA
        subprocess.run([*pip, PEER_PIN, TORCH_PIN], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"  peer unavailable ({exc}); skipping the comparison")
        return None
    return python


def _peer_run(python: Path, *args: str) -> dict[str, float] | None:
    done = subprocess.run([str(python), __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        print("  peer run failed:\n" + done.stderr[-2000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _span(values: list[float], unit: str, digits: int) -> str:
    if not values:
        return "-"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f}{unit} [{low:.{digits}f}-{high:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["main", "peer", "peer-gpt2"], default="main")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved GPT-2 rounds")
    parser.add_argument("--repeats", type=int, default=2000, help="timed traces per tiny-model figure")
    parser.add_argument("--alternations", type=int, default=3, help="ours/peer alternations")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-gpt2", action="store_true")
    args = parser.parse_args()

    if args.role == "peer":
        peer_role(args.repeats)
        return
    if args.role == "peer-gpt2":
        print(json.dumps(gpt2_overhead(_peer_wrap, args.rounds)))
        return

    python = None if args.skip_peer else ensure_peer()
    if not args.skip_gpt2:
        print("GPT-2 (4 layers, n_embd 256, batch 4 x seq 64, 1 thread): all four blocks' output gradients")
        ours_runs, peer_runs = [], []
        for _ in range(args.alternations):
            ours_runs.append(gpt2_overhead(_ours_wrap, args.rounds))
            if python is not None:
                peer = _peer_run(python, "--role", "peer-gpt2", "--rounds", str(args.rounds))
                if peer is not None:
                    peer_runs.append(peer)
        for name, runs in (("backlens", ours_runs), ("nnsight", peer_runs)):
            if not runs:
                continue
            ratios = [run["median ratio"] for run in runs]
            same = "equal to plain autograd" if all(run["same gradients"] for run in runs) else "NOT EQUAL to plain"
            print(
                f"  {name:9s} ratio {_span(ratios, 'x', 3)}   plain {_span([r['plain ms'] for r in runs], ' ms', 1)}"
                f"   traced {_span([r['traced ms'] for r in runs], ' ms', 1)}   gradients {same}"
            )
        if peer_runs:
            ours = statistics.median(run["median ratio"] for run in ours_runs)
            theirs = statistics.median(run["median ratio"] for run in peer_runs)
            print(f"  target <= 1.03x and <= the peer's: backlens {ours:.3f}x, nnsight {theirs:.3f}x")

    print("Fixed cost per trace, tiny model (trace minus plain, microseconds, median [range over runs]):")
    ours_runs, peer_runs = [], []
    for _ in range(args.alternations):
        ours_runs.append(ours_fixed(args.repeats))
        if python is not None:
            peer = _peer_run(python, "--role", "peer", "--repeats", str(args.repeats))
            if peer is not None:
                peer_runs.append(peer)
    for body in ("forward", "forward+backward", "forward edit"):
        ours = statistics.median(run[body] for run in ours_runs)
        line = f"  {body:17s} backlens {_span([run[body] for run in ours_runs], ' us', 1)}"
        if peer_runs:
            theirs = statistics.median(run[body] for run in peer_runs)
            verdict = "ours no higher" if ours <= theirs else "ours higher"
            line += f"   nnsight {_span([run[body] for run in peer_runs], ' us', 1)}   ({verdict})"
        print(line)


if __name__ == "__main__":
    main()
