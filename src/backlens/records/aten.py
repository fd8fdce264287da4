"""``pass_.aten_ops``: every ATen call a counted backward pass dispatched, in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backlens.graph.labels import call_label


@dataclass(frozen=True)
class AtenOp:
    """One ATen call of a backward pass."""

    name: str  # the overload: "aten.mm.default"
    call: str | None  # the node call it ran under ("mm_back_1_3:1"), None under no recorded call
    flops: int
    grad_enabled: bool  # grad mode during the call (on for checkpoint recomputation)
    start: float | None = None  # seconds from its pass's start (None: not timed)
    duration: float | None = None  # seconds


class AtenOpList(list):
    """The ATen calls of one pass, in dispatch order; ``.to_pandas()`` is one row per call."""

    COLUMNS = ("name", "call", "flops", "grad_enabled", "start", "duration")

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame([(a.name, a.call, a.flops, a.grad_enabled, a.start, a.duration) for a in self],
                            columns=list(self.COLUMNS))


def aten_ops_of(state: Any, columns: dict[str, list] | None, pass_start_ns: int = 0) -> AtenOpList | None:
    """The records of a pass's ``aten_ops`` columns (None: the pass was not counted)."""
    if columns is None:
        return None
    starts, ends = columns.get("start_ns"), columns.get("end_ns")
    if starts is None or ends is None:
        starts = ends = [None] * len(columns["op"])
    names, nodes, calls = columns["names"], state.nodes, state.calls
    labels: dict[int, str] = {}

    def label(position: int | None) -> str | None:
        if position is None:
            return None
        found = labels.get(position)
        if found is None:
            entry = calls[position]
            found = labels[position] = call_label(nodes[entry.node].label, entry.ordinal)
        return found

    return AtenOpList(
        AtenOp(names[op], label(call), flops, grad_enabled,
               (start - pass_start_ns) / 1e9 if start is not None else None,
               (end - start) / 1e9 if start is not None else None)
        for op, call, flops, grad_enabled, start, end in zip(columns["op"], columns["call"], columns["flops"],
                                                              columns["grad_enabled"], starts, ends)
    )
