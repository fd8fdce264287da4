"""A block body running in step with a driver.

The *driver* is whatever runs the model: the forward call (module hooks) or
the autograd engine (tensor hooks). Each block body runs on a pooled worker
thread as a *mediator*. When the body asks for a value (``lens.fc1.output``,
``h.grad``) the mediator records the request and hands control back to the
driver; when the driver reaches that value it hands it over as an
:class:`Event` and waits until the body asks for the next value or finishes.
Only one side runs at a time, so neither needs locks around the model's
tensors, and the body may replace the value (``event.replace``) before the
driver continues with it.

Two shortcuts keep a trace cheap without changing what the body observes:

* *planned reads* (:meth:`Mediator.defer`): when a body's leading statements
  only bind requested values to names, the driver collects those values as
  they come and wakes the body once, at the last of them;
* *inline bodies* (``Mediator.inline``): when nothing the body does after its
  planned reads can wait for the model, the body runs in the driver's own
  thread, with no hand-off at all.

No wait here can hang: the driver waits only while the body runs user code,
and every body still waiting when the driver is done is resumed with an
error (:meth:`Mediator.fail`) or unwound (:meth:`Mediator.cancel`).
"""

from __future__ import annotations

import collections
import functools
import os
import select
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from backlens.live.context import Block, set_block
from backlens.live.source import run_body
from backlens.live.withbody import strip_internal_head


def _autocast_devices() -> tuple[str, ...]:
    """Devices whose autocast state a caller may have on (checked once: each check costs)."""
    devices = ["cpu"]
    for name in ("cuda", "xpu", "mps", "hpu"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available():
                devices.append(name)
        except Exception:  # a backend that cannot even answer is not in use
            continue
    return tuple(devices)


_AUTOCAST_DEVICES = _autocast_devices()


class Cancelled(BaseException):
    """Unwinds a mediator whose run was stopped (another body failed, or the model did)."""


class StopRun(BaseException):
    """Raised from a hook to stop the model run after a body failed.

    A ``BaseException`` so model code that catches ``Exception`` cannot
    swallow it.
    """


@dataclass(eq=False)
class Event:
    """A value handed to a mediator: ``key`` says what it is."""

    key: Any
    value: Any
    replaced: bool = False

    def replace(self, value: Any) -> None:
        self.value = value
        self.replaced = True


@dataclass(frozen=True)
class CallerState:
    """The grad mode, inference mode and autocast state of the thread that opened a block."""

    grad_enabled: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]

    @classmethod
    def capture(cls) -> CallerState:
        autocast = []
        for device in _AUTOCAST_DEVICES:
            try:
                if torch.is_autocast_enabled(device):
                    autocast.append((device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()))
            except (RuntimeError, TypeError, AttributeError):
                continue
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast))

    @property
    def is_default(self) -> bool:
        """The state a fresh (or reset) thread has: nothing to apply."""
        return self.grad_enabled and not self.inference and not self.autocast

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Apply this state to the calling thread (all three are thread-local in torch)."""
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode(True))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            yield


class _Channel:
    """Two one-way wake-ups between a driver and one worker thread.

    Built on ``eventfd`` (Linux) or a pipe: the system call that wakes the
    other side runs with the GIL released, so the woken thread finds the
    GIL free and runs at once. A lock release would wake it while this
    thread still holds the GIL, and it would have to be woken a second time
    when the GIL drops: about three times slower per hand-off. Each wake and
    wait is a single bound C call.
    """

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            flags = os.EFD_SEMAPHORE | os.EFD_CLOEXEC
            to_worker = os.eventfd(0, flags)
            to_driver = os.eventfd(0, flags)
            self._fds = (to_worker, to_driver)
            self.wake_worker = functools.partial(os.eventfd_write, to_worker, 1)
            self.wait_for_driver = functools.partial(os.eventfd_read, to_worker)
            self.wake_driver = functools.partial(os.eventfd_write, to_driver, 1)
            self.wait_for_worker = functools.partial(os.eventfd_read, to_driver)
            self._to_worker = to_worker
        else:
            worker_r, worker_w = os.pipe()
            driver_r, driver_w = os.pipe()
            self._fds = (worker_r, worker_w, driver_r, driver_w)
            self.wake_worker = functools.partial(os.write, worker_w, b"\0")
            self.wait_for_driver = functools.partial(os.read, worker_r, 1)
            self.wake_driver = functools.partial(os.write, driver_w, b"\0")
            self.wait_for_worker = functools.partial(os.read, driver_r, 1)
            self._to_worker = worker_r

    def wait_for_job(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the next wake-up; False if none came."""
        if not select.select([self._to_worker], [], [], timeout)[0]:
            return False
        self.wait_for_driver()
        return True

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass


class _Worker:
    """A pooled daemon thread that runs one mediator at a time.

    Starting an OS thread costs far more than a whole small trace, so a
    finished worker waits (holding no reference to user objects) for the next
    mediator, and retires after ``_IDLE_SECONDS`` without work.
    """

    def __init__(self) -> None:
        self.channel = _Channel()
        self._job: Mediator | None = None
        # Set when a driver was interrupted while waiting on this worker: its
        # channel may hold a stale wake-up, so it never serves another body.
        # (Its two descriptors are left open: a late write must not reach a
        # reused descriptor number.)
        self.poisoned = False
        threading.Thread(target=self._loop, name="backlens mediator", daemon=True).start()

    def run(self, mediator: Mediator) -> None:
        self._job = mediator
        self.channel.wake_worker()

    def _loop(self) -> None:
        channel = self.channel
        while True:
            if not channel.wait_for_job(_IDLE_SECONDS):
                with _pool_lock:
                    if self in _idle:
                        _idle.remove(self)
                        channel.close()
                        return
                if self.poisoned:  # passed over by _worker(): no job is coming
                    return
                channel.wait_for_driver()  # taken from the pool just now: its job is coming
            mediator, self._job = self._job, None
            assert mediator is not None
            mediator._main()
            del mediator
            if self.poisoned:  # its driver was interrupted: nobody will read this wake-up
                return
            _reset_thread_state()
            with _pool_lock:
                _idle.append(self)
            channel.wake_driver()


def _reset_thread_state() -> None:
    """Undo torch state a body set without a `with` (it would leak into the next body)."""
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                torch.set_autocast_enabled(device, False)
        except (RuntimeError, TypeError, AttributeError):
            continue


_IDLE_SECONDS = 10.0
_pool_lock = threading.Lock()
_idle: list[_Worker] = []


def _worker() -> _Worker:
    with _pool_lock:
        while _idle:
            worker = _idle.pop()
            if not worker.poisoned:
                return worker
    return _Worker()


def _forget_workers_after_fork() -> None:
    """A forked child has none of the parent's threads: drop their pool entries."""
    for worker in _idle:
        worker.channel.close()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers_after_fork)


class Mediator:
    """Runs one block body on a pooled thread, one step at a time.

    Mediator side: :meth:`request` (blocks until the driver serves the key).
    Driver side: :meth:`start`, :meth:`serve`, :meth:`fail`, :meth:`cancel`;
    each returns once the body has asked for its next value or finished.
    After that, ``pending`` is the key it waits for (None when done), ``done``
    says it finished, ``error`` holds what the body raised and ``result`` its
    final local variables. Hand-offs go through the worker's :class:`_Channel`.
    """

    def __init__(
        self,
        block: Block,
        body: Callable[..., dict[str, Any]],
        namespace: dict[str, Any],
        state: CallerState,
        context: Callable[[], Any] | None = None,
    ):
        self.block = block
        block.mediator = self
        self.pending: Any = None
        self.event: Event | None = None
        self.done = False
        self.started = False
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self._body: Callable[..., dict[str, Any]] | None = body
        self._namespace: dict[str, Any] | None = namespace
        self._state = state
        self._context = context
        self._inbox_error: BaseException | None = None
        self._cancelled = False
        self._worker: _Worker | None = None
        self._plan: collections.deque[Any] = collections.deque()
        self.queued: collections.deque[Event] = collections.deque()
        # Set by the driver when the body only binds planned values to names:
        # it then runs in the driver's own thread when the last one arrives.
        self.inline = False
        self._interrupted = False

    # -- mediator side -------------------------------------------------
    def _main(self) -> None:
        """The body, run on the worker thread (the worker signals the end)."""
        previous = set_block(self.block)
        try:
            # A pooled thread is reset to the default state after each body; an
            # inline body runs in the driver's thread, whose state is checked.
            current = CallerState.capture() == self._state if self.inline else self._state.is_default
            if current and self._context is None:
                self._run_body()
            else:
                with ExitStack() as stack:
                    stack.enter_context(self._state.applied())
                    if self._context is not None:
                        stack.enter_context(self._context())
                    self._run_body()
        except Cancelled:
            pass
        except BaseException as exc:  # handed to the driver, re-raised in the caller's thread
            exc.__traceback__ = strip_internal_head(exc.__traceback__, _PLUMBING)
            self.error = exc
        finally:
            set_block(previous)
            self.done = True
            self.pending = None
            self.event = None

    def _run_body(self) -> None:
        body, namespace = self._body, self._namespace
        self._body = self._namespace = None
        assert body is not None and namespace is not None
        self.result = run_body(body, namespace)

    def request(self, key: Any) -> Event:
        """Wait until the driver serves ``key``; returns the event it served."""
        if self._cancelled:
            raise Cancelled()
        if self._worker is None:  # an inline body never waits (see inline)
            raise RuntimeError(f"backlens: an inline body asked for an unplanned value {key!r}")
        self.event = None
        self.pending = key
        channel = self._worker.channel  # type: ignore[union-attr]
        channel.wake_driver()
        channel.wait_for_driver()
        self.pending = None
        if self._inbox_error is not None:
            error, self._inbox_error = self._inbox_error, None
            raise error
        event = self.event
        assert event is not None and event.key == key
        return event

    # -- driver side ---------------------------------------------------
    def start(self) -> None:
        """Run the body until its first request (or its end)."""
        self.started = True
        self.pending = None
        self.inline = False
        self._plan.clear()
        self._worker = _worker()
        self._worker.run(self)
        self._wait()

    def defer(self, plan: list[Any]) -> None:
        """Wait for the keys of ``plan`` without running the body yet.

        For a body whose leading statements ask for these keys, in order,
        and do nothing in between that anyone could see: starting it only
        when the last one is served runs the same code to the same effect,
        and saves a hand-off each way per key.
        """
        self._plan = collections.deque(plan)
        self.pending = self._plan.popleft()

    def hold(self, event: Event) -> bool:
        """Keep a planned event for the deferred body; False when the body must run now."""
        if self.started or not self._plan:
            return False
        self.queued.append(event)
        self.pending = self._plan.popleft()
        return True

    def serve(self, event: Event) -> None:
        """Hand ``event`` to the body waiting for it; return when it yields again."""
        self.event = event
        if not self.started:
            self.started = True
            self.pending = None
            self._plan.clear()
            if self.inline:
                self._main()  # every request is already served: nothing can block
                self.event = None
                return
            self._worker = _worker()
            self._worker.run(self)
        else:
            self._worker.channel.wake_worker()  # type: ignore[union-attr]
        self._wait()
        self.event = None

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` in the body at its pending request."""
        if not self.started:
            self.start()  # a deferred body: run it up to the request it was waiting for
            if self.done or self.pending is None:
                return
        self._inbox_error = error
        self._worker.channel.wake_worker()  # type: ignore[union-attr]
        self._wait()

    def cancel(self) -> None:
        """Unwind the body if it waits; make any later request unwind it."""
        self._cancelled = True
        if not self.started:
            self.done = True  # a deferred body that never got its value never runs
            self.pending = None
        elif self.done:
            return
        elif self._interrupted:
            # The driver was interrupted (Ctrl-C) while it waited, so the
            # channel's wake-ups can no longer be trusted: wake a body waiting
            # at a request without waiting for it; a body still running user
            # code unwinds at its next request. Its worker then retires.
            self._inbox_error = Cancelled()
            self._worker.channel.wake_worker()  # type: ignore[union-attr]
        elif self.pending is not None:
            self.fail(Cancelled())

    def _wait(self) -> None:
        # Blocks only while the body runs user code: the body always ends in
        # a request or in the worker's wake-up (see _Worker._loop).
        worker = self._worker
        assert worker is not None
        try:
            worker.channel.wait_for_worker()
        except BaseException:
            self._interrupted = True
            worker.poisoned = True
            raise


# Frames at the head of a body's traceback that are only this thread's plumbing.
_PLUMBING = {Mediator._main.__code__, Mediator._run_body.__code__, run_body.__code__}
