"""Backward recording: node discovery, per-fire hooks, passes and the call journal.

Every node of the capture's graph gets a pre-hook; a post-hook is added only
while some pass may keep the gradients a node sends on (``grad_inputs``) or
non-finite gradients are watched. A fire is journalled as a call entry of the
capture's state (node, pass, ordinal, timing, the gradients the pass's policy
keeps), a pass as a pass entry. Hooks never change gradients unless an edit is
armed for that node.

A fire starts at its pre-hook and ends when the engine starts the next node
on the same thread for the same run (or when the run ends; under
``torch.distributed``, when the engine has run the pass's last node, before
the final callbacks that wait for collectives). Its duration therefore
includes the engine routing the node's outputs to the nodes that consume them
(summing gradients that arrive from several paths), and leaves out
backlens's own work in its hooks (edits, copies of kept gradients, non-finite
checks) and the time spent in collectives issued inside it
(capture/collectives.py charges that to them); per thread, the durations of a
pass's fires add up to the time the engine spent in it, less that work.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from backlens import _torch
from backlens._fence import complete
from backlens._warn import warn
from backlens.capture.policy import GRAD_INPUT, GRAD_OUTPUT, GradPolicy, GradSite
from backlens.capture.state import CallEntry, CaptureState, PassEntry
from backlens.capture.views import InputNode, NodeView
from backlens.errors import NonFiniteGradError
from backlens.graph import engine
from backlens.graph.discovery import walk_bounded, walk_new

_now = time.perf_counter_ns
_task_id = _torch.graph_task_id_function()
_sequence_nr = _torch.sequence_nr
_thread = threading.get_ident


class BackwardRecorder:
    """Records every backward engine run over one capture's graph into its state.

    Held by the state and by the hooks on the user's graph; it reaches the state
    through one weak reference (a strong one would make the state a cycle that
    only the collector frees). ``failures`` explains refused and failed passes;
    ``observers`` see each pass close (``on_pass_close(state, pass_, error)``) and
    may hold a context open around an explicit run (``run_context(run, pass_)``);
    ``edits`` puts armed gradient edits on nodes as they are found.
    """

    def __init__(
        self,
        state: CaptureState,
        output_roots: list[Any],
        policy: GradPolicy,
        *,
        timing: bool,
        input_tensors: list[torch.Tensor],
        source_ids: dict[int, int],
        failures: Any,
        observers: list[Any] = (),
        edits: Any = None,
        detect_nonfinite: bool = False,
    ):
        self._state = weakref.ref(state)
        # The parts of the state the hooks write, held directly (no lookup per fire).
        self.table = state.table
        self.calls = state.calls
        self.node_calls = state.node_calls
        self.passes = state.passes
        self.store = state.store
        self.policy = policy
        self.timing = timing
        self.failures = failures
        self.observers = list(observers)
        self.edits = edits
        self.detect_nonfinite = detect_nonfinite
        self.pre_edits: dict[int, Callable[[tuple, PassEntry], tuple | None]] = {}
        self._input_tensors = input_tensors
        self._source_ids = source_ids  # id(parameter or input) -> source index
        self._output_roots = list(output_roots)
        self._handles: list[Any] = []
        self._sentinel_nodes: set[Any] = set()  # output nodes pre-hooked by arm()
        self._post_hooked = self._needs_post_hooks(policy, detect_nonfinite)
        self._forward_discovered = False
        self._forward_nodes = 0  # the first nodes of the table: those the forward made (and its leaves)
        self._forward_start = state.journal.seq_start  # nodes numbered before it are not the forward's
        # Where the graph leaves the forward (non-leaf inputs' grad_fns), until the
        # captures upstream of them are known (``upstream``).
        self._exits: list[Any] = []
        self._input_exits: list[tuple[int, InputNode]] = []  # non-leaf inputs: position, what policies see
        self._upstream: list[weakref.ref] | None = None
        self._task: int | None = None
        self._pass: PassEntry | None = None
        self._next_policy: GradPolicy | None = None
        self.armed = False
        self.hooking = True
        # Under torch.distributed: end each pass's last fire when the engine has run its
        # nodes, before the final callbacks that wait for collectives (DDP's, FSDP's).
        self.end_fires_at_drain = False

    # -- arming ----------------------------------------------------------
    def arm(self) -> None:
        """Route engine runs here; sentinel pre-hooks on the output nodes catch
        a first run that bypasses the entry points."""
        if self.armed:
            return
        self.armed = True
        for node in self._output_roots:
            if node not in self._sentinel_nodes:
                self._handles.append(node.register_prehook(partial(self._on_sentinel_pre, node)))
                self._sentinel_nodes.add(node)
        engine.arm(self)

    def disarm(self) -> None:
        self.armed = False
        engine.disarm(self)

    def remove_hooks(self) -> None:
        self.disarm()
        self.hooking = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._sentinel_nodes.clear()
        self._output_roots = []
        self._exits = []

    def close(self) -> None:
        """Remove every hook and let go of the user's tensors (the capture closes)."""
        self.close_stale()
        self.remove_hooks()
        self.failures.forget()
        self._input_tensors = []

    def _interrupted(self) -> None:
        """Adding nodes was cut short: the node table and the lists beside it may disagree,
        so the capture stops recording (its hooks go) and later ``cap.backward()`` calls raise."""
        state = self._state()
        if state is not None and state.interrupted is None:
            state.interrupted = "adding autograd nodes to the capture was interrupted"

        def stop() -> None:
            self.remove_hooks()
            self.table.repair()
            del self.node_calls[len(self.table):]
            self.node_calls.extend([[] for _ in range(len(self.table) - len(self.node_calls))])

        complete(stop)

    def _recording_failed(self, error: BaseException, pass_: PassEntry | None = None) -> None:
        """An internal error in a hook: the pass is marked ``recording_failed`` with the cause,
        a warning says so once per pass, and the user's backward goes on untouched."""
        pass_ = pass_ if pass_ is not None else self._pass
        if pass_ is not None and pass_.recording_error is not None:
            return
        if pass_ is not None:
            pass_.recording_error = error
        where = f"backward pass {pass_.number}" if pass_ is not None else "a backward pass"
        warn(f"backlens could not record {where} ({type(error).__name__}: {error}); the backward ran unchanged, "
             "but the records of this pass are incomplete.", "recording_failed", in_hook=True)

    # -- discovery -------------------------------------------------------
    def discover_forward(self) -> None:
        """Index the forward's graph: from its outputs down to its parameters' and leaf
        inputs' AccumulateGrad nodes, stopping where a non-leaf input's history starts
        (nodes made before the forward belong to whoever made them)."""
        if self._forward_discovered:
            return
        self._forward_discovered = True
        found, self._exits = walk_bounded(self._output_roots, self.table.knows, self._made_before)
        self._add(found)
        self._forward_nodes = len(self.table)
        self._hook_input_exits()

    def _made_before(self, node: Any) -> bool:
        """Whether ``node`` was made before the forward (another graph's: a non-leaf input's history)."""
        start = self._forward_start
        if start is None or type(node).__name__ == "AccumulateGrad":
            return False
        seq = _torch.node_sequence_nr(node)
        return seq is not None and seq < start

    def _hook_input_exits(self) -> None:
        """A non-leaf input's gradient is what arrives at its grad_fn, a node of its
        history: a pre-hook there keeps it (the node itself is not this capture's)."""
        if not self.hooking or not self._exits:
            return
        exits = set(self._exits)
        state = self._state()
        for position, tensor in enumerate(self._input_tensors):
            node = tensor.grad_fn
            if node is not None and node in exits and state is not None:
                hook = partial(self._on_input_pre, position, tensor.output_nr, node)
                self._handles.append(node.register_prehook(hook))
                self._input_exits.append((position, InputNode(state.inputs[position].name, type(node).__name__)))

    # -- ownership (graph/engine.py) ---------------------------------------
    def forward_node(self, node: Any) -> bool:
        """Whether the forward made ``node`` (its AccumulateGrad nodes excluded)."""
        index = self.table.index_of.get(node)
        return index is not None and index < self._forward_nodes and self.table.types[index] != "AccumulateGrad"

    def owns(self, node: Any) -> bool:
        """Whether ``node`` is this capture's own: made by its forward, its loss, or a pass."""
        index = self.table.index_of.get(node)
        return index is not None and self.table.types[index] != "AccumulateGrad"

    def knows(self, node: Any) -> bool:
        return node in self.table.index_of

    def adopt(self, nodes: list[Any]) -> None:
        """Take the nodes a run found on its way to this graph (the loss)."""
        self._add(nodes)

    def upstream(self, live: list[Any]) -> list[Any]:
        """The live captures whose forward graphs this one's non-leaf inputs came from.

        Found once: a capture upstream of this one's inputs was made before it.
        """
        if self._upstream is None:
            others = [p for p in live if p is not self]
            found: list[Any] = []
            if others and self._exits:
                def owner(node: Any) -> Any:
                    return next((p for p in others if p.forward_node(node)), None)

                for node in walk_new(self._exits, lambda node: owner(node) is not None)[1]:
                    at = owner(node)
                    if at not in found:
                        found.append(at)
            self._upstream = [weakref.ref(p) for p in found]
        return [p for p in (ref() for ref in self._upstream) if p is not None and p.armed]

    def fired_nodes(self, pass_: PassEntry) -> list[Any]:
        nodes, calls = self.table.nodes, self.calls
        return [nodes[calls[i].node] for i in pass_.calls if calls[i].node < len(nodes)]

    def _leaf_source(self, node: Any) -> int | None:
        """The parameter or input an AccumulateGrad node accumulates into (its source index)."""
        variable = _torch.accumulate_grad_variable(node)
        return self._source_ids.get(id(variable)) if variable is not None else None

    def _add(self, found: list[Any]) -> list[int]:
        # Several lists grow together here; one cut short (a Ctrl-C, an error) would
        # make the capture inconsistent, so it then stops recording (see _interrupted).
        completed = False
        try:
            added = self._add_nodes(found)
            completed = True
        finally:
            if not completed:
                self._interrupted()
        return added

    def _add_nodes(self, found: list[Any]) -> list[int]:
        added = self.table.add(found, self._leaf_source)
        node_calls = self.node_calls
        nodes = self.table.nodes
        node_calls.extend([[] for _ in added])
        if self.hooking:
            handles = self._handles
            sentinels = self._sentinel_nodes  # their sentinel pre-hook serves as theirs
            post_hooked = self._post_hooked
            on_pre, on_post = self._on_pre, self._on_post
            for index in added:
                node = nodes[index]
                if node not in sentinels:
                    handles.append(node.register_prehook(partial(on_pre, index)))
                if post_hooked:
                    handles.append(node.register_hook(partial(on_post, index)))
        state = self._state()
        if added and state is not None:
            # Relate the new nodes to the forward's tensors while they are held (by
            # identity), fingerprint custom Functions' saved tensors, arm gradient edits.
            for index in added:
                if self.table.is_custom(index):
                    self.failures.remember(nodes[index])
            state.slots.resolve(state.journal, self._input_tensors, self.table.index_of)
            if self.edits is not None:
                self.edits.arm(state, self.pre_edits)
        return added

    @staticmethod
    def _needs_post_hooks(policy: GradPolicy, detect_nonfinite: bool) -> bool:
        """Whether fires must also be seen after the node ran (for the gradients it sends on)."""
        return detect_nonfinite or not policy.saves_nothing

    def _add_post_hooks(self) -> None:
        """For a pass that may keep outgoing gradients when the nodes so far have no post-hooks."""
        self._post_hooked = True
        for index, node in enumerate(self.table.nodes):
            self._handles.append(node.register_hook(partial(self._on_post, index)))

    # -- passes ----------------------------------------------------------
    def use_policy_for_next_pass(self, policy: GradPolicy | None) -> None:
        self._next_policy = policy

    def open_pass(self, run: engine.Run) -> PassEntry:
        policy = self._next_policy or self.policy
        self._next_policy = None
        number = len(self.passes) + 1
        if self.hooking and not self._post_hooked and self._needs_post_hooks(policy, self.detect_nonfinite):
            self._add_post_hooks()
        if isinstance(policy.spec, bool):
            sides = [policy.sides(None, number)] * len(self.table)  # no per-node question to ask
        else:
            state = self._state()  # alive: a collected state disarmed this recorder
            sides = [policy.sides(state.view(NodeView, i), number) for i in range(len(self.table))]
        pass_ = PassEntry(
            number=number,
            trigger=run.trigger,
            call_site=run.call_site,
            retain_graph=run.retain_graph,
            create_graph=run.create_graph,
            policy=policy,
            start_ns=_now(),
            run=run,
            sides=sides,
            kept_inputs=self._kept_inputs(policy, number),
            seq_start=_sequence_nr(),
        )
        self.passes.append(pass_)
        return pass_

    def _kept_inputs(self, policy: GradPolicy, number: int) -> frozenset[int]:
        """The non-leaf inputs whose gradient a pass under ``policy`` keeps."""
        if not self._input_exits or policy.saves_nothing:
            return frozenset()
        return frozenset(position for position, stand_in in self._input_exits
                         if policy.matches(GradSite(stand_in, number, "grad_output")))

    def preflight(self, pass_: PassEntry) -> BaseException | None:
        """An error to raise instead of running the engine (a node that cannot run again)."""
        state = self._state()
        return self.failures.refuse(state, pass_) if state is not None else None

    def run_contexts(self, run: engine.Run) -> list[Any]:
        """Context managers to hold open around an explicit engine run."""
        pass_ = run.passes.get(self)
        contexts = []
        for observer in self.observers:
            make = getattr(observer, "run_context", None)
            context = make(run, pass_) if make is not None and pass_ is not None else None
            if context is not None:
                contexts.append(context)
        return contexts

    def close_pass(self, pass_: PassEntry, error: BaseException | None) -> BaseException | None:
        """Close a pass; returns the error to raise in place of ``error`` (None: leave it)."""
        if self._pass is pass_:
            self._task = None
            self._pass = None
        if pass_.status != "running":
            return None
        try:
            return self._close_pass(pass_, error)
        except Warning:
            raise  # a BacklensWarning the user's filter turned into an error is theirs
        except Exception as exc:  # noqa: BLE001 - an internal error never reaches the user's backward
            self._recording_failed(exc, pass_)
            pass_.status = "failed" if error is not None else "recording_failed"
            pass_.error = error if error is not None else exc
            return None

    def _close_pass(self, pass_: PassEntry, error: BaseException | None) -> BaseException | None:
        end = pass_.end_ns = _now()
        recording_error = pass_.recording_error
        pass_.status = "failed" if error is not None else "recording_failed" if recording_error else "ok"
        still_open = _take_open(pass_.run, self)
        if error is not None:
            if still_open:
                # The fire started last and never followed by another is the one that raised.
                pass_.failed_node = still_open[-1].node
        else:
            for entry in still_open:
                self._finish(entry, end, pass_)
        pass_.error = error if error is not None else recording_error
        pass_.seq_end = _sequence_nr()
        state = self._state()
        if state is None:
            return None
        if pass_.create_graph and error is None:
            self._discover_created(state, pass_)
        if any(p.create_graph for p in self.passes):
            nodes = state.nodes
            orders = [nodes[self.calls[i].node].order for i in pass_.calls]
            pass_.orders = sorted({order for order in orders if order is not None})
            resolved = sum(1 for order in orders if order is not None)
            pass_.order_coverage = resolved / len(orders) if orders else 1.0
        else:
            pass_.orders = [1] if pass_.calls else []  # no pass made nodes: every node is order 1
            pass_.order_coverage = 1.0
        for observer in self.observers:
            observer.on_pass_close(state, pass_, error)
        if error is not None:
            return self.failures.translate(state, pass_, error)
        self._keep_returned_input_grads(state, pass_)
        pass_.result = None  # read: torch.autograd.grad's results are the caller's
        return None

    def _keep_returned_input_grads(self, state: CaptureState, pass_: PassEntry) -> None:
        """``torch.autograd.grad`` returns its inputs' gradients instead of accumulating them:
        those of the capture's inputs are theirs (when the pass keeps gradients)."""
        run = pass_.run
        if run.trigger != "torch.autograd.grad" or not run.inputs or pass_.policy.saves_nothing:
            return
        results = pass_.result if isinstance(pass_.result, (tuple, list)) else ()
        for given, result in zip(run.inputs, results):
            position = next((i for i, t in enumerate(self._input_tensors) if t is given), None)
            if position is not None and isinstance(result, torch.Tensor):
                state.extra_input_grads.append((position, result, pass_.number))

    def _discover_created(self, state: CaptureState, pass_: PassEntry) -> None:
        roots = list(pass_.created_roots)
        result = pass_.result
        if isinstance(result, (tuple, list)):
            roots.extend(t.grad_fn for t in result if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        pass_.created_roots = []
        found, _outside = walk_bounded(roots, self.table.knows, self._made_before)
        self._add(found)

    def open_call(self) -> CallEntry | None:
        """The fire of this capture's graph running on this thread now (None outside its passes)."""
        pass_ = self._pass if _task_id() == self._task else None
        opened = pass_.run.open.get(_thread()) if pass_ is not None and pass_.run is not None else None
        return next((entry for r, entry, _p in opened[1:] if r is self), None) if opened else None

    def close_stale(self) -> None:
        """Backstop: close implicit passes whose engine run has drained."""
        if any(p.status == "running" and not p.run.explicit for p in self.passes):
            engine.close_stale_implicit_runs(_task_id())

    # -- hooks (hot path) --------------------------------------------------
    def _current(self, index: int) -> PassEntry | None:
        task = _task_id()
        if task == self._task and self.hooking:
            return self._pass
        return self._resolve_pass(index, task)

    def _resolve_pass(self, index: int, task: int) -> PassEntry | None:
        if not self.hooking:
            return None  # removed while this fire was under way (its capture was collected)
        nodes = self.table.nodes
        if index >= len(nodes):
            return None
        pass_ = engine.pass_for(self, task, nodes[index])
        if pass_ is not None:
            self._task = task
            self._pass = pass_
            if self.end_fires_at_drain and not pass_.drain_queued:
                # Queued at the pass's first fire, so it runs before callbacks queued later.
                pass_.drain_queued = _torch.queue_engine_callback(partial(self._drained, pass_))
        return pass_

    def _drained(self, pass_: PassEntry) -> None:
        """The engine has run every node of the pass: the fires still open end now."""
        try:
            if pass_.status == "running":
                now = _now()
                for entry in _take_open(pass_.run, self):
                    self._finish(entry, now, pass_)
        except Exception as exc:  # noqa: BLE001 - never into the engine; close_pass ends them instead
            self._recording_failed(exc, pass_)

    def charge_wait(self, nanoseconds: int) -> None:
        """Time the rank spent in a collective inside the fire open on this thread: the
        collective's, not the node's (leaves the fire's ``duration``)."""
        entry = self.open_call()
        if entry is not None:
            entry.wait_ns += nanoseconds

    def _on_sentinel_pre(self, node: Any, grad_outputs: tuple) -> tuple | None:
        try:
            if not self.armed:
                return None
            if not self._forward_discovered:
                self.discover_forward()
            index = self.table.index_of.get(node)
            if index is None:
                return None
        except Exception as exc:  # noqa: BLE001 - never abort the user's backward
            self._recording_failed(exc)
            return None
        return self._on_pre(index, grad_outputs)

    # Hooks keep backlens's own errors out of the user's backward (_recording_failed);
    # only an edit's error and a non-finite gradient (detect_nonfinite) reach it.
    def _on_pre(self, index: int, grad_outputs: tuple) -> tuple | None:
        try:
            task = _task_id()
            pass_ = self._pass if task == self._task and self.hooking else self._resolve_pass(index, task)
            if pass_ is None:
                return None
            now = _now()
            nodes = self.table.nodes
            if index >= len(nodes):
                return None  # the capture closed while this fire was under way
            node = nodes[index]
            opened = pass_.run.open
            thread = _thread()
            previous = opened.get(thread)
            if previous is not None and previous[0] is not node:
                # The engine started another node: the fires on this thread end now, whichever
                # capture recorded them (a capture's time is its own nodes').
                del opened[thread]
                for recorder, entry, entry_pass in previous[1:]:
                    recorder._finish(entry, now, entry_pass)
                previous = None
        except Exception as exc:  # noqa: BLE001
            self._recording_failed(exc)
            return None
        edit = self.pre_edits.get(index)
        replaced = edit(grad_outputs, pass_) if edit is not None else None
        try:
            create_graph = pass_.create_graph
            arriving = replaced if replaced is not None else grad_outputs
            sides = pass_.sides[index] if index < len(pass_.sides) else 0
            kept = self.store.keep(self._owned(index, arriving), "grad_outputs") if sides & GRAD_OUTPUT else None
            entry = CallEntry(
                index,
                pass_.number,
                0,
                _now() if self.timing else None,  # after the edit and the copies: they are not the node's
                0,
                None,
                kept,
                _sequence_nr() if create_graph else None,
            )
            if previous is None:
                opened[thread] = [node, (self, entry, pass_)]
            else:
                previous.append((self, entry, pass_))  # the same fire, recorded by another capture too
            if create_graph:
                for grad in arriving:
                    if grad is not None and grad.grad_fn is not None:
                        pass_.created_roots.append(grad.grad_fn)
        except Exception as exc:  # noqa: BLE001
            self._recording_failed(exc, pass_)
        return replaced

    def _on_input_pre(self, position: int, output_nr: int, node: Any, grad_outputs: tuple) -> None:
        """A non-leaf input's gradient arrives at its grad_fn (a node of another graph)."""
        pass_ = None
        try:
            task = _task_id()
            pass_ = self._pass if task == self._task and self.hooking else None
            if pass_ is None:
                if not self.hooking:
                    return None
                pass_ = engine.pass_for(self, task, node)
                if pass_ is None:
                    return None
                self._task, self._pass = task, pass_
            opened = pass_.run.open
            previous = opened.get(_thread())
            if previous is not None and previous[0] is not node:
                # Leaving this capture's graph: its last fire ends here, not with foreign work.
                now = _now()
                for recorder, entry, entry_pass in previous[1:]:
                    if recorder is self:
                        recorder._finish(entry, now, entry_pass)
                previous[1:] = [item for item in previous[1:] if item[0] is not self]
                if len(previous) == 1:
                    del opened[_thread()]
            grad = grad_outputs[output_nr] if output_nr < len(grad_outputs) else None
            state = self._state()
            if grad is None or state is None or position not in pass_.kept_inputs:
                return None
            state.extra_input_grads.append((position, grad, pass_.number))
        except Exception as exc:  # noqa: BLE001 - never abort the user's backward
            self._recording_failed(exc, pass_)
        return None

    def _finish(self, entry: CallEntry, end: int, pass_: PassEntry) -> None:
        """Journal a fire once the next one on its thread starts (or its run ends)."""
        entry.end_ns = end
        if pass_.create_graph:
            entry.seq_end = _sequence_nr()
        ordinals = self.node_calls[entry.node]
        entry.ordinal = len(ordinals) + 1
        call_index = len(self.calls)
        self.calls.append(entry)
        ordinals.append(call_index)
        pass_.calls.append(call_index)

    def _on_post(self, index: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        began = _now()
        pass_ = None
        try:
            pass_ = self._current(index)
            if pass_ is None:
                return None
            opened = pass_.run.open.get(_thread())
            entry = next((e for r, e, _p in opened[1:] if r is self), None) if opened is not None else None
            if entry is None or entry.node != index:
                return None
            try:
                sides = pass_.sides[index] if index < len(pass_.sides) else 0
                if sides & GRAD_INPUT:
                    entry.grad_inputs = self.store.keep(tuple(grad_inputs), "grad_inputs")
                if self.detect_nonfinite:
                    self._check_finite(index, pass_, grad_inputs, grad_outputs)
                if pass_.create_graph:
                    for grad in grad_inputs:
                        if grad is not None and grad.grad_fn is not None:
                            pass_.created_roots.append(grad.grad_fn)
            finally:
                entry.hook_ns += _now() - began
        except NonFiniteGradError:
            raise  # the product: detect_nonfinite stops the backward at the node that made it
        except Exception as exc:  # noqa: BLE001
            self._recording_failed(exc, pass_)
        return None

    def _owned(self, index: int, grads: tuple) -> tuple:
        """AccumulateGrad may adopt its incoming gradient as ``param.grad`` and add later
        passes into it in place; keep a copy so each pass's increment stays as it was."""
        if self.table.types[index] == "AccumulateGrad":
            return tuple(g.detach().clone() if g is not None else None for g in grads)
        return tuple(grads)

    def _check_finite(self, index: int, pass_: PassEntry, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Stop at the first node turning finite incoming gradients into NaN/Inf.

        Incoming gradients were checked as the outgoing ones of earlier nodes, so
        they are looked at only once an outgoing one is bad.
        """
        for grad in grad_inputs:
            if _finite(grad):
                continue
            if not all(_finite(g) for g in grad_outputs):
                return  # it arrived non-finite; the node that made it was reported or is upstream
            bad = "NaN" if torch.isnan(grad).any() else "Inf"
            raise self.failures.nonfinite(self._state(), index, pass_, bad)


def _take_open(run: engine.Run, recorder: BackwardRecorder) -> list[CallEntry]:
    """Remove ``recorder``'s fires still open in ``run`` (on every thread); returns them."""
    taken = []
    for thread, opened in list(run.open.items()):
        mine = [entry for r, entry, _p in opened[1:] if r is recorder]
        if mine:
            taken += mine
            opened[1:] = [item for item in opened[1:] if item[0] is not recorder]
            if len(opened) == 1:
                del run.open[thread]
    return taken


def _finite(grad: Any) -> bool:
    if grad is None or not (grad.is_floating_point() or grad.is_complex()):
        return True
    # One reduction pass; NaN and Inf survive a sum. A sum that overflows is rechecked exactly.
    if bool(torch.isfinite(grad.sum())):
        return True
    return bool(torch.isfinite(grad).all())
