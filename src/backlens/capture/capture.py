"""``bl.capture``: record a forward and every backward pass over its graph.

:func:`capture` runs the forward under the recorder; the :class:`Capture` it
returns builds records from its :class:`~backlens.capture.core.CaptureCore`
on first read and caches them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from backlens import _torch
from backlens._nested import iter_named_tensors
from backlens.capture.backward import PassState
from backlens.capture.core import CaptureCore, owning_module
from backlens.capture.forward import ActivationPolicy, ForwardJournal, ForwardRecorder
from backlens.capture.interventions import ArmedEdits
from backlens.capture.policy import GradPolicy
from backlens.capture.record_source import LiveRecordSource
from backlens.capture.unmatched import warn_if_no_activation_kept
from backlens.cost.forward_count import FlopForwardRecorder
from backlens.cost.journal import CostJournal
from backlens.edits import as_interventions
from backlens.errors import CaptureClosedError, UnsupportedInputError
from backlens.io.disk_store import make_store
from backlens.records.backward import BackwardPass, GradFn, GradFnCall
from backlens.records.forward import (
    InputRecord,
    ModuleCallRecord,
    OpRecord,
    ParamRecord,
)
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
    return Capture(CaptureCore(
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
    ))


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
    """A recorded forward and the backward passes run over its graph.

    Records are built from the core when first read and cached here; they
    point at the core, not at this object, so dropping the capture frees it,
    its graph and its saved gradients at once (records you still hold keep
    what they read from alive).
    """

    def __init__(self, core: CaptureCore):
        self._core = core
        self._source = LiveRecordSource(core, self)
        self._forward_records: tuple | None = None
        self._grad_fn_cache: list[GradFn] = []
        self._call_records: list[GradFnCall] = []
        self._pass_records: dict[int, BackwardPass] = {}
        core.read_records_from(self, self._source)

    @property
    def output(self) -> Any:
        """What the model returned."""
        return self._core.output

    @output.setter
    def output(self, value: Any) -> None:
        self._core.output = value  # e.g. None, to let go of the graph behind it

    @property
    def inference_only(self) -> bool:
        return self._core.inference_only

    @property
    def backward_requested(self) -> bool:
        return self._core.backward_requested

    @property
    def flops_enabled(self) -> bool:
        return self._core.flops_enabled

    # The core's parts that bundles, cost reports and explanations read.
    @property
    def _backward(self) -> Any:
        return self._core.backward

    @property
    def _cost(self) -> CostJournal:
        return self._core.cost

    @property
    def _store(self) -> Any:
        return self._core.store

    @property
    def _inference_cause(self) -> str:
        return self._core.inference_cause

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
        core = self._core
        journal = core.journal
        source = self._source
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
                    forward_flops=core.cost.op_flops(entry.index),
                    _source=source,
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
                    _source=source,
                )
            )
        params = [
            ParamRecord(
                name=name,
                module=owning_module(name),
                shape=tuple(shape),
                dtype=dtype,
                requires_grad=requires_grad,
                _source=source,
            )
            for name, shape, dtype, requires_grad in core.param_shapes
        ]
        inputs = [
            InputRecord(
                index=i,
                name=name,
                shape=shape,
                dtype=dtype,
                requires_grad=requires_grad,
                was_parameter=was_parameter,
                _source=source,
            )
            for i, (name, shape, dtype, requires_grad, was_parameter) in enumerate(core.input_meta)
        ]
        return ops, modules, params, inputs

    # -- backward records ----------------------------------------------------
    def _grad_fn_record(self, index: int) -> GradFn:
        return self._grad_fn_records[index]

    @property
    def _grad_fn_records(self) -> list[GradFn]:
        """GradFn records of every discovered node, built on first read."""
        cache = self._grad_fn_cache
        entries = self._core.table.entries
        calls = self._core.journal.module_calls
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
                    _source=self._source,
                )
            )
        return cache

    def _op_grad_fn(self, op_index: int) -> GradFn | None:
        self._core.discover()
        node = self._core.output_node_of_op.get(op_index)
        return self._grad_fn_records[node] if node is not None else None

    def _node_calls(self, node_index: int) -> list[GradFnCall]:
        records = self._calls()
        return [records[i] for i in self._core.backward.node_calls[node_index]]

    def _pass_calls(self, number: int) -> list[GradFnCall]:
        records = self._calls()
        return [records[i] for i in self._core.backward.passes[number - 1].call_indices]

    def _calls(self) -> list[GradFnCall]:
        backward = self._core.backward
        store = self._core.store
        records = self._call_records
        passes = backward.passes
        for entry in backward.calls[len(records):]:
            grad_fn = self._grad_fn_records[entry.node]
            pass_start = passes[entry.pass_number - 1].start_ns
            start = entry.start_ns
            records.append(
                GradFnCall(
                    label=f"{grad_fn.label}:{entry.ordinal}",
                    grad_fn=grad_fn,
                    index=entry.ordinal,
                    pass_number=entry.pass_number,
                    grad_inputs=store.load(entry.grad_inputs) if entry.grad_inputs is not None else None,
                    grad_outputs=store.load(entry.grad_outputs) if entry.grad_outputs is not None else None,
                    start=(start - pass_start) / 1e9 if start is not None else None,
                    duration=(entry.end_ns - start - entry.hook_ns) / 1e9 if start is not None else None,
                    flops=entry.flops,
                    recompute_flops=entry.recompute_flops,
                )
            )
        return records

    def _pass_closed(self, state: PassState, error: BaseException | None) -> BaseException | None:
        """A pass closed: records read while it ran get its FLOPs; a failure is explained."""
        built = self._call_records
        for i in state.call_indices:
            if i < len(built):
                entry = self._core.backward.calls[i]
                built[i].flops, built[i].recompute_flops = entry.flops, entry.recompute_flops
        return self._core.failures.translate(state, error) if error is not None else None

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
        self._core.discover()
        return self._grad_fn_records

    def _call_list(self) -> list[GradFnCall]:
        self._core.backward.close_stale()
        return self._calls()

    def _pass_list(self) -> list[BackwardPass]:
        """Pass records: copies of the recorder's, pointing at the record source
        (the recorder's own would make a cycle through the core); a finished
        pass's copy is kept, a running one's is taken afresh at each read."""
        self._core.backward.close_stale()
        records = []
        for state in self._core.backward.passes:
            record = self._pass_records.get(state.record.number)
            if record is None:
                record = dataclasses.replace(state.record, _source=self._source)
                if state.record.status != "running":
                    self._pass_records[record.number] = record
            records.append(record)
        return records

    # -- backward ----------------------------------------------------------
    def backward(self, loss: torch.Tensor | None = None, *, save_grads: Any = None, **backward_kwargs: Any) -> None:
        """Run ``torch.autograd.backward(loss)`` as one recorded pass.

        ``save_grads`` widens or narrows the save policy for this pass only.
        """
        self._core.run_backward(loss, save_grads, backward_kwargs)

    @property
    def forward_edits(self) -> list:
        """Every activation edit applied in this capture's forward, with norms before and after."""
        return list(self._core.armed.forward_applications)

    def do(self, site: Any, edit: Any, inputs: Any = None, loss: Any = None) -> Capture:
        """Rerun the forward with ``edit`` armed at ``site`` (and the backward when ``loss`` is given).

        Returns a new capture; this one is untouched. ``inputs`` replaces the
        original positional inputs (a tuple, or one tensor); ``loss`` is
        ``lambda cap: tensor``.
        """
        from backlens.edits import when

        core = self._core
        if core.rerun is None or core.model is None:
            raise CaptureClosedError("This capture cannot rerun its forward (closed or loaded from disk).")
        args, kwargs, options, intervene = core.rerun
        if inputs is not None:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
        armed = [*as_interventions(intervene), when(site, edit)]
        new = capture(core.model, *args, intervene=armed, **options, **kwargs)
        if loss is not None:
            new.backward(loss(new))
        return new

    # -- lifetime ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._core.closed

    def disarm(self) -> None:
        """Stop recording later passes; keep every record."""
        self._core.backward.remove_hooks()

    def save(self, path: Any = None, *, overwrite: bool = False) -> Any:
        """Write this capture as a bundle directory (API.md §6, docs/bundles.md); returns its path."""
        from backlens.io.bundle import save

        return save(self, path, overwrite=overwrite)

    def close(self) -> None:
        """Remove every hook and drop every autograd node this capture holds.

        A ``storage=bl.to_disk(path)`` capture then writes its bundle manifest.
        """
        core = self._core
        if core.closed:
            return
        core.close()
        finish = getattr(core.store, "finish", None)
        try:
            if finish is not None:
                finish(self)  # to_disk: write the bundle manifest (records outlive close)
        finally:
            core.store.close()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        core = self._core
        state = "closed" if core.closed else "inference-only" if core.inference_only else "armed"
        return (
            f"<Capture {state}: {len(core.journal.ops)} ops, {len(core.journal.module_calls)} module calls, "
            f"{len(core.backward.passes)} backward passes>"
        )
