"""Records of the backward: passes, autograd nodes, and each fire of a node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from backlens.errors import LabelNotFoundError
from backlens.records.base import RecordList

if TYPE_CHECKING:
    from backlens.graph.engine import CallSite
    from backlens.records.forward import OpRecord


@dataclass(eq=False)
class GradFnCall:
    """One fire of one autograd node (``addmm_back_1_4:2``)."""

    label: str
    grad_fn: GradFn
    index: int
    pass_number: int
    grad_inputs: tuple[torch.Tensor | None, ...] | None
    grad_outputs: tuple[torch.Tensor | None, ...] | None
    start: float | None
    duration: float | None
    flops: int | None = None
    recompute_flops: int | None = None

    def row(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "grad_fn": self.grad_fn.label,
            "type": self.grad_fn.type,
            "index": self.index,
            "pass_number": self.pass_number,
            "op": self.grad_fn.op.label if self.grad_fn.op is not None else None,
            "module": self.grad_fn.module,
            "start": self.start,
            "duration": self.duration,
            "flops": self.flops,
            "recompute_flops": self.recompute_flops,
            "saved_grad_inputs": self.grad_inputs is not None,
            "saved_grad_outputs": self.grad_outputs is not None,
        }


CALL_COLUMNS = [
    "label", "grad_fn", "type", "index", "pass_number", "op", "module", "start", "duration",
    "flops", "recompute_flops", "saved_grad_inputs", "saved_grad_outputs",
]


class CallList(RecordList[GradFnCall]):
    """Node calls; by position, by ``"label:k"``, or ``for_pass(k)``."""

    kind = "grad_fn call"

    def __init__(self, calls: list[GradFnCall]):
        super().__init__(calls, lambda c: c.label, GradFnCall.row, CALL_COLUMNS)

    def for_pass(self, k: int) -> list[GradFnCall]:
        return [c for c in self._records if c.pass_number == k]


@dataclass(eq=False)
class GradFn:
    """One distinct autograd node (``addmm_back_1_4``)."""

    index: int
    label: str
    type: str
    op: OpRecord | None
    module: str | None
    module_source: str | None
    order: int | None
    is_custom: bool
    param: str | None
    sequence_nr: int | None
    _source: Any = field(repr=False, default=None)
    kind: str = field(default="grad_fn", repr=False)

    @property
    def calls(self) -> CallList:
        return CallList(self._source._node_calls(self.index))

    @property
    def func(self) -> str | None:
        return self.op.func if self.op is not None else None

    def row(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "label": self.label,
            "type": self.type,
            "op": self.op.label if self.op is not None else None,
            "module": self.module,
            "module_source": self.module_source,
            "order": self.order,
            "is_custom": self.is_custom,
            "param": self.param,
            "num_calls": len(self._source._node_calls(self.index)),
        }


GRAD_FN_COLUMNS = [
    "index", "label", "type", "op", "module", "module_source", "order", "is_custom", "param",
    "num_calls",
]


@dataclass(eq=False)
class BackwardPass:
    """One backward engine run over the capture's graph."""

    number: int
    trigger: str
    call_site: CallSite | None
    retain_graph: bool | None
    create_graph: bool
    save_grads_policy: Any
    status: str = "running"
    error: BaseException | str | None = None
    duration: float | None = None
    orders: list[int] = field(default_factory=list)
    order_coverage: float | None = None
    edits: list[Any] = field(default_factory=list)
    _source: Any = field(repr=False, default=None)

    @property
    def calls(self) -> list[GradFnCall]:
        return self._source._pass_calls(self.number)

    def row(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "trigger": self.trigger,
            "call_site": str(self.call_site) if self.call_site is not None else None,
            "retain_graph": self.retain_graph,
            "create_graph": self.create_graph,
            "orders": list(self.orders),
            "order_coverage": self.order_coverage,
            "save_grads_policy": repr(self.save_grads_policy),
            "duration": self.duration,
            "num_calls": len(self.calls),
            "num_edits": len(self.edits),
            "status": self.status,
            "error": None if self.error is None else str(self.error).splitlines()[0],
        }


PASS_COLUMNS = [
    "number", "trigger", "call_site", "retain_graph", "create_graph", "orders", "order_coverage",
    "save_grads_policy", "duration", "num_calls", "num_edits", "status", "error",
]


class PassList(RecordList[BackwardPass]):
    """Backward passes, 0-based by position; ``for_pass(k)`` by 1-based number."""

    kind = "backward pass"

    def __init__(self, passes: list[BackwardPass]):
        super().__init__(passes, lambda p: str(p.number), BackwardPass.row, PASS_COLUMNS)

    def for_pass(self, k: int) -> BackwardPass:
        for backward_pass in self._records:
            if backward_pass.number == k:
                return backward_pass
        numbers = [p.number for p in self._records]
        raise LabelNotFoundError(
            f"No backward pass number {k}; passes recorded: {numbers or 'none'}.",
            remedy="Pass numbers are 1-based; pick one from the message.",
        )
