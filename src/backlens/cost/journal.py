"""The cost data a capture keeps, as plain data (ints, strings, lists, dicts).

One :class:`CostJournal` per capture state (``state.cost``). ``forward`` is
``{"op_flops": [int | None per op], "replay_failures": [{"op_index", "func",
"error"}]}`` (``None`` when the capture was made with ``flops=False``; an op's
entry is ``None`` when its meta replay failed); ``passes`` holds one dict per
backward pass that closed while FLOP counting was on.
Per-call FLOPs live on the call records (``GradFnCall.flops`` and
``.recompute_flops``). Reports read only this journal and the capture's
records, so a capture loaded from a bundle reads the same once both are
restored (``CostJournal.from_dict(journal.to_dict())`` round-trips exactly).

A pass dict::

    {"pass": 1,                       # BackwardPass.number
     "counted": True,                 # False: no count; "reason" says why
     "reason": None,
     "executed_flops": 123,           # None when not counted
     "unattributed_flops": 0,
     "unattributed_ops": [{"op": "aten.mm", "under": None, "calls": 1, "flops": 70}],
     "recompute_known": True,         # False: recompute_flops are None (no evidence)
     "recompute_flops": 0,
     "attributed": True,              # False: the executing node was unreadable
     "aten_calls": 57,
     "aten_ops": {"names": ["aten.mm.default", ...],   # every ATen call, in dispatch order
                  "op": [0, ...],                       # index into names, per call
                  "call": [12, None, ...],              # its node call's position (None: none)
                  "flops": [70, ...],
                  "grad_enabled": [False, ...]}}        # None when not counted
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

FORMAT_VERSION = 1


class CostJournal:
    """Forward FLOPs per op and one dict per backward pass (see the module docstring).

    ``pending_forward`` (live captures): a callable that computes the forward
    dict on first read, so the forward pays nothing for it.
    """

    def __init__(self, forward: dict[str, Any] | None = None, passes: list[dict[str, Any]] | None = None,
                 pending_forward: Callable[[], dict[str, Any]] | None = None):
        self._forward = forward
        self._pending_forward = pending_forward
        self.passes: list[dict[str, Any]] = passes if passes is not None else []

    @property
    def forward(self) -> dict[str, Any] | None:
        """``{"op_flops": [...], "replay_failures": [...]}``, or None when not counted."""
        if self._pending_forward is not None:
            compute, self._pending_forward = self._pending_forward, None
            self._forward = compute()
        return self._forward

    def pass_cost(self, number: int) -> dict[str, Any] | None:
        """The cost dict of pass ``number`` (None when FLOPs were not counted for it)."""
        for cost in self.passes:
            if cost["pass"] == number:
                return cost
        return None

    def op_flops(self, index: int) -> int | None:
        """Forward FLOPs of op ``index`` (None when not counted)."""
        forward = self.forward
        if forward is None:
            return None
        flops = forward["op_flops"]
        return flops[index] if index < len(flops) else None

    @property
    def forward_flops(self) -> int | None:
        """All forward FLOPs (None when not counted, or when an op could not be counted)."""
        forward = self.forward
        if forward is None or any(f is None for f in forward["op_flops"]):
            return None
        return sum(forward["op_flops"])

    def to_dict(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "forward": copy.deepcopy(self.forward),
                "passes": copy.deepcopy(self.passes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostJournal:
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"cost data format {version!r} is not {FORMAT_VERSION}")
        return cls(forward=copy.deepcopy(data.get("forward")), passes=copy.deepcopy(data.get("passes", [])))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostJournal) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
