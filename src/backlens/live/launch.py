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
coroutine from the one ``switch`` in its loop, where it waits until the run
is over. A body (:func:`launch`) is a coroutine first entered from that same
``switch``: a new one is handed to the launcher to enter; a parked one, first
entered there by an earlier run, the driver enters itself. Every greenlet of
the run then has that live ``switch`` call above its base, and the caller's
own frames above that. A run started inside a run (a backward block in a
body) is driven in place by the coroutine that starts it, whose bodies are
anchored under the same launcher.

A finished coroutine parks for reuse (a fresh greenlet costs a mapping and an
unmapping of its Python frame stack, about 15 µs), but only for a run entered
from the same native stack address: the pool is keyed by the stack pointer
of the launcher's loop, read with ``_setjmp`` where the layout is known
(x86-64 Linux with glibc, which stores it mangled: a key all the same).
Elsewhere, and under a trace or profile function, every coroutine is new.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import os
import platform
import sys
import sysconfig
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
    """A function that returns a key of the native stack pointer where it is called, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held
        libc.gnu_get_libc_version  # noqa: B018 - glibc, whose jmp_buf layout is known
        setjmp = libc._setjmp
    except (OSError, AttributeError):
        return None
    setjmp.restype = None  # it returns 0 (it is never jumped back to)
    local = threading.local()

    def read() -> int:
        slot = getattr(local, "slot", None)
        if slot is None:
            # A jmp_buf: rbx, rbp, r12-r15, then the stack pointer (mangled by the pointer guard).
            buffer = (ctypes.c_uint64 * 64)()
            slot = local.slot = (ctypes.byref(buffer), buffer)
        setjmp(slot[0])
        return slot[1][6]

    return read


_stack_pointer = _stack_pointer_reader()


# -- coroutines and where they park ------------------------------------------------


class _Coroutine(greenlet.greenlet):
    """A driver or a body. ``site``: the stack address of the loop that first entered it;
    ``launcher``: while it runs, the coroutine whose :func:`drive` loop anchors its run."""

    site: int | None
    launcher: greenlet.greenlet | None
    handed: Any = None  # what its last job returned, until the parent takes it (see _run_jobs)


class _Thread(threading.local):
    """Per thread: the parked coroutines by site (in the order the sites were used) and the
    thread's root greenlet."""

    def __init__(self) -> None:
        self.pools: dict[int, list[_Coroutine]] = {}
        root = getcurrent()
        while root.parent is not None:
            root = root.parent
        self.root = root


_thread = _Thread()
_HANDED = object()  # switched to a parent by a coroutine that parked: its result is its ``handed``


def _run_jobs(job: Callable[[], Any]) -> Any:
    """What every coroutine runs: a job; then, parked, the next (a body's job never raises)."""
    me = getcurrent()
    while True:
        result = job()
        job = None  # type: ignore[assignment]  # hold nothing of the user's while parked
        me.launcher = None
        receiver = me.parent
        if not _park(me):
            return result  # ends, which hands ``result`` to the parent
        # Parked under the thread's root, so a parked coroutine keeps no driver alive.
        me.parent = _thread.root
        me.gr_context = None
        # Handed over on the coroutine, not as the switch's argument, which this frame would hold
        # while parked: a driver's result is the model's output, kept alive until the next run
        # ends (and then freed in the middle of it, where glibc gives the heap back to the OS).
        me.handed = result
        result = None
        job = receiver.switch(_HANDED)
        if job is None:  # ended to make room
            return None


def _park(me: _Coroutine) -> bool:
    """Keep ``me`` for a later run entered from its site, if there is room."""
    site = me.site
    if site is None:
        return False
    pools = _thread.pools
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
    pools = _thread.pools
    if site in pools or len(pools) < _SITES:
        return
    for glet in pools.pop(next(iter(pools))):
        if not glet.dead:
            glet.parent = root
            glet.switch(None)


def _take(site: int | None) -> _Coroutine:
    """A coroutine first entered from ``site``: a parked one, or a new one."""
    if site is not None:
        pools = _thread.pools
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
    """What a coroutine of a run sends its launcher: enter the new coroutine ``glet`` with
    ``job``; ``sender`` waits for its answer."""

    __slots__ = ("glet", "job", "sender")

    def __init__(self, glet: greenlet.greenlet, job: Any, sender: greenlet.greenlet):
        self.glet = glet
        self.job = job
        self.sender = sender


_PENDING = object()  # no reply yet


def drive(job: Callable[[], T]) -> T:
    """Run ``job`` (a model call, an engine run) as a run's driver, in a coroutine.

    This frame enters the driver (and every new coroutine of the run) from
    the one ``switch`` below, and waits there until the driver's job returns;
    the job must leave no body suspended (each run unwinds its bodies when it
    ends). The driver runs in the caller's ``contextvars`` context, as the job
    would in place. Returns what ``job`` returns; what it raises propagates
    from here. Called from a coroutine of a running run, ``job`` runs in place:
    that coroutine is already anchored under the run's launcher, and so are
    the bodies it launches.
    """
    launcher = getcurrent()
    if getattr(launcher, "launcher", None) is not None:
        return job()
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
    value: Any = job
    reply: Any = _PENDING
    while True:
        try:
            while True:
                reply = target.switch(value)  # the one switch that enters this run's coroutines
                if type(reply) is not _Launch:
                    if reply is _HANDED:  # the driver's job returned, and the driver parked
                        reply, driver.handed = driver.handed, None
                    return reply  # the driver's job returned
                target, value = reply.glet, reply.job
        except BaseException as exc:
            if driver.dead or (reply is not _PENDING and type(reply) is not _Launch):
                raise  # the driver's job raised it, or the run is over
            # Raised here between switches (a Ctrl-C): the coroutine waiting for this loop
            # unwinds its run as if its launch had raised it (the driver, before it began:
            # as its job), and reports it as it reports a failed run.
            target = reply.sender if reply is not _PENDING else driver
            value = _Interrupted(exc)


def _python_profile(profiler: Any) -> Any:
    """The standard library's pure-Python ``profile.Profile`` behind a profile function, or None.

    Under ``python -m profile script.py`` that class is ``__main__.Profile``
    (the module ran as the main one), so it is known by the file it comes from.
    """
    owner = getattr(profiler, "__self__", None)
    if owner is None:
        return None
    for cls in type(owner).__mro__:
        if cls.__name__ == "Profile" and _is_stdlib_profile(sys.modules.get(cls.__module__)):
            return owner
    return None


def _is_stdlib_profile(module: Any) -> bool:
    if module is None:
        return False
    if module is sys.modules.get("profile"):
        return True
    file = getattr(module, "__file__", None)
    return file is not None and os.path.normcase(os.path.realpath(file)) == _stdlib_profile_file()


@functools.cache
def _stdlib_profile_file() -> str:
    return os.path.normcase(os.path.realpath(os.path.join(sysconfig.get_path("stdlib"), "profile.py")))


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
    """Sent to a coroutine waiting for its launcher that the launcher was interrupted:
    raised where it waits (its launch), or as its job if it had not begun (a driver)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __call__(self) -> None:
        raise self.error


def launch(job: Callable[[], Any], context: contextvars.Context) -> tuple[greenlet.greenlet, Any]:
    """From a coroutine driving a run: run ``job`` in a body coroutine, in ``context``; its
    return goes to the caller.

    A parked coroutine first entered from this run's launcher site is entered
    from here; a new one by the launcher. Returns the coroutine and what it
    next switched to the caller (the body's first request, or its end).
    """
    driver = getcurrent()
    launcher = getattr(driver, "launcher", None)
    if launcher is None:
        raise RuntimeError("backlens: a live body was started outside a run (live.launch.drive)")
    glet = _take(driver.site)
    glet.parent = driver
    glet.gr_context = context
    glet.launcher = launcher
    if glet:  # parked: anchored under this launcher's switch when it was new
        return glet, glet.switch(job)
    reply = launcher.switch(_Launch(glet, job, driver))
    if type(reply) is _Interrupted:
        raise reply.error
    return glet, reply


# Frames at the head of a coroutine's traceback that are only this plumbing.
PLUMBING = {_run_jobs.__code__}
