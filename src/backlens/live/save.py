"""``bl.save(value)`` and ``tensor.save()``: mark a value to leave its block.

A block body runs on a copy of the caller's locals; when it ends, only names
bound to saved values are written back to the enclosing scope (and count as
saved there too, so they keep travelling outwards through nested blocks).
"""

from __future__ import annotations

from typing import TypeVar

import torch

from backlens.errors import TraceError
from backlens.live.context import current_block

T = TypeVar("T")


def save(value: T) -> T:
    """Mark ``value`` so the name bound to it reaches the caller after the trace.

    Returns ``value`` unchanged, so ``g = bl.save(h.grad)`` and
    ``g = h.grad.save()`` read the same. Raises :class:`TraceError` (code
    ``save_outside_trace``) outside a trace or backward block, where there is
    nothing to save from.
    """
    block = current_block()
    if block is None:
        raise TraceError(
            "save() was called outside a trace: values only need saving inside a "
            "`with lens.trace(...)` or `with loss.backward():` block, whose body runs "
            "on a copy of your variables.",
            code="save_outside_trace",
            remedy="Call .save() inside the with block, or drop it outside one.",
        )
    block.keep(value)
    return value


def _tensor_save(self: torch.Tensor) -> torch.Tensor:
    """Mark this tensor to reach the caller's scope after the trace (see ``bl.save``)."""
    block = current_block()
    if block is None:
        return save(self)  # raises save_outside_trace
    block.saved[id(self)] = self  # Block.keep, inlined: a body's last line, in every trace
    return self


def install_tensor_save() -> None:
    """Add ``Tensor.save`` once; torch has no attribute of that name to shadow."""
    if getattr(torch.Tensor, "save", None) is not _tensor_save:
        torch.Tensor.save = _tensor_save  # type: ignore[attr-defined]


def add_save_hint(error: BaseException) -> None:
    """``value.save()`` on a value without ``save`` (a transformers ``ModelOutput``, a tuple,
    a dict) raised ``AttributeError``: say, in its message, how to keep any value."""
    if not isinstance(error, AttributeError) or getattr(error, "name", None) != "save" or len(error.args) != 1:
        return
    owner = getattr(error, "obj", None)
    if isinstance(owner, torch.Tensor):
        return
    what = type(owner).__name__ if owner is not None else "the value"
    error.args = (f"{error.args[0]}. Only tensors have .save(); keep a {what} (or any value) with "
                  "bl.save(value), e.g. `out = bl.save(lens.output)`.",)
