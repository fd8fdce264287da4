"""Backward engine runs: which captures a run belongs to, and its pass per capture.

``torch.autograd.backward``, ``Tensor.backward`` and ``torch.autograd.grad``
all end in one engine entry point of ``torch.autograd.graph``. backlens wraps it
through ``_torch.install_engine_wrapper`` while a capture is armed or an observer
watches, and puts torch's own back when the last of them goes, so a plain
backward runs no backlens code. A run started elsewhere is found by the engine's graph-task
id when one of a capture's hooks first fires, and becomes an *implicit* run,
closed when the engine drains.

Ownership. A run belongs to a capture when it reaches a node that capture's
forward made; a run reaching it only through a leaf input's or a shared
parameter's AccumulateGrad is not its pass. One walk per run, from its roots,
stops at the nodes the live captures' forwards made: the captures it reaches
take part, and so do the captures whose graphs theirs feed (an encoder captured
apart from the head that consumes its output). The nodes the walk finds on the
way (the loss) go to the capture they lead to (the first armed, when they lead
to several). When one run reaches several captures, each records the pass with
its own nodes, FLOPs and time.
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
from backlens._fence import complete
from backlens._frames import PACKAGE_DIR, TORCH_DIR, user_frame
from backlens.graph.discovery import root_nodes, walk


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

    armed: bool

    def discover_forward(self) -> None: ...
    def forward_node(self, node: Any) -> bool: ...
    def owns(self, node: Any) -> bool: ...
    def knows(self, node: Any) -> bool: ...
    def adopt(self, nodes: list[Any]) -> None: ...
    def upstream(self, live: list[Participant]) -> list[Participant]: ...
    def fired_nodes(self, backward_pass: Any) -> list[Any]: ...
    def open_pass(self, run: Run) -> Any: ...
    def close_pass(self, backward_pass: Any, error: BaseException | None) -> None: ...
    def run_contexts(self, run: Run) -> list[Any]: ...
    def preflight(self, backward_pass: Any) -> BaseException | None: ...


@dataclass(eq=False)
class Run:
    """One engine run and the pass it opened in each participating capture.

    ``open``: per thread, the fire in progress, as ``[node, (participant, call
    entry, pass), ...]`` (several captures may record the same node: a shared
    parameter's AccumulateGrad). ``shared``: what the captures' observers share
    for the run (one FLOP census); emptied when the run closes.
    """

    trigger: str
    call_site: CallSite | None
    retain_graph: bool | None
    create_graph: bool
    explicit: bool
    inputs: tuple[Any, ...] | None = None
    task_id: int | None = None
    # The nodes the run starts from: the first node it runs is one of them, whichever
    # thread runs it (held until the run is bound to its engine task).
    roots: tuple[Any, ...] = ()
    passes: dict[Any, Any] = field(default_factory=dict)
    closed: bool = False
    open: dict[int, list] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)

    def recorded_elsewhere(self, node: Any, participant: Any) -> bool:
        """Whether another capture taking part in this run has ``node`` in its graph."""
        return any(other is not participant and other.knows(node) for other in self.passes)


# Weak: a capture the user dropped stops taking part (and can be collected).
_participants: list[weakref.ref] = []
_runs_by_task: dict[int, Run] = {}
# Explicit runs started and not yet bound to their engine task, in every thread. The
# engine runs a CUDA device's nodes on that device's own thread, so a run's first hook
# may fire in another thread than the one whose wrapper opened it.
_unbound: list[Run] = []
_local = threading.local()
_lock = threading.RLock()
# Called with every run's engine arguments before it starts (see run_arguments).
_observers: list[Any] = []


_wrappers: dict[Any, Any] = {}  # torch's entry point -> our wrapper of it (made once)


def _wrapper_of(original: Any) -> Any:
    made = _wrappers.get(original)
    if made is None:
        made = _wrappers[original] = _make_wrapper(original)
    return made


def arm(participant: Participant) -> None:
    """Start routing engine runs to ``participant`` (installs the wrapper with the first one)."""
    with _lock:
        _torch.install_engine_wrapper(_wrapper_of)
        if participant not in _live_participants():
            _participants.append(weakref.ref(participant))


def observing(observer: Any) -> bool:
    return observer in _observers


_holders: dict[Any, set[object]] = {}  # observer -> the tokens that hold it (watch/unwatch)


def watch(observer: Any, token: object) -> None:
    """Call ``observer(args, kwargs)`` before every engine run while any token holds it (the
    wrapper installed with the first observer; live traces take and leave it at every trace)."""
    with _lock:
        holders = _holders.get(observer)
        if holders is None:
            holders = _holders[observer] = set()
        holders.add(token)
        if observer not in _observers:
            _torch.install_engine_wrapper(_wrapper_of)
            _observers.append(observer)


def unwatch(observer: Any, token: object) -> None:
    """Let ``token`` go; the last one's leaving stops the observer, and restores torch's entry
    point when nothing else needs the wrapper (idempotent)."""
    with _lock:
        holders = _holders.get(observer)
        if holders is not None:
            holders.discard(token)
            if holders:
                return
        if observer in _observers:
            _observers.remove(observer)
            _uninstall_when_unused()


def disarm(participant: Participant) -> None:
    """Stop routing runs to ``participant``; with no capture armed and no observer left,
    torch's entry point is restored, so a plain backward runs no backlens code."""
    with _lock:
        _participants[:] = [ref for ref in _participants if ref() is not None and ref() is not participant]
        _uninstall_when_unused()


def _uninstall_when_unused() -> None:
    if not _participants and not _observers:
        _torch.uninstall_engine_wrapper()


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
        # From here every pass the run opened is closed whatever happens (a Ctrl-C
        # included), so none stays "running" and no census mode stays installed.
        pending = _pending()
        try:
            for participant, backward_pass in list(run.passes.items()):
                refused = participant.preflight(backward_pass)
                if refused is not None:
                    close_run(run, refused)
                    raise refused
            try:
                pending.append(run)
                with _lock:
                    _unbound.append(run)
                with ExitStack() as stack:
                    for participant in list(run.passes):
                        for context in participant.run_contexts(run):
                            stack.enter_context(context)
                    result = original(t_outputs, *args, **kwargs)
            finally:
                complete(lambda: _forget(run, pending))
        except BaseException as exc:
            failure, outcome = exc, []
            complete(lambda: outcome.append(close_run(run, failure)))
            replacement = outcome[-1] if outcome else None
            if replacement is not None and replacement is not exc:
                raise replacement from exc
            raise
        complete(lambda: close_run(run, None, result))
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
    with _lock:
        if run in _unbound:
            _unbound.remove(run)
        if run.task_id is not None:
            _runs_by_task.pop(run.task_id, None)
    run.roots = ()


def _open_explicit_run(t_outputs, args, kwargs) -> Run | None:
    if isinstance(t_outputs, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        t_outputs = (t_outputs,)
    inputs = _arg(args, kwargs, 3, "inputs", None)
    roots = root_nodes(t_outputs)
    with _lock:
        live = _live_participants()
        for participant in live:
            participant.discover_forward()
        # With ``inputs`` the engine runs only the nodes on paths to them: a capture
        # upstream of the ones reached joins when one of its nodes fires (pass_for).
        claims = claim(roots, live, follow_upstream=not inputs)
        for participant, found in claims.items():
            if found:
                participant.adopt(found)
    if not claims:
        return None
    retain_graph = _arg(args, kwargs, 1, "retain_graph", None)
    create_graph = bool(_arg(args, kwargs, 2, "create_graph", False))
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
        roots=tuple(roots),
    )
    try:
        for participant in claims:
            run.passes[participant] = participant.open_pass(run)
    except BaseException as exc:
        failure = exc
        complete(lambda: close_run(run, failure))  # the passes opened so far do not stay "running"
        raise
    return run


def claim(roots: list[Any], live: list[Participant], *, follow_upstream: bool = True) -> dict[Participant, list[Any]]:
    """The captures a run from ``roots`` belongs to, each with the new nodes it takes.

    One walk from the roots stops at nodes the live captures' forwards made
    (their AccumulateGrad nodes never stop it or decide anything); the captures
    reached are claimed, then (``follow_upstream``) the captures their graphs
    feed. Each node the walk found that no capture knows yet (the loss) goes to
    the first armed capture it leads to; a node leading to none goes with the
    node that led the walk to it.
    """
    owner_of: dict[Any, Participant] = {}

    def made_by_a_forward(node: Any) -> bool:
        owner = next((p for p in live if p.forward_node(node)), None)
        if owner is not None:
            owner_of[node] = owner
        return owner is not None

    done = walk(roots, made_by_a_forward, parents=True)
    walked, led_by = done.found, done.led_by
    if not owner_of:
        return {}
    reached = set(owner_of.values())
    claimed = [p for p in live if p in reached]
    if follow_upstream:
        for participant in claimed:  # grows as it goes: the captures a claimed one feeds
            claimed.extend(q for q in participant.upstream(live) if q not in claimed)
    claims: dict[Participant, list[Any]] = {p: [] for p in live if p in claimed}
    leads = _leads(walked, owner_of)
    assigned: dict[Any, Participant] = {}
    for node in walked:
        targets = leads[node]
        owner = next((p for p in live if p in targets), None) if targets else assigned.get(led_by[node])
        owner = owner or claimed[0]
        assigned[node] = owner
        if not any(p.knows(node) for p in live):
            claims[owner].append(node)
    return claims


def _leads(walked: list[Any], owner_of: dict[Any, Participant]) -> dict[Any, set]:
    """For each walked node, the captures whose forward nodes it leads to (depth first, no recursion)."""
    inside = set(walked)
    leads: dict[Any, set] = {}
    for start in walked:
        if start in leads:
            continue
        stack = [(start, False)]
        while stack:
            node, children_done = stack.pop()
            if node in leads:
                continue
            if not children_done:
                stack.append((node, True))
                stack.extend((child, False) for child, _ in node.next_functions
                             if child is not None and child in inside and child not in leads)
                continue
            targets: set = set()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                if child in inside:
                    targets |= leads.get(child, set())
                elif child in owner_of:
                    targets.add(owner_of[child])
            leads[node] = targets
    return leads


def reaches(participant: Participant, tensors: Any) -> bool:
    """Whether a backward from ``tensors`` would be ``participant``'s pass (ownership above)."""
    if isinstance(tensors, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        tensors = (tensors,)
    roots = root_nodes(tensors)
    with _lock:
        live = _live_participants()
        for other in live:
            other.discover_forward()
        return participant in claim(roots, live)


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
    """Close every pass of ``run``; returns the error to raise (maybe translated).

    Called again after an interruption, it closes the passes still open.
    """
    if run.closed:
        return error
    raised = error
    for participant, backward_pass in list(run.passes.items()):
        backward_pass.result = result
        translated = participant.close_pass(backward_pass, error)  # closing twice is a no-op
        if translated is not None and raised is error:
            raised = translated
    _count_other_capture_nodes(run)
    # Each pass keeps its run; the run need not keep its passes (no cycle to collect),
    # nor what observers shared (a census holds the nodes that ran).
    run.passes.clear()
    run.shared.clear()
    run.open.clear()
    run.roots = ()
    run.closed = True
    return raised


def _count_other_capture_nodes(run: Run) -> None:
    """Each pass's ``other_capture_nodes``: the nodes that fired in the run for the other
    captures taking part, outside its own graph."""
    if len(run.passes) < 2:
        return
    fired = {participant: participant.fired_nodes(p) for participant, p in run.passes.items()}
    for participant, backward_pass in run.passes.items():
        others = {node for other, nodes in fired.items() if other is not participant for node in nodes}
        backward_pass.other_capture_nodes = sum(1 for node in others if not participant.knows(node))


def pass_for(participant: Participant, task_id: int, node: Any) -> Any:
    """The pass ``participant`` should record a fire of ``node`` into, or None.

    Binds a pending explicit run to the engine's task id on its first fire
    (whichever thread it fires in); opens an implicit run for a task no wrapper saw.
    """
    with _lock:
        run = _runs_by_task.get(task_id)
        if run is None:
            run = _bind_pending(task_id, node)
        if run is None:
            if not participant.owns(node):
                return None  # a leaf's or a shared parameter's node in a run that is not ours
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
        if found is None and not run.closed and participant.owns(node):
            # Our graph, reached only through another capture's: join the run.
            found = run.passes[participant] = participant.open_pass(run)
        return found


def _bind_pending(task_id: int, node: Any) -> Run | None:
    """The explicit run whose first fire this is (bound to ``task_id`` from now on), or None.

    In the thread that opened it, the innermost run not yet bound (the engine runs
    CPU nodes in the calling thread, and a nested run starts and ends inside its
    caller's fire). In another thread (a device's own thread, on CUDA) the run that
    starts from ``node``: the first node a run executes is one of its roots. A fire
    that is neither is not guessed into a run: it opens an implicit one.
    """
    found = next((run for run in reversed(_pending()) if run.task_id is None), None)
    if found is None:
        found = next((run for run in reversed(_unbound) if run.task_id is None and node in run.roots), None)
    if found is not None:
        found.task_id = task_id
        _runs_by_task[task_id] = found
        if found in _unbound:
            _unbound.remove(found)
        found.roots = ()
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
