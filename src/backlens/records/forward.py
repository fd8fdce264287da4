"""Records of the forward: ops, module calls, parameters and model inputs.

Records are plain objects. Gradients are read through the capture that made
them (``_source``), from its backward journal, so there is one source of truth
however many passes run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from backlens.records.grads import GradRecord, describe_grads, grad_for_pass, single_grad

if TYPE_CHECKING:
    from backlens.records.backward import GradFn


@dataclass(eq=False)
class OpRecord:
    """One torch-level call in the forward (``linear_2``)."""

    index: int
    label: str
    func: str
    module: str | None
    parents: list[str]
    param_parents: list[str]
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    num_outputs: int
    inplace: bool
    activation: torch.Tensor | None
    forward_flops: int | None
    _source: Any = field(repr=False, default=None)
    kind: str = field(default="op", repr=False)

    @property
    def grad_fn(self) -> GradFn | None:
        """The autograd node this op's output came from (None before discovery)."""
        return self._source._op_grad_fn(self.index)

    @property
    def grads(self) -> list[GradRecord]:
        """Saved gradients of this op's output, one per pass that saved one."""
        return self._source._op_grads(self.index)

    @property
    def grad(self) -> torch.Tensor:
        return single_grad(self.grads, f"op {self.label!r}")

    def grad_for(self, *, pass_: int) -> torch.Tensor:
        return grad_for_pass(self.grads, pass_, f"op {self.label!r}")

    def row(self) -> dict[str, Any]:
        grad_fn = self.grad_fn
        return {
            "index": self.index,
            "label": self.label,
            "func": self.func,
            "module": self.module,
            "parents": list(self.parents),
            "param_parents": list(self.param_parents),
            "shape": self.shape,
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype is not None else None,
            "num_outputs": self.num_outputs,
            "inplace": self.inplace,
            "grad_fn": grad_fn.label if grad_fn is not None else None,
            "has_activation": self.activation is not None,
            "forward_flops": self.forward_flops,
            **describe_grads(self.grads),
        }


OP_COLUMNS = [
    "index", "label", "func", "module", "parents", "param_parents", "shape", "dtype",
    "num_outputs", "inplace", "grad_fn", "has_activation", "forward_flops", "grad", "num_saved_grads",
]


@dataclass(eq=False)
class ModuleCallRecord:
    """One call of one module (``encoder.layer.0``, a repeat ``encoder.layer.0:2``)."""

    index: int
    address: str
    module_address: str
    module_type: str
    call_number: int
    parent: str | None
    children: list[str]
    ops: list[str]
    output_shape: tuple[int, ...] | None
    _source: Any = field(repr=False, default=None)
    kind: str = field(default="module", repr=False)

    @property
    def output_grads(self) -> list[GradRecord]:
        """Saved gradients of this call's output (its first tensor output)."""
        return self._source._module_output_grads(self.index)

    @property
    def output_grad(self) -> torch.Tensor:
        return single_grad(self.output_grads, f"module call {self.address!r} output")

    def output_grad_for(self, *, pass_: int) -> torch.Tensor:
        return grad_for_pass(self.output_grads, pass_, f"module call {self.address!r} output")

    def row(self) -> dict[str, Any]:
        grads = describe_grads(self.output_grads)
        return {
            "index": self.index,
            "address": self.address,
            "module_address": self.module_address,
            "module_type": self.module_type,
            "call_number": self.call_number,
            "parent": self.parent,
            "children": list(self.children),
            "num_ops": len(self.ops),
            "output_shape": self.output_shape,
            "output_grad": grads["grad"],
            "num_saved_grads": grads["num_saved_grads"],
        }


MODULE_COLUMNS = [
    "index", "address", "module_address", "module_type", "call_number", "parent", "children",
    "num_ops", "output_shape", "output_grad", "num_saved_grads",
]


@dataclass(eq=False)
class ParamRecord:
    """One named parameter of the model."""

    name: str
    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    _source: Any = field(repr=False, default=None)
    kind: str = field(default="param", repr=False)

    @property
    def grad(self) -> torch.Tensor | None:
        """The live accumulated ``param.grad`` (what an optimizer would read)."""
        return self._source._param_live_grad(self.name)

    @property
    def increments(self) -> list[GradRecord]:
        """What each pass added to ``param.grad`` (from its AccumulateGrad node)."""
        return self._source._param_increments(self.name)

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "shape": self.shape,
            "dtype": str(self.dtype).replace("torch.", ""),
            "requires_grad": self.requires_grad,
            "num_increments": len(self.increments),
        }


PARAM_COLUMNS = ["name", "module", "shape", "dtype", "requires_grad", "num_increments"]


@dataclass(eq=False)
class InputRecord:
    """One tensor found in the model's inputs (``args[0]``, ``kwargs['input_ids']``)."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    was_parameter: bool
    _source: Any = field(repr=False, default=None)
    kind: str = field(default="input", repr=False)

    @property
    def grads(self) -> list[GradRecord]:
        return self._source._input_grads(self.index)

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
            "dtype": str(self.dtype).replace("torch.", ""),
            "requires_grad": self.requires_grad,
            "was_parameter": self.was_parameter,
            "grad": grads["grad"],
            "num_saved_grads": grads["num_saved_grads"],
        }


INPUT_COLUMNS = [
    "index", "name", "shape", "dtype", "requires_grad", "was_parameter", "grad", "num_saved_grads",
]
