"""Gradient norms reaching module outputs, during recorded steps only.

:func:`watch_module_outputs` is the one place the monitor sees module calls.
It subscribes to the module-call mechanism capture and live tracing share
(``backlens._module_calls``: modules stay on torch's fast call path, where a
forward hook would put every call on the slow one) only while a recorded
step's forwards run, in the thread that trains, and cancels at its optimizer
step; each call's first output tensor (the
house's one reading of a nested output, ``_nested.first_tensor``) gets a
tensor hook that files the norm of the gradient reaching it, once for all
the modules returning that same tensor (a container and its last child). A
tensor hook reads the gradient and returns nothing, so it never changes one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from backlens import _module_calls
from backlens._nested import first_tensor


@dataclass
class Fired:
    """The output gradients of a step: ``positions`` (the module of each, in backward order, the
    order the engine reached them), ``slots`` (where its norm is among ``size`` norms: modules
    returning the same tensor share one) and the norms as ``(slots, values)`` chunks on the device."""

    positions: np.ndarray
    slots: np.ndarray
    size: int
    chunks: list[tuple[np.ndarray, torch.Tensor]]


class OutputWatch:
    """A module-call subscriber for ``modules`` while armed; each firing gradient's norm written, in firing
    order, into one preallocated vector per device and dtype (no allocation that outlives the
    hook: small tensors kept across a backward fragment the C heap, which then faults pages in
    again every step)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], failed: Callable[[BaseException], None]):
        self.modules = modules
        self.failed = failed
        self.fires: list[tuple[int, tuple, int]] = []  # (module position, vector key, index in it)
        self._vectors: dict[tuple, list] = {}  # (device, dtype) -> [vector, used]
        self._position_of = {id(module): position for position, (_address, module) in enumerate(modules)}
        self._subscription: Any = None
        self._tensor_handles: list[Any] = []
        self._hooked: dict[int, tuple[weakref.ref, list[int]]] = {}  # id(tensor) -> tensor, its modules

    @property
    def armed(self) -> bool:
        return self._subscription is not None

    def arm(self) -> None:
        if self._subscription is None:
            self._subscription = _module_calls.subscribe(self)

    def disarm(self) -> None:
        """Stop watching module calls and remove any tensor hook still waiting for its gradient."""
        subscription, self._subscription = self._subscription, None
        waiting, self._tensor_handles = self._tensor_handles, []
        if subscription is not None:
            subscription.cancel()
        for handle in waiting:
            handle.remove()
        self._hooked = {}

    # -- the module-call subscriber (backlens._module_calls) ------------------------
    def module_called(self, module: nn.Module, _args: tuple, _kwargs: dict) -> int | None:
        return self._position_of.get(id(module))

    def module_returned(self, module: nn.Module, position: int, output: Any) -> Any:
        self._called(position, output)
        return output

    def module_raised(self, module: nn.Module, position: int) -> None:
        pass

    def take(self) -> Fired:
        """The step's output gradient norms (float64, on their devices), and a fresh start."""
        fires, self.fires = self.fires, []
        waiting, self._tensor_handles = self._tensor_handles, []
        for handle in waiting:  # outputs whose gradient never came (an evaluation forward)
            handle.remove()
        self._hooked = {}
        chunks, offsets, size = [], {}, 0
        for key, entry in self._vectors.items():
            vector, used = entry
            if used:
                offsets[key] = size
                chunks.append((np.arange(size, size + used), vector[:used].to(torch.float64)))
                size += used
                entry[1] = 0
        return Fired(np.array([position for position, _k, _i in fires], dtype=np.int64),
                     np.array([offsets[key] + index for _p, key, index in fires], dtype=np.int64), size, chunks)

    def _called(self, position: int, output: Any) -> None:
        try:
            tensor = first_tensor(output)
            if tensor is None or not tensor.requires_grad:
                return
            known = self._hooked.get(id(tensor))
            if known is not None and known[0]() is tensor:
                known[1].append(position)
                return
            positions = [position]
            self._hooked[id(tensor)] = (weakref.ref(tensor), positions)
            self._tensor_handles.append(tensor.register_hook(partial(self._reached, positions)))
        except Exception as exc:  # noqa: BLE001 - the user's forward goes on
            self.failed(exc)

    def _reached(self, positions: list[int], grad: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
                key = (grad.device, dtype)
                entry = self._vectors.get(key)
                if entry is None:
                    entry = self._vectors[key] = [torch.empty(4 * len(self.modules) + 4, dtype=dtype,
                                                              device=grad.device), 0]
                vector, used = entry
                if used == len(vector):  # more gradients than expected this step: twice the room
                    entry[0] = vector = torch.cat([vector, torch.empty_like(vector)])
                torch.linalg.vector_norm(grad, dtype=dtype, out=vector[used])
                entry[1] = used + 1
                self.fires.extend((position, key, used) for position in positions)
        except Exception as exc:  # noqa: BLE001 - the user's backward goes on
            self.failed(exc)


def watch_module_outputs(modules: list[tuple[str, nn.Module]],
                         failed: Callable[[BaseException], None]) -> OutputWatch:
    """The monitor's module-call mechanism: armed for the forwards of recorded steps only."""
    return OutputWatch(modules, failed)
