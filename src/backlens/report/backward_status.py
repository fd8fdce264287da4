"""Backward FLOPs attribution, read from a capture's records and cost journal.

``bl.report.backward_status(cap)`` builds a :class:`BackwardStatus`: one
:class:`PassFlops` per backward pass (counted or not, and why), the executed
FLOPs of the counted passes, and one :class:`FlopsAttribution` per counted pass
with a row per node call. Within an attribution, ``sum(row.flops) +
unattributed_flops == executed_flops`` exactly.

Reads only public records (``cap.passes``, ``cap.grad_fn_calls``) and the
cost journal of its state, never torch hooks, so a capture loaded
from a bundle reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backlens import _args
from backlens._pandas import data_frame
from backlens.cost.journal import CostJournal
from backlens.errors import LabelNotFoundError
from backlens.report.display import flops_text, seconds_text


@dataclass(frozen=True)
class AttributionRow:
    """The FLOPs one node call ran (``flops`` includes its ``recompute_flops``)."""

    pass_number: int
    call_label: str
    grad_fn_label: str
    grad_fn_type: str
    call_index: int
    op_label: str | None
    module: str | None
    flops: int
    recompute_flops: int | None
    duration: float | None

    def row(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class UnattributedOp:
    """ATen calls of one name charged to no node call, and what they ran under."""

    op: str
    under: str | None
    calls: int
    flops: int

    def __str__(self) -> str:
        where = f" under {self.under}" if self.under else " under no node"
        return f"{self.op}{where} ({self.calls} call{'s' if self.calls != 1 else ''}, {self.flops} FLOPs)"


ROW_COLUMNS = [
    "pass_number", "call_label", "grad_fn_label", "grad_fn_type", "call_index", "op_label",
    "module", "flops", "recompute_flops", "duration",
]


@dataclass
class FlopsAttribution:
    """Where the executed FLOPs of one counted pass went."""

    pass_number: int
    executed_flops: int
    rows: list[AttributionRow]
    unattributed_flops: int
    unattributed_ops: list[UnattributedOp]
    recompute_flops: int | None

    def flops_by_op(self) -> dict[str | None, int]:
        """Forward op label -> backward FLOPs of its nodes' calls.

        Calls of nodes with no forward op (the loss, built after the forward)
        are summed under ``None``; unattributed FLOPs are not included.
        """
        by_op: dict[str | None, int] = {}
        for row in self.rows:
            by_op[row.op_label] = by_op.get(row.op_label, 0) + row.flops
        return by_op

    def to_pandas(self):
        return data_frame([r.row() for r in self.rows], ROW_COLUMNS)

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"pass {self.pass_number}: {flops_text(self.executed_flops)} FLOPs executed")
        for name in ("call", "op", "module", "FLOPs", "recompute", "time"):
            table.add_column(name, justify="right" if name in ("FLOPs", "recompute", "time") else "left")
        for row in sorted(self.rows, key=lambda r: -r.flops):
            if row.flops == 0:
                continue
            table.add_row(row.call_label, row.op_label or "-", row.module or "-", flops_text(row.flops),
                          flops_text(row.recompute_flops), seconds_text(row.duration))
        table.add_row("(unattributed)", "-", "-", flops_text(self.unattributed_flops), "-", "-")
        return table


@dataclass(frozen=True)
class PassFlops:
    """One backward pass: its FLOP count, or why it has none."""

    number: int
    status: str
    counted: bool
    executed_flops: int | None
    recompute_flops: int | None
    unattributed_flops: int | None
    aten_calls: int | None
    duration: float | None
    reason: str | None

    def row(self) -> dict[str, Any]:
        return dict(self.__dict__)


PASS_COLUMNS = ["number", "status", "counted", "executed_flops", "recompute_flops",
                "unattributed_flops", "aten_calls", "duration", "reason"]


@dataclass
class BackwardStatus:
    """Executed backward FLOPs per pass and their attribution.

    ``executed_flops`` sums the counted passes (``None`` when none was
    counted; ``state`` is then a short code and ``reason`` a sentence saying
    why). ``flops_attributions`` has one entry per counted pass, in pass order.
    """

    passes: list[PassFlops]
    executed_flops: int | None
    flops_attributions: tuple[FlopsAttribution, ...]
    forward_flops: int | None
    state: str = "counted"
    reason: str | None = None
    _by_pass: dict[int, FlopsAttribution] = field(default_factory=dict, repr=False)

    def for_pass(self, number: int) -> FlopsAttribution:
        """The attribution of counted pass ``number`` (1-based)."""
        found = self._by_pass.get(number)
        if found is None:
            why = next((p.reason for p in self.passes if p.number == number), None)
            raise LabelNotFoundError(
                f"Pass {number} has no FLOP count" + (f": {why}." if why else "; counted passes: "
                                                         f"{sorted(self._by_pass) or 'none'}."),
                remedy="Pick a counted pass from status.passes.",
            )
        return found

    def to_pandas(self):
        return data_frame([p.row() for p in self.passes], PASS_COLUMNS)

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table

        table = Table(title="backward passes")
        for name in ("pass", "status", "FLOPs executed", "recompute", "time", "note"):
            table.add_column(name)
        for p in self.passes:
            table.add_row(str(p.number), p.status, flops_text(p.executed_flops), flops_text(p.recompute_flops),
                          seconds_text(p.duration), p.reason or "")
        if not self.passes:
            table.add_row("-", "-", "-", "-", "-", self.reason or "")
        return Group(table, *self.flops_attributions)


def backward_status(cap: Any) -> BackwardStatus:
    """The FLOP count and attribution of every backward pass over ``cap``."""
    _args.capture(cap, "bl.report.backward_status(cap)")
    journal: CostJournal = cap._state.cost or CostJournal()
    passes = list(cap.passes)
    calls_by_pass: dict[int, list[Any]] = {}
    for call in cap.grad_fn_calls:
        calls_by_pass.setdefault(call.pass_number, []).append(call)
    rows: list[PassFlops] = []
    attributions: list[FlopsAttribution] = []
    for record in passes:
        cost = journal.pass_cost(record.number)
        reason = _no_count_reason(cap, record, cost)
        if cost is None or not cost["counted"]:
            rows.append(PassFlops(record.number, record.status, False, None, None, None, None,
                                  record.duration, reason))
            continue
        rows.append(PassFlops(record.number, record.status, True, cost["executed_flops"],
                              cost["recompute_flops"], cost["unattributed_flops"], cost["aten_calls"],
                              record.duration, None))
        if cost.get("attributed", True):
            attributions.append(_attribution(record.number, cost, calls_by_pass.get(record.number, [])))
    counted = [p for p in rows if p.counted]
    executed = sum(p.executed_flops for p in counted) if counted else None
    state, reason = ("counted", None) if executed is not None else _status_reason(cap, rows)
    return BackwardStatus(
        passes=rows,
        executed_flops=executed,
        flops_attributions=tuple(attributions),
        forward_flops=journal.forward_flops,
        state=state,
        reason=reason,
        _by_pass={a.pass_number: a for a in attributions},
    )


def _attribution(number: int, cost: dict[str, Any], calls: list[Any]) -> FlopsAttribution:
    rows = [
        AttributionRow(
            pass_number=number,
            call_label=call.label,
            grad_fn_label=call.grad_fn.label,
            grad_fn_type=call.grad_fn.type,
            call_index=call.index,
            op_label=call.grad_fn.op.label if call.grad_fn.op is not None else None,
            module=call.grad_fn.module,
            flops=call.flops,
            recompute_flops=call.recompute_flops,
            duration=call.duration,
        )
        for call in calls
    ]
    return FlopsAttribution(
        pass_number=number,
        executed_flops=cost["executed_flops"],
        rows=rows,
        unattributed_flops=cost["unattributed_flops"],
        unattributed_ops=[UnattributedOp(o["op"], o["under"], o["calls"], o["flops"])
                          for o in cost["unattributed_ops"]],
        recompute_flops=cost["recompute_flops"],
    )


def _no_count_reason(cap: Any, record: Any, cost: dict[str, Any] | None) -> str | None:
    if cost is not None:
        return cost["reason"]
    if not getattr(cap, "flops_enabled", True):
        return "the capture was made with flops=False"
    if record.status == "running":
        return "the pass is still running"
    return "no FLOP count was recorded for this pass"


def _status_reason(cap: Any, rows: list[PassFlops]) -> tuple[str, str]:
    """(code, sentence): why no pass of ``cap`` has a count."""
    if not getattr(cap, "flops_enabled", True):
        return "flops_off", "the capture was made with flops=False"
    if not getattr(cap, "backward_requested", True):
        return "backward_not_requested", "the capture was made with backward=False: no backward pass is recorded"
    if getattr(cap, "inference_only", False):
        return "inference_only", "the capture has no autograd graph (inference only): no backward pass can run"
    if not rows:
        return "no_backward", "no backward pass has run over this capture yet"
    return "not_counted", "no pass was counted: " + "; ".join(f"pass {p.number}: {p.reason}" for p in rows)
