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


class Norms:
    """One preallocated vector of output gradient norms per device and dtype, written in firing
    order through 0-d views made once."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.vector = torch.empty(size, dtype=dtype, device=device)
        self.views = list(self.vector.unbind())
        self.used = 0

    def write(self, grad: torch.Tensor) -> int:
        """File the norm of ``grad``; return its index."""
        index = self.used
        if index == len(self.views):  # more gradients than expected this step: twice the room
            vector = torch.empty(2 * index, dtype=self.dtype, device=self.vector.device)
            vector[:index] = self.vector
            self.vector, self.views = vector, list(vector.unbind())
        if grad.dtype == self.dtype:
            torch.linalg.vector_norm(grad, out=self.views[index])
        else:
            torch.linalg.vector_norm(grad, dtype=self.dtype, out=self.views[index])
        self.used = index + 1
        return index


class OutputWatch:
    """A module-call subscriber for ``modules`` while armed; each firing gradient's norm written, in firing
    order, into one preallocated vector per device and dtype (no allocation that outlives the
    hook: small tensors kept across a backward fragment the C heap, which then faults pages in
    again every step)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], failed: Callable[[BaseException], None]):
        self.modules = modules
        self.failed = failed
        self.fires: list[tuple[list[int], Norms, int]] = []  # (module positions, their vector, index in it)
        self._vectors: dict[tuple, Norms] = {}  # (device, dtype) -> the norms written there
        self._position_of = {id(module): position for position, (_address, module) in enumerate(modules)}
        self._subscription: Any = None
        self._tensor_handles: list[Any] = []
        # The output hooked last, and the modules returning it: a container returns its last child's
        # output right after the child, and the two share one hook (any other repeat gets a hook
        # of its own, whose norm is the same).
        self._last: tuple[weakref.ref, list[int]] | None = None

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
        self._last = None

    # -- the module-call subscriber (backlens._module_calls) ------------------------
    def module_called(self, module: nn.Module, _args: tuple, _kwargs: dict) -> int | None:
        return self._position_of.get(id(module))

    def module_returned(self, module: nn.Module, position: int, output: Any) -> Any:
        try:
            tensor = output if isinstance(output, torch.Tensor) else first_tensor(output)
            if tensor is not None and tensor.requires_grad:
                last = self._last
                if last is not None and last[0]() is tensor:
                    last[1].append(position)
                else:
                    positions = [position]
                    self._last = (weakref.ref(tensor), positions)
                    self._tensor_handles.append(tensor.register_hook(partial(self._reached, positions)))
        except Exception as exc:  # noqa: BLE001 - the user's forward goes on
            self.failed(exc)
        return output

    def module_raised(self, module: nn.Module, position: int) -> None:
        pass

    def take(self) -> Fired:
        """The step's output gradient norms (on their devices), and a fresh start."""
        fires, self.fires = self.fires, []
        waiting, self._tensor_handles = self._tensor_handles, []
        for handle in waiting:  # also outputs whose gradient never came (an evaluation forward)
            handle.remove()
        self._last = None
        chunks, offsets, size = [], {}, 0
        for norms in self._vectors.values():
            if norms.used:
                offsets[id(norms)] = size
                chunks.append((np.arange(size, size + norms.used), norms.vector[:norms.used]))
                size += norms.used
                norms.used = 0
        return Fired(np.array([p for positions, _n, _i in fires for p in positions], dtype=np.int64),
                     np.array([offsets[id(norms)] + index for positions, norms, index in fires for _p in positions],
                              dtype=np.int64), size, chunks)

    def _reached(self, positions: list[int], grad: torch.Tensor) -> None:
        try:
            key = (grad.device, grad.dtype)
            norms = self._vectors.get(key)
            if norms is None:
                dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
                norms = self._vectors[key] = Norms(4 * len(self.modules) + 4, dtype, grad.device)
            if torch.is_grad_enabled():  # a backward with create_graph=True: record nothing
                with torch.no_grad():
                    index = norms.write(grad)
            else:
                index = norms.write(grad)
            self.fires.append((positions, norms, index))
        except Exception as exc:  # noqa: BLE001 - the user's backward goes on
            self.failed(exc)


def watch_module_outputs(modules: list[tuple[str, nn.Module]],
                         failed: Callable[[BaseException], None]) -> OutputWatch:
    """The monitor's module-call mechanism: armed for the forwards of recorded steps only."""
    return OutputWatch(modules, failed)
