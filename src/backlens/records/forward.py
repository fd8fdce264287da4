"""Records of the forward: ops, module calls, parameters and model inputs.

Each reads its entry in the capture state and its gradients from the state's
call entries, so there is one source of truth however many passes run.
"""

from __future__ import annotations

from typing import Any

import torch

from backlens.capture.views import OpView, entry_field
from backlens.errors import AmbiguousLabelError
from backlens.graph.labels import label_not_found, owning_module
from backlens.records.base import Record, RecordList
from backlens.records.grads import (
    GradRecord,
    describe_grads,
    grad_for_pass,
    single_grad,
    why_none_saved,
)


def _grads(pairs: list[tuple[torch.Tensor, int]]) -> list[GradRecord]:
    return [GradRecord(tensor, number) for tensor, number in pairs]


def _dtype_text(dtype: torch.dtype | None) -> str | None:
    return str(dtype).replace("torch.", "") if dtype is not None else None


class OpRecord(Record, OpView):
    """One torch-level call in the forward (``linear_2``)."""

    __slots__ = ()
    noun = "op"
    FIELDS = ("index", "label", "func", "module", "parents", "param_parents", "shape", "dtype",
              "num_outputs", "inplace", "activation", "forward_flops", "call_site")
    COLUMNS = ("index", "label", "func", "module", "parents", "param_parents", "shape", "dtype",
               "num_outputs", "inplace", "grad_fn", "has_activation", "forward_flops", "call_site", "grad",
               "num_saved_grads")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return state.journal.ops[at].label

    @property
    def forward_flops(self) -> int | None:
        cost = self._state.cost
        return cost.op_flops(self._at) if cost is not None else None

    @property
    def grad_fn(self) -> Any:
        """The autograd node this op's output came from (None when it has none)."""
        self._state.sync()
        return self._related("grad_fn", self._state.node_of_op(self._at))

    @property
    def grads(self) -> list[GradRecord]:
        """Saved gradients of this op's output, one per pass that saved one."""
        return _grads(self._state.op_grads(self._at))

    @property
    def grad(self) -> torch.Tensor:
        return single_grad(self.grads, f"op {self.label!r}",
                           lambda: why_none_saved(self._state, self._state.node_of_op(self._at)))

    def grad_for(self, *, pass_: int) -> torch.Tensor:
        return grad_for_pass(self.grads, pass_, f"op {self.label!r}")

    def row(self) -> dict[str, Any]:
        grad_fn = self.grad_fn
        return {
            "index": self.index,
            "label": self.label,
            "func": self.func,
            "module": self.module,
            "parents": self.parents,
            "param_parents": self.param_parents,
            "shape": self.shape,
            "dtype": _dtype_text(self.dtype),
            "num_outputs": self.num_outputs,
            "inplace": self.inplace,
            "grad_fn": grad_fn.label if grad_fn is not None else None,
            "has_activation": self.activation is not None,
            "forward_flops": self.forward_flops,
            "call_site": str(self.call_site) if self.call_site is not None else None,
            **describe_grads(self.grads),
        }


class ModuleCallRecord(Record):
    """One call of one module (``encoder.layer.0``; of a module called twice, ``encoder.layer.0:2``)."""

    __slots__ = ()
    kind = "module"
    noun = "module call"
    FIELDS = ("index", "address", "label", "call", "module_type", "parent", "children", "ops", "output_shape")
    COLUMNS = ("index", "address", "label", "module_type", "call", "parent", "children", "num_ops",
               "output_shape", "output_grad", "num_saved_grads")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return state.journal.call_label(at)

    @property
    def _entry(self) -> Any:
        return self._state.journal.module_calls[self._at]

    @property
    def index(self) -> int:
        return self._at

    address = entry_field("address", "The module's address (``encoder.layer.0``), naming all its calls.")
    call = entry_field("call", "1 for the module's first call, 2 for its second...")
    output_shape = entry_field("output_shape", "Shape of the call's first tensor output.")

    @property
    def label(self) -> str:
        """This call's name: the address when the module ran once, else ``address:k``."""
        return self._state.journal.call_label(self._at)

    @property
    def module_type(self) -> str:
        return self._state.journal.module_types.get(self._entry.address, "")

    @property
    def parent(self) -> str | None:
        """Label of the enclosing call (None for the root)."""
        return self._state.journal.call_label(self._entry.parent)

    @property
    def children(self) -> list[str]:
        """Labels of the calls made directly inside it."""
        journal = self._state.journal
        return [journal.call_label(c) for c in journal.children(self._at)]

    @property
    def ops(self) -> list[str]:
        """Labels of the ops that ran inside the call (its subtree)."""
        ops, entry = self._state.journal.ops, self._entry
        end = entry.op_end if entry.op_end is not None else len(ops)
        return [ops[i].label for i in range(entry.op_start, end)]

    @property
    def output_grads(self) -> list[GradRecord]:
        """Saved gradients of this call's output (its first tensor output)."""
        return _grads(self._state.module_grads(self._at))

    @property
    def output_grad(self) -> torch.Tensor:
        return single_grad(self.output_grads, f"module call {self.label!r} output", self._why_none_saved)

    def _why_none_saved(self) -> str:
        state = self._state
        untracked = None
        if not self._entry.output_tracked:
            untracked = ("its output had no grad_fn, so no backward pass carries its gradient (the call ran "
                         "without autograd tracking: inside torch.utils.checkpoint with use_reentrant=True, "
                         "or under torch.no_grad(); or its output needs no gradient)")
        return why_none_saved(state, state.node_of_module_call(self._at), untracked)

    def output_grad_for(self, *, pass_: int) -> torch.Tensor:
        return grad_for_pass(self.output_grads, pass_, f"module call {self.label!r} output")

    def row(self) -> dict[str, Any]:
        grads = describe_grads(self.output_grads)
        return {
            "index": self.index,
            "address": self.address,
            "label": self.label,
            "module_type": self.module_type,
            "call": self.call,
            "parent": self.parent,
            "children": self.children,
            "num_ops": len(self.ops),
            "output_shape": self.output_shape,
            "output_grad": grads["grad"],
            "num_saved_grads": grads["num_saved_grads"],
        }


class ModuleCallList(RecordList[ModuleCallRecord]):
    """Module calls by position or address: ``"lin"`` when ``lin`` ran once, ``"lin:2"``
    for its second call; a module that ran several times has no single record, and
    its address alone raises ``AmbiguousLabelError`` naming its calls."""

    def __init__(self, state: Any, positions: Any):
        super().__init__(state, ModuleCallRecord, positions)

    def _find(self, key: str) -> int | None:
        found = self._index().get(key)
        if found is not None:
            return found
        journal = self._state.journal
        calls = journal.resolve(key)
        if calls is None:
            return None
        if len(calls) > 1:
            labels = [journal.call_label(c) for c in calls]
            raise AmbiguousLabelError(
                f"Module {key!r} was called {len(calls)} times ({', '.join(labels)}); "
                f"{key!r} names all of them, a record lookup needs one.",
                remedy=f"Name one call: {labels[0]!r} ... {labels[-1]!r} (1-based).",
            )
        return calls[0] if calls[0] in self._positions else None

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            found = self._find(key)
            if found is None:
                raise label_not_found(self.kind, key, list(self._index()))
            return self._record(found)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        found = self._find(key)
        return default if found is None else self._record(found)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            try:
                return self._find(key) is not None
            except AmbiguousLabelError:
                return False
        return super().__contains__(key)


class ParamRecord(Record):
    """One named parameter of the model."""

    __slots__ = ()
    kind = "param"
    noun = "parameter"
    FIELDS = ("name", "module", "shape", "dtype", "requires_grad")
    COLUMNS = ("name", "module", "shape", "dtype", "requires_grad", "num_increments")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return state.params[at].name

    @property
    def _entry(self) -> Any:
        return self._state.params[self._at]

    name = entry_field("name", "The parameter's name (``encoder.layer.0.weight``).")
    shape = entry_field("shape")
    dtype = entry_field("dtype")
    requires_grad = entry_field("requires_grad")

    @property
    def module(self) -> str:
        """Address of the module that owns it."""
        return owning_module(self.name)

    @property
    def grad(self) -> torch.Tensor | None:
        """The live accumulated ``param.grad`` (what an optimizer would read)."""
        return self._entry.grad

    @property
    def increments(self) -> list[GradRecord]:
        """What each pass added to ``param.grad`` (from its AccumulateGrad node)."""
        return _grads(self._state.param_increments(self.name))

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "shape": self.shape,
            "dtype": _dtype_text(self.dtype),
            "requires_grad": self.requires_grad,
            "num_increments": len(self.increments),
        }


class InputRecord(Record):
    """One tensor found in the model's inputs (``args[0]``, ``input_ids``)."""

    __slots__ = ()
    kind = "input"
    noun = "input"
    FIELDS = ("index", "name", "shape", "dtype", "requires_grad", "was_parameter")
    COLUMNS = ("index", "name", "shape", "dtype", "requires_grad", "was_parameter", "grad", "num_saved_grads")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return state.inputs[at].name

    @property
    def _entry(self) -> Any:
        return self._state.inputs[self._at]

    @property
    def index(self) -> int:
        return self._at

    name = entry_field("name", "Where it was found (``args[0]``, ``input_ids``, ``args[1]['mask']``).")
    shape = entry_field("shape")
    dtype = entry_field("dtype")
    requires_grad = entry_field("requires_grad")
    was_parameter = entry_field("was_parameter", "Whether it is an ``nn.Parameter``.")

    @property
    def grads(self) -> list[GradRecord]:
        return _grads(self._state.input_grads(self._at))

    @property
    def grad(self) -> torch.Tensor:
        """The gradient that reached this input (one saved pass; see ``grads``)."""
        return single_grad(self.grads, f"input {self.name!r}")

    def grad_for(self, *, pass_: int) -> torch.Tensor:
        return grad_for_pass(self.grads, pass_, f"input {self.name!r}")

    def row(self) -> dict[str, Any]:
        grads = describe_grads(self.grads)
        return {
            "index": self.index,
            "name": self.name,
            "shape": self.shape,
            "dtype": _dtype_text(self.dtype),
            "requires_grad": self.requires_grad,
            "was_parameter": self.was_parameter,
            "grad": grads["grad"],
            "num_saved_grads": grads["num_saved_grads"],
        }
