"""Watching module calls: the one mechanism capture, live tracing and the monitor share.

Contract
--------
``subscription = subscribe(subscriber)`` shows ``subscriber`` every module call
made in the calling thread (in any coroutine of it) until
``subscription.cancel()``; calls in other threads never reach it. The
subscriber is held weakly: one that is freed without cancelling unsubscribes
itself, so a forward cut short where no cleanup could run leaves nothing
installed once its subscriber is gone.

``subscribe(subscriber, classes)`` shows it at least the calls of modules of
those classes (a model's, from :func:`module_classes`), and
``subscription.widen(classes)`` adds more while it runs. What that saves is
the cost of installing: see below.

A subscriber has three methods, called in the thread that calls the module:

``module_called(module, args, kwargs) -> token``
    Before the call runs (before the module's own hooks). ``None`` means the
    call is none of the subscriber's business, and it hears nothing more of
    it; any other value is handed back below. To run the call on other
    inputs, return ``NewInputs(args, kwargs, token)``.
``module_returned(module, token, output) -> output``
    After the call returned ``output`` (its own forward hooks included);
    returns what the caller gets: ``output`` itself to keep it, another value
    to replace it (live tracing's ``lens.fc1.output = ...``).
``module_raised(module, token) -> None``
    Instead of ``module_returned`` when the call raised; the exception goes
    on to the caller.

Several subscribers in one thread nest like context managers: ``module_called``
in the order they subscribed, ``module_returned`` in reverse, each seeing
the output the ones subscribed after it left. An exception a subscriber
raises goes into the model's call (live tracing stops a run that way), so a
subscriber that must not disturb the model catches its own errors.

Gradients of module outputs: ``module_returned`` gets the real output, so a
subscriber registers a tensor hook on it (``output.register_hook``) to see
the gradient reaching it in later backward passes; no
``register_full_backward_hook`` (which inserts nodes into the user's graph).

How it is done: while any thread has a subscriber, the attribute of
``nn.Module`` that every module call goes through is wrapped (process-wide,
put back when the last subscriber leaves). That is the private
``nn.Module._call_impl``, behind ``_torch.HAS_MODULE_CALL_IMPL``: modules
stay on torch's fast path, where any forward hook, global or per module,
would put every call on ``nn.Module``'s slow hooked path, and setting it
costs nothing. Without that capability ``nn.Module.__call__`` is wrapped:
the same calls are seen, and each install updates every module class's call
slot (about 0.2 ms).

Setting an attribute of a class invalidates the type cache of the class and
of every subclass, so setting it on ``nn.Module`` walks every module class
loaded in the process: about 45 µs a set on GPT-2 with transformers
imported (500 classes), run cold after the model's kernels, and growing with
each library of models imported (15 µs a set warm with 3,500). A subscription
with classes sets the same wrapper on those classes instead (each class that
inherits torch's entry: one with its own is not watched, as under
``nn.Module``'s wrapper either), and takes it off when its last such
subscriber leaves: the cost follows the model, not the process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from torch import nn

from backlens import _torch
from backlens._fence import complete


class NewInputs(NamedTuple):
    """What ``module_called`` returns to run the call on other inputs."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    token: Any


class Subscriber(Protocol):
    def module_called(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def module_returned(self, module: Any, token: Any, output: Any) -> Any: ...

    def module_raised(self, module: Any, token: Any) -> None: ...


class Subscription:
    """One subscriber's place in its thread; ``cancel()`` (idempotent) takes it out."""

    __slots__ = ("_ref", "_thread")

    def __init__(self, ref: weakref.ref, thread: int):
        self._ref = ref
        self._thread = thread

    def cancel(self) -> None:
        try:
            _remove(self._thread, self._ref)
        except KeyboardInterrupt:  # cut short: finish it, then let the interrupt go on
            complete(lambda: _remove(self._thread, self._ref))
            raise

    def widen(self, classes: Iterable[type]) -> None:
        """Watch the calls of modules of ``classes`` too (a subscription with classes; a
        cancelled one stays cancelled)."""
        with _lock:
            if self._ref in _scopes:
                _hold(self._ref, classes)


_lock = threading.RLock()  # weakref callbacks may run while it is held
# thread id -> the weak references of its subscribers, outermost first (replaced, never mutated)
_by_thread: dict[int, tuple[weakref.ref, ...]] = {}
_installed: tuple[str, Any, Any] | None = None  # (attribute, torch's function, our wrapper)
_everywhere: set[weakref.ref] = set()  # the subscribers that see every module call (nn.Module's wrapper)
# class -> (attribute, our wrapper, the subscribers with classes that hold it there)
_on_classes: dict[type, tuple[str, Any, set[weakref.ref]]] = {}
_scopes: dict[weakref.ref, list[type]] = {}  # a subscriber with classes -> the classes it asked for


def subscribe(subscriber: Subscriber, classes: Iterable[type] | None = None) -> Subscription:
    """Show ``subscriber`` the module calls of the calling thread until the subscription is
    cancelled: every one, or (``classes``) at least those of modules of these classes."""
    thread = threading.get_ident()
    ref = weakref.ref(subscriber, lambda dead: _forget_dead(thread, dead))
    with _lock:
        try:
            _by_thread[thread] = (*_by_thread.get(thread, ()), ref)
            if classes is None:
                _everywhere.add(ref)
                _install()
            else:
                _scopes[ref] = []
                _hold(ref, classes)
        except KeyboardInterrupt:  # no subscription to cancel: take back what was installed
            complete(lambda: _remove(thread, ref))
            raise
    return Subscription(ref, thread)


def module_classes(model: nn.Module) -> set[type]:
    """The classes of ``model`` and of every module under it."""
    found: set[type] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        found.add(type(module))
        stack.extend(child for child in _torch.module_children(module).values() if child is not None)
    return found


def watching() -> bool:
    """Whether module calls are being watched now (in any thread)."""
    return bool(_by_thread) and (_installed is not None or bool(_on_classes))


def _forget_dead(thread: int, dead: weakref.ref) -> None:
    """A subscriber was freed: take it out unless it was cancelled already (the usual case)."""
    if any(ref is dead for ref in _by_thread.get(thread, ())):
        _remove(thread, dead)


def _remove(thread: int, ref: weakref.ref) -> None:
    with _lock:
        refs = _by_thread.get(thread)
        if refs is not None:
            if len(refs) == 1:
                if refs[0] is ref:
                    del _by_thread[thread]
            elif any(r is ref for r in refs):
                _by_thread[thread] = tuple(r for r in refs if r is not ref)
        _release(ref)
        _everywhere.discard(ref)
        if not _everywhere:
            _uninstall()


_wrappers: dict[str, tuple[Any, Any]] = {}  # attribute -> (the function wrapped, its wrapper): made once


def _entry() -> tuple[str, Any, Any]:
    """The attribute module calls go through, torch's function there and our wrapper of it."""
    if _installed is not None:
        return _installed
    name, original = _torch.module_call_entry()
    made = _wrappers.get(name)
    if made is None or made[0] is not original:
        made = _wrappers[name] = (original, _make_wrapper(original))
    return name, original, made[1]


def _install() -> None:
    global _installed
    if _installed is not None:
        return
    name, original, wrapper = _entry()
    _installed = (name, original, wrapper)
    _torch.set_module_call_entry(name, wrapper)


def _hold(ref: weakref.ref, classes: Iterable[type]) -> None:
    """Put the wrapper on each of ``classes`` that takes it, held there by ``ref``."""
    name, original, wrapper = _entry()
    scope = _scopes[ref]
    for cls in classes:
        entry = _on_classes.get(cls)
        if entry is None:
            # Only a class whose modules reach nn.Module's entry (or ours on a base class): one
            # with an entry of its own is not watched, as under nn.Module's wrapper either.
            reached = getattr(cls, name, None)
            if reached is not original and reached is not wrapper:
                continue
            # Noted before it is set: a release after a Ctrl-C here still finds it.
            _on_classes[cls] = (name, wrapper, {ref})
            scope.append(cls)
            setattr(cls, name, wrapper)
        elif ref not in entry[2]:
            scope.append(cls)
            entry[2].add(ref)


def _release(ref: weakref.ref) -> None:
    """Take ``ref``'s holds off its classes, and the wrapper off those no one holds (idempotent:
    run again after a Ctrl-C, it finishes what is left)."""
    for cls in _scopes.get(ref, ()):
        entry = _on_classes.get(cls)
        if entry is None:
            continue
        name, wrapper, holders = entry
        holders.discard(ref)
        if not holders:
            if cls.__dict__.get(name) is wrapper:
                delattr(cls, name)
            # Else someone set their own over ours: theirs stays (ours under it passes calls through).
            del _on_classes[cls]
    _scopes.pop(ref, None)


def _uninstall() -> None:
    global _installed
    if _installed is None:
        return
    name, original, wrapper = _installed
    if _torch.module_call_entry_now(name) is wrapper:
        _torch.set_module_call_entry(name, original)
        _installed = None
    # Else someone wrapped it over ours: ours stays under theirs, passing calls straight through.


def _make_wrapper(original: Any) -> Any:
    by_thread = _by_thread
    get_ident = threading.get_ident

    def _call_impl(module, *args, **kwargs):  # noqa: ANN001, ANN202 - runs per module call: kept flat
        refs = by_thread.get(get_ident())
        if refs is None:
            return original(module, *args, **kwargs)
        if len(refs) > 1:
            return _nested(refs, 0, original, module, args, kwargs)
        subscriber = refs[0]()
        if subscriber is None:
            return original(module, *args, **kwargs)
        token = subscriber.module_called(module, args, kwargs)
        if token is None:
            return original(module, *args, **kwargs)
        if type(token) is NewInputs:
            args, kwargs, token = token
        try:
            output = original(module, *args, **kwargs)
        except BaseException:
            subscriber.module_raised(module, token)
            raise
        return subscriber.module_returned(module, token, output)

    return _call_impl


def _nested(refs: tuple[weakref.ref, ...], i: int, original: Any, module: Any, args: tuple, kwargs: dict) -> Any:
    """Several subscribers in one thread: each wraps the ones subscribed after it."""
    if i == len(refs):
        return original(module, *args, **kwargs)
    subscriber = refs[i]()
    token = subscriber.module_called(module, args, kwargs) if subscriber is not None else None
    if token is None:
        return _nested(refs, i + 1, original, module, args, kwargs)
    if type(token) is NewInputs:
        args, kwargs, token = token
    try:
        output = _nested(refs, i + 1, original, module, args, kwargs)
    except BaseException:
        subscriber.module_raised(module, token)  # type: ignore[union-attr]
        raise
    return subscriber.module_returned(module, token, output)  # type: ignore[union-attr]
