"""The state of one capture, and the answers that need no record.

A :class:`CaptureCore` holds what a capture recorded: the forward journal,
the backward recorder and its node table, the kept gradients. It answers the
gradient questions records ask (``op_grads``, ``param_increments``...). It
never holds a record: records point at the core (through
:class:`~backlens.capture.record_source.LiveRecordSource`), and the
:class:`~backlens.capture.capture.Capture` that caches them points at it too,
so a dropped capture and its records are freed by reference counting, saved
gradients included, without waiting for the cycle collector.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from backlens import _torch
from backlens._nested import iter_named_tensors
from backlens.capture.backward import BackwardRecorder, PassState
from backlens.capture.failures import FailureTranslator
from backlens.capture.forward import ForwardJournal
from backlens.capture.interventions import ArmedEdits
from backlens.capture.node_maps import NodeMaps
from backlens.capture.policy import GradPolicy
from backlens.capture.store import MemoryStore
from backlens.capture.unmatched import UnmatchedSelectorWarner
from backlens.cost.journal import CostJournal
from backlens.cost.observer import FlopObserver
from backlens.errors import BackwardUnavailableError, CaptureClosedError
from backlens.graph import engine
from backlens.graph.table import NodeTable, Pairing
from backlens.records.grads import GradRecord


class CaptureCore:
    """One capture's recorded state (see the module docstring)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        output: Any,
        journal: ForwardJournal,
        params: dict[str, torch.nn.Parameter],
        inputs: list[tuple[str, torch.Tensor]],
        input_sources: list[int],
        grad_policy: GradPolicy,
        backward: bool,
        timing: bool,
        flops: bool,
        forward_grad_mode: tuple[bool, bool],
        detect_nonfinite: bool = False,
        cost: CostJournal | None = None,
        armed: ArmedEdits | None = None,
        rerun: tuple | None = None,
        store: Any = None,
    ):
        self.output = output
        self.backward_requested = backward
        self.flops_enabled = flops
        self.journal = journal
        self.model: torch.nn.Module | None = model
        self.rerun = rerun
        self.armed = armed if armed is not None else ArmedEdits([])
        self.store = store if store is not None else MemoryStore()
        self.closed = False
        self._params: dict[str, weakref.ref] = {}
        self._source_ids: dict[int, int] = {}
        self.param_shapes: list[tuple] = []
        for i, (name, param) in enumerate(params.items()):
            self._params[name] = weakref.ref(param)
            self._source_ids[id(param)] = i
            self.param_shapes.append((name, param.shape, param.dtype, param.requires_grad))
        self._input_tensors = [tensor for _name, tensor in inputs]
        self._input_source_index = {src: i for i, src in enumerate(input_sources)}
        for i, (_name, tensor) in enumerate(inputs):
            self._source_ids[id(tensor)] = input_sources[i]
        self.input_meta = [
            (name, tuple(t.shape), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter))
            for name, t in inputs
        ]
        self._node_maps = NodeMaps()
        self.extra_input_grads: list[tuple[int, GradRecord]] = []
        self._first_call_of_module: dict[str, int] = {}
        for call in journal.module_calls:
            self._first_call_of_module.setdefault(call.module_address, call.index)
        self._grad_edits_pending = (
            list(self.armed.gradient_targets(journal.ops, journal.module_calls, self.module_address_of))
            if self.armed.gradient else []
        )
        output_tensors = [t for _p, t in iter_named_tensors(output)]
        self.inference_only = not any(t.requires_grad for t in output_tensors)
        self.inference_cause = _inference_cause(forward_grad_mode, params, inputs)

        # The parts below call back into this core, and the core into the capture
        # that caches records, through weak references: no reference cycle.
        self._capture: Callable[[], Any] = lambda: None
        self._record_sources: weakref.WeakSet = weakref.WeakSet()
        self.table = NodeTable(_weak_call(self, "_describe_node"), _weak_call(self, "_leaf_source"))
        self.failures = FailureTranslator(self.table, _weak_call(self, "records"))
        roots = [t.grad_fn for t in output_tensors if t.grad_fn is not None]
        self.backward = BackwardRecorder(
            table=self.table,
            output_roots=roots,
            policy=grad_policy,
            timing=timing,
            store=self.store,
            on_nodes_added=_weak_call(self, "_on_nodes_added"),
            grad_fn_record=_weak_call(self, "_grad_fn_record"),
            on_pass_closed=_weak_call(self, "_on_pass_closed"),
            failures=self.failures,
            source_kinds=journal.source_kinds,
            detect_nonfinite=detect_nonfinite,
        )
        self.cost = cost if cost is not None else CostJournal()
        if backward and not self.inference_only:
            if flops:
                self.backward.observers.append(FlopObserver(self.backward, self.cost))
            self.backward.observers.append(UnmatchedSelectorWarner(self.backward))
            self.backward.arm()
        else:
            self.backward.hooking = False  # no pass will open: no pass observers either

    def read_records_from(self, capture: Any, source: Any) -> None:
        """Note the capture that caches this core's records and the source its records
        read through (both held weakly)."""
        self._capture = weakref.ref(capture)
        self._record_sources.add(source)

    def records(self) -> Any:
        """The capture caching this core's records: the user's, or, once it is gone
        and records read from it remain, the one those records read through."""
        capture = self._capture()
        if capture is None:
            for source in self._record_sources:
                return source.records()
        return capture

    # -- node pairing ----------------------------------------------------
    def _leaf_source(self, node: Any) -> int | None:
        """The parameter or input an AccumulateGrad node accumulates into (its source index)."""
        variable = _torch.accumulate_grad_variable(node)
        return self._source_ids.get(id(variable)) if variable is not None else None

    def _describe_node(self, type_name: str, seq: int | None, is_custom: bool, source: int | None) -> Pairing:
        journal = self.journal
        if type_name == "AccumulateGrad":
            if source is None:
                return Pairing()
            kind, name = journal.source_kinds[source], journal.source_names[source]
            if kind == "param":
                return Pairing(
                    module_call=self._first_call_of_module.get(owning_module(name)),
                    module_source="paired",
                    param=name,
                    source=source,
                )
            return Pairing(source=source)
        if seq is not None and journal.in_forward(seq):
            op_index = journal.op_index_for_sequence_nr(seq)
            if op_index is not None:
                module_call = journal.module_call_of_op(op_index)
                return Pairing(op=op_index, module_call=module_call,
                               module_source="paired" if module_call is not None else None)
            op = journal.op_run_by_custom_node(seq) if is_custom else None
            if op is not None:
                # A custom Function's apply is invisible to the mode; its node lands
                # on the output of the last op its forward ran.
                return Pairing(op=op.index, module_call=op.module_call, module_source="inferred")
            call = journal.module_call_for_sequence_nr(seq)
            if call is not None:
                return Pairing(module_call=call.index, module_source="inferred")
            return Pairing()
        order, creator = self.backward.order_for_created(seq)
        if creator is not None:
            creator_entry = self.table.entries[creator]
            module_call = creator_entry.module_call
            return Pairing(module_call=module_call, order=order,
                           module_source="inferred" if module_call is not None else None)
        return Pairing(order=order)

    def _on_nodes_added(self, indices: list[int]) -> None:
        """At discovery: relate the new nodes to the forward's tensors by identity (nodes are
        dropped at close), fingerprint custom Functions' saved tensors, arm gradient edits."""
        table = self.table
        nodes = table.nodes
        for index in indices:
            if table.is_custom[index]:
                self.failures.remember_saved(nodes[index])
        self._node_maps.resolve(self.journal, self._input_tensors, table.index_of)
        if self._grad_edits_pending:
            self._arm_grad_edits()

    def _synced_node_maps(self) -> NodeMaps:
        """Which node made each op's, module call's, parameter's and input's gradient (built on read)."""
        return self._node_maps.sync(self.table.entries, self._input_source_index)

    @property
    def output_node_of_op(self) -> dict[int, int]:
        return self._synced_node_maps().output_node_of_op

    @property
    def output_node_of_module(self) -> dict[int, int]:
        return self._synced_node_maps().output_node_of_module

    @property
    def node_of_param(self) -> dict[str, int]:
        return self._synced_node_maps().node_of_param

    @property
    def node_of_input(self) -> dict[int, tuple[int, int]]:
        return self._synced_node_maps().node_of_input

    def module_address_of(self, op: Any) -> str | None:
        calls = self.journal.module_calls
        return calls[op.module_call].address if op.module_call is not None else None

    def _arm_grad_edits(self) -> None:
        """Put each gradient edit on the pre-hook of the node its site's output came from."""
        journal = self.journal
        per_node: dict[int, list] = {}
        still_pending = []
        for kind, index, intervention, site in self._grad_edits_pending:
            if kind == "op":
                node = self.output_node_of_op.get(index)
                output_nr = journal.ops[index].output_nr
                op, module = journal.ops[index].label, self.module_address_of(journal.ops[index])
            else:
                node = self.output_node_of_module.get(index)
                output_nr = journal.module_calls[index].output_nr
                op, module = None, journal.module_calls[index].address
            if node is None:
                still_pending.append((kind, index, intervention, site))
                continue
            per_node.setdefault(node, []).append((output_nr, intervention, site, op, module))
        self._grad_edits_pending = still_pending
        for node, edits in per_node.items():
            self.backward.pre_edits[node] = self.armed.grad_edit(edits)

    # -- callbacks into the capture's records ------------------------------
    def _grad_fn_record(self, index: int) -> Any:
        records = self.records()
        return records._grad_fn_record(index) if records is not None else None

    def _on_pass_closed(self, state: PassState, error: BaseException | None) -> BaseException | None:
        records = self.records()
        translated = records._pass_closed(state, error) if records is not None else None
        if error is not None:
            return translated
        run = state.run
        if run.trigger == "torch.autograd.grad" and run.inputs and not state.policy.saves_nothing:
            results = state.result if isinstance(state.result, (tuple, list)) else ()
            for given, result in zip(run.inputs, results):
                position = self._input_position(given)
                if position is not None and isinstance(result, torch.Tensor):
                    self.extra_input_grads.append((position, GradRecord(result, state.record.number)))
        return None

    def _input_position(self, tensor: Any) -> int | None:
        for i, candidate in enumerate(self._input_tensors):
            if candidate is tensor:
                return i
        return None

    # -- the gradient questions records ask ----------------------------------
    def grads_at(self, node_and_nr: tuple[int, int] | None) -> list[GradRecord]:
        if node_and_nr is None:
            return []
        node, output_nr = node_and_nr
        calls = self.backward.calls
        grads = []
        for call_index in self.backward.node_calls[node]:
            entry = calls[call_index]
            saved = self.store.load(entry.grad_outputs) if entry.grad_outputs is not None else None
            if saved is not None and output_nr < len(saved) and saved[output_nr] is not None:
                grads.append(GradRecord(saved[output_nr], entry.pass_number))
        return grads

    def op_grads(self, op_index: int) -> list[GradRecord]:
        node = self.output_node_of_op.get(op_index)
        if node is None:
            return []
        return self.grads_at((node, self.journal.ops[op_index].output_nr))

    def module_output_grads(self, call_index: int) -> list[GradRecord]:
        node = self.output_node_of_module.get(call_index)
        if node is None:
            return []
        return self.grads_at((node, self.journal.module_calls[call_index].output_nr))

    def param_increments(self, name: str) -> list[GradRecord]:
        node = self.node_of_param.get(name)
        return self.grads_at((node, 0)) if node is not None else []

    def param_live_grad(self, name: str) -> torch.Tensor | None:
        param = self._params[name]()
        return param.grad if param is not None else None

    def input_grads(self, index: int) -> list[GradRecord]:
        grads = self.grads_at(self.node_of_input.get(index))
        grads += [g for i, g in self.extra_input_grads if i == index]
        return sorted(grads, key=lambda g: g.pass_number)

    def discover(self) -> None:
        if not self.closed and not self.inference_only:
            self.backward.discover_forward()

    # -- backward ----------------------------------------------------------
    def run_backward(self, loss: torch.Tensor | None, save_grads: Any, backward_kwargs: dict) -> None:
        self.check_backward_available()
        if loss is None:
            loss = self._default_loss()
        policy = GradPolicy(save_grads) if save_grads is not None else None
        self.backward.use_policy_for_next_pass(policy)
        engine.set_trigger_override("cap.backward")
        try:
            torch.autograd.backward(loss, **backward_kwargs)
        finally:
            engine.set_trigger_override(None)
            self.backward.use_policy_for_next_pass(None)

    def check_backward_available(self) -> None:
        if self.closed:
            raise CaptureClosedError(
                "This capture was closed; its hooks are gone, so it cannot record a backward.",
            )
        if not self.backward_requested:
            raise BackwardUnavailableError(
                "This capture was made with backward=False: it recorded the forward only "
                "and installed no gradient hooks.",
                code="backward_not_requested",
                remedy="Capture again without backward=False.",
            )
        if self.inference_only:
            raise BackwardUnavailableError(
                f"This capture has no autograd graph: the forward ran {self.inference_cause}.",
                code="inference_only",
                remedy="Capture the forward with gradients enabled (outside torch.no_grad() / "
                "torch.inference_mode(), with parameters or inputs that require grad).",
            )

    def _default_loss(self) -> torch.Tensor:
        tensors = [t for _p, t in iter_named_tensors(self.output)]
        if len(tensors) == 1 and tensors[0].numel() == 1:
            return tensors[0]
        raise BackwardUnavailableError(
            "cap.backward() needs a loss: the output is not a single scalar tensor.",
            code="loss_required",
            remedy="Pass the loss explicitly: cap.backward(loss).",
        )

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook and drop every autograd node; the kept gradients stay."""
        self.backward.close_stale()
        self.backward.remove_hooks()
        self.table.clear()
        self.failures.forget()
        self.model = None
        self.rerun = None
        self.journal.drop_nodes()
        self._node_maps.drop_nodes()
        self.closed = True

    def __del__(self) -> None:
        # A capture nobody holds (nor any record read from it) takes its hooks
        # and its place in the engine router with it.
        backward = self.__dict__.get("backward")
        if backward is not None and (backward.armed or backward._handles):
            try:
                backward.remove_hooks()
            except Exception:  # noqa: BLE001, S110 - at interpreter exit torch (and this module) may be half gone
                pass


def _weak_call(target: Any, method: str) -> Callable[..., Any]:
    """``target.<method>``, called through a weak reference (None once the target is gone)."""
    ref = weakref.ref(target)

    def call(*args: Any) -> Any:
        found = ref()
        return getattr(found, method)(*args) if found is not None else None

    return call


def owning_module(param_name: str) -> str:
    """``encoder.layer.0.weight`` -> ``encoder.layer.0`` (the root module is ``""``)."""
    return param_name.rpartition(".")[0]


def _inference_cause(grad_mode: tuple[bool, bool], params: dict, inputs: list) -> str:
    grad_enabled, inference_mode = grad_mode
    if inference_mode:
        return "under torch.inference_mode()"
    if not grad_enabled:
        return "under torch.no_grad() (grad mode disabled)"
    if not any(p.requires_grad for p in params.values()) and not any(t.requires_grad for _n, t in inputs):
        return "with no parameter or input that requires grad (a frozen model)"
    return "without building an autograd graph to its output"
