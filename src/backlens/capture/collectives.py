"""Collectives inside a backward: DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters.

A :class:`CollectiveRecorder` is a pass observer of a capture's backward
recorder. Around each captured engine run (``run_context``) it lets the
model's data-parallel wrappers report every collective they issue, as a
:class:`~backlens.capture.state.CollectiveEntry` of that pass: its kind, the
bytes of the buffer it reduces or gathers, the parameters it carries and their
modules, when it was issued and when its work completed.

Where the collectives are seen (capture/comm_hooks.py):

* DDP's reducer calls the process group from C++; the one place Python sees a
  bucket is DDP's communication hook, which DDP takes once per model. The
  first capture of a DDP model registers backlens's hook, which runs what DDP
  runs without one (so gradients stay bitwise equal) and records only while a
  captured engine run is under way.
* FSDP2 keeps each unit's all-gather and reduce-scatter objects (the ones
  ``FSDPModule.set_custom_all_gather`` replaces); recording wrappers take their
  place for one captured engine run and the originals are put back in its
  ``finally``.

Waiting. The time the issuing thread spends inside a collective call
(enqueueing it, or all of it when the call is synchronous, as FSDP's are on
CPU) is the collective's: it is taken out of the node fire it happened in
(``BackwardRecorder.charge_wait``). The waits in the engine's final
callbacks (DDP's finalize, FSDP's root post-backward) come after the pass's
last fire has ended (``BackwardRecorder.end_fires_at_drain``), so no node is
charged for them either.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from backlens import _torch
from backlens._fence import complete
from backlens.capture.comm_hooks import DdpBucketHook, RecordingComm, ddp_bucket_hook
from backlens.capture.state import CaptureState, CollectiveEntry, PassEntry
from backlens.errors import BacklensWarning
from backlens.graph.labels import owning_module


@dataclass(frozen=True)
class FsdpGroup:
    """One FSDP2 param group of a unit: the parameters its collectives carry, by name."""

    group: Any
    params: tuple[str, ...]
    modules: tuple[str, ...]


class CollectiveRecorder:
    """Records one capture's collectives (see the module docstring).

    Reaches its state weakly (it is held by the state's backward recorder).
    ``notes`` says what it cannot record (a DDP model with a hook of its own).
    """

    def __init__(self, state: CaptureState, ddp_hooks: list[DdpBucketHook], fsdp_groups: list[FsdpGroup],
                 param_names: dict[int, str], notes: list[str]):
        self._state = weakref.ref(state)
        self._ddp_hooks = ddp_hooks
        self._fsdp_groups = fsdp_groups
        self._param_names = param_names  # id(parameter) -> name in the captured model
        self.notes = notes
        self._warned = False

    @classmethod
    def for_model(cls, state: CaptureState, model: torch.nn.Module, addresses: dict[int, str],
                  params: dict[str, Any]) -> CollectiveRecorder | None:
        """The recorder for ``model``'s DDP and FSDP2 parts; None when it has none."""
        ddp_models, fsdp_units = _parallel_parts(model)
        if not ddp_models and not fsdp_units:
            return None
        notes: list[str] = []
        hooks = []
        for ddp in ddp_models:
            try:
                hook = ddp_bucket_hook(ddp)
            except Exception as exc:  # noqa: BLE001 - capture goes on; its all-reduces are not recorded
                notes.append(f"registering backlens's communication hook failed ({type(exc).__name__}: {exc})")
                continue
            if hook is None:
                notes.append(f"the DDP model at {addresses.get(id(ddp), '?') or '(model)'!r} has a communication "
                             "hook of its own registered before the capture: its all-reduces are not recorded")
            else:
                hooks.append(hook)
        groups = [FsdpGroup(group, names, _modules_of(names))
                  for unit in fsdp_units
                  for group in _torch.fsdp_param_groups(unit)
                  for names in [_unit_param_names(unit, addresses, fsdp_units)]]
        if fsdp_units and not groups:
            notes.append("this torch keeps FSDP2's communication objects where backlens does not look "
                         "(bl.doctor(): HAS_FSDP_COMM_OBJECTS): its all-gathers and reduce-scatters are not recorded")
        for note in notes:
            warnings.warn(BacklensWarning(f"Collectives: {note}.", code="collectives_not_recorded"), stacklevel=3)
        return cls(state, hooks, groups, {id(p): name for name, p in params.items()}, notes)

    def param_aliases(self, sources: dict[str, int]) -> dict[int, int]:
        """id -> source index of the unsharded parameters FSDP2 computes with (their
        AccumulateGrad nodes accumulate into them, not into the sharded parameters)."""
        aliases = {}
        for fsdp_group in self._fsdp_groups:
            for sharded, unsharded in _torch.fsdp_unsharded_params(fsdp_group.group):
                name = self._param_names.get(id(sharded))
                if name is not None and name in sources:
                    aliases[id(unsharded)] = sources[name]
        return aliases

    # -- around a captured engine run -------------------------------------------------
    def run_context(self, run: Any, pass_: PassEntry) -> Any:
        return self._recording(pass_)

    @contextmanager
    def _recording(self, pass_: PassEntry) -> Iterator[None]:
        hooks: list[DdpBucketHook] = []
        swapped: list[tuple[Any, Any, Any]] = []
        try:
            try:
                for hook in self._ddp_hooks:
                    hooks.append(hook)  # first: the finally then takes out what a Ctrl-C cut short
                    hook.recorders.append((self, pass_))
                for fsdp_group in self._fsdp_groups:
                    all_gather, reduce_scatter = _torch.fsdp_comms(fsdp_group.group)
                    swapped.append((fsdp_group.group, all_gather, reduce_scatter))
                    _torch.set_fsdp_comms(
                        fsdp_group.group,
                        RecordingComm(all_gather, "all_gather", self, pass_, fsdp_group.params,
                                      fsdp_group.modules),
                        RecordingComm(reduce_scatter, "reduce_scatter", self, pass_, fsdp_group.params,
                                      fsdp_group.modules),
                    )
            except Exception as exc:  # noqa: BLE001 - the backward runs unrecorded rather than not at all
                self.failed(exc)
            yield
        finally:
            def restore() -> None:  # idempotent: run to completion, also on Ctrl-C
                for group, all_gather, reduce_scatter in reversed(swapped):
                    _torch.set_fsdp_comms(group, all_gather, reduce_scatter)
                for hook in hooks:
                    hook.recorders[:] = [(r, p) for r, p in hook.recorders if not (r is self and p is pass_)]

            complete(restore)

    def on_pass_close(self, state: CaptureState, pass_: PassEntry, error: BaseException | None) -> None:
        """Nothing to finish: a collective's end is written when its work completes."""

    # -- what the wrappers report ----------------------------------------------------------
    def issued(self, pass_: PassEntry, kind: str, nbytes: int, params: tuple[str, ...], modules: tuple[str, ...],
               start: int, returned: int) -> CollectiveEntry | None:
        """Journal a collective issued at ``start`` whose call returned at ``returned``."""
        state = self._state()
        if state is None:
            return None
        entry = CollectiveEntry(pass_.number, kind, nbytes, start, None, params, modules)
        state.collectives.append(entry)
        if state.recorder is not None:
            state.recorder.charge_wait(returned - start)
        return entry

    def names_of(self, tensors: list[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of the captured model's parameters among ``tensors``, and their modules."""
        names = tuple(name for t in tensors if (name := self._param_names.get(id(t))) is not None)
        return names, _modules_of(names)

    def failed(self, exc: BaseException) -> None:
        """A recording error: the collective ran as it would have; say so once."""
        if not self._warned:
            self._warned = True
            warnings.warn(BacklensWarning(f"recording a collective failed ({type(exc).__name__}: {exc}); the "
                                          "collective ran unchanged and the pass's collectives are incomplete.",
                                          code="collective_recording_failed"), stacklevel=2)


def _modules_of(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(owning_module(name) for name in names))


def _parallel_parts(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The DDP models and FSDP2 units in ``model`` (itself included), in module order."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever called fully_shard
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    ddp_models, fsdp_units = [], []
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            ddp_models.append(module)
        elif fsdp_module is not None and isinstance(module, fsdp_module):
            fsdp_units.append(module)
    return ddp_models, fsdp_units


def _unit_param_names(unit: torch.nn.Module, addresses: dict[int, str], units: list[Any]) -> tuple[str, ...]:
    """The parameters an FSDP2 unit manages: those in its subtree that no unit nested in it
    manages (``fully_shard``'s rule), named as in the captured model."""
    prefix = addresses.get(id(unit), "")
    nested = {id(other) for other in units if other is not unit}
    names: list[str] = []
    seen: set[int] = set()
    pending = [(prefix, unit)]
    while pending:
        address, module = pending.pop()
        here = f"{address}." if address else ""
        own_params, _own_buffers, own_children = _torch.module_parts(module)
        for name, param in own_params:
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                names.append(here + name)
        children = [(here + name, child) for name, child in own_children
                    if child is not None and id(child) not in nested]
        pending.extend(reversed(children))
    return tuple(names)
