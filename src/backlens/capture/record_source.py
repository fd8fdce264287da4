"""What a live capture's records read through (see :mod:`backlens.records.source`).

Gradient questions are answered straight from the capture's
:class:`~backlens.capture.core.CaptureCore`, which the source keeps alive;
questions whose answer is another record go to the capture that caches them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backlens.records.source import RecordSource

if TYPE_CHECKING:
    import torch

    from backlens.capture.core import CaptureCore
    from backlens.records.grads import GradRecord


class LiveRecordSource(RecordSource):
    """A live capture's: gradients come from its core, which this keeps alive."""

    __slots__ = ("_core",)

    def __init__(self, core: CaptureCore, capture: Any):
        super().__init__(capture)
        self._core = core

    def _make_successor(self) -> Any:
        from backlens.capture.capture import Capture

        return Capture(self._core)

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
