"""What every backlens ``with`` block shares: find the body, skip it, run it, write back.

The call that makes the block (``lens.trace(x)``, ``tracer.invoke(x)``,
``loss.backward()``) finds its ``with`` statement from the caller's source
and checks everything that can be checked before the body runs (the source,
statements that cannot leave the body, that the body compiles). A problem
found there is raised by the ``with`` statement itself, from C, so the
traceback holds only the user's lines (:func:`refusal`).

Subclasses call :meth:`WithBody._arm` from ``__enter__`` and implement
``_run(frame)``, which runs the compiled body and returns the saved names to
bind in the caller. ``__exit__`` does the rest: it swallows the skip, runs
the body, re-raises the body's error so the traceback reads as the user's
code, and writes saved values into the caller's frame (also marking them
saved in an enclosing block, so they keep travelling outwards).
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Iterator
from typing import Any

from backlens.errors import BacklensError
from backlens.live import compiler
from backlens.live.context import current_block
from backlens.live.save import add_save_hint
from backlens.live.skip import GuardSkip, SkipBody, Skipper, write_locals
from backlens.live.source import BlockSource, find_block
from backlens.live.torchstate import CallerState


def _exhausted() -> Iterator[None]:
    yield


def refusal(error: BaseException) -> Any:
    """A context manager whose ``__enter__`` raises ``error`` with no frame of ours.

    Throwing into a finished generator raises the exception from C, and a
    ``staticmethod`` around a ``functools.partial`` is called without a
    Python frame either: the traceback the user sees starts and ends at
    their own ``with`` line.
    """
    error.__traceback__ = None  # raised once on the way here: only the with line is the user's
    error.__context__ = None
    done = _exhausted()
    for _ in done:
        pass
    kind = type(
        "RefusedBlock",
        (),
        {
            "__slots__": (),
            "__enter__": staticmethod(functools.partial(done.throw, error)),
            "__exit__": staticmethod(_never),
        },
    )
    return kind()


def _never(*args: Any) -> None:
    return None


class WithBody:
    """Base of the trace, invoke and backward blocks (see the module docstring)."""

    _what = "the block"
    _grads = False  # a backward block: the body's `.grad` go through the running backward

    _frame: types.FrameType | None = None
    _source: BlockSource | None = None
    _skip: Skipper | GuardSkip | None = None
    _guarded = False  # made by a guarded `with` statement of a body (rewrite.py), not entered yet

    def _prepare(self, source: BlockSource) -> None:
        """Checks made when the block is made (the errors a refusal raises)."""
        compiler.check(source, self._what, self._grads)
        self._source = source

    def _arm(self, frame: types.FrameType) -> BlockSource:
        source = self._source
        if source is None:  # made elsewhere and entered here: find the block by its line
            source = find_block(frame, self._what)
            compiler.check(source, self._what, self._grads)
            self._source = source
        self._frame = frame
        if self._guarded:  # entered by the statement that made it: its guard skips the body
            self._guarded = False
            self._skip = GuardSkip(self)
            return source
        self._skip = Skipper(frame, source.skip_line)
        self._skip.install()
        return source

    def _reach_guard(self, frame: types.FrameType) -> bool:
        """The guard of the statement entering this block was reached in ``frame``: whether
        the statements run in place (only when it is another statement's guard)."""
        skip = self._skip
        if type(skip) is not GuardSkip or frame is not self._frame or skip.fired:
            return True
        skip.reach()
        return False

    def _run(self, frame: types.FrameType, state: CallerState) -> dict[str, Any]:
        raise NotImplementedError

    def _cleanup(self) -> None:
        """Release what the block held, whatever happened."""

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        skip, frame = self._skip, self._frame
        self._skip = self._frame = None
        if skip is None or frame is None:
            return False
        skip.restore()
        missed = skip.missed(exc)
        if missed is not None:  # a tracer kept the body from being skipped: it ran in place
            self._cleanup()
            raise missed from exc
        if exc is not None and not skip.owns(exc):
            self._cleanup()
            return False  # something failed before the body: let it through
        if not skip.fired:
            self._cleanup()
            return False
        state = skip.state if skip.state is not None else CallerState.capture()
        error: BaseException | None = None
        updates: dict[str, Any] = {}
        try:
            updates = self._run(frame, state)
        except BaseException as err:  # re-raised below, outside this handler
            error = err
        finally:
            self._cleanup()
        if error is not None:
            _detach_from_skip(error)
            _tidy_traceback(error)
            add_save_hint(error)
            raise error
        write_locals(frame, updates)
        parent = current_block()
        if parent is not None:
            for value in updates.values():
                parent.keep(value)
        del frame
        return True


def _detach_from_skip(error: BaseException) -> None:
    """Keep our private SkipBody out of the traceback the user sees.

    ``__exit__`` runs while the interpreter handles SkipBody, so any error
    raised there gets it as ``__context__``. Drop it from the chain, keep a
    real earlier context as the cause, and suppress the implicit one the
    final ``raise`` adds.
    """
    seen: set[int] = set()
    item: BaseException | None = error
    while item is not None and id(item) not in seen:
        seen.add(id(item))
        if isinstance(item.__context__, SkipBody):
            item.__context__ = None
        item = item.__cause__ if item.__cause__ is not None else item.__context__
    if error.__cause__ is None and error.__context__ is not None:
        error.__cause__ = error.__context__
    error.__suppress_context__ = True


_LIVE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _ours(tb: types.TracebackType) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(_LIVE_DIR)


def _tidy_traceback(error: BaseException) -> None:
    """Show the user's lines, not our plumbing, when the error went through them.

    Leading entries from this package (the path from ``__exit__`` down to the
    body that failed) are dropped; for our own errors, so are the trailing
    ones after the user's line that asked (the property that raised it), and
    all of them when no user line was involved (an error about the inputs).
    Any other error that never went through user code keeps its full
    traceback: that is a bug of ours, and its frames are the evidence.
    """
    entries = []
    tb = error.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    user = [i for i, entry in enumerate(entries) if not _ours(entry)]
    if not user:
        if isinstance(error, BacklensError):
            error.__traceback__ = None
        return
    if isinstance(error, BacklensError):
        entries[user[-1]].tb_next = None
    error.__traceback__ = entries[user[0]]


def strip_internal_head(tb: types.TracebackType | None, codes: set[types.CodeType]) -> types.TracebackType | None:
    """Drop the leading traceback entries that are our own coroutine plumbing."""
    while tb is not None and tb.tb_frame.f_code in codes:
        tb = tb.tb_next
    return tb
