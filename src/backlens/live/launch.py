"""Where live coroutines are entered: every coroutine of a run from one ``switch``.

A greenlet's C stack begins just below the native frame of the ``switch``
call that first entered it. The frames above that point are not the
greenlet's own and are not saved with it: whenever it runs later, the memory
there holds whatever the coroutine in place left. Native code that walks the
stack from inside a greenlet walks on into that memory, and torch does so for
every error it raises (a ``c10::Error`` records a C++ backtrace: a freed
graph, a shape mismatch, an in-place check). The walk is sound only while a
``switch`` call of the same native frame layout waits at that very address;
otherwise it reads stale words as frame addresses, and the process can crash.

So the frame that runs a model or an autograd engine for live bodies does not
run it itself: :func:`drive` runs it in a driver coroutine and enters that
coroutine, and each body the driver starts (:func:`launch`), from the one
``switch`` in its loop, where it waits until the run is over. Every greenlet
of the run then has that live ``switch`` call above its base, and the
caller's own frames above that. Runs nest: a driver or body that drives a run
of its own is the launcher of that run.

A finished coroutine parks for reuse (a fresh greenlet costs a mapping and an
unmapping of its Python frame stack, about 15 µs), but only for a run entered
from the same native stack address: the pool is keyed by the stack pointer
of the launcher's loop, read with ``getcontext`` where the layout is known
(x86-64 Linux with glibc). Elsewhere, and under a trace or profile function,
every coroutine is new.
"""

from __future__ import annotations

import contextvars
import ctypes
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import greenlet

getcurrent = greenlet.getcurrent
T = TypeVar("T")

_SITES = 8  # stack addresses with parked coroutines, per thread
_PER_SITE = 8  # parked coroutines per stack address


# -- the native stack address of the launcher's loop ---------------------------


def _stack_pointer_reader() -> Callable[[], int] | None:
    """A function that returns the native stack pointer where it is called, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        getcontext = ctypes.PyDLL(None).getcontext  # PyDLL: the GIL stays held
    except (OSError, AttributeError):  # not glibc
        return None
    getcontext.argtypes = [ctypes.c_void_p]
    getcontext.restype = ctypes.c_int
    local = threading.local()

    def read() -> int:
        slot = getattr(local, "slot", None)
        if slot is None:
            context = ctypes.create_string_buffer(1024)  # a ucontext_t (936 bytes)
            # uc_mcontext.gregs[REG_RSP]: after uc_flags, uc_link, uc_stack (40 bytes), 15 registers on.
            slot = local.slot = (ctypes.addressof(context), ctypes.c_uint64.from_buffer(context, 160), context)
        getcontext(slot[0])
        return slot[1].value

    return read


_stack_pointer = _stack_pointer_reader()


# -- coroutines and where they park ------------------------------------------------


class _Coroutine(greenlet.greenlet):
    """A driver or a body. ``site``: the stack address of the loop that first entered it;
    ``launcher`` (a driver's): the coroutine whose :func:`drive` loop waits for it."""

    site: int | None
    launcher: greenlet.greenlet | None


_parked = threading.local()


def _pools() -> dict[int, list[_Coroutine]]:
    pools = getattr(_parked, "pools", None)
    if pools is None:
        pools = _parked.pools = {}
    return pools


def _root() -> greenlet.greenlet:
    root = getcurrent()
    while root.parent is not None:
        root = root.parent
    return root


def _run_jobs(job: Callable[[], Any]) -> Any:
    """What every coroutine runs: a job; then, parked, the next (a body's job never raises)."""
    me = getcurrent()
    while True:
        result = job()
        job = None  # type: ignore[assignment]  # hold nothing of the user's while parked
        receiver = me.parent
        if not _park(me):
            return result  # ends, which hands ``result`` to the parent
        # Parked under the thread's root, so a parked coroutine keeps no driver alive.
        me.parent = _root()
        me.gr_context = None
        job = receiver.switch(result)
        if job is None:  # ended to make room
            return None


def _park(me: _Coroutine) -> bool:
    """Keep ``me`` for a later run entered from its site, if there is room."""
    site = me.site
    if site is None:
        return False
    pools = _pools()
    pool = pools.get(site)
    if pool is None:
        if len(pools) >= _SITES:
            return False
        pool = pools[site] = []
    if len(pool) >= _PER_SITE:
        return False
    pool.append(me)
    return True


def _make_room(site: int, root: greenlet.greenlet) -> None:
    """At a run from the thread's own stack: end the coroutines of the site used longest ago
    when ``site`` is new and every place is taken.

    Only there: entering a parked coroutine (to end it, or by its collection,
    which enters it to raise ``GreenletExit``) moves the frames above its base
    off the stack, and during a run those are the running launchers'.
    """
    pools = _pools()
    if site in pools or len(pools) < _SITES:
        return
    for glet in pools.pop(next(iter(pools))):
        if not glet.dead:
            glet.parent = root
            glet.switch(None)


def _take(site: int | None) -> _Coroutine:
    """A coroutine first entered from ``site``: a parked one, or a new one."""
    if site is not None:
        pools = _pools()
        pool = pools.pop(site, None)
        if pool is not None:
            pools[site] = pool  # last: the dict keeps its sites in the order they were used
            while pool:
                glet = pool.pop()
                if not glet.dead:
                    return glet
    glet = _Coroutine(_run_jobs)
    glet.site = site
    glet.launcher = None
    return glet


# -- runs -------------------------------------------------------------------------


class _Launch:
    """What a driver sends its launcher: enter ``glet`` with ``job``."""

    __slots__ = ("glet", "job")

    def __init__(self, glet: greenlet.greenlet, job: Any):
        self.glet = glet
        self.job = job


class _Finished:
    __slots__ = ("result",)

    def __init__(self, result: Any):
        self.result = result


def drive(job: Callable[[], T]) -> T:
    """Run ``job`` (a model call, an engine run) as a run's driver, in a coroutine.

    This frame enters the driver and every body the driver starts with
    :func:`launch`, all from the one ``switch`` below, and waits there until
    the driver's job returns; the job must leave no body suspended (each run
    unwinds its bodies when it ends). The driver runs in the caller's
    ``contextvars`` context, as the job would in place. Returns what ``job``
    returns; what it raises propagates from here.
    """
    launcher = getcurrent()
    profiler = sys.getprofile()
    if profiler is not None or sys.gettrace() is not None:
        # Under a trace or profile function, new coroutines only: each one's first event is its
        # call and each frame it starts returns within the run (a parked coroutine's never would),
        # so a tracer that keeps a stack of frames (coverage, profile) stays in step.
        python_profile = type(profiler) is not _ProfileStacks and _python_profile(profiler) is not None
        stacks = _ProfileStacks.install(profiler, launcher) if python_profile else None
        try:
            return _run(job, launcher, None)
        finally:
            if stacks is not None:
                stacks.uninstall()
    site = _stack_pointer() if _stack_pointer is not None else None
    if site is not None and launcher.parent is None:  # the thread's own stack: no run under way
        _make_room(site, launcher)
    return _run(job, launcher, site)


def _run(job: Callable[[], T], launcher: greenlet.greenlet, site: int | None) -> T:
    driver = _take(site)
    driver.parent = launcher
    driver.launcher = launcher
    context = launcher.gr_context
    if context is None:  # no context object yet: one is made for the caller, to share
        contextvars.copy_context()
        context = launcher.gr_context
    driver.gr_context = context
    target: greenlet.greenlet = driver
    value: Any = _DriverJob(job)
    reply: Any = None
    while True:
        try:
            while True:
                reply = target.switch(value)  # the one switch that enters this run's coroutines
                if type(reply) is _Launch:
                    target, value = reply.glet, reply.job
                elif type(reply) is _Finished:
                    return reply.result
                else:
                    raise RuntimeError(f"backlens: a live run's driver switched to its launcher with {reply!r}")
        except BaseException as exc:
            if driver.dead or type(reply) is _Finished:
                raise  # the driver's job raised it, or the run is over
            # Raised here between switches (a Ctrl-C): the driver unwinds its run as if its
            # launch had raised it, and reports it as it reports a failed run.
            target, value = driver, _Interrupted(exc)


def _python_profile(profiler: Any) -> Any:
    """The standard library's pure-Python ``profile.Profile`` behind a profile function, or None."""
    module = sys.modules.get("profile")
    owner = getattr(profiler, "__self__", None)
    return owner if module is not None and isinstance(owner, module.Profile) else None


class _ProfileStacks:
    """The profile function while a run goes on under the pure-Python ``profile`` module.

    ``profile.Profile`` keeps one call stack per thread and asserts that each
    call's caller is the frame on top of it ("Bad call"); coroutines
    interleave their frames in one thread. Its stack is swapped for the
    running coroutine's at each event that comes from another coroutine
    than the last one, here in the profile function itself, where no profile
    event of our own can come between. (cProfile keeps no such stack.)
    """

    __slots__ = ("profiler", "dispatch", "stacks", "current")

    def __init__(self, profiler: Any, launcher: greenlet.greenlet):
        self.profiler = _python_profile(profiler)
        self.dispatch = profiler
        self.stacks: dict[greenlet.greenlet, Any] = {}
        self.current = launcher

    @classmethod
    def install(cls, profiler: Any, launcher: greenlet.greenlet) -> _ProfileStacks:
        stacks = cls(profiler, launcher)
        sys.setprofile(stacks)
        return stacks

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        here = getcurrent()
        if here is not self.current:
            profiler = self.profiler
            self.stacks[self.current] = profiler.cur
            if here in self.stacks:
                profiler.cur = self.stacks.pop(here)
            else:  # a new coroutine: its stack starts with a stand-in caller, as the profiler's own does
                profiler.cur = None
                profiler.simulate_call("coroutine")
            self.current = here
        return self.dispatch(frame, event, arg)

    def uninstall(self) -> None:
        sys.setprofile(self.dispatch)
        self.stacks.clear()


class _Interrupted:
    """Sent to a driver that its launcher was interrupted: raised where the driver waits
    (its launch), or as its job if it had not begun."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __call__(self) -> None:
        raise self.error


class _DriverJob:
    __slots__ = ("job",)

    def __init__(self, job: Callable[[], Any]):
        self.job = job

    def __call__(self) -> _Finished:
        me = getcurrent()
        try:
            return _Finished(self.job())
        finally:
            self.job = None  # type: ignore[assignment]
            me.launcher = None


def launch(job: Callable[[], Any], context: contextvars.Context) -> tuple[greenlet.greenlet, Any]:
    """From a driver: run ``job`` in a new body coroutine, in ``context``; its return goes to the driver.

    Entered by the driver's launcher; returns the coroutine and what is next
    switched to the driver (the body's first request, or its end).
    """
    driver = getcurrent()
    launcher = getattr(driver, "launcher", None)
    if launcher is None:
        raise RuntimeError("backlens: a live body was started outside a run's driver (live.launch.drive)")
    glet = _take(driver.site)
    glet.parent = driver
    glet.gr_context = context
    reply = launcher.switch(_Launch(glet, job))
    if type(reply) is _Interrupted:
        raise reply.error
    return glet, reply


# Frames at the head of a coroutine's traceback that are only this plumbing.
PLUMBING = {_run_jobs.__code__, _DriverJob.__call__.__code__}
