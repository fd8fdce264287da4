"""Records of the backward: autograd nodes, each fire of a node, and passes.

A pass's status, duration and errors, and a call's FLOPs, are written into the
state's entries as the pass runs and closes; these records read them there.
"""

from __future__ import annotations

from typing import Any

import torch

from backlens.capture.views import NodeView, entry_field
from backlens.errors import AmbiguousLabelError, LabelNotFoundError
from backlens.graph.labels import call_label
from backlens.records.aten import AtenOpList, aten_ops_of
from backlens.records.base import Record, RecordList
from backlens.records.collectives import CollectiveList
from backlens.records.grads import check_pass_number
from backlens.records.memory import PassMemory, pass_memory


class GradFn(Record, NodeView):
    """One distinct autograd node (``addmm_back_1_4``)."""

    __slots__ = ()
    noun = "grad_fn"
    FIELDS = ("index", "label", "type", "op", "module", "module_source", "order", "is_custom", "param",
              "sequence_nr")
    COLUMNS = ("index", "label", "type", "op", "module", "module_source", "order", "is_custom", "param",
               "num_calls")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return state.nodes[at].label

    @property
    def calls(self) -> NodeCalls:
        """This node's calls: ``calls[0]``, ``calls.for_pass(k)``."""
        return NodeCalls(self._state, self._state.node_calls[self._at])

    def row(self) -> dict[str, Any]:
        op = self.op
        return {
            "index": self.index,
            "label": self.label,
            "type": self.type,
            "op": op.label if op is not None else None,
            "module": self.module,
            "module_source": self.module_source,
            "order": self.order,
            "is_custom": self.is_custom,
            "param": self.param,
            "num_calls": len(self._state.node_calls[self._at]),
        }


class GradFnCall(Record):
    """One fire of one autograd node (``addmm_back_1_4:2``)."""

    __slots__ = ()
    kind = "grad_fn_call"
    noun = "grad_fn call"
    FIELDS = ("label", "grad_fn", "index", "pass_number", "grad_inputs", "grad_outputs", "start", "duration",
              "flops", "recompute_flops")
    COLUMNS = ("label", "grad_fn", "type", "index", "pass_number", "op", "module", "start", "duration",
               "flops", "recompute_flops", "saved_grad_inputs", "saved_grad_outputs")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        entry = state.calls[at]
        return call_label(state.nodes[entry.node].label, entry.ordinal)

    @property
    def _entry(self) -> Any:
        return self._state.calls[self._at]

    pass_number = entry_field("pass_number", "The 1-based number of the pass it fired in.")
    index = entry_field("ordinal", "The 1-based fire number of its node (``:k`` in its label).")
    flops = entry_field("flops", "FLOPs it ran, recompute included (None: not counted).")
    recompute_flops = entry_field("recompute_flops", "FLOPs of checkpoint recomputation (None: unknown).")

    @property
    def label(self) -> str:
        return self.key_of(self._state, self._at)

    @property
    def grad_fn(self) -> GradFn:
        return self._related("grad_fn", self._entry.node)

    @property
    def grad_inputs(self) -> tuple[torch.Tensor | None, ...] | None:
        """The gradients it sent on (w.r.t. its forward inputs), when kept."""
        handle = self._entry.grad_inputs
        return self._state.store.load(handle) if handle is not None else None

    @property
    def grad_outputs(self) -> tuple[torch.Tensor | None, ...] | None:
        """The gradients that arrived at it (w.r.t. its forward outputs), when kept."""
        handle = self._entry.grad_outputs
        return self._state.store.load(handle) if handle is not None else None

    @property
    def start(self) -> float | None:
        """Seconds from its pass's start to its own (None without timing)."""
        entry = self._entry
        if entry.start_ns is None:
            return None
        return (entry.start_ns - self._state.passes[entry.pass_number - 1].start_ns) / 1e9

    @property
    def duration(self) -> float | None:
        """Seconds it ran, less backlens's own hook work and the time spent in collectives
        (``pass_.collectives``) issued or waited for inside it (None without timing)."""
        entry = self._entry
        if entry.start_ns is None:
            return None
        return (entry.end_ns - entry.start_ns - entry.hook_ns - entry.wait_ns) / 1e9

    def row(self) -> dict[str, Any]:
        node = self.grad_fn
        op = node.op
        return {
            "label": self.label,
            "grad_fn": node.label,
            "type": node.type,
            "index": self.index,
            "pass_number": self.pass_number,
            "op": op.label if op is not None else None,
            "module": node.module,
            "start": self.start,
            "duration": self.duration,
            "flops": self.flops,
            "recompute_flops": self.recompute_flops,
            "saved_grad_inputs": self._entry.grad_inputs is not None,
            "saved_grad_outputs": self._entry.grad_outputs is not None,
        }


class CallList(RecordList[GradFnCall]):
    """Node calls; by position or by ``"label:k"``."""

    def __init__(self, state: Any, positions: Any):
        super().__init__(state, GradFnCall, positions)


class NodeCalls(CallList):
    """One node's calls; by position, by ``"label:k"``, or ``for_pass(k)``."""

    def for_pass(self, k: int) -> GradFnCall:
        """The one call of pass ``k`` (a node fires at most once per engine run)."""
        check_pass_number(k, "calls.for_pass")
        calls = self._state.calls
        found = [p for p in self._positions if calls[p].pass_number == k]
        if len(found) == 1:
            return self._record(found[0])
        fired_in = sorted({calls[p].pass_number for p in self._positions})
        if not found:
            raise LabelNotFoundError(
                f"No call in pass {k}: this node fired in passes {fired_in or 'none'}.",
                remedy="Pick a pass from the message (1-based), or iterate .calls.",
            )
        labels = [self._record(p).label for p in found]
        raise AmbiguousLabelError(
            f"{len(found)} calls in pass {k} ({', '.join(labels)}); for_pass(k) gives one.",
            remedy="Pick one by label or position from .calls.",
        )


class BackwardPass(Record):
    """One backward engine run over the capture's graph."""

    __slots__ = ()
    kind = "backward_pass"
    noun = "backward pass"
    FIELDS = ("number", "trigger", "call_site", "retain_graph", "create_graph", "save_grads_policy", "status",
              "error", "duration", "orders", "order_coverage", "other_capture_nodes", "edits")
    COLUMNS = ("number", "trigger", "call_site", "retain_graph", "create_graph", "orders", "order_coverage",
               "save_grads_policy", "duration", "num_calls", "other_capture_nodes", "num_edits", "num_collectives",
               "status", "error")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return str(at + 1)

    @property
    def _entry(self) -> Any:
        return self._state.passes[self._at]

    number = entry_field("number", "1-based pass number.")
    trigger = entry_field("trigger", "What started it: ``Tensor.backward``, ``cap.backward``, ``implicit``...")
    call_site = entry_field("call_site", "The user's line that started it (None for implicit passes).")
    retain_graph = entry_field("retain_graph")
    create_graph = entry_field("create_graph")
    save_grads_policy = entry_field("policy", "The save policy it ran under.")
    status = entry_field("status", "``running``, ``ok``, ``failed``, or ``recording_failed`` (the backward ran "
                         "unchanged but backlens could not record all of it; ``error`` says why).")
    error = entry_field("error", "The exception a failed pass raised (a loaded one: its type name and message).")
    orders = entry_field("orders", "The node orders that ran (``[1]``; ``[1, 2]`` with second-order nodes).")
    order_coverage = entry_field("order_coverage", "The resolved fraction (by order) of the nodes that fired in it; "
                                 "1.0 when all are resolved.")
    other_capture_nodes = entry_field("other_capture_nodes", "Nodes of the same engine run that belong to other "
                                      "captures and were recorded there (0 when it ran over this capture alone).")
    edits = entry_field("edits", "Every gradient edit applied in it, with norms before and after.")

    @property
    def duration(self) -> float | None:
        """Seconds from its start to its end (None while it runs)."""
        entry = self._entry
        return (entry.end_ns - entry.start_ns) / 1e9 if entry.end_ns is not None else None

    @property
    def calls(self) -> list[GradFnCall]:
        view = self._state.view
        return [view(GradFnCall, i) for i in self._entry.calls]

    @property
    def collectives(self) -> CollectiveList:
        """The collectives issued while it ran (DDP's all-reduces, FSDP's all-gathers and
        reduce-scatters), in the order they were issued; empty outside ``torch.distributed``."""
        number = self._entry.number
        state = self._state
        return CollectiveList(state, [i for i, e in enumerate(state.collectives) if e.pass_number == number])

    @property
    def aten_ops(self) -> AtenOpList | None:
        """Every ATen call the pass dispatched, in order (None when its FLOPs were not counted)."""
        cost = self._state.cost
        counted = cost.pass_cost(self._entry.number) if cost is not None else None
        return aten_ops_of(self._state, counted.get("aten_ops") if counted is not None else None,
                           self._entry.start_ns)

    @property
    def memory(self) -> PassMemory | None:
        """The bytes the backward held after each of its node calls, and their peak
        (a ``memory=True`` capture; None otherwise)."""
        return pass_memory(self._state, self._entry.number)

    def row(self) -> dict[str, Any]:
        error = self.error
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
            "num_calls": len(self._entry.calls),
            "other_capture_nodes": self.other_capture_nodes,
            "num_edits": len(self.edits),
            "num_collectives": sum(1 for e in self._state.collectives if e.pass_number == self._entry.number),
            "status": self.status,
            "error": None if error is None else (str(error).splitlines() or [""])[0],
        }


class PassList(RecordList[BackwardPass]):
    """Backward passes, 0-based by position; ``for_pass(k)`` by 1-based number."""

    def __init__(self, state: Any, positions: Any):
        super().__init__(state, BackwardPass, positions)

    def for_pass(self, k: int) -> BackwardPass:
        check_pass_number(k, "passes.for_pass")
        if k - 1 in self._positions:
            return self._record(k - 1)
        numbers = [p + 1 for p in self._positions]
        raise LabelNotFoundError(
            f"No backward pass number {k}; passes recorded: {numbers or 'none'}.",
            remedy="Pass numbers are 1-based; pick one from the message.",
        )
