"""What a live capture's records read through.

A record answers ``op.grads``, ``param.increments``... from the capture's
:class:`~backlens.capture.core.CaptureCore`, which it keeps alive. Questions
whose answer is another record (``op.grad_fn``, ``grad_fn.calls``,
``pass_.calls``) go to the capture that caches records, held weakly: the
capture holds its records, so a strong reference back would make every read
capture a reference cycle. A record that outlives its capture gets those
answers from a fresh capture over the same core.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from backlens.capture.capture import Capture
    from backlens.capture.core import CaptureCore
    from backlens.records.backward import GradFn, GradFnCall
    from backlens.records.base import RecordList
    from backlens.records.forward import ModuleCallRecord
    from backlens.records.grads import GradRecord


class RecordSource:
    __slots__ = ("_core", "_capture", "_successor", "__weakref__")

    def __init__(self, core: CaptureCore, capture: Capture):
        self._core = core
        self._capture = weakref.ref(capture)
        self._successor: Capture | None = None

    def records(self) -> Capture:
        capture = self._capture()
        if capture is None:
            if self._successor is None:
                from backlens.capture.capture import Capture

                self._successor = Capture(self._core)
            capture = self._successor
        return capture

    @property
    def modules(self) -> RecordList[ModuleCallRecord]:
        """The capture's module calls (selectors read the call tree from them)."""
        return self.records().modules

    def _op_grads(self, index: int) -> list[GradRecord]:
        return self._core.op_grads(index)

    def _module_output_grads(self, index: int) -> list[GradRecord]:
        return self._core.module_output_grads(index)

    def _param_increments(self, name: str) -> list[GradRecord]:
        return self._core.param_increments(name)

    def _param_live_grad(self, name: str) -> torch.Tensor | None:
        return self._core.param_live_grad(name)

    def _input_grads(self, index: int) -> list[GradRecord]:
        return self._core.input_grads(index)

    def _op_grad_fn(self, index: int) -> GradFn | None:
        return self.records()._op_grad_fn(index)

    def _node_calls(self, index: int) -> list[GradFnCall]:
        return self.records()._node_calls(index)

    def _pass_calls(self, number: int) -> list[GradFnCall]:
        return self.records()._pass_calls(number)
