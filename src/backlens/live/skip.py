"""Skipping a ``with`` body in the caller's frame, and writing results back into it.

``Skipper.install`` sets a trace function on the caller's frame that raises
:class:`SkipBody` when the first body line is about to run (reading torch's
modes there first: that is where the body starts, after every other context
manager of the same ``with`` statement has been entered). The block's
``__exit__`` swallows it, runs the body itself, and binds the saved names in
the caller's frame with :func:`write_locals`.

A frame's trace function is called only by Python's own ``sys.settrace``
machinery. A tracer installed from C (coverage.py's C tracer) keeps its own
and never calls it, so it is displaced while the skip is armed (the body's
first line comes right after the ``with`` line) and put back after; a
Python-level tracer (a debugger, a user's ``sys.settrace``) keeps running
alongside. Should anything still keep the skip from firing, the body has run
in place: :meth:`Skipper.missed` is the error that says so, naming the tracer.
"""

from __future__ import annotations

import contextvars
import ctypes
import dis
import inspect
import sys
import types
from typing import Any

from backlens.errors import TraceError
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

    __slots__ = (
        "frame", "first_line", "fired", "state", "_active", "_token", "_prev_global", "_prev_local",
        "_prev_opcodes", "_found",
    )  # fmt: skip

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
        self._found: Any = None  # the thread's trace function when the block ended

    def install(self) -> None:
        if self.first_line is None:
            return
        self._prev_global = sys.gettrace()
        self._prev_local = self.frame.f_trace
        self._prev_opcodes = self.frame.f_trace_opcodes
        self.frame.f_trace = self._trace
        previous = self._prev_global
        if not _calls_frame_trace(previous):
            sys.settrace(_untraced)
            if previous is not None and callable(previous):
                # Our frames between here and the caller return while it is displaced: it is
                # handed their returns, so a tracer that keeps its own stack of frames (coverage
                # does) stays in step with the interpreter's.
                forward = _ReturnsTo(previous)
                for pending in _frames_up_to(sys._getframe(), self.frame):
                    pending.f_trace = forward
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
        self._found = found = sys.gettrace()
        previous = self._prev_global
        # Ours, or none (a trace function that raises is dropped): put back what was there. A
        # tracer someone installed meanwhile stays.
        if (found is None or found is _untraced) and found is not previous:
            sys.settrace(previous)
            if previous is not None and callable(previous) and not _calls_frame_trace(previous):
                # Our frames from the block's __exit__ to here began while it was displaced: it
                # sees their calls now, outermost first, before it sees them return.
                for pending in reversed(_frames_up_to(sys._getframe(), self.frame)):
                    previous(pending, "call", None)
        self.frame.f_trace = self._prev_local
        self.frame.f_trace_opcodes = self._prev_opcodes
        # The token's traceback holds the caller's frame: drop it, so no cycle
        # is left for the garbage collector.
        self._token.__traceback__ = None
        self._token.__context__ = None


    def missed(self, exc: BaseException | None) -> TraceError | None:
        """The error when the body ran in place instead of being skipped (None when it did not).

        Called at the block's end, after :meth:`restore`. ``exc`` is what the
        block ended with: one raised before the body (another context manager
        of the same ``with``) means the body never ran, and is let through.
        """
        if self.fired or self.first_line is None:
            return None
        if exc is not None and not self._raised_in_body(exc):
            return None
        found = self._found
        if found is None or found is _untraced:
            who = "another tracer removed the trace function that skips it"
        elif found is self._prev_global:
            who = f"the trace function {found!r} does not call a frame's own trace function"
        else:
            who = f"the trace function {found!r} replaced the one that skips it"
        return TraceError(
            f"the body starting at {self.frame.f_code.co_filename}:{self.first_line} ran in place, "
            f"outside the trace: backlens skips a block's body with a trace function (sys.settrace), "
            f"and {who}.",
            code="body_ran_in_place",
            remedy="Run the trace without that tracer, or with one that leaves sys.settrace working or "
            "uses sys.monitoring (coverage.py's cores, pdb and the profilers all do).",
        )

    def _raised_in_body(self, exc: BaseException) -> bool:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame is self.frame:
                return tb.tb_lineno >= self.first_line  # type: ignore[operator]
            tb = tb.tb_next
        return True  # raised from a frame the body called, not seen here: assume the body


_guarding: contextvars.ContextVar[Any] = contextvars.ContextVar("backlens_live_guarding", default=None)
guarding = _guarding.get
"""The block whose guarded ``with`` statement is being entered in this body, or None."""


class GuardSkip:
    """What :class:`Skipper` does, for a body's backward ``with`` statement that the rewrite put
    under a guard (``if BODY_HERE():``, ``rewrite.py``): the guard, reached where the body
    starts, reads torch's modes there and says to skip. Nothing to install or restore."""

    __slots__ = ("fired", "state", "_token")

    def __init__(self, block: Any):
        self.fired = False
        self.state: CallerState | None = None
        self._token: Any = _guarding.set(block)

    def reach(self) -> None:
        self.fired = True
        self.state = CallerState.capture()
        self.restore()

    def restore(self) -> None:
        token = self._token
        if token is not None:
            self._token = None
            _guarding.reset(token)

    def missed(self, exc: BaseException | None) -> None:
        return None

    def owns(self, exc: BaseException | None) -> bool:
        return False


def _frames_up_to(frame: types.FrameType | None, caller: types.FrameType) -> list[types.FrameType]:
    """``frame`` and its callers up to, not including, ``caller`` (innermost first)."""
    frames = []
    while frame is not None and frame is not caller:
        frames.append(frame)
        frame = frame.f_back
    return frames


class _ReturnsTo:
    """A frame's trace function that hands only the frame's return to a displaced tracer."""

    __slots__ = ("tracer",)

    def __init__(self, tracer: Any):
        self.tracer = tracer

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.tracer(frame, event, arg)
        return self


def _calls_frame_trace(tracer: Any) -> bool:
    """Whether the thread's trace function calls a frame's own ``f_trace`` (Python-level ones do)."""
    return isinstance(tracer, (types.FunctionType, types.MethodType))


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
