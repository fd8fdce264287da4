"""torch's multi-tensor ("foreach") kernels for the gradient monitor, for backlens._torch (which
alone imports this module and re-exports its names; the capability flag is
``_torch.HAS_FOREACH_KERNELS``, read there at each call so that it can be turned off in one place).

The monitor's per-step statistics make one call over every gradient instead of a Python loop
of launches (on CPU a few percent faster, on an accelerator one fused launch instead of
hundreds). Without these underscore names the monitor loops with the public ops, same results.
"""

from __future__ import annotations

import torch

from backlens import _torch  # the module importing this one: only its flag is read, at each call

_foreach_norm = getattr(torch, "_foreach_norm", None)
_foreach_copy = getattr(torch, "_foreach_copy_", None)
_foreach_sub = getattr(torch, "_foreach_sub_", None)

FOREACH_PRESENT = None not in (_foreach_norm, _foreach_copy, _foreach_sub)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The L2 norm of each tensor, accumulated and returned in ``dtype`` (0-d tensors)."""
    if _torch.HAS_FOREACH_KERNELS:
        return list(_foreach_norm(tensors, 2, dtype=dtype))
    return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


def foreach_copy_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair."""
    if _torch.HAS_FOREACH_KERNELS:
        _foreach_copy(destinations, sources)
        return
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


def foreach_sub_(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``t.sub_(o)`` for each pair."""
    if _torch.HAS_FOREACH_KERNELS:
        _foreach_sub(tensors, others)
        return
    for tensor, other in zip(tensors, others):
        tensor.sub_(other)
