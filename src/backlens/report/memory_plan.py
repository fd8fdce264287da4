"""``bl.report.memory_plan(cap, budget_bytes=None)``: which module calls to checkpoint.

Under non-reentrant activation checkpointing (``torch.utils.checkpoint(...,
use_reentrant=False)``) a wrapped module call saves nothing for the backward
but its tensor arguments, and runs its forward again when the backward first
needs one of its tensors. So checkpointing a call frees the storages it saved
that nothing outside it saved, less its arguments when nothing else kept them
(``cap.memory.checkpoint_saving``), and costs its forward again: its forward
FLOPs and, as an estimate, the time its recorded forward took.

The plan ranks every module call that would free something by bytes freed per
recompute FLOP (a call of zero forward FLOPs, elementwise work only, first),
then walks that ranking, taking a call unless one around it is taken, and
trading the calls inside it for it when that frees more, until the saved
bytes left fit ``budget_bytes``. With no budget it walks the whole ranking
and never trades: it takes every call that neither contains nor sits inside
one taken before it, the cheapest savings per FLOP first.
The saving of the chosen set is computed for the set, not summed (two
checkpoints side by side can keep what one alone would free).
:meth:`MemoryPlan.apply` wraps the chosen calls in checkpoint for a new
capture, which shows the saving.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from backlens import _args
from backlens._pandas import data_frame
from backlens.errors import UnsupportedInputError
from backlens.report.display import bytes_text, flops_text, seconds_text

NO_MEMORY = "captured without memory=True: pass memory=True to bl.capture"


@dataclass(frozen=True)
class PlanRow:
    """One module call the plan could checkpoint: what checkpointing it alone would free
    (``saved_bytes``) and cost (``recompute_flops``, ``recompute_time`` in seconds,
    both None when unknown), ``bytes_per_flop`` (infinite for a call of zero FLOPs),
    and whether the plan chose it."""

    module: str
    address: str
    call: int
    saved_bytes: int
    recompute_flops: int | None
    recompute_time: float | None
    bytes_per_flop: float | None
    chosen: bool


@dataclass
class MemoryPlan:
    """The ranked candidates (``rows``), the chosen module calls (``chosen``, labels), and
    what checkpointing them together would save and cost.

    ``saved_bytes_before`` is what the forward saved (parameters apart);
    ``saved_bytes_after`` what would be saved with the chosen checkpoints;
    ``saving`` their difference; ``within_budget`` whether ``saved_bytes_after``
    fits ``budget_bytes`` (None without a budget).
    """

    rows: list[PlanRow]
    chosen: list[str]
    budget_bytes: int | None
    saved_bytes_before: int
    saved_bytes_after: int
    recompute_flops: int | None
    recompute_time: float | None
    within_budget: bool | None
    notes: list[str] = field(default_factory=list)

    @property
    def saving(self) -> int:
        return self.saved_bytes_before - self.saved_bytes_after

    def to_pandas(self):
        columns = ["module", "address", "call", "saved_bytes", "recompute_flops", "recompute_time",
                   "bytes_per_flop", "chosen"]
        return data_frame([[getattr(r, c) for c in columns] for r in self.rows], columns)

    @contextlib.contextmanager
    def apply(self, model: Any) -> Iterator[Any]:
        """Within the block, the chosen module calls of ``model`` (the captured model) run
        under ``torch.utils.checkpoint(..., use_reentrant=False)``: the chosen call of a
        module is counted from the start of each forward of ``model``. Leaves ``model``
        as it was on exit."""
        import torch
        from torch.utils.checkpoint import checkpoint

        if not isinstance(model, torch.nn.Module):
            raise UnsupportedInputError(f"plan.apply(model) takes the captured nn.Module, not {type(model).__name__}.",
                                        code="not_a_module", remedy="Pass the model you captured.")
        targets: dict[str, set[int]] = {}
        for row in self.rows:
            if row.chosen:
                targets.setdefault(row.address, set()).add(row.call)
        counters: dict[str, list[int]] = {}
        patched: list[tuple[Any, bool, Any]] = []

        def restart(*_args: Any) -> None:
            for counter in counters.values():
                counter[0] = 0

        handle = model.register_forward_pre_hook(restart)
        try:
            for address, calls in targets.items():
                try:
                    module = model.get_submodule(address) if address else model
                except AttributeError as exc:
                    raise UnsupportedInputError(
                        f"plan.apply: the model has no module {address!r}; the plan was made for another model.",
                        code="plan_module_missing", remedy="Apply the plan to the model it was made from.") from exc
                counter = counters[address] = [0]
                original = module.forward

                def forward(*args: Any, _original: Any = original, _counter: list[int] = counter,
                            _calls: frozenset[int] = frozenset(calls), **kwargs: Any) -> Any:
                    _counter[0] += 1
                    if _counter[0] in _calls:
                        return checkpoint(_original, *args, use_reentrant=False, **kwargs)
                    return _original(*args, **kwargs)

                patched.append((module, "forward" in module.__dict__, original))
                module.forward = forward
            yield model
        finally:
            handle.remove()
            for module, had_own, original in reversed(patched):
                if had_own:
                    module.forward = original
                else:
                    del module.forward

    def __str__(self) -> str:
        lines = [f"Checkpointing plan: {len(self.chosen)} module call(s) of {len(self.rows)} candidates"
                 + (f" for a budget of {bytes_text(self.budget_bytes)}" if self.budget_bytes is not None else "")]
        lines.append(f"  saved for the backward: {bytes_text(self.saved_bytes_before)} -> "
                     f"{bytes_text(self.saved_bytes_after)} (saves {bytes_text(self.saving)}); recompute costs "
                     f"{flops_text(self.recompute_flops)} FLOPs, about {seconds_text(self.recompute_time)}")
        for row in self.rows:
            if row.chosen:
                lines.append(f"  checkpoint {row.module or '(model)'}: frees {bytes_text(row.saved_bytes)} alone, "
                             f"recompute {flops_text(row.recompute_flops)} FLOPs")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def memory_plan(cap: Any, budget_bytes: int | None = None) -> MemoryPlan:
    """Rank ``cap``'s module calls by saved bytes freed per recompute FLOP under
    non-reentrant checkpointing and choose the ones that bring the saved bytes
    within ``budget_bytes`` (see the module docstring)."""
    _args.capture(cap, "bl.report.memory_plan(cap)", needs=("memory", "modules"))
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes < 0):
        raise UnsupportedInputError(
            f"bl.report.memory_plan: budget_bytes must be a whole number of bytes >= 0 or None, not "
            f"{budget_bytes!r}.", code="bad_argument", remedy="Pass budget_bytes=2**30, or None for no budget.")
    memory = cap.memory
    if memory is None:
        raise UnsupportedInputError(f"bl.report.memory_plan: this capture has no memory record ({NO_MEMORY}).",
                                    code="memory_not_recorded", remedy="Capture with bl.capture(..., memory=True).")
    candidates = []
    for record in cap.modules:
        label = record.label
        saving = memory.checkpoint_saving([label])
        if saving <= 0:
            continue
        flops = _forward_flops(cap, record)
        ratio = None if flops is None else math.inf if flops == 0 else saving / flops
        candidates.append((label, record, saving, flops, memory[label].forward_time, ratio))
    candidates.sort(key=lambda c: (c[5] is None, -(c[5] or 0.0), -c[2]))
    before = memory.saved_bytes
    chosen: list[str] = []
    current = 0
    for label, _record, _saving, _flops, _time, _ratio in candidates:
        if budget_bytes is not None and before - current <= budget_bytes:
            break
        if any(_within(cap, label, other) for other in chosen):
            continue  # a call around it is checkpointed already
        inside = [other for other in chosen if _within(cap, other, label)]
        if inside and budget_bytes is None:
            continue  # no budget asks for more: keep the cheaper calls inside it
        trial = [other for other in chosen if other not in inside] + [label]
        saving = memory.checkpoint_saving(trial)
        if saving > current:
            chosen, current = trial, saving
    taken = set(chosen)
    rows = [PlanRow(label, record.address, record.call, saving, flops, seconds, ratio, label in taken)
            for label, record, saving, flops, seconds, ratio in candidates]
    picked = [r for r in rows if r.chosen]
    flops = None if any(r.recompute_flops is None for r in picked) else sum(r.recompute_flops for r in picked)
    seconds = None if any(r.recompute_time is None for r in picked) else sum(r.recompute_time for r in picked)
    notes = list(memory.reasons)
    if budget_bytes is not None and before - current > budget_bytes:
        notes.append(f"no set of module calls brings the saved bytes within the budget: the best found leaves "
                     f"{before - current:,} bytes")
    return MemoryPlan(rows, [label for label in chosen], budget_bytes, before, before - current, flops, seconds,
                      None if budget_bytes is None else before - current <= budget_bytes, notes)


def _forward_flops(cap: Any, record: Any) -> int | None:
    """The forward FLOPs of the ops inside a module call (None when any is unknown)."""
    total = 0
    ops = cap.ops
    for label in record.ops:
        flops = ops[label].forward_flops
        if flops is None:
            return None
        total += flops
    return total


def _within(cap: Any, inner: str, outer: str) -> bool:
    """Whether module call ``inner`` is ``outer`` or runs inside it."""
    modules = cap.modules
    label: str | None = inner
    while label is not None:
        if label == outer:
            return True
        label = modules[label].parent
    return False
