"""Skipping a ``with`` body in the caller's frame, and writing results back into it.

``Skipper.install`` sets a trace function on the caller's frame that raises
:class:`SkipBody` when the first body line is about to run (reading torch's
modes there first: that is where the body starts, after every other context
manager of the same ``with`` statement has been entered). The block's
``__exit__`` swallows it, runs the body itself, and binds the saved names in
the caller's frame with :func:`write_locals`.
"""

from __future__ import annotations

import ctypes
import dis
import inspect
import sys
import types
from typing import Any

from backlens.live.torchstate import CallerState

_EVENTS = ("line", "opcode")
_NOP = dis.opmap["NOP"]


class SkipBody(BaseException):
    """Raised at a block's first body line so the caller's frame skips it.

    A ``BaseException`` so that ``except Exception`` in the caller (or a
    ``contextlib.suppress(Exception)`` stacked in the same ``with``) cannot
    swallow it before our ``__exit__`` sees it.
    """


class Skipper:
    """Makes the caller's frame skip a block's body.

    CPython drops the thread's trace function when one raises, so ``restore``
    puts back any tracer (a debugger, coverage) that was there before. A body
    of no-op statements only (``pass``) needs no skipping: it may run as it is.
    """

    __slots__ = ("frame", "first_line", "fired", "state", "_active", "_token", "_prev_global", "_prev_local", "_prev_opcodes")

    def __init__(self, frame: types.FrameType, first_line: int | None):
        self.frame = frame
        self.first_line = first_line
        self.fired = first_line is None
        # The torch modes where the body starts (read at the skip; at install
        # when there is nothing to skip).
        self.state: CallerState | None = CallerState.capture() if first_line is None else None
        self._active = False
        self._token = SkipBody()
        self._prev_global: Any = None
        self._prev_local: Any = None
        self._prev_opcodes = False

    def install(self) -> None:
        if self.first_line is None:
            return
        self._prev_global = sys.gettrace()
        self._prev_local = self.frame.f_trace
        self._prev_opcodes = self.frame.f_trace_opcodes
        self.frame.f_trace = self._trace
        if self._prev_global is None:
            sys.settrace(_untraced)
        self._active = True

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame is self.frame and event in _EVENTS and frame.f_lineno >= self.first_line:  # type: ignore[operator]
            if frame.f_code.co_code[frame.f_lasti] == _NOP:
                # No exception handler covers a NOP (the line of a `try:`, a `while True:`):
                # raised there, SkipBody would leave the frame without our __exit__. Raise at
                # the body's first real instruction instead.
                frame.f_trace_opcodes = True
                return self._trace
            self.fired = True
            self.state = CallerState.capture()
            raise self._token
        return self._trace

    def owns(self, exc: BaseException | None) -> bool:
        return exc is self._token

    def restore(self) -> None:
        if not self._active:
            return
        self._active = False
        if sys.gettrace() is not self._prev_global:
            sys.settrace(self._prev_global)
        self.frame.f_trace = self._prev_local
        self.frame.f_trace_opcodes = self._prev_opcodes
        # The token's traceback holds the caller's frame: drop it, so no cycle
        # is left for the garbage collector.
        self._token.__traceback__ = None
        self._token.__context__ = None


def _untraced(frame: types.FrameType, event: str, arg: Any) -> None:
    """Global tracer while a skip is armed: traces no new frame."""
    return None


_CO_OPTIMIZED = inspect.CO_OPTIMIZED
_locals_to_fast: Any = None
if sys.version_info < (3, 13):
    _locals_to_fast = ctypes.pythonapi.PyFrame_LocalsToFast
    _locals_to_fast.argtypes = [ctypes.py_object, ctypes.c_int]
    _locals_to_fast.restype = None


def write_locals(frame: types.FrameType, updates: dict[str, Any]) -> None:
    """Bind ``updates`` as variables of ``frame`` (a function, module or exec frame).

    Module, class and ``exec`` frames keep their variables in a dict, which
    ``f_locals`` returns. A function frame keeps them in fast slots and cells:
    before 3.13, ``f_locals`` is a snapshot that ``PyFrame_LocalsToFast``
    copies back; from 3.13 on it is a write-through proxy. Either works on a
    frame that is suspended (a body waiting at a barrier).
    """
    if not updates:
        return
    f_locals = frame.f_locals
    for name, value in updates.items():
        f_locals[name] = value
    if _locals_to_fast is not None and frame.f_code.co_flags & _CO_OPTIMIZED:
        _locals_to_fast(frame, 0)
