"""What records read through, without pointing back at the object that caches them.

A capture caches its records, so a record holding its capture strongly would
make every read capture a reference cycle: dropped, it would wait for the
cycle collector with its saved gradients. Records hold a ``RecordSource``
instead. It holds the capture weakly; once the capture is gone, a record that
is still held gets its answers from a successor capture over the same data
(records it returns then are new objects).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from backlens.records.backward import GradFn, GradFnCall
    from backlens.records.base import RecordList
    from backlens.records.forward import ModuleCallRecord
    from backlens.records.grads import GradRecord


class RecordSource:
    """Every question goes to the capture (or its successor)."""

    __slots__ = ("_capture", "_successor", "__weakref__")

    def __init__(self, capture: Any):
        self._capture = weakref.ref(capture)
        self._successor: Any = None

    def records(self) -> Any:
        """The capture that caches the records: the original while it lives, else a successor."""
        capture = self._capture()
        if capture is None:
            if self._successor is None:
                self._successor = self._make_successor()
            capture = self._successor
        return capture

    def _make_successor(self) -> Any:
        raise NotImplementedError

    @property
    def modules(self) -> RecordList[ModuleCallRecord]:
        """The capture's module calls (selectors read the call tree from them)."""
        return self.records().modules

    def _op_grads(self, index: int) -> list[GradRecord]:
        return self.records()._op_grads(index)

    def _module_output_grads(self, index: int) -> list[GradRecord]:
        return self.records()._module_output_grads(index)

    def _param_increments(self, name: str) -> list[GradRecord]:
        return self.records()._param_increments(name)

    def _param_live_grad(self, name: str) -> torch.Tensor | None:
        return self.records()._param_live_grad(name)

    def _input_grads(self, index: int) -> list[GradRecord]:
        return self.records()._input_grads(index)

    def _op_grad_fn(self, index: int) -> GradFn | None:
        return self.records()._op_grad_fn(index)

    def _node_calls(self, index: int) -> list[GradFnCall]:
        return self.records()._node_calls(index)

    def _pass_calls(self, number: int) -> list[GradFnCall]:
        return self.records()._pass_calls(number)
