"""Backward engine runs: which captures a run belongs to, and its pass per capture.

``torch.autograd.backward``, ``Tensor.backward`` and ``torch.autograd.grad``
all end in one engine entry point of ``torch.autograd.graph``. backlens wraps it
once per process through ``_torch.install_engine_wrapper`` and leaves it in
place (as live tracing does with ``Tensor.backward``); with no capture armed
the wrapper is a pass-through. A run started elsewhere is found by the engine's graph-task
id when one of a capture's hooks first fires, and becomes an *implicit* run,
closed when the engine drains.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from backlens import _torch
from backlens._frames import PACKAGE_DIR, TORCH_DIR, user_frame
from backlens.graph.discovery import root_nodes


@dataclass(frozen=True)
class CallSite:
    """The user's line that started a pass."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


class Participant(Protocol):
    """What a capture's backward recorder offers the engine router."""

    def discover_forward(self) -> None: ...
    def claim(self, roots: list[Any], others: list[Any]) -> bool: ...
    def open_pass(self, run: Run) -> Any: ...
    def close_pass(self, backward_pass: Any, error: BaseException | None) -> None: ...
    def owns_non_leaf(self, node: Any) -> bool: ...
    def run_contexts(self, run: Run) -> list[Any]: ...
    def preflight(self, backward_pass: Any) -> BaseException | None: ...


@dataclass(eq=False)
class Run:
    """One engine run and the pass it opened in each participating capture."""

    trigger: str
    call_site: CallSite | None
    retain_graph: bool | None
    create_graph: bool
    explicit: bool
    inputs: tuple[Any, ...] | None = None
    task_id: int | None = None
    passes: dict[Any, Any] = field(default_factory=dict)
    closed: bool = False


# Weak: a capture the user dropped stops taking part (and can be collected).
_participants: list[weakref.ref] = []
_runs_by_task: dict[int, Run] = {}
_local = threading.local()
_lock = threading.RLock()
# Called with every run's engine arguments before it starts (see run_arguments).
_observers: list[Any] = []



def arm(participant: Participant) -> None:
    """Start routing engine runs to ``participant`` (installs the wrapper once)."""
    _torch.install_engine_wrapper(_make_wrapper)
    with _lock:
        if participant not in _live_participants():
            _participants.append(weakref.ref(participant))


def observe(observer: Any) -> None:
    """Call ``observer(args, kwargs)`` before every engine run (installs the wrapper once)."""
    _torch.install_engine_wrapper(_make_wrapper)
    with _lock:
        _observers.append(observer)


def unobserve(observer: Any) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def disarm(participant: Participant) -> None:
    with _lock:
        _participants[:] = [ref for ref in _participants if ref() is not None and ref() is not participant]


def _live_participants() -> list[Participant]:
    alive = [p for p in (ref() for ref in _participants) if p is not None]
    if len(alive) != len(_participants):
        _participants[:] = [weakref.ref(p) for p in alive]
    return alive


def _pending() -> list[Run]:
    stack = getattr(_local, "pending", None)
    if stack is None:
        stack = _local.pending = []
    return stack


def set_trigger_override(name: str | None) -> None:
    """``cap.backward`` names its own trigger for the run it starts."""
    _local.trigger_override = name


def _make_wrapper(original):
    def run_engine(t_outputs, *args, **kwargs):
        if _observers:
            _notify(args, kwargs)
        if not _participants:
            return original(t_outputs, *args, **kwargs)
        run = _open_explicit_run(t_outputs, args, kwargs)
        if run is None:
            return original(t_outputs, *args, **kwargs)
        for participant, backward_pass in run.passes.items():
            refused = participant.preflight(backward_pass)
            if refused is not None:
                close_run(run, refused)
                raise refused
        pending = _pending()
        pending.append(run)
        try:
            try:
                with ExitStack() as stack:
                    for participant in run.passes:
                        for context in participant.run_contexts(run):
                            stack.enter_context(context)
                    result = original(t_outputs, *args, **kwargs)
            finally:
                _forget(run, pending)
        except BaseException as exc:
            replacement = close_run(run, exc)
            if replacement is not None and replacement is not exc:
                raise replacement from exc
            raise
        close_run(run, None, result)
        return result

    return run_engine


def _notify(args, kwargs) -> None:
    for observer in list(_observers):
        observer(args, kwargs)


def run_arguments(args, kwargs) -> tuple[bool, bool]:
    """``(accumulates into .grad, retains the graph)`` for an engine run's arguments."""
    retain = _arg(args, kwargs, 1, "retain_graph", None)
    create = bool(_arg(args, kwargs, 2, "create_graph", False))
    accumulate = bool(_arg(args, kwargs, 5, "accumulate_grad", True))
    return accumulate, bool(retain) if retain is not None else create


def _forget(run: Run, pending: list[Run]) -> None:
    if run in pending:
        pending.remove(run)
    if run.task_id is not None:
        with _lock:
            _runs_by_task.pop(run.task_id, None)


def _open_explicit_run(t_outputs, args, kwargs) -> Run | None:
    if isinstance(t_outputs, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        t_outputs = (t_outputs,)
    roots = root_nodes(t_outputs)
    with _lock:
        live = _live_participants()
        for participant in live:
            participant.discover_forward()
        participants = [p for p in live if p.claim(roots, [q for q in live if q is not p])]
    if not participants:
        return None
    retain_graph = _arg(args, kwargs, 1, "retain_graph", None)
    create_graph = bool(_arg(args, kwargs, 2, "create_graph", False))
    inputs = _arg(args, kwargs, 3, "inputs", None)
    accumulate = _arg(args, kwargs, 5, "accumulate_grad", True)
    override = getattr(_local, "trigger_override", None)
    trigger = override or _trigger_name(accumulate)
    run = Run(
        trigger=trigger,
        call_site=user_call_site(),
        retain_graph=bool(retain_graph) if retain_graph is not None else create_graph,
        create_graph=create_graph,
        explicit=True,
        inputs=tuple(inputs) if inputs else None,
    )
    for participant in participants:
        run.passes[participant] = participant.open_pass(run)
    return run


def _arg(args, kwargs, position: int, name: str, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _trigger_name(accumulate_grad: bool) -> str:
    if not accumulate_grad:
        return "torch.autograd.grad"
    frame = sys._getframe(3)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and code.co_filename.endswith(os.path.join("torch", "_tensor.py")):
            return "Tensor.backward"
        if not code.co_filename.startswith((TORCH_DIR, PACKAGE_DIR)):
            break
        frame = frame.f_back
    return "torch.autograd.backward"


def user_call_site() -> CallSite | None:
    """The innermost frame outside torch and backlens."""
    frame, _level = user_frame(1)
    if frame is None:
        return None
    return CallSite(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def close_run(run: Run, error: BaseException | None, result: Any = None) -> BaseException | None:
    """Close every pass of ``run``; returns the error to raise (maybe translated)."""
    if run.closed:
        return error
    run.closed = True
    raised = error
    for participant, backward_pass in list(run.passes.items()):
        backward_pass.result = result
        translated = participant.close_pass(backward_pass, error)
        if translated is not None and raised is error:
            raised = translated
    # Each pass keeps its run; the run need not keep its passes (no cycle to collect).
    run.passes.clear()
    return raised


def pass_for(participant: Participant, task_id: int, node: Any) -> Any:
    """The pass ``participant`` should record a fire of ``node`` into, or None.

    Binds a pending explicit run to the engine's task id on its first fire;
    opens an implicit run for a task no wrapper saw.
    """
    with _lock:
        run = _runs_by_task.get(task_id)
        if run is None:
            for pending in reversed(_pending()):
                if pending.task_id is None:
                    pending.task_id = task_id
                    _runs_by_task[task_id] = pending
                    run = pending
                    break
        if run is None:
            if not participant.owns_non_leaf(node):
                return None  # a shared parameter's node in a run that is not ours
            run = Run(
                trigger="implicit",
                call_site=None,
                retain_graph=_torch.current_keep_graph(),
                create_graph=torch.is_grad_enabled(),
                explicit=False,
                task_id=task_id,
            )
            _runs_by_task[task_id] = run
            _torch.queue_engine_callback(lambda: _close_implicit(run))
        found = run.passes.get(participant)
        if found is None and participant.owns_non_leaf(node):
            # Our graph, reached only through another capture's: join the run.
            found = run.passes[participant] = participant.open_pass(run)
        return found


def _close_implicit(run: Run) -> None:
    with _lock:
        if run.task_id is not None:
            _runs_by_task.pop(run.task_id, None)
    close_run(run, None)


def close_stale_implicit_runs(current_task: int) -> None:
    """Backstop for engines without queue_callback: close runs no longer running."""
    with _lock:
        stale = [r for t, r in _runs_by_task.items() if not r.explicit and t != current_task]
    for run in stale:
        _close_implicit(run)
