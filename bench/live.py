"""Live tracing: what a trace costs, beside the interleaving peer (nnsight).

Two measurements (API.md §2):

1. **Overhead on a real model.** A 4-layer GPT-2 config (n_embd 256, 4 heads,
   vocab 1000), batch 4 x seq 64, one intra-op thread: a trace that reads all
   four blocks' outputs and saves their gradients in a ``with loss.backward():``
   block, against plain forward + backward with a tensor hook on each block's
   output. Each round runs plain and traced four times in ABBA BAAB order and
   keeps the fastest of each; the median of the per-round ratios is printed, in
   CPU time (what the code cost) and wall time. Target: <= 1.03x, and no higher
   than the peer's ratio for the same body, measured in the same run. The
   difference of the two sides' ratios, round by round, is printed with the
   standard error of its median: the noise the verdict sits in.

2. **Fixed cost per trace on a tiny model**, against the peer: trace time minus
   the plain equivalent, for a forward-only body, a forward + backward-block
   body, and a body that edits a layer. Target: each no higher than the peer's.

The peer runs in its own virtual environment, created by this script under
/tmp (torch pinned first, so pip never fetches a CUDA build); it is never a
dependency of backlens. Each side is measured by a worker subprocess running
this same file, started the same way, and the two take turns round by round
(who goes first alternating), so drift in a shared machine's load hits both
alike.

The plain steps are stock PyTorch in both workers: they run on an untouched
copy of the model (``copy.deepcopy`` before the library wraps it) and call
``torch.autograd.backward(loss)``. The peer changes both when it wraps a model
and when it is imported: it puts its own controller in place of every module's
``forward`` (each module call then runs its Python code, in or out of a trace),
and replaces ``torch.Tensor.backward`` (a plain ``loss.backward()`` then looks
for a ``with`` block in the caller's source and finds none). Each is a cost on
every plain step that would lower its traced/plain ratio without making its
trace any faster. backlens changes neither. What a plain step on the wrapped
tiny model costs beyond the same step on its untouched copy, and what a plain
``.backward()`` costs beyond torch's function, are printed last for each side.

Both workers run with glibc's malloc thresholds fixed (``MALLOC_MMAP_THRESHOLD_``
32 MiB, ``MALLOC_TRIM_THRESHOLD_`` 64 MiB: where glibc's own adjustment ends
once a process has freed a large block). Left to adjust, they depend on the
largest block each process happened to free before (while importing, say):
one process then gives the top of its heap back to the OS after every step
and faults it in again in the next (hundreds of page faults a step, a
traced step more than a plain one as its body keeps tensors alive), another
does not, and the comparison measures that accident instead of the
libraries. The page faults of each side's steps are printed;
``--malloc-as-is`` leaves the thresholds to glibc.

Each timed step is also charged for the garbage it leaves: the step ends
with a run of Python's cyclic collector, inside the timing, on both sides and
for plain and traced steps alike. A step that leaves objects in reference
cycles (the peer's trace keeps its whole autograd graph, 48 objects with the
loss and the block outputs, in one) would otherwise hand their freeing,
about 130 µs on GPT-2, to whichever later step the collector happens to run
in; and the fastest-of-four rule below drops exactly those steps, so that
cost would never be counted. Setup's objects are frozen (``gc.freeze``) so
that each collection looks only at what the steps made (about 25 µs, the
same on every step). The objects each side's steps left are printed;
``--collector-as-is`` leaves the collector to Python.

    python bench/live.py                 # both
    python bench/live.py --skip-peer     # no nnsight
    python bench/live.py --rounds 40

Timing figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_VENV = Path(os.environ.get("BACKLENS_PEER_VENV", "/tmp/backlens-nnsight-venv"))
TORCH_PIN = "torch==2.13.0"
PEER_PIN = os.environ.get("BACKLENS_PEER_SPEC", "nnsight")
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
BODIES = ("forward", "forward+backward", "forward edit")


# -- what each side runs (both spell every body the same way) -------------------


def _median_us(fn, repeats: int, clock, charge_garbage: bool) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        if charge_garbage:
            gc.collect()
        times.append(clock() - start)
    return statistics.median(times) * 1e6


# Wall time, and the process's CPU time: on a machine shared with other work,
# CPU time is what the code itself cost (time spent preempted is not in it).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class Workload:
    """The tiny model's bodies and the GPT-2 body, traced through ``wrap(model)`` and plain."""

    def __init__(self, wrap, gpt2: bool, charge_garbage: bool):
        import torch
        from torch import nn

        self.charge_garbage = charge_garbage

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.tiny = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.tiny_untouched = copy.deepcopy(self.tiny)  # plain steps run stock (see the docstring)
        self.x = torch.randn(2, 4)
        self.tiny_lens = wrap(self.tiny)
        self.traced = self._tiny_traced()
        self.plain = self._tiny_plain()
        self.backward_forms = self._tiny_backward_forms()
        for name in BODIES:
            for _ in range(100):  # warm caches, pools and allocators
                self.traced[name]()
                self.plain[name]()
        for form in self.backward_forms.values():
            for _ in range(100):
                form()
        if gpt2:
            self._gpt2_setup(wrap)
        if charge_garbage:  # each step's collection then looks only at what steps made
            gc.collect()
            gc.freeze()

    def _tiny_traced(self):
        wrapped, x = self.tiny_lens, self.x

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

        return {"forward": forward, "forward+backward": forward_backward, "forward edit": forward_edit}

    def _tiny_plain(self):
        import torch

        model, x = self.tiny_untouched, self.x

        def forward():
            model(x)

        def forward_backward():
            h = model[0](x)
            h.register_hook(lambda grad: None)
            torch.autograd.backward(model[2](model[1](h)).sum())  # stock PyTorch in both workers (see the docstring)

        def forward_edit():
            h = model[0](x) * 2
            model[2](model[1](h))

        return {"forward": forward, "forward+backward": forward_backward, "forward edit": forward_edit}

    def _tiny_backward_forms(self):
        """A plain step outside any trace on the wrapped model, its backward spelled as a method
        and as torch's function, and the function's step on the untouched copy."""
        import torch

        model, untouched, x = self.tiny, self.tiny_untouched, self.x

        def method():
            model(x).sum().backward()

        def function():
            torch.autograd.backward(model(x).sum())

        def untouched_function():
            torch.autograd.backward(untouched(x).sum())

        return {"method": method, "function": function, "untouched": untouched_function}

    def backward_tax(self, repeats: int, clock: str) -> dict[str, float]:
        """One round: median time of a plain step on the wrapped model calling ``.backward()``
        and calling ``torch.autograd.backward``, and of the latter on the untouched copy
        (microseconds)."""
        tick = CLOCKS[clock]
        return {form: _median_us(fn, repeats, tick, self.charge_garbage) for form, fn in self.backward_forms.items()}

    def fixed(self, body: str, repeats: int, clock: str) -> dict[str, float]:
        """One round: median traced and plain time of ``body``, microseconds."""
        tick = CLOCKS[clock]
        return {
            "traced": _median_us(self.traced[body], repeats, tick, self.charge_garbage),
            "plain": _median_us(self.plain[body], repeats, tick, self.charge_garbage),
        }

    def _gpt2_setup(self, wrap) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=64)
        model = GPT2LMHeadModel(config).eval()
        untouched = copy.deepcopy(model)  # plain steps run stock (see the docstring)
        x = torch.randint(0, 1000, (4, 64))
        lens = wrap(model)
        blocks = list(untouched.transformer.h)

        def plain():
            kept = {}
            handles = []
            for i, block in enumerate(blocks):

                def hook(module, args, output, i=i):
                    hidden = output[0] if isinstance(output, tuple) else output
                    hidden.register_hook(lambda grad: kept.__setitem__(i, grad))

                handles.append(block.register_forward_hook(hook))
            try:
                out = untouched(x)
            finally:
                for handle in handles:
                    handle.remove()
            torch.autograd.backward(out.logits.sum())
            untouched.zero_grad(set_to_none=True)
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

        self.same = all(torch.equal(a, b) for a, b in zip(plain(), traced()))
        for _ in range(3):
            plain()
            traced()
        self.gpt2_plain, self.gpt2_traced = plain, traced

    def gpt2(self, traced_first: bool) -> dict[str, float]:
        """One round: four plain and four traced GPT-2 steps in ABBA BAAB order, the fastest of
        each (milliseconds, wall and CPU): the order cancels drift, the minimum a stray stall."""
        timing: dict[str, float] = {}
        first, second = ("traced", self.gpt2_traced), ("plain", self.gpt2_plain)
        if not traced_first:
            first, second = second, first
        for name, fn in (first, second, second, first, second, first, first, second):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            garbage = gc.collect() if self.charge_garbage else 0
            wall, cpu = (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            timing[name] = min(timing.get(name, wall), wall)
            timing[name + " cpu"] = min(timing.get(name + " cpu", cpu), cpu)
            timing[name + " faults"] = timing.get(name + " faults", 0) + faults / 4  # the mean of its four steps
            timing[name + " garbage"] = timing.get(name + " garbage", 0) + garbage / 4
        timing["same"] = float(self.same)
        return timing


def _ours_wrap(model):
    import backlens.live as bl

    return bl.wrap(model)


def _peer_wrap(model):
    from nnsight import NNsight

    return NNsight(model)


def worker_role(side: str, gpt2: bool, charge_garbage: bool) -> None:
    """Run in a worker: answer one JSON request per line (a round) on stdout."""
    work = Workload(_ours_wrap if side == "backlens" else _peer_wrap, gpt2, charge_garbage)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["what"] == "gpt2":
            answer = work.gpt2(request["traced_first"])
        elif request["what"] == "backward tax":
            answer = work.backward_tax(request["repeats"], request["clock"])
        else:
            answer = work.fixed(request["body"], request["repeats"], request["clock"])
        print(json.dumps(answer), flush=True)


class Side:
    """One side's worker subprocess (``python`` runs it), asked for one round at a time."""

    def __init__(self, name: str, python: Path | str, gpt2: bool, env: dict[str, str] | None, charge_garbage: bool):
        args = [str(python), __file__, "--role", "worker", "--side", name] + ([] if gpt2 else ["--skip-gpt2"])
        args += [] if charge_garbage else ["--collector-as-is"]
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.name = name
        self._read()

    def _read(self) -> dict[str, float]:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped")
        return json.loads(line)

    def ask(self, **request) -> dict[str, float]:
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=60)


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


def _span(values: list[float], unit: str, digits: int) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f}{unit} [{low:.{digits}f}-{high:.{digits}f}]"


def _paired(ours: list[float], theirs: list[float]) -> str:
    """Ours minus the peer's ratio round by round (the two sides ran back to back): its
    median and that median's standard error (1.25 sd / sqrt(n)), in points of plain."""
    differences = [(a - b) * 100 for a, b in zip(ours, theirs)]
    error = 1.25 * statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
    return f"ours minus the peer's, round by round: median {statistics.median(differences):+.2f} +/- {error:.2f} points"


def _turns(sides: dict, r: int):
    """The sides in this round's order (who goes first alternates)."""
    names = list(sides)
    return [(name, sides[name]) for name in (names if r % 2 == 0 else names[::-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["main", "worker"], default="main")
    parser.add_argument("--side", choices=["backlens", "nnsight"], default="backlens", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=60, help="GPT-2 rounds per side")
    parser.add_argument("--repeats", type=int, default=300, help="timed traces per tiny-model round")
    parser.add_argument("--alternations", type=int, default=24, help="tiny-model rounds per side and body")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu", help="clock of the tiny-model figures")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--malloc-as-is", action="store_true", help="leave glibc's malloc thresholds to glibc")
    parser.add_argument("--collector-as-is", action="store_true", help="leave Python's cyclic collector to Python")
    args = parser.parse_args()
    charge_garbage = not args.collector_as_is

    if args.role == "worker":
        worker_role(args.side, not args.skip_gpt2, charge_garbage)
        return

    gpt2 = not args.skip_gpt2
    env = None if args.malloc_as_is else {**os.environ, **FIXED_MALLOC}
    print("malloc thresholds: " + ("as glibc sets them" if args.malloc_as_is else " ".join(f"{k}={v}" for k, v in FIXED_MALLOC.items())))
    print("garbage: " + ("left to Python's collector" if args.collector_as_is else "collected at the end of every timed step"))
    sides: dict = {}
    try:
        sides["backlens"] = Side("backlens", sys.executable, gpt2, env, charge_garbage)
        python = None if args.skip_peer else ensure_peer()
        if python is not None:
            sides["nnsight"] = Side("nnsight", python, gpt2, env, charge_garbage)
        if gpt2:
            print("GPT-2 (4 layers, n_embd 256, batch 4 x seq 64, 1 thread): all four blocks' output gradients")
            ratios: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in sides}
            plain_ms: dict[str, list[float]] = {name: [] for name in sides}
            faults: dict[str, dict[str, list[float]]] = {name: {"plain": [], "traced": []} for name in sides}
            garbage: dict[str, dict[str, list[float]]] = {name: {"plain": [], "traced": []} for name in sides}
            same = {name: True for name in sides}
            for r in range(args.rounds):
                for name, side in _turns(sides, r):
                    got = side.ask(what="gpt2", traced_first=bool(r % 4 < 2))
                    ratios[name]["wall"].append(got["traced"] / got["plain"])
                    ratios[name]["cpu"].append(got["traced cpu"] / got["plain cpu"])
                    plain_ms[name].append(got["plain cpu"])
                    for kind in ("plain", "traced"):
                        faults[name][kind].append(got[kind + " faults"])
                        garbage[name][kind].append(got[kind + " garbage"])
                    same[name] = same[name] and bool(got["same"])
            for name in sides:
                print(
                    f"  {name:9s} traced/plain: CPU time {_span(ratios[name]['cpu'], 'x', 3)}"
                    f"   wall time {_span(ratios[name]['wall'], 'x', 3)}"
                    f"   (median [range] of {args.rounds} rounds; plain step {statistics.median(plain_ms[name]):.1f} ms CPU)"
                    f"   gradients {'equal to' if same[name] else 'NOT EQUAL to'} plain autograd"
                )
                left = (
                    ""
                    if args.collector_as_is
                    else f"; objects left for the collector per step: plain {statistics.median(garbage[name]['plain']):.0f},"
                    f" traced {statistics.median(garbage[name]['traced']):.0f}"
                )
                print(
                    f"  {'':9s} page faults per step (median): plain {statistics.median(faults[name]['plain']):.0f},"
                    f" traced {statistics.median(faults[name]['traced']):.0f}{left}"
                )
            if len(sides) > 1:
                for clock in ("cpu", "wall"):
                    ours, theirs = (statistics.median(ratios[name][clock]) for name in ("backlens", "nnsight"))
                    verdict = "met" if ours <= 1.03 and ours <= theirs else "NOT met"
                    print(f"  target <= 1.03x and <= the peer's ({clock}): backlens {ours:.3f}x, nnsight {theirs:.3f}x ({verdict})")
                    print(f"    {_paired(ratios['backlens'][clock], ratios['nnsight'][clock])}")

        print(
            f"Fixed cost per trace, tiny model (trace minus plain, {args.clock} time, microseconds; "
            f"median [range] of {args.alternations} rounds):"
        )
        for body in BODIES:
            costs: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.alternations):
                for name, side in _turns(sides, r):
                    got = side.ask(what="fixed", body=body, repeats=args.repeats, clock=args.clock)
                    costs[name].append(got["traced"] - got["plain"])
            line = f"  {body:17s}" + "".join(f"   {name} {_span(costs[name], ' us', 1)}" for name in sides)
            if len(sides) > 1:
                ours, theirs = (statistics.median(costs[name]) for name in ("backlens", "nnsight"))
                line += "   (ours no higher)" if ours <= theirs else "   (ours higher)"
            print(line)
        print(
            "A plain step outside any trace, tiny model (cost beyond stock, "
            f"{args.clock} time, microseconds; median [range] of {args.alternations} rounds):"
        )
        taxes: dict[str, dict[str, list[float]]] = {name: {"wrap": [], "backward": []} for name in sides}
        for r in range(args.alternations):
            for name, side in _turns(sides, r):
                got = side.ask(what="backward tax", repeats=args.repeats, clock=args.clock)
                taxes[name]["wrap"].append(got["function"] - got["untouched"])
                taxes[name]["backward"].append(got["method"] - got["function"])
        print("  on the wrapped model (minus its untouched copy):      "
              + "   ".join(f"{name} {_span(taxes[name]['wrap'], ' us', 1)}" for name in sides))
        print("  .backward() (minus torch.autograd.backward, wrapped): "
              + "   ".join(f"{name} {_span(taxes[name]['backward'], ' us', 1)}" for name in sides))
    finally:
        for side in sides.values():
            side.close()


if __name__ == "__main__":
    main()
