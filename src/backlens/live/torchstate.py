"""torch's per-thread modes (grad, inference, autocast) for bodies that share a thread.

The model, the autograd engine and every block body run in the caller's
thread, so they share torch's thread-local modes. A body starts with the modes
the caller had where the body starts (:class:`CallerState`), and what it
changes there (``with torch.no_grad():`` around a request) must not leak into
the model while the body waits, nor the model's changes into the body:
:class:`StateSwitch` swaps the modes at each hand-over, and when both sides
agree (nearly always) that is one fingerprint read and a tuple compare.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from backlens import _torch

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = _torch.set_grad_enabled_function()
_inference_enabled = torch.is_inference_mode_enabled
_any_autocast = _torch.any_autocast_enabled_function()


@functools.cache
def _autocast_devices() -> tuple[str, ...]:
    """Devices whose autocast state a caller may have on (checked once, when first needed:
    each check costs, and importing backlens probes no backend)."""
    devices = ["cpu"]
    for name in ("cuda", "xpu", "mps", "hpu"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available():
                devices.append(name)
        except Exception:  # a backend that cannot even answer is not in use
            continue
    return tuple(devices)


Autocast = tuple[tuple[str, bool, Any], ...]
_NO_AUTOCAST: Autocast = ()


def _autocast_details() -> Autocast:
    found = []
    for device in _autocast_devices():
        try:
            found.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError, AttributeError):
            continue
    found.append(("cache", torch.is_autocast_cache_enabled(), None))
    return tuple(found)


def _autocast_now() -> Autocast:
    if _any_autocast is not None and not _any_autocast():
        return _NO_AUTOCAST
    details = _autocast_details()
    return details if any(on for device, on, _ in details if device != "cache") else ()


def _set_autocast(details: Autocast) -> None:
    if not details:
        details = tuple((d, False, dtype) for d, _, dtype in _autocast_details() if d != "cache")
    for device, on, dtype in details:
        if device == "cache":
            torch.set_autocast_cache_enabled(on)
            continue
        try:
            torch.set_autocast_enabled(device, on)
            if dtype is not None:
                torch.set_autocast_dtype(device, dtype)
        except (RuntimeError, TypeError, AttributeError):
            continue


class CallerState(NamedTuple):
    """The grad mode, inference mode and autocast state of the calling thread.

    A named tuple: built at every hand-over, so it must be cheap to build and compare.
    """

    grad_enabled: bool
    inference: bool
    autocast: Autocast

    @classmethod
    def capture(cls) -> CallerState:
        autocast = _NO_AUTOCAST if _any_autocast is not None and not _any_autocast() else _autocast_now()
        return _new(cls, (_grad_enabled(), _inference_enabled(), autocast))

    def applied(self) -> Any:
        """Apply this state to the calling thread for the duration (no-op when it already holds)."""
        if CallerState.capture() == self:  # the usual case: nothing to apply or undo
            return _NOTHING
        return _Applied(self)

    def apply_over(self, current: CallerState) -> list[Callable[[], None]]:
        """Make this state current; returns the steps that restore ``current`` (run in reverse)."""
        if current == self:
            return []
        undo: list[Callable[[], None]] = []
        grad = current.grad_enabled
        if current.inference != self.inference:
            guard = _torch.inference_mode_guard(self.inference)
            guard.__enter__()
            # The guard's exit restores grad and inference mode wholesale.
            undo.append(lambda: guard.__exit__(None, None, None))
            grad = _grad_enabled()
        if grad != self.grad_enabled:
            _set_grad_enabled(self.grad_enabled)
            undo.append(lambda: _set_grad_enabled(grad))
        if current.autocast != self.autocast:
            previous = _autocast_details()
            _set_autocast(self.autocast)
            undo.append(lambda: _set_autocast(previous))
        return undo


_new = tuple.__new__
_NOTHING = contextlib.nullcontext()


class _Applied:
    __slots__ = ("_state", "_undo")

    def __init__(self, state: CallerState):
        self._state = state
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        self._undo = self._state.apply_over(CallerState.capture())

    def __exit__(self, *exc: Any) -> None:
        for step in reversed(self._undo):
            step()


class StateSwitch:
    """Keeps the two sides of one hand-over (driver, body) in their own torch modes.

    At each switch the leaving side's modes are recorded; the arriving side
    gets back exactly the modes it left with. Steps applied when entering one
    side are undone when leaving it, which restores the other side's modes as
    they were (the inference-mode guard restores them wholesale).
    """

    __slots__ = ("body", "driver", "_undo")

    def __init__(self, body: CallerState):
        # Each side's modes as a plain tuple, in CallerState's order: built at every switch, a
        # CallerState only where they differ in more than grad mode.
        self.body: tuple[bool, bool, Autocast] = body
        self.driver: tuple[bool, bool, Autocast] | None = None
        # What undoes the side entered last: the steps of CallerState.apply_over, or for a
        # grad-mode flip alone the mode to set back.
        self._undo: list[Callable[[], None]] | bool | None = None

    def to_body(self) -> None:
        """Called by the driver right before it switches to the body."""
        # _autocast_now() inlined for its usual answer (this runs at every switch).
        autocast = _NO_AUTOCAST if _any_autocast is not None and not _any_autocast() else _autocast_now()
        self.driver = current = (_grad_enabled(), _inference_enabled(), autocast)
        self._cross(current, self.body)

    def to_driver(self) -> None:
        """Called by the body right before it switches back to the driver."""
        autocast = _NO_AUTOCAST if _any_autocast is not None and not _any_autocast() else _autocast_now()
        self.body = current = (_grad_enabled(), _inference_enabled(), autocast)
        self._cross(current, self.driver)

    def _cross(self, current: tuple[bool, bool, Autocast], arriving: tuple[bool, bool, Autocast] | None) -> None:
        """Undo what entering the side now left applied; else give the arriving side its modes."""
        undo = self._undo
        if undo is not None:
            self._undo = None
            if type(undo) is bool:
                _set_grad_enabled(undo)
            else:
                for step in reversed(undo):
                    step()
        elif arriving is not None and current != arriving:
            # The usual difference, grad mode alone (the autograd engine runs without it),
            # is one call each way.
            if current[1] == arriving[1] and current[2] == arriving[2]:
                _set_grad_enabled(arriving[0])
                self._undo = current[0]
            else:
                self._undo = _new(CallerState, arriving).apply_over(_new(CallerState, current))


def single_threaded_engine() -> bool:
    """Whether the autograd engine's device work must be kept in the calling thread, where
    bodies switch (``torch.autograd.set_multithreading_enabled(False)`` around the run).

    The engine runs CPU nodes in the calling thread anyway; only an accelerator's nodes run in
    its device threads. Turning those threads off costs about 3% of a CPU-only backward, so it
    is done only once an accelerator is in use in this process.
    """
    for module in _accelerator_modules():
        if module.is_initialized():
            return True
    return _mps_available()


@functools.cache
def _accelerator_modules() -> tuple[Any, ...]:
    """The accelerator modules that can be in use in this process: those with a device (checked
    once, at the first backward block; a torch built without one never initializes it)."""
    found = []
    for name in ("cuda", "xpu", "mtia"):
        module = getattr(torch, name, None)
        if module is None or getattr(module, "is_initialized", None) is None:
            continue
        try:
            if module.is_available():
                found.append(module)
        except Exception:  # a backend that cannot even answer is not in use
            continue
    return tuple(found)


@functools.cache
def _mps_available() -> bool:
    """Whether this machine has an MPS device (fixed for the process)."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
