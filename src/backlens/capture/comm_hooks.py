"""Where collectives are seen: backlens's DDP communication hook and FSDP2's recording comms.

Each runs the collective exactly as it would run without backlens, then
reports it to the recorders listening (capture/collectives.py). A failure to
record never reaches the collective: it warns once and the collective's
result is untouched.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from backlens import _torch
from backlens._clock import now as _now

# One hook per DDP model (DDP takes one, for good); None for a model with a hook of its own.
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DdpBucketHook:
    """backlens's communication hook on one DDP model.

    It runs what DDP's reducer runs without a hook: each bucket scaled by one
    over the world size (DDP scales each gradient as it copies it into the
    bucket; one multiply by the same factor, so the same bits) and all-reduced
    (sum) over the model's process group. A hook the user registers later
    (``ddp.register_comm_hook``) runs in its place, inside it. While
    ``recorders`` is not empty (a captured engine run is under way), each
    bucket is reported to them with its bytes and parameters, and completes
    when its work does.
    """

    def __init__(self, process_group: Any):
        self.group = process_group
        self.inner: tuple[Any, Any] | None = None
        self.recorders: list[tuple[Any, Any]] = []  # (CollectiveRecorder, its pass)

    def adopt(self, state: object, hook: Any) -> None:
        """Stands in for ``ddp.register_comm_hook`` once this hook is registered."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        self.inner = (state, hook)

    def all_reduce(self, state, bucket):  # noqa: ANN001, ANN201 - DDP checks real annotations, these are strings
        recording = list(self.recorders)
        start = _now() if recording else 0
        if self.inner is not None:
            inner_state, hook = self.inner
            future = hook(inner_state, bucket)
            done = _value
        else:
            buffer = bucket.buffer()
            buffer.mul_(1.0 / _group_size(self.group))
            future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
            done = _first_tensor
        if not recording:
            return future.then(done) if done is _first_tensor else future
        returned = _now()
        entries = []
        try:
            buffer = bucket.buffer()
            nbytes = buffer.numel() * buffer.element_size()
            parameters = bucket.parameters()
            for recorder, pass_ in recording:
                params, modules = recorder.names_of(parameters)
                entry = recorder.issued(pass_, "all_reduce", nbytes, params, modules, start, returned)
                if entry is not None:
                    entries.append(entry)
        except Exception as exc:  # noqa: BLE001 - recording never stops the all-reduce
            recording[0][0].failed(exc)
        return future.then(partial(_completed, entries, done))


def _group_size(group: Any) -> int:
    return group.size() if group is not None else dist.get_world_size()


def _first_tensor(future: torch.futures.Future) -> torch.Tensor:
    return future.value()[0]


def _value(future: torch.futures.Future) -> Any:
    return future.value()


def _completed(entries: list[Any], done: Any, future: torch.futures.Future) -> Any:
    """The bucket's work completed (runs in the thread that completed it)."""
    now = _now()
    for entry in entries:
        entry.end_ns = now
    return done(future)


def ddp_bucket_hook(ddp: Any) -> DdpBucketHook | None:
    """backlens's hook on ``ddp``, registered on first use; None when ``ddp`` already has
    a communication hook of its own (DDP accepts one only)."""
    if ddp in _HOOKS:
        return _HOOKS[ddp]
    hook = None
    registered = _torch.ddp_comm_hooks(ddp)
    if not registered:
        candidate = DdpBucketHook(getattr(ddp, "process_group", None))
        hooks_before = list(registered or ())
        try:
            ddp.register_comm_hook(None, candidate.all_reduce)
        except (RuntimeError, ValueError):  # a built-in hook is registered (in C++, not in that list)
            if registered is not None:
                registered[:] = hooks_before
        else:
            hook = candidate
            # A hook the user registers later runs inside ours instead of failing
            # with DDP's "can only be called once".
            ddp.register_comm_hook = hook.adopt
    _HOOKS[ddp] = hook
    return hook


class RecordingComm:
    """An FSDP2 unit's all-gather or reduce-scatter object, recording each call.

    Calls the object it stands in for with the same arguments; ``allocate``
    and anything else FSDP asks of it are that object's.
    """

    def __init__(self, inner: Any, kind: str, recorder: Any, pass_: Any, params: tuple[str, ...],
                 modules: tuple[str, ...]):
        self.inner = inner
        self.kind = kind
        self._recorder = recorder
        self._pass = pass_
        self._params = params
        self._modules = modules

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = _now()
        work = self.inner(*args, **kwargs)
        returned = _now()
        try:
            # all_gather(output_tensor, input_tensor, ...): what it gathers is its output;
            # reduce_scatter(output_tensor, input_tensor, ...): what it reduces is its input.
            name, position = ("output_tensor", 0) if self.kind == "all_gather" else ("input_tensor", 1)
            buffer = kwargs[name] if name in kwargs else args[position]
            entry = self._recorder.issued(self._pass, self.kind, buffer.numel() * buffer.element_size(),
                                          self._params, self._modules, start, returned)
            if entry is not None:
                if work is None:
                    entry.end_ns = returned  # synchronous: done when the call returned
                else:
                    work.get_future().then(partial(_completed, [entry], _value))
        except Exception as exc:  # noqa: BLE001 - recording never stops the collective
            self._recorder.failed(exc)
        return work
