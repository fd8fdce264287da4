"""``bl.capture``: record a forward and every backward pass over its graph."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from backlens import _torch
from backlens.capture.backward import BackwardRecorder, PassState
from backlens.capture.failures import FailureTranslator
from backlens.capture.forward import (
    ActivationPolicy,
    ForwardJournal,
    ForwardRecorder,
    iter_named_tensors,
)
from backlens.capture.interventions import ArmedEdits
from backlens.capture.node_maps import NodeMaps
from backlens.capture.policy import GradPolicy
from backlens.capture.store import MemoryStore
from backlens.capture.unmatched import UnmatchedSelectorWarner, warn_if_no_activation_kept
from backlens.cost.forward_count import FlopForwardRecorder
from backlens.cost.journal import CostJournal
from backlens.cost.observer import FlopObserver
from backlens.edits import as_interventions
from backlens.errors import (
    BackwardUnavailableError,
    CaptureClosedError,
    UnsupportedInputError,
)
from backlens.graph import engine
from backlens.graph.table import NodeTable, Pairing
from backlens.io.disk_store import make_store
from backlens.records.backward import GradFn, GradFnCall
from backlens.records.forward import (
    InputRecord,
    ModuleCallRecord,
    OpRecord,
    ParamRecord,
)
from backlens.records.grads import GradRecord
from backlens.records.view import RecordView


def capture(
    model: torch.nn.Module,
    *args: Any,
    save_grads: Any = False,
    save_activations: Any = False,
    storage: Any = None,
    flops: bool = True,
    timing: bool = True,
    intervene: Any = (),
    backward: bool = True,
    detect_nonfinite: bool = False,
    **kwargs: Any,
) -> Capture:
    """Run ``model(*args, **kwargs)`` once, record it, and arm backward capture.

    The user's graph is not changed: no clone or identity nodes are inserted,
    inputs are not copied, and gradients reach leaves and parameters exactly as
    without backlens. See API.md §1 for every option.
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedInputError(
            f"bl.capture needs a torch.nn.Module, got {type(model).__name__}.",
            code="not_a_module",
            remedy="Wrap the callable in an nn.Module (its forward calls the function) and capture that.",
        )
    store = make_store(storage)
    grad_policy = GradPolicy(save_grads)
    armed = ArmedEdits(as_interventions(intervene))
    armed.check_backward(backward)
    journal = ForwardJournal()
    # flops=True: the recorder also counts or notes the ops that may carry FLOPs (no dispatch mode).
    recorder = (FlopForwardRecorder if flops else ForwardRecorder)(
        journal, ActivationPolicy(save_activations), op_hook=armed.op_hook(journal) if armed.activation else None
    )
    if armed.edits_module_outputs:
        recorder.module_output_hook = armed.module_hook
    addresses, module_types, params, buffers = _walk_model(model)
    recorder.register_sources("param", params.items())
    recorder.register_sources("buffer", buffers.items())
    inputs = _named_inputs(args, kwargs)
    input_sources = recorder.register_sources("input", inputs)
    grad_enabled = torch.is_grad_enabled()
    inference_mode = torch.is_inference_mode_enabled()

    recorder.attach(addresses, module_types)
    journal.seq_start = _torch.sequence_nr()
    try:
        with recorder:
            output = model(*args, **kwargs)
    finally:
        recorder.detach()
    journal.seq_end = _torch.sequence_nr()
    recorder.finish()
    warn_if_no_activation_kept(save_activations, journal)
    if armed.any:
        armed.check_sites(journal.ops, journal.module_calls)
    return Capture(
        model=model,
        output=output,
        journal=journal,
        params=params,
        inputs=inputs,
        input_sources=input_sources,
        grad_policy=grad_policy,
        backward=backward,
        timing=timing,
        flops=flops,
        forward_grad_mode=(grad_enabled, inference_mode),
        detect_nonfinite=detect_nonfinite,
        store=store,
        cost=CostJournal(pending_forward=recorder.forward_cost() if flops else None),
        armed=armed,
        rerun=(args, kwargs, dict(save_grads=save_grads, save_activations=save_activations, flops=flops,
                                  timing=timing, backward=backward, detect_nonfinite=detect_nonfinite),
               intervene),
    )


def _walk_model(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, str], dict, dict]:
    """Module addresses (by module id) and types, parameters and buffers by name, in one walk.

    The order and names are those of ``named_modules`` / ``named_parameters``
    (pre-order, a shared module or tensor under its first name); an explicit
    stack because the generator chain costs more than the rest of the setup.
    """
    addresses: dict[int, str] = {}
    types: dict[str, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    pending = [("", model)]
    while pending:
        address, module = pending.pop()
        if id(module) in addresses:
            continue
        addresses[id(module)] = address
        types[address] = type(module).__name__
        prefix = f"{address}." if address else ""
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params[prefix + name] = param
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                buffers[prefix + name] = buffer
        children = module._modules
        if children:
            pending.extend((prefix + name, child) for name, child in reversed(children.items()) if child is not None)
    return addresses, types, params, buffers


def _named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    named = []
    for position, arg in enumerate(args):
        named.extend(iter_named_tensors(arg, f"args[{position}]"))
    for key, value in kwargs.items():
        named.extend(iter_named_tensors(value, key))
    seen: set[int] = set()
    unique = []
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append((name, tensor))
    return unique


class Capture(RecordView):
    """A recorded forward and the backward passes run over its graph."""

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
        self._journal = journal
        self._model = model
        self._rerun = rerun
        self._armed = armed if armed is not None else ArmedEdits([])
        self._grad_edits_pending = (
            list(self._armed.gradient_targets(journal.ops, journal.module_calls, self._module_address_of))
            if self._armed.gradient else []
        )
        self._store = store if store is not None else MemoryStore()
        self._closed = False
        self._params: dict[str, weakref.ref] = {}
        self._source_ids: dict[int, int] = {}
        self._param_shapes: list[tuple] = []
        for i, (name, param) in enumerate(params.items()):
            self._params[name] = weakref.ref(param)
            self._source_ids[id(param)] = i
            self._param_shapes.append((name, param.shape, param.dtype, param.requires_grad))
        self._input_tensors = [tensor for _name, tensor in inputs]
        self._input_source_index = {src: i for i, src in enumerate(input_sources)}
        for i, (_name, tensor) in enumerate(inputs):
            self._source_ids[id(tensor)] = input_sources[i]
        self._node_maps = NodeMaps()
        self._extra_input_grads: list[tuple[int, GradRecord]] = []
        self._grad_fn_cache: list[GradFn] = []
        self._call_records: list[GradFnCall] = []

        self._forward_records: tuple | None = None
        self._input_meta = [
            (name, tuple(t.shape), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter))
            for name, t in inputs
        ]
        self._first_call_of_module: dict[str, int] = {}
        for call in journal.module_calls:
            self._first_call_of_module.setdefault(call.module_address, call.index)
        output_tensors = [t for _p, t in iter_named_tensors(output)]
        self.inference_only = not any(t.requires_grad for t in output_tensors)
        self._inference_cause = _inference_cause(forward_grad_mode, params, inputs)

        # The parts below call back into this capture through weak references: a
        # capture without reference cycles is freed (with its graph) as soon as
        # the user drops it, without waiting for the cyclic garbage collector.
        self._table = NodeTable(_weak_call(self, "_describe_node"), _weak_call(self, "_leaf_source"))
        self._failures = FailureTranslator(weakref.proxy(self))
        roots = [t.grad_fn for t in output_tensors if t.grad_fn is not None]
        self._backward = BackwardRecorder(
            table=self._table,
            output_roots=roots,
            policy=grad_policy,
            timing=timing,
            store=self._store,
            on_nodes_added=_weak_call(self, "_on_nodes_added"),
            grad_fn_record=_weak_call(self, "_grad_fn_record"),
            on_pass_closed=_weak_call(self, "_on_pass_closed"),
            failures=self._failures,
            source_kinds=journal.source_kinds,
            detect_nonfinite=detect_nonfinite,
        )
        self._cost = cost if cost is not None else CostJournal()
        if backward and not self.inference_only:
            if flops:
                self._backward.observers.append(FlopObserver(self._backward, self._cost))
            self._backward.observers.append(UnmatchedSelectorWarner(self._backward))
            self._backward.arm()
        else:
            self._backward.hooking = False  # no pass will open: no pass observers either

    # -- forward records ---------------------------------------------------
    @property
    def _ops(self) -> list[OpRecord]:
        return self._records()[0]

    @property
    def _modules(self) -> list[ModuleCallRecord]:
        return self._records()[1]

    def _records(self) -> tuple:
        if self._forward_records is None:
            self._forward_records = self._build_forward_records()
        return self._forward_records

    def _build_forward_records(self) -> tuple:
        journal = self._journal
        calls = journal.module_calls
        source_kinds, source_names = journal.source_kinds, journal.source_names
        ops = []
        for entry in journal.ops:
            ops.append(
                OpRecord(
                    index=entry.index,
                    label=entry.label,
                    func=entry.name,
                    module=calls[entry.module_call].address if entry.module_call is not None else None,
                    parents=[journal.ops[p].label for p in entry.parents],
                    param_parents=[source_names[s] for s in entry.sources if source_kinds[s] == "param"],
                    shape=entry.shape,
                    dtype=entry.dtype,
                    num_outputs=entry.num_outputs,
                    inplace=entry.inplace,
                    activation=entry.activation,
                    forward_flops=self._cost.op_flops(entry.index),
                    _source=self,
                )
            )
        modules = []
        children = journal.module_children()
        for call in calls:
            op_end = call.op_end if call.op_end is not None else len(ops)
            modules.append(
                ModuleCallRecord(
                    index=call.index,
                    address=call.address,
                    module_address=call.module_address,
                    module_type=journal.module_types.get(call.module_address, ""),
                    call_number=call.call_number,
                    parent=calls[call.parent].address if call.parent is not None else None,
                    children=[calls[c].address for c in children[call.index]],
                    ops=[ops[i].label for i in range(call.op_start, op_end)],
                    output_shape=call.output_shape,
                    _source=self,
                )
            )
        params = [
            ParamRecord(
                name=name,
                module=_owning_module(name),
                shape=tuple(shape),
                dtype=dtype,
                requires_grad=requires_grad,
                _source=self,
            )
            for name, shape, dtype, requires_grad in self._param_shapes
        ]
        inputs = [
            InputRecord(
                index=i,
                name=name,
                shape=shape,
                dtype=dtype,
                requires_grad=requires_grad,
                was_parameter=was_parameter,
                _source=self,
            )
            for i, (name, shape, dtype, requires_grad, was_parameter) in enumerate(self._input_meta)
        ]
        return ops, modules, params, inputs

    # -- node pairing ----------------------------------------------------
    def _leaf_source(self, node: Any) -> int | None:
        """The parameter or input an AccumulateGrad node accumulates into (its source index)."""
        variable = _torch.accumulate_grad_variable(node)
        return self._source_ids.get(id(variable)) if variable is not None else None

    def _describe_node(self, type_name: str, seq: int | None, is_custom: bool, source: int | None) -> Pairing:
        journal = self._journal
        if type_name == "AccumulateGrad":
            if source is None:
                return Pairing()
            kind, name = journal.source_kinds[source], journal.source_names[source]
            if kind == "param":
                return Pairing(
                    module_call=self._first_call_of_module.get(_owning_module(name)),
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
        order, creator = self._backward.order_for_created(seq)
        if creator is not None:
            creator_entry = self._table.entries[creator]
            module_call = creator_entry.module_call
            return Pairing(module_call=module_call, order=order,
                           module_source="inferred" if module_call is not None else None)
        return Pairing(order=order)

    def _on_nodes_added(self, indices: list[int]) -> None:
        """At discovery: relate the new nodes to the forward's tensors by identity (nodes are
        dropped at close), fingerprint custom Functions' saved tensors, arm gradient edits."""
        table = self._table
        nodes = table.nodes
        for index in indices:
            if table.is_custom[index]:
                self._failures.remember_saved(nodes[index])
        self._node_maps.resolve(self._journal, self._input_tensors, table.index_of)
        if self._grad_edits_pending:
            self._arm_grad_edits()

    def _synced_node_maps(self) -> NodeMaps:
        """Which node made each op's, module call's, parameter's and input's gradient (built on read)."""
        return self._node_maps.sync(self._table.entries, self._input_source_index)

    @property
    def _output_node_of_op(self) -> dict[int, int]:
        return self._synced_node_maps().output_node_of_op

    @property
    def _output_node_of_module(self) -> dict[int, int]:
        return self._synced_node_maps().output_node_of_module

    @property
    def _node_of_param(self) -> dict[str, int]:
        return self._synced_node_maps().node_of_param

    @property
    def _node_of_input(self) -> dict[int, tuple[int, int]]:
        return self._synced_node_maps().node_of_input

    def _grad_fn_record(self, index: int) -> GradFn:
        return self._grad_fn_records[index]

    @property
    def _grad_fn_records(self) -> list[GradFn]:
        """GradFn records of every discovered node, built on first read."""
        cache = self._grad_fn_cache
        entries = self._table.entries
        calls = self._journal.module_calls
        for entry in entries[len(cache):]:
            cache.append(
                GradFn(
                    index=entry.index,
                    label=entry.label,
                    type=entry.type,
                    op=self._ops[entry.op] if entry.op is not None else None,
                    module=calls[entry.module_call].address if entry.module_call is not None else None,
                    module_source=entry.module_source,
                    order=entry.order,
                    is_custom=entry.is_custom,
                    param=entry.param,
                    sequence_nr=entry.sequence_nr,
                    _source=self,
                )
            )
        return cache

    def _module_address_of(self, op: Any) -> str | None:
        calls = self._journal.module_calls
        return calls[op.module_call].address if op.module_call is not None else None

    def _arm_grad_edits(self) -> None:
        """Put each gradient edit on the pre-hook of the node its site's output came from."""
        journal = self._journal
        per_node: dict[int, list] = {}
        still_pending = []
        for kind, index, intervention, site in self._grad_edits_pending:
            if kind == "op":
                node = self._output_node_of_op.get(index)
                output_nr = journal.ops[index].output_nr
                op, module = journal.ops[index].label, self._module_address_of(journal.ops[index])
            else:
                node = self._output_node_of_module.get(index)
                output_nr = journal.module_calls[index].output_nr
                op, module = None, journal.module_calls[index].address
            if node is None:
                still_pending.append((kind, index, intervention, site))
                continue
            per_node.setdefault(node, []).append((output_nr, intervention, site, op, module))
        self._grad_edits_pending = still_pending
        for node, edits in per_node.items():
            self._backward.pre_edits[node] = self._armed.grad_edit(edits)

    def _on_pass_closed(self, state: PassState, error: BaseException | None) -> BaseException | None:
        # A pass record reaches the capture once read (_pass_list); setting it here
        # would make every capture a reference cycle.
        built = self._call_records
        for i in state.call_indices:  # records read while the pass ran get its FLOPs now
            if i < len(built):
                entry = self._backward.calls[i]
                built[i].flops, built[i].recompute_flops = entry.flops, entry.recompute_flops
        if error is not None:
            self._pass_list()  # the explanation reads earlier passes' records
            return self._failures.translate(state, error)
        run = state.run
        if error is None and run.trigger in ("torch.autograd.grad",) and run.inputs and not state.policy.saves_nothing:
            results = state.result if isinstance(state.result, (tuple, list)) else ()
            for given, result in zip(run.inputs, results):
                position = self._input_position(given)
                if position is not None and isinstance(result, torch.Tensor):
                    self._extra_input_grads.append((position, GradRecord(result, state.record.number)))
        return None

    def _input_position(self, tensor: Any) -> int | None:
        for i, candidate in enumerate(self._input_tensors):
            if candidate is tensor:
                return i
        return None

    # -- the _source protocol records read through -------------------------
    def _grads_at(self, node_and_nr: tuple[int, int] | None) -> list[GradRecord]:
        if node_and_nr is None:
            return []
        node, output_nr = node_and_nr
        calls = self._backward.calls
        grads = []
        for call_index in self._backward.node_calls[node]:
            entry = calls[call_index]
            saved = self._store.load(entry.grad_outputs) if entry.grad_outputs is not None else None
            if saved is not None and output_nr < len(saved) and saved[output_nr] is not None:
                grads.append(GradRecord(saved[output_nr], entry.pass_number))
        return grads

    def _op_grads(self, op_index: int) -> list[GradRecord]:
        node = self._output_node_of_op.get(op_index)
        if node is None:
            return []
        return self._grads_at((node, self._journal.ops[op_index].output_nr))

    def _op_grad_fn(self, op_index: int) -> GradFn | None:
        self._discover()
        node = self._output_node_of_op.get(op_index)
        return self._grad_fn_records[node] if node is not None else None

    def _module_output_grads(self, call_index: int) -> list[GradRecord]:
        node = self._output_node_of_module.get(call_index)
        if node is None:
            return []
        return self._grads_at((node, self._journal.module_calls[call_index].output_nr))

    def _param_increments(self, name: str) -> list[GradRecord]:
        node = self._node_of_param.get(name)
        return self._grads_at((node, 0)) if node is not None else []

    def _param_live_grad(self, name: str) -> torch.Tensor | None:
        param = self._params[name]()
        return param.grad if param is not None else None

    def _input_grads(self, index: int) -> list[GradRecord]:
        grads = self._grads_at(self._node_of_input.get(index))
        grads += [g for i, g in self._extra_input_grads if i == index]
        return sorted(grads, key=lambda g: g.pass_number)

    def _node_calls(self, node_index: int) -> list[GradFnCall]:
        records = self._calls()
        return [records[i] for i in self._backward.node_calls[node_index]]

    def _pass_calls(self, number: int) -> list[GradFnCall]:
        records = self._calls()
        return [records[i] for i in self._backward.passes[number - 1].call_indices]

    def _calls(self) -> list[GradFnCall]:
        journal = self._backward.calls
        records = self._call_records
        passes = self._backward.passes
        for entry in journal[len(records):]:
            grad_fn = self._grad_fn_records[entry.node]
            pass_start = passes[entry.pass_number - 1].start_ns
            start = entry.start_ns
            records.append(
                GradFnCall(
                    label=f"{grad_fn.label}:{entry.ordinal}",
                    grad_fn=grad_fn,
                    index=entry.ordinal,
                    pass_number=entry.pass_number,
                    grad_inputs=self._store.load(entry.grad_inputs) if entry.grad_inputs is not None else None,
                    grad_outputs=self._store.load(entry.grad_outputs) if entry.grad_outputs is not None else None,
                    start=(start - pass_start) / 1e9 if start is not None else None,
                    duration=(entry.end_ns - start - entry.hook_ns) / 1e9 if start is not None else None,
                    flops=entry.flops,
                    recompute_flops=entry.recompute_flops,
                )
            )
        return records

    def _discover(self) -> None:
        if not self._closed and not self.inference_only:
            self._backward.discover_forward()

    # -- record lists (RecordView turns them into the public lists) ------------
    def _op_list(self) -> list[OpRecord]:
        return self._ops

    def _module_list(self) -> list[ModuleCallRecord]:
        return self._modules

    def _param_list(self) -> list[ParamRecord]:
        return self._records()[2]

    def _input_list(self) -> list[InputRecord]:
        return self._records()[3]

    def _grad_fn_list(self) -> list[GradFn]:
        self._discover()
        return self._grad_fn_records

    def _call_list(self) -> list[GradFnCall]:
        self._backward.close_stale()
        return self._calls()

    def _pass_list(self) -> list:
        self._backward.close_stale()
        records = []
        for state in self._backward.passes:
            state.record._source = self
            records.append(state.record)
        return records

    # -- backward ----------------------------------------------------------
    def backward(self, loss: torch.Tensor | None = None, *, save_grads: Any = None, **backward_kwargs: Any) -> None:
        """Run ``torch.autograd.backward(loss)`` as one recorded pass.

        ``save_grads`` widens or narrows the save policy for this pass only.
        """
        self._check_backward_available()
        if loss is None:
            loss = self._default_loss()
        policy = GradPolicy(save_grads) if save_grads is not None else None
        self._backward.use_policy_for_next_pass(policy)
        engine.set_trigger_override("cap.backward")
        try:
            torch.autograd.backward(loss, **backward_kwargs)
        finally:
            engine.set_trigger_override(None)
            self._backward.use_policy_for_next_pass(None)

    @property
    def forward_edits(self) -> list:
        """Every activation edit applied in this capture's forward, with norms before and after."""
        return list(self._armed.forward_applications)

    def do(self, site: Any, edit: Any, inputs: Any = None, loss: Any = None) -> Capture:
        """Rerun the forward with ``edit`` armed at ``site`` (and the backward when ``loss`` is given).

        Returns a new capture; this one is untouched. ``inputs`` replaces the
        original positional inputs (a tuple, or one tensor); ``loss`` is
        ``lambda cap: tensor``.
        """
        from backlens.edits import as_interventions, when

        if self._rerun is None or self._model is None:
            raise CaptureClosedError("This capture cannot rerun its forward (closed or loaded from disk).")
        args, kwargs, options, intervene = self._rerun
        if inputs is not None:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
        armed = [*as_interventions(intervene), when(site, edit)]
        new = capture(self._model, *args, intervene=armed, **options, **kwargs)
        if loss is not None:
            new.backward(loss(new))
        return new

    def _check_backward_available(self) -> None:
        if self._closed:
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
                f"This capture has no autograd graph: the forward ran {self._inference_cause}.",
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
    @property
    def closed(self) -> bool:
        return self._closed

    def disarm(self) -> None:
        """Stop recording later passes; keep every record."""
        self._backward.remove_hooks()

    def save(self, path: Any = None, *, overwrite: bool = False) -> Any:
        """Write this capture as a bundle directory (API.md §6, docs/bundles.md); returns its path."""
        from backlens.io.bundle import save

        return save(self, path, overwrite=overwrite)

    def close(self) -> None:
        """Remove every hook and drop every autograd node this capture holds.

        A ``storage=bl.to_disk(path)`` capture then writes its bundle manifest.
        """
        if self._closed:
            return
        self._backward.close_stale()
        self._backward.remove_hooks()
        self._table.clear()
        self._failures.forget()
        self._model = None
        self._rerun = None
        self._journal.drop_nodes()
        self._node_maps.drop_nodes()
        self._closed = True
        finish = getattr(self._store, "finish", None)
        try:
            if finish is not None:
                finish(self)  # to_disk: write the bundle manifest (records outlive close)
        finally:
            self._store.close()

    def __del__(self) -> None:
        # A dropped capture takes its hooks and its place in the engine router with it.
        backward = self.__dict__.get("_backward")
        if backward is not None and (backward.armed or backward._handles):
            with contextlib.suppress(Exception):  # at interpreter exit torch may be half gone
                backward.remove_hooks()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "inference-only" if self.inference_only else "armed"
        return (
            f"<Capture {state}: {len(self._journal.ops)} ops, {len(self._journal.module_calls)} module calls, "
            f"{len(self._backward.passes)} backward passes>"
        )


def _weak_call(capture: Capture, method: str) -> Callable[..., Any]:
    """``capture.<method>``, called through a weak reference (None once the capture is gone)."""
    ref = weakref.ref(capture)

    def call(*args: Any) -> Any:
        target = ref()
        return getattr(target, method)(*args) if target is not None else None

    return call


def _owning_module(param_name: str) -> str:
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
