"""What differentiable replay needs from the forward: each op's call, with tensors as references.

Recorded only by a capture that keeps activations (``save_activations``):
replay starts from recorded activations, so a capture that keeps none could
not replay anyway, and the default capture pays nothing. Per op it keeps the
positional and keyword arguments with every tensor replaced by a
:class:`TensorRef` (the op output or source it was), the grad mode it ran in,
and, for an op that returned several tensors, the activations of the others
(``OpEntry.activation`` is the first). It also notes which op made each module
call's first output and the model's output tensors.

Nothing here keeps a forward activation alive: a tensor of unknown origin is
kept only when it has no autograd history (a constant held by the model
anyway); one with history is noted as :class:`Untracked` and cannot be replayed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from backlens._nested import iter_tensors

Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor the forward knew: output ``position`` of op ``index`` (``index >= 0``), or
    source ``-1 - index`` (a parameter, buffer or input)."""

    index: int
    position: int = 0

    @property
    def source(self) -> int | None:
        return -1 - self.index if self.index < 0 else None


@dataclass(frozen=True, slots=True)
class Untracked:
    """A tensor with autograd history that no recorded op made (its origin cannot be replayed)."""

    shape: tuple[int, ...]


@dataclass(slots=True)
class OpCall:
    """One op's arguments as recorded (tensors as :class:`TensorRef`)."""

    args: tuple
    kwargs: dict
    grad_enabled: bool


class ReplayRecording:
    """The calls of one forward, filled by the forward recorder (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[OpCall] = []
        self.other_outputs: dict[int, list[Tensor | None]] = {}  # op -> activations of outputs[1:]
        self.module_outputs: dict[int, TensorRef] = {}  # module call -> the op output it returned first
        self.output: list[Any] = []  # the model output's tensors in reading order (refs)
        self._ids: dict[int, int] | None = None
        self._positions: dict[int, int] = {}  # id(tensor) -> its position among a multi-output op's outputs
        # id(op output) -> a weak reference to it: an id the table holds may be a dead tensor's, reused.
        self._alive: dict[int, Any] = {}

    def start(self, ids: dict[int, int]) -> None:
        """Read tensor origins from the forward recorder's table (id -> op index or -1 - source)."""
        self._ids = ids

    def record(self, index: int, args: tuple, kwargs: dict | None, outputs: Any, primary: Tensor) -> None:
        """Op ``index``'s call, before its outputs enter the table."""
        self.calls.append(OpCall(self._refs(args), self._refs(kwargs) if kwargs else {}, _grad_enabled()))
        positions, alive = self._positions, self._alive
        if outputs is None:
            positions.pop(id(primary), None)
            alive[id(primary)] = weakref.ref(primary)
        else:
            for position, item in enumerate(outputs):
                if isinstance(item, Tensor):
                    positions[id(item)] = position
                    alive[id(item)] = weakref.ref(item)

    def keep_other_outputs(self, index: int, outputs: Any) -> None:
        """Activations of a multi-output op's outputs after the first (its activation is kept)."""
        if isinstance(outputs, (tuple, list)) and len(outputs) > 1:
            self.other_outputs[index] = [t.detach().clone() if isinstance(t, Tensor) else None
                                         for t in outputs[1:]]

    def module_output(self, call: int, first: Tensor | None) -> None:
        if first is not None:
            found = self._ref(first)
            if isinstance(found, TensorRef):
                self.module_outputs[call] = found

    def finish(self, output: Any) -> None:
        self.output = [self._ref(t) for t in iter_tensors(output)]
        self._ids = None
        self._positions = {}
        self._alive = {}

    # -- references ----------------------------------------------------------
    def _ref(self, tensor: Tensor) -> Any:
        found = self._ids.get(id(tensor))
        if found is not None and found < 0:
            return TensorRef(found)  # a source: alive through the forward, so its id is its own
        if found is not None:
            held = self._alive.get(id(tensor))
            if held is not None and held() is tensor:
                return TensorRef(found, self._positions.get(id(tensor), 0))
        if tensor.grad_fn is not None:
            return Untracked(tuple(tensor.shape))
        return tensor  # a constant (no history): held as it is

    def _refs(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            return self._ref(value)
        if isinstance(value, (tuple, list)):
            items = [self._refs(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value  # nothing to replace (shapes, dims, scalars): kept as it was
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self._refs(v) for k, v in value.items()}
        return value
