"""Profiler ranges for a captured backward, for backlens._torch (which alone imports this module
and re-exports its names; the capability flag is ``_torch.HAS_PROFILER_RANGES``, read there at
each call so that it can be turned off in one place).

While torch.profiler records, a captured backward marks each node call with a range named by
its module address, as ``torch.profiler.record_function`` does, through the C entry points
that bypass the dispatcher, so the backward's FLOP census never sees them (about 2 us a range,
against 10 us through torch.ops). Whether a profiler records is asked once per pass, never
per node.
"""

from __future__ import annotations

from typing import Any

from backlens import _torch  # the module importing this one: its lookups and its flag

_profiler_enabled = _torch._lookup(_torch._autograd_c, "_profiler_enabled")
_range_enter = _torch._lookup(_torch._autograd_c, "_record_function_with_args_enter")
_range_exit = _torch._lookup(_torch._autograd_c, "_record_function_with_args_exit")

RANGES_PRESENT = None not in (_profiler_enabled, _range_enter, _range_exit)


def profiler_recording() -> bool:
    """Whether a torch.profiler (or the autograd profiler) records on this thread now."""
    return _torch.HAS_PROFILER_RANGES and bool(_profiler_enabled())


def open_profiler_range(name: str) -> Any:
    """Begin a user-annotation range named ``name``; returns its handle for
    :func:`close_profiler_range`."""
    return _range_enter(name)


def close_profiler_range(handle: Any) -> None:
    _range_exit(handle)
