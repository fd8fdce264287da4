"""A block body running in step with a driver, as a coroutine in the caller's thread.

The *driver* is whatever runs the model: the forward call (module hooks) or
the autograd engine (tensor hooks). Each block body runs as a *mediator*: a
``greenlet`` (a coroutine with its own C stack, switched in the same OS
thread). When the body asks for a value (``lens.fc1.output``, ``h.grad``) the
mediator records the request and switches back to the driver; when the
driver reaches that value it switches to the body with an :class:`Event`
and continues when the body asks for its next value or finishes. Only one
side runs at a time and both run in the caller's thread, so nothing needs a
lock, the backward runs where the forward did, and the body may replace the
value (``event.replace``) before the driver continues with it.

Each switch keeps torch's thread-local modes apart (:class:`StateSwitch`);
each body runs in its own copy of the caller's ``contextvars`` context. No
switch can hang: the driver switches to a body only to let it run user code,
and every body still waiting when the driver is done is resumed with an error
(:meth:`Mediator.fail`) or unwound (:meth:`Mediator.cancel`).

Every coroutine is entered first by the launcher of its run, from one
``switch`` (:mod:`backlens.live.launch`): the driver is itself a coroutine
(:func:`~backlens.live.launch.drive`), so that a torch error raised in a body,
the engine or the model walks only sound native frames.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import greenlet

from backlens.live.compiler import CompiledBody
from backlens.live.context import Block, enter_block, leave_block
from backlens.live.launch import PLUMBING, getcurrent, launch
from backlens.live.torchstate import CallerState, StateSwitch
from backlens.live.withbody import strip_internal_head


class Cancelled(BaseException):
    """Unwinds a mediator whose run was stopped (another body failed, or the model did)."""


class StopRun(BaseException):
    """Raised from a hook to stop the model run after a body failed.

    A ``BaseException`` so model code that catches ``Exception`` cannot
    swallow it.
    """


class Event:
    """A value handed to a mediator: ``key`` says what it is.

    ``merge`` turns a replacement into what the driver continues with (an
    invoke's rows written into the batched value); it runs when the body sets
    the value, so a replacement that does not fit fails at the user's line.
    """

    __slots__ = ("key", "value", "replaced", "merged", "_merge")

    def __init__(self, key: Any, value: Any, merge: Callable[[Any], Any] | None = None):
        self.key = key
        self.value = value
        self.replaced = False
        self.merged: Any = None
        self._merge = merge

    def replace(self, value: Any) -> None:
        merged = self._merge(value) if self._merge is not None else value
        self.value = value
        self.merged = merged
        self.replaced = True


class _Raise:
    """What the driver sends a waiting body instead of an event: raise this there."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()
_REQUEST = object()


class Mediator:
    """Runs one block body as a coroutine, one step at a time.

    Body side: :meth:`request` (switches to the driver until it serves the
    key). Driver side: :meth:`start`, :meth:`serve`, :meth:`fail`,
    :meth:`cancel`; each returns once the body has asked for its next value
    or finished. After that, ``pending`` is the key it waits for (None when
    done), ``done`` says it finished, ``error`` holds what the body raised and
    ``result`` its final local variables.
    """

    __slots__ = (
        "block", "pending", "event", "done", "started", "error", "result", "body",
        "_state", "_glet", "_driver", "_cancelled",
    )  # fmt: skip

    def __init__(self, block: Block, body: CompiledBody, state: CallerState):
        self.block = block
        block.mediator = self
        self.pending: Any = None
        self.event: Event | None = None
        self.done = False
        self.started = False
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self.body: CompiledBody | None = body
        self._state = StateSwitch(state)
        self._glet: greenlet.greenlet | None = None
        self._driver: greenlet.greenlet | None = None
        self._cancelled = False

    # -- body side -------------------------------------------------------
    def _main(self) -> Any:
        """The body, run in a coroutine of its run (never raises)."""
        token = enter_block(self.block)
        try:
            body = self.body
            assert body is not None
            self.result = body.run()
        except Cancelled:
            pass
        except BaseException as exc:  # handed to the driver, re-raised in the caller's frame
            exc.__traceback__ = strip_internal_head(exc.__traceback__, _PLUMBING)
            self.error = exc
        finally:
            leave_block(token)
            self.done = True
            self.pending = None
            self.event = None
            self._state.to_driver()
        return _DONE

    def request(self, key: Any) -> Event:
        """Wait until the driver serves ``key``; returns the event it served."""
        if self._cancelled:
            raise Cancelled()
        self.event = None
        self.pending = key
        self._state.to_driver()
        reply = self._driver.switch(_REQUEST)  # type: ignore[union-attr]
        self.pending = None
        if type(reply) is _Raise:
            raise reply.error
        self.event = reply
        return reply

    # -- driver side -----------------------------------------------------
    def start(self) -> None:
        """Run the body until its first request (or its end). Called by a run's driver."""
        self._driver = getcurrent()
        self._state.to_body()
        try:
            self._glet, _ = launch(self._main, contextvars.copy_context())
        except BaseException:  # interrupted before the body began: nothing to unwind
            self._state.to_driver()
            raise
        self.started = True

    def serve(self, event: Event) -> None:
        """Hand ``event`` to the body waiting for it; return when it yields again."""
        self._state.to_body()
        self._glet.switch(event)  # type: ignore[union-attr]

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` in the body at its pending request; return when it yields again."""
        self._resume(_Raise(error))

    def _resume(self, reply: Any) -> None:
        self._state.to_body()
        self._glet.switch(reply)  # type: ignore[union-attr]

    def release(self) -> None:
        """Drop what ties this mediator to its block and run (no cycle left for the collector)."""
        block = self.block
        if block is not None:
            block.mediator = None
            block.forward = block.backward = None  # type: ignore[assignment]
        self.event = None
        self.body = None
        self._glet = self._driver = None

    def cancel(self) -> None:
        """Unwind a body that is still waiting (its ``finally`` blocks run)."""
        if self.done or not self.started:
            self.done = True
            return
        self._cancelled = True
        self.fail(Cancelled())


# Frames at the head of a body's traceback that are only the coroutine's plumbing.
_PLUMBING = {Mediator._main.__code__, CompiledBody.run.__code__, *PLUMBING}


_MAX_UNSERVED = 100  # a body that keeps catching the error and asking again is unwound after this


def answer_unserved(
    mediator: Mediator,
    waits: Callable[[Any], bool],
    why: Callable[[Any], BaseException],
    after: Callable[[Mediator], None],
) -> None:
    """When the driver is done: raise in a body still waiting (``waits(pending)``) the error
    saying why its value never came (``why(pending)``), again each time it catches it and
    asks once more; ``after(mediator)`` runs after each (the forward's barrier bookkeeping,
    or stopping the run on a body's error)."""
    attempts = 0
    while not mediator.done and waits(mediator.pending):
        attempts += 1
        if attempts > _MAX_UNSERVED:
            mediator.cancel()
            return
        mediator.fail(why(mediator.pending))
        after(mediator)
