"""``bl.bench.backward``: time the backward pass alone.

The forward runs once, under a capture; the backward then runs ``warmup +
repeats`` times over the retained graph with the capture's fire timings on
(per node, per node type, per module call), and ``repeats`` more times with
every hook removed, which give the pass times. Parameter and input ``.grad``
are cleared before each pass (so every pass does the same work) and restored
at the end.

A node that frees its own saved tensors (see :mod:`backlens.cost.once_only`)
is caught after the first pass, before a second one could fail with a
misleading shape or storage error: the result names it, with its forward op
and module, and times the backward as forward+backward minus forward, each
repeat on a fresh graph.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from backlens import _args
from backlens._pandas import data_frame
from backlens._progress import progress
from backlens.capturing import capture
from backlens.cost.once_only import OnceOnlyNode, changed_since, describe, snapshot
from backlens.errors import UnsupportedInputError
from backlens.graph.labels import NO_FORWARD_OP
from backlens.report.display import seconds_text

RETAINED_GRAPH = "retained_graph"
FORWARD_BACKWARD_MINUS_FORWARD = "forward_backward_minus_forward"


@dataclass(frozen=True)
class Stats:
    """Seconds over the timed repeats."""

    median: float
    min: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        return cls(statistics.median(samples), min(samples), max(samples), tuple(samples))

    def row(self) -> dict[str, float]:
        return {"median": self.median, "min": self.min, "max": self.max, "repeats": len(self.samples)}


@dataclass(frozen=True)
class ModuleTiming:
    """Backward time of one module call: its own nodes, and with its descendants'."""

    address: str
    module_type: str | None
    depth: int
    self: Stats
    subtree: Stats


@dataclass
class BackwardBench:
    """What :func:`backward` measured (all times in seconds).

    ``passes``: backward wall time per pass, no hooks installed (with
    ``method == "forward_backward_minus_forward"``, forward+backward minus
    forward per repeat). ``instrumented_passes``: the same with the per-node
    fire timing on. ``by_node_type``, ``by_node`` (node label) and
    ``by_module`` (module call address) sum node fire times per pass.
    ``once_only`` names the nodes that could not run twice.
    """

    method: str
    passes: Stats
    instrumented_passes: Stats | None
    forward: Stats | None
    by_node_type: dict[str, Stats]
    by_node: dict[str, Stats]
    by_module: dict[str, ModuleTiming]
    once_only: list[OnceOnlyNode]
    repeats: int
    warmup: int
    note: str | None = None
    _columns: list[str] = field(default_factory=lambda: ["kind", "name", "median", "min", "max", "repeats"],
                                repr=False)

    def to_pandas(self):
        """One row per measured quantity: ``kind`` is pass, forward, node_type, node,
        module_self or module_subtree."""
        rows = [{"kind": "pass", "name": self.method, **self.passes.row()}]
        if self.instrumented_passes is not None:
            rows.append({"kind": "instrumented_pass", "name": self.method, **self.instrumented_passes.row()})
        if self.forward is not None:
            rows.append({"kind": "forward", "name": "forward", **self.forward.row()})
        rows += [{"kind": "node_type", "name": k, **v.row()} for k, v in self.by_node_type.items()]
        rows += [{"kind": "node", "name": k, **v.row()} for k, v in self.by_node.items()]
        for address, timing in self.by_module.items():
            rows.append({"kind": "module_self", "name": address, **timing.self.row()})
            rows.append({"kind": "module_subtree", "name": address, **timing.subtree.row()})
        return data_frame(rows, self._columns)

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        def stats_cells(stats: Stats) -> tuple[str, str, str]:
            return seconds_text(stats.median), seconds_text(stats.min), seconds_text(stats.max)

        head = Table(title=f"backward alone ({self.method.replace('_', ' ')}; "
                           f"{self.repeats} repeats after {self.warmup} warmup)")
        for name in ("", "median", "min", "max"):
            head.add_column(name, justify="left" if not name else "right")
        head.add_row("backward pass", *stats_cells(self.passes))
        if self.instrumented_passes is not None:
            head.add_row("with fire timing", *stats_cells(self.instrumented_passes))
        if self.forward is not None:
            head.add_row("forward", *stats_cells(self.forward))
        parts: list[Any] = [head]
        for node in self.once_only:
            parts.append(Text(f"once-only node: {node}", style="yellow"))
        if self.note:
            parts.append(Text(self.note, style="yellow"))
        types = Table(title="per node type (sum of fires per pass)")
        for name in ("node type", "median", "min", "max"):
            types.add_column(name, justify="left" if name == "node type" else "right")
        for name, stats in sorted(self.by_node_type.items(), key=lambda kv: -kv[1].median):
            types.add_row(name, *stats_cells(stats))
        modules = Table(title="per module call")
        for name in ("module call", "self median", "subtree median", "subtree min", "subtree max"):
            modules.add_column(name, justify="left" if name == "module call" else "right")
        for address, timing in self.by_module.items():
            modules.add_row("  " * timing.depth + (address or "(model)"), seconds_text(timing.self.median),
                            *stats_cells(timing.subtree))
        return Group(*parts, types, modules)

    def show(self) -> None:
        """Print the tables (rich)."""
        from rich.console import Console

        Console().print(self)


def backward(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    repeats: int = 10,
    warmup: int = 2,
) -> BackwardBench:
    """Time ``model``'s backward pass alone; see the module docstring.

    ``inputs``: one tensor, a tuple/list of positional arguments, or a dict of
    keyword arguments. ``loss_fn(output) -> scalar`` (default: the output
    itself, which must then be a scalar tensor).
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedInputError(f"bl.bench.backward needs a torch.nn.Module, got {type(model).__name__}.",
                                    code="not_a_module",
                                    remedy="Pass the model first: bl.bench.backward(model, x, loss_fn).")
    if loss_fn is not None:
        _args.callable_(loss_fn, "loss_fn", "bl.bench.backward", "lambda out: out.sum()")
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UnsupportedInputError(f"bl.bench.backward: {name} must be an integer >= {low}, got {value!r}.",
                                        code="bad_repeats", remedy="Pass repeats=1 or more and warmup=0 or more.")
    args, kwargs = _split_inputs(inputs)
    leaves = [p for p in model.parameters()] + [t for t in _tensors(args, kwargs) if t.is_leaf and t.requires_grad]
    original_grads = [t.grad for t in leaves]
    try:
        cap = capture(model, *args, flops=False, timing=True, **kwargs)
        try:
            loss = _loss(loss_fn, cap.output)
            before = snapshot([loss.grad_fn])
            with progress("Timing the backward", warmup + 2 * repeats, unit="passes") as tick:
                first = _pass(loss, leaves, tick=tick)
                changes = changed_since(before)
                if changes:
                    once = [describe(node, detail, cap.grad_fns) for node, detail in changes]
                    cap.close()
                    del loss
                    return _fallback(model, args, kwargs, loss_fn, leaves, repeats, warmup, once)
                instrumented = [first] if warmup == 0 else []
                for i in range(1, warmup + repeats):
                    elapsed = _pass(loss, leaves, tick=tick)
                    if i >= warmup:
                        instrumented.append(elapsed)
                timed_passes = [p.number for p in cap.passes][warmup:]
                by_type, by_node, by_module = _per_node([(cap, n) for n in timed_passes])
                cap.disarm()  # removes every hook: the clean passes time torch alone
                clean = [_pass(loss, leaves, tick=tick) for _ in range(repeats)]
        finally:
            cap.close()
    finally:
        for tensor, grad in zip(leaves, original_grads):
            tensor.grad = grad
    return BackwardBench(
        method=RETAINED_GRAPH, passes=Stats.of(clean), instrumented_passes=Stats.of(instrumented),
        forward=None, by_node_type=by_type, by_node=by_node, by_module=by_module, once_only=[],
        repeats=repeats, warmup=warmup,
    )


def _fallback(model, args, kwargs, loss_fn, leaves, repeats, warmup, once) -> BackwardBench:
    """Backward = forward+backward minus forward, each repeat on a fresh graph."""
    with progress("Timing forward+backward minus forward", warmup + 2 * repeats, unit="passes") as tick:
        return _fallback_timed(model, args, kwargs, loss_fn, leaves, repeats, warmup, once, tick)


def _fallback_timed(model, args, kwargs, loss_fn, leaves, repeats, warmup, once, tick) -> BackwardBench:
    forward_times, total_times = [], []
    for i in range(warmup + repeats):
        _clear(leaves)
        start = _now(None)
        loss = _loss(loss_fn, model(*args, **kwargs))
        forward_time = _now(loss) - start
        del loss
        _clear(leaves)
        start = _now(None)
        loss = _loss(loss_fn, model(*args, **kwargs))
        torch.autograd.backward(loss)
        total_time = _now(loss) - start
        del loss
        if i >= warmup:
            forward_times.append(forward_time)
            total_times.append(total_time)
        tick(1)
    instrumented, captures = [], []
    for _ in range(repeats):  # fire timings, one fresh graph per repeat
        _clear(leaves)
        cap = capture(model, *args, flops=False, timing=True, **kwargs)
        instrumented.append(_pass(_loss(loss_fn, cap.output), leaves, retain=False, tick=tick))
        captures.append((cap, cap.passes[0].number))
    by_type, by_node, by_module = _per_node(captures)
    for cap, _number in captures:
        cap.close()
    names = ", ".join(str(node) for node in once)
    return BackwardBench(
        method=FORWARD_BACKWARD_MINUS_FORWARD,
        passes=Stats.of([t - f for t, f in zip(total_times, forward_times)]),
        instrumented_passes=Stats.of(instrumented),
        forward=Stats.of(forward_times),
        by_node_type=by_type, by_node=by_node, by_module=by_module, once_only=once,
        repeats=repeats, warmup=warmup,
        note=(f"The backward cannot run twice over one graph: {names}. It frees its own saved tensors, "
              "so each repeat ran a fresh forward and the pass time is forward+backward minus forward."),
    )


def _pass(loss: torch.Tensor, leaves: list[torch.Tensor], retain: bool = True,
          tick: Callable[[float], None] | None = None) -> float:
    _clear(leaves)
    start = _now(loss)
    torch.autograd.backward(loss, retain_graph=retain)
    elapsed = _now(loss) - start
    if tick is not None:  # after the clock stops: drawing is not timed
        tick(1)
    return elapsed


def _per_node(passes: list[tuple[Any, int]]):
    """Per node type, node label and module call: Stats of the summed fire times per pass."""
    types: dict[str, list[float]] = {}
    nodes: dict[str, list[float]] = {}
    selfs: dict[str, list[float]] = {}
    subtrees: dict[str, list[float]] = {}
    layout: dict[str, tuple[str | None, int]] = {}
    for cap, number in passes:
        parents = {}
        for call in cap.modules:
            parents[call.label] = call.parent
            if call.label not in layout:
                depth = layout[call.parent][1] + 1 if call.parent in layout else 0
                layout[call.label] = (call.module_type, depth)
        per_type: dict[str, float] = {}
        per_node: dict[str, float] = {}
        per_self: dict[str, float] = dict.fromkeys(parents, 0.0)
        per_subtree: dict[str, float] = dict.fromkeys(parents, 0.0)
        for call in cap.passes.for_pass(number).calls:
            duration = call.duration or 0.0
            grad_fn = call.grad_fn
            per_type[grad_fn.type] = per_type.get(grad_fn.type, 0.0) + duration
            per_node[grad_fn.label] = per_node.get(grad_fn.label, 0.0) + duration
            module = grad_fn.module_call if grad_fn.module_call in parents else NO_FORWARD_OP
            per_self[module] = per_self.get(module, 0.0) + duration
            while module is not None:
                per_subtree[module] = per_subtree.get(module, 0.0) + duration
                module = parents.get(module)
        for source, target in ((per_type, types), (per_node, nodes), (per_self, selfs), (per_subtree, subtrees)):
            for key, value in source.items():
                target.setdefault(key, []).append(value)
    layout.setdefault(NO_FORWARD_OP, (None, 0))
    by_module = {
        address: ModuleTiming(address, layout[address][0], layout[address][1],
                              Stats.of(selfs[address]), Stats.of(subtrees[address]))
        for address in selfs
    }
    return ({k: Stats.of(v) for k, v in types.items()}, {k: Stats.of(v) for k, v in nodes.items()}, by_module)


def _clear(leaves: list[torch.Tensor]) -> None:
    for tensor in leaves:
        tensor.grad = None


def _now(anchor: torch.Tensor | None) -> float:
    """perf_counter, after waiting for queued device work (CUDA and other accelerators)."""
    if anchor is not None and anchor.device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize()
        elif anchor.device.type == "cuda":
            torch.cuda.synchronize(anchor.device)
    return time.perf_counter()


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


def _loss(loss_fn: Callable[[Any], torch.Tensor] | None, output: Any) -> torch.Tensor:
    loss = loss_fn(output) if loss_fn is not None else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UnsupportedInputError(
            "bench.backward needs a scalar loss: the model output is not one.",
            code="loss_required",
            remedy="Pass loss_fn, e.g. lambda out: out.logits.sum().",
        )
    if loss.grad_fn is None:
        raise UnsupportedInputError(
            "The loss has no autograd graph (no parameter or input requires grad, or grad mode is off).",
            code="no_graph",
            remedy="Run bench.backward with grad enabled on a model whose parameters require grad.",
        )
    return loss
