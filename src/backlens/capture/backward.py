"""Backward recording: node discovery, per-fire hooks, passes and the call journal.

Every node of the capture's graph gets a pre-hook; a post-hook is added only
while some pass may keep the gradients a node sends on (``grad_inputs``) or
non-finite gradients are watched. A fire is journalled as a :class:`CallEntry`
(node, pass, ordinal, timing, the gradients the pass's policy keeps); records
are built from the journal when read. Hooks never change gradients unless an
edit is armed for that node.

A fire starts at its pre-hook and ends when the engine starts the next node
on the same thread for the same run (or when the run ends). Its duration
therefore includes the engine routing the node's outputs to the nodes that
consume them (summing gradients that arrive from several paths), and leaves
out backlens's own work in its hooks (edits, copies of kept gradients,
non-finite checks); per thread, the durations of a pass's fires add up to the
time the engine spent in it, less that work.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from backlens import _torch
from backlens.capture.policy import GRAD_INPUT, GRAD_OUTPUT, GradPolicy
from backlens.capture.store import TensorStore
from backlens.graph import engine
from backlens.graph.discovery import walk_new
from backlens.graph.table import NodeTable
from backlens.records.backward import BackwardPass

_now = time.perf_counter_ns
_task_id = _torch.graph_task_id_function()
_sequence_nr = _torch.sequence_nr
_thread = threading.get_ident


@dataclass(eq=False, slots=True)
class CallEntry:
    """One journalled fire of one node."""

    node: int
    pass_number: int
    ordinal: int
    start_ns: int | None
    end_ns: int
    grad_inputs: tuple | None
    grad_outputs: tuple | None
    seq_start: int | None = None
    seq_end: int | None = None
    # Time spent in backlens's own post-hook inside the fire (not the node's).
    hook_ns: int = 0
    # Set when the pass closes, by backlens.cost (None: not counted).
    flops: int | None = None
    recompute_flops: int | None = None


@dataclass(eq=False)
class PassState:
    """Journal-side state of one pass (the public record is ``record``)."""

    record: BackwardPass
    run: engine.Run
    policy: GradPolicy
    sides: list[int]
    start_ns: int
    call_indices: list[int]
    created_roots: list[Any]
    seq_start: int | None
    seq_end: int | None = None
    result: Any = None
    failed_node: int | None = None


class BackwardRecorder:
    """Records every backward engine run over one capture's graph."""

    def __init__(
        self,
        table: NodeTable,
        output_roots: list[Any],
        policy: GradPolicy,
        timing: bool,
        store: TensorStore,
        on_nodes_added: Callable[[list[int]], None],
        grad_fn_record: Callable[[int], Any],
        on_pass_closed: Callable[[PassState, BaseException | None], BaseException | None],
        failures: Any,
        source_kinds: list[str],
        detect_nonfinite: bool = False,
    ):
        self.table = table
        self.policy = policy
        self.timing = timing
        self.store = store
        # Objects with on_pass_open(state) / on_pass_close(state, error) and
        # optionally run_context(run) -> context manager entered around an
        # explicit engine run (e.g. a dispatch mode counting FLOPs).
        self.observers: list[Any] = []
        self.passes: list[PassState] = []
        self.calls: list[CallEntry] = []
        self.node_calls: list[list[int]] = []
        self._output_roots = list(output_roots)
        self._on_nodes_added = on_nodes_added
        self._grad_fn_record = grad_fn_record
        self._on_pass_closed = on_pass_closed
        self._source_kinds = source_kinds  # "input" | "param" | "buffer", by source index
        self._handles: list[Any] = []
        self._sentinel_nodes: set[Any] = set()  # output nodes pre-hooked by arm()
        self._post_hooked = self._needs_post_hooks(policy, detect_nonfinite)
        self._forward_discovered = False
        self._task: int | None = None
        self._pass: PassState | None = None
        # The fire still running (or whose outputs the engine is routing), per (run, thread).
        self._open: dict[tuple[int, int], CallEntry] = {}
        self._next_policy: GradPolicy | None = None
        self.armed = False
        self.hooking = True
        # Explains refused and failed passes (capture/failures.py).
        self._failures = failures
        self.detect_nonfinite = detect_nonfinite
        self.pre_edits: dict[int, Callable[[tuple, PassState], tuple | None]] = {}

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
        self._open.clear()

    # -- discovery -------------------------------------------------------
    def discover_forward(self) -> None:
        if self._forward_discovered:
            return
        self._forward_discovered = True
        found, _reached = walk_new(self._output_roots, self.table.knows)
        self._add(found)

    def _add(self, found: list[Any]) -> list[int]:
        added = self.table.add(found)
        node_calls = self.node_calls
        nodes = self.table.nodes
        if self.hooking:
            handles = self._handles
            sentinels = self._sentinel_nodes  # their sentinel pre-hook serves as theirs
            post_hooked = self._post_hooked
            on_pre, on_post = self._on_pre, self._on_post
            for index in added:
                node_calls.append([])
                node = nodes[index]
                if node not in sentinels:
                    handles.append(node.register_prehook(partial(on_pre, index)))
                if post_hooked:
                    handles.append(node.register_hook(partial(on_post, index)))
        else:
            node_calls.extend([] for _ in added)
        if added:
            self._on_nodes_added(added)
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

    def claim(self, roots: list[Any], others: list[BackwardRecorder] = ()) -> bool:
        """Whether a run from ``roots`` touches this capture's graph (discovers loss nodes).

        The walk stops at nodes of ``others`` (other live captures, already
        discovered), so a backward over another capture's graph costs a walk of
        its loss nodes only. A graph reached only through another capture's is
        joined when one of our nodes fires (``engine.pass_for``).
        """
        if not self.armed:
            return False
        self.discover_forward()
        knows = self.table.knows

        def is_known(node: Any) -> bool:
            return knows(node) or any(other.owns_non_leaf(node) for other in others)

        found, reached = walk_new(roots, is_known)
        owned = any(self.owns_non_leaf(node) for node in reached)
        if owned:
            self._add(found)
        return owned

    def owns_non_leaf(self, node: Any) -> bool:
        index = self.table.index_of.get(node)
        if index is None:
            return False
        if self.table.types[index] != "AccumulateGrad":
            return True
        source = self.table.leaf_source(index)  # an input's, not a (shared) parameter's
        return source is not None and self._source_kinds[source] != "param"

    # -- passes ----------------------------------------------------------
    def use_policy_for_next_pass(self, policy: GradPolicy | None) -> None:
        self._next_policy = policy

    def open_pass(self, run: engine.Run) -> PassState:
        policy = self._next_policy or self.policy
        self._next_policy = None
        number = len(self.passes) + 1
        record = BackwardPass(
            number=number,
            trigger=run.trigger,
            call_site=run.call_site,
            retain_graph=run.retain_graph,
            create_graph=run.create_graph,
            save_grads_policy=policy,
        )
        if self.hooking and not self._post_hooked and self._needs_post_hooks(policy, self.detect_nonfinite):
            self._add_post_hooks()
        if isinstance(policy.spec, bool):
            sides = [policy.sides(None, number)] * len(self.table)  # no per-node question to ask
        else:
            sides = [policy.sides(self._grad_fn_record(i), number) for i in range(len(self.table))]
        state = PassState(
            record=record,
            run=run,
            policy=policy,
            sides=sides,
            start_ns=_now(),
            call_indices=[],
            created_roots=[],
            seq_start=_sequence_nr(),
        )
        self.passes.append(state)
        for observer in self.observers:
            observer.on_pass_open(state)
        return state

    def preflight(self, state: PassState) -> BaseException | None:
        """An error to raise instead of running the engine (a node that cannot run again)."""
        return self._failures.refuse_once_only_rerun(state)

    def run_contexts(self, run: engine.Run) -> list[Any]:
        """Context managers to hold open around an explicit engine run."""
        contexts = []
        for observer in self.observers:
            make = getattr(observer, "run_context", None)
            context = make(run) if make is not None else None
            if context is not None:
                contexts.append(context)
        return contexts

    def close_pass(self, state: PassState, error: BaseException | None) -> BaseException | None:
        if self._pass is state:
            self._task = None
            self._pass = None
        record = state.record
        if record.status != "running":
            return None
        end = _now()
        record.duration = (end - state.start_ns) / 1e9
        record.status = "failed" if error is not None else "ok"
        still_open = [(key, entry) for key, entry in self._open.items() if entry.pass_number == record.number]
        for key, _entry in still_open:
            del self._open[key]
        if error is not None:
            if still_open:
                # The fire started last and never followed by another is the one that raised.
                state.failed_node = still_open[-1][1].node
        else:
            for _key, entry in still_open:
                self._finish(entry, end, state)
        record.error = error
        state.seq_end = _sequence_nr()
        if state.run.create_graph and error is None:
            self._discover_created(state)
        if any(p.run.create_graph for p in self.passes):
            record.orders = sorted(
                {order for i in state.call_indices if (order := self.table.entries[self.calls[i].node].order) is not None}
            )
        else:
            record.orders = [1] if state.call_indices else []  # no pass made nodes: every node is order 1
        for observer in self.observers:
            observer.on_pass_close(state, error)
        return self._on_pass_closed(state, error)

    def _discover_created(self, state: PassState) -> None:
        roots = list(state.created_roots)
        result = state.result
        if isinstance(result, (tuple, list)):
            roots.extend(t.grad_fn for t in result if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        state.created_roots = []
        found, _reached = walk_new(roots, self.table.knows)
        added = self._add(found)
        resolved = sum(1 for i in added if self.table.entries[i].order is not None)
        state.record.order_coverage = resolved / len(added) if added else 1.0

    def order_for_created(self, seq: int | None) -> tuple[int | None, int | None]:
        """(order, creator node index) for a node made after the forward."""
        if seq is None:
            return 1, None
        for state in self.passes:
            if not state.run.create_graph or state.seq_start is None:
                continue
            end = state.seq_end if state.seq_end is not None else _sequence_nr()
            if not (state.seq_start <= seq < (end or 0)):
                continue
            calls = [self.calls[i] for i in state.call_indices if self.calls[i].seq_start is not None]
            starts = [c.seq_start for c in calls]
            pos = bisect_right(starts, seq) - 1
            if pos >= 0 and calls[pos].seq_end is not None and seq < calls[pos].seq_end:
                creator = calls[pos].node
                creator_order = self.table.entries[creator].order
                return (creator_order + 1 if creator_order is not None else None), creator
            return None, None
        return 1, None

    def close_stale(self) -> None:
        """Backstop: close implicit passes whose engine run has drained."""
        if any(s.record.status == "running" and not s.run.explicit for s in self.passes):
            engine.close_stale_implicit_runs(_task_id())

    # -- hooks (hot path) --------------------------------------------------
    def _current(self, index: int) -> PassState | None:
        task = _task_id()
        if task == self._task and self.hooking:
            return self._pass
        return self._resolve_pass(index, task)

    def _resolve_pass(self, index: int, task: int) -> PassState | None:
        if not self.hooking:
            return None  # removed while this fire was under way (its capture was collected)
        nodes = self.table.nodes
        if index >= len(nodes):
            return None
        state = engine.pass_for(self, task, nodes[index])
        if state is not None:
            self._task = task
            self._pass = state
        return state

    def _on_sentinel_pre(self, node: Any, grad_outputs: tuple) -> tuple | None:
        if not self.armed:
            return None
        if not self._forward_discovered:
            self.discover_forward()
        index = self.table.index_of.get(node)
        if index is None:
            return None
        return self._on_pre(index, grad_outputs)

    def _on_pre(self, index: int, grad_outputs: tuple) -> tuple | None:
        task = _task_id()
        state = self._pass if task == self._task and self.hooking else self._resolve_pass(index, task)
        if state is None:
            return None
        now = _now()
        create_graph = state.run.create_graph
        key = (self._task, _thread())
        previous = self._open.get(key)
        if previous is not None:
            self._finish(previous, now, state)
        edit = self.pre_edits.get(index)
        replaced = edit(grad_outputs, state) if edit is not None else None
        arriving = replaced if replaced is not None else grad_outputs
        sides = state.sides[index] if index < len(state.sides) else 0
        kept = self.store.keep(self._owned(index, arriving), "grad_outputs") if sides & GRAD_OUTPUT else None
        self._open[key] = CallEntry(
            index,
            state.record.number,
            0,
            _now() if self.timing else None,  # after the edit and the copies: they are not the node's
            0,
            None,
            kept,
            _sequence_nr() if create_graph else None,
        )
        if create_graph:
            for grad in arriving:
                if grad is not None and grad.grad_fn is not None:
                    state.created_roots.append(grad.grad_fn)
        return replaced

    def _finish(self, entry: CallEntry, end: int, state: PassState) -> None:
        """Journal a fire once the next one on its thread starts (or its run ends)."""
        entry.end_ns = end
        if state.run.create_graph:
            entry.seq_end = _sequence_nr()
        ordinals = self.node_calls[entry.node]
        entry.ordinal = len(ordinals) + 1
        call_index = len(self.calls)
        self.calls.append(entry)
        ordinals.append(call_index)
        state.call_indices.append(call_index)

    def _on_post(self, index: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        began = _now()
        state = self._current(index)
        if state is None:
            return None
        entry = self._open.get((self._task, _thread()))
        if entry is None or entry.node != index:
            return None
        try:
            sides = state.sides[index] if index < len(state.sides) else 0
            if sides & GRAD_INPUT:
                entry.grad_inputs = self.store.keep(tuple(grad_inputs), "grad_inputs")
            if self.detect_nonfinite:
                self._check_finite(index, state, grad_inputs, grad_outputs)
            if state.run.create_graph:
                for grad in grad_inputs:
                    if grad is not None and grad.grad_fn is not None:
                        state.created_roots.append(grad.grad_fn)
        finally:
            entry.hook_ns += _now() - began
        return None

    def _owned(self, index: int, grads: tuple) -> tuple:
        """AccumulateGrad may adopt its incoming gradient as ``param.grad`` and add later
        passes into it in place; keep a copy so each pass's increment stays as it was."""
        if self.table.types[index] == "AccumulateGrad":
            return tuple(g.detach().clone() if g is not None else None for g in grads)
        return tuple(grads)

    def _check_finite(self, index: int, state: PassState, grad_inputs: tuple, grad_outputs: tuple) -> None:
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
            raise self._failures.nonfinite_error(index, state, bad)


def _finite(grad: Any) -> bool:
    if grad is None or not (grad.is_floating_point() or grad.is_complex()):
        return True
    # One reduction pass; NaN and Inf survive a sum. A sum that overflows is rechecked exactly.
    if bool(torch.isfinite(grad.sum())):
        return True
    return bool(torch.isfinite(grad).all())
