"""Differentiable replay: run a capture's recorded ops downstream of a site again, with an edit.

No model runs. The ops downstream of the edited sites (those that read, at any
distance, what a site produced) are called again with the arguments the
forward recorded (capture/replay_record.py), each in the grad mode it ran in.
Every tensor they read that no replayed op makes is a *frontier* value and
enters as a fresh leaf: a recorded activation (also a site's own, before its
edit), or a model input, detached. Parameters and buffers are the model's own.
So the replay's graph starts at the frontier: no gradient reaches the source
run's tensors or the parameters upstream of it.

The replay fills a fresh :class:`~backlens.capture.state.CaptureState` (the
*fork*) as a forward recorder would: one op entry per replayed op, under the
source's labels and module calls, bracketed by autograd sequence numbers so
its nodes pair with its ops; frontier leaves are its inputs.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from backlens import _torch
from backlens._nested import iter_tensors
from backlens.capture.forward import ModuleCallEntry, OpEntry
from backlens.capture.replay_record import TensorRef, Untracked
from backlens.capture.state import CaptureState, EditApplication, InputEntry, ParamEntry
from backlens.capture.views import OpView
from backlens.edits import EditContext, Intervention, KeepGrad, apply_checked
from backlens.errors import BacklensWarning, ReplayError
from backlens.graph.labels import label_not_found

Tensor = torch.Tensor
def _sequence_nr() -> int:
    return _torch.sequence_nr_function()()


def _norm(tensor: Tensor) -> float:
    return float(tensor.detach().float().norm())


@dataclass
class ReplaySite:
    """An edited op of the source and the interventions applied to its output."""

    op: int
    edits: list[tuple[Intervention, str]] = field(default_factory=list)


def find_sites(state: CaptureState, interventions: list[Intervention]) -> dict[int, ReplaySite]:
    """The source ops each activation site names (an op label, a module call's output, a selector).

    Gradient sites are refused: a replay has no backward of the source run to edit.
    """
    for intervention in interventions:
        if any(part.gradient for part in intervention.site.parts()):
            raise ReplayError(
                f"Gradient edit {intervention!r} cannot be replayed: differentiable replay reruns forward "
                "ops, and the gradient at a site belongs to a backward pass of the fork.",
                code="replay_gradient_edit_unsupported",
                remedy="Replay an activation edit, then arm the gradient edit on a rerun: "
                "cap.do(bl.grad(site), edit, loss=...) without differentiable=True.",
            )
    if state.replay is None:
        raise ReplayError(
            f"Cannot replay from {interventions[-1].site!r}: this capture kept no activations "
            "(save_activations=False), so there is no recorded activation at the frontier and no recorded "
            "op calls.",
            code="replay_no_activation",
            remedy="Capture with save_activations=True (or a selector that keeps the frontier ops).",
        )
    sites: dict[int, ReplaySite] = {}
    for intervention in interventions:
        for part in intervention.site.parts():
            for target in part.targets:
                text = target if isinstance(target, str) else repr(target)
                for op in _ops_of_target(state, target):
                    sites.setdefault(op, ReplaySite(op)).edits.append((intervention, text))
    if not sites:
        raise ReplayError(f"The site {interventions[-1].site!r} matches no op of this capture.",
                          code="replay_site_matched_nothing",
                          remedy="Pick a site from cap.ops.labels() or cap.modules.")
    return sites


def _ops_of_target(state: CaptureState, target: Any) -> list[int]:
    journal = state.journal
    if not isinstance(target, str):
        return [op.index for op in journal.ops if target.matches(state.view(OpView, op.index))]
    ops = [op.index for op in journal.ops if op.label == target]
    if ops:
        return ops
    calls = [journal.module_calls[i] for i in journal.resolve(target) or ()]
    if not calls:
        labels = [op.label for op in journal.ops] + [journal.call_label(c.index) for c in journal.module_calls]
        raise label_not_found("op or module", target, labels)
    found = []
    for call in calls:
        ref = state.replay.module_outputs.get(call.index)
        if ref is None or ref.index < 0 or ref.position != 0:
            raise ReplayError(
                f"Module call {journal.call_label(call.index)!r} returned no tensor a recorded op made first, so there is "
                "no activation to edit and replay from.",
                code="replay_no_activation",
                remedy="Name the op that makes the value instead (see cap.modules[...].ops).",
            )
        found.append(ref.index)
    return found


class Replay:
    """One replay of ``source`` with edits at ``sites``, filling ``fork`` (see the module docstring).

    ``tensors_of_source(kind, name)``: the model's parameter or buffer, or the
    input tensor, that the source recorded under ``name``.
    """

    def __init__(self, source: CaptureState, sites: dict[int, ReplaySite], tensors_of_source: Any):
        self.source = source
        self.sites = sites
        self._tensor_of_source = tensors_of_source
        self.recording = source.replay
        self.replayed = self._downstream()
        self._refuse_unreplayable()
        self.fork = CaptureState()
        self._fork_op_of: dict[int, int] = {}  # replayed source op -> fork op
        self._values: dict[int, list[Any]] = {}  # replayed source op -> its outputs (edited when a site)
        self._frontier_values: dict[tuple, Tensor] = {}  # frontier key -> leaf, parameter or buffer
        self._edited_frontier: dict[int, Tensor] = {}  # frontier site op -> its edited leaf
        self._fork_source_of: dict[tuple, int] = {}  # frontier key -> fork source
        self._inputs: list[tuple[str, Tensor]] = []
        self._params: list[tuple[str, Tensor]] = []
        self._applications = 0
        self._warned_keep_grad = False

    # -- planning -----------------------------------------------------------
    def _downstream(self) -> list[int]:
        """Ops that read, at any distance, what a site produced (in forward order)."""
        calls = self.recording.calls
        reached = set(self.sites)
        replayed = []
        for index in range(min(self.sites), len(calls)):
            if any(ref.index in reached for ref in _refs(calls[index])):
                reached.add(index)
                replayed.append(index)
        return replayed

    def _refuse_unreplayable(self) -> None:
        source, journal = self.source, self.source.journal
        replayed = set(self.replayed)
        # A tensor with history that no recorded op made may depend on a site without a
        # recorded path saying so: an op after the first site that reads one cannot be replayed.
        for index in range(min(self.sites), len(self.recording.calls)):
            if any(isinstance(item, Untracked) for item in _recorded_items(self.recording.calls[index])):
                raise ReplayError(
                    f"Op {journal.ops[index].label!r} cannot be replayed: it read a tensor with autograd "
                    "history that no recorded op made (made by code the recorder does not see), so what "
                    "it depends on is unknown.",
                    code="replay_op_unsupported",
                    remedy="Edit a site after that op, or rerun the model: cap.do(site, edit) without "
                    "differentiable=True.",
                )
        if source.inference_only or source.closed and not source.table.built():
            return
        source.sync()
        for node in source.nodes:
            if node.is_custom and node.op is not None and node.op in replayed:
                raise ReplayError(
                    f"Op {journal.ops[node.op].label!r} ran inside the custom autograd Function "
                    f"{node.type.removesuffix('Backward')!r} ({node.label}); replay would run its forward's "
                    "ops without its backward.",
                    code="replay_custom_function",
                    remedy="Edit a site after the Function, or rerun the model: cap.do(site, edit) without "
                    "differentiable=True.",
                )

    # -- running --------------------------------------------------------------
    def run(self, output: Any) -> Any:
        """Replay the ops, fill the fork's journal, and return the fork's output (``output``'s structure)."""
        journal = self.fork.journal
        journal.seq_start = _sequence_nr()
        for index in sorted(set(self.sites) - set(self.replayed)):
            leaf, _source = self._frontier(TensorRef(index), index)
            self._edited_frontier[index] = self._edited(index, [leaf])[0]
        rows: list[tuple] = []
        entries: list[OpEntry] = []
        for index in self.replayed:
            self._replay_op(index, rows, entries)
        journal.seq_end = _sequence_nr()
        self._finish_journal(rows, entries)
        return self._output(output)

    def _replay_op(self, index: int, rows: list, entries: list) -> None:
        source_op = self.source.journal.ops[index]
        call = self.recording.calls[index]
        parents: list[int] = []
        sources: list[int] = []
        args = self._materialize(call.args, parents, sources, index)
        kwargs = self._materialize(call.kwargs, parents, sources, index)
        func = source_op.func
        with torch.set_grad_enabled(call.grad_enabled):
            before = _sequence_nr()
            try:
                out = func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - named in model terms, torch's text kept
                raise ReplayError(
                    f"Replaying op {source_op.label!r} failed: {type(exc).__name__}: {exc}",
                    code="replay_op_failed",
                    remedy="Edit a site after that op, or rerun the model: cap.do(site, edit) without "
                    "differentiable=True.",
                ) from exc
            after = _sequence_nr()
        if isinstance(out, Tensor):
            outputs = [out]
        elif isinstance(out, (tuple, list)):
            outputs = list(out)
        else:
            outputs = [args[0]]  # an in-place op returning None (setitem)
        primary = outputs[0]
        # As the recorder does: name the output's node when there are several (or no sequence numbers).
        several = after - before > 1 or not _torch.HAS_SEQUENCE_NR
        output_node = primary.grad_fn if several else None
        output_nr = primary.output_nr
        self._fork_op_of[index] = len(entries)
        self._values[index] = self._edited(index, outputs) if index in self.sites else outputs
        rows.append((func, None, before, after, primary.shape, primary.dtype, len(outputs), 0, 0,
                     output_node, output_nr, source_op.inplace))
        entries.append(OpEntry(
            index=len(entries), name=source_op.name, label=source_op.label, module_call=None,
            shape=tuple(primary.shape), dtype=primary.dtype, num_outputs=len(outputs),
            parents=list(dict.fromkeys(parents)), sources=list(dict.fromkeys(sources)), output_nr=output_nr,
            inplace=source_op.inplace, func=func, seq_start=before, seq_end=after, output_node=output_node,
        ))

    def _materialize(self, value: Any, parents: list[int], sources: list[int], consumer: int) -> Any:
        """A recorded argument with its references replaced by this replay's values."""
        if isinstance(value, TensorRef):
            fork_op = self._fork_op_of.get(value.index) if value.index >= 0 else None
            if fork_op is not None:
                parents.append(fork_op)
                return self._values[value.index][value.position]
            tensor, source = self._frontier(value, consumer)
            sources.append(source)
            return tensor
        if isinstance(value, (tuple, list)):
            items = [self._materialize(v, parents, sources, consumer) for v in value]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self._materialize(v, parents, sources, consumer) for k, v in value.items()}
        return value

    def _frontier(self, ref: TensorRef, consumer: int) -> tuple[Tensor, int]:
        """The value of a tensor no replayed op makes, and its fork source: a fresh leaf (an edited
        one for a site), or the model's own parameter or buffer."""
        key = ("op", ref.index, ref.position) if ref.index >= 0 else ("source", ref.index)
        if key not in self._frontier_values:
            if ref.index >= 0:
                tensor, name = self._activation(ref), self._frontier_name(ref)
                kind = "input"
            else:
                kind, name = self.source.journal.source_kinds[ref.source], self.source.journal.source_names[ref.source]
                tensor = self._tensor_of_source(kind, name)
                if tensor is None:
                    raise ReplayError(
                        f"Op {self.source.journal.ops[consumer].label!r} reads the {kind} {name!r}, which this "
                        "capture no longer holds (its model or inputs were released).",
                        code="replay_source_missing",
                        remedy="Replay from a capture that is still open.",
                    )
            if kind == "input":
                tensor = self._fresh_leaf(tensor, ref)
                self._inputs.append((name, tensor))
            elif kind == "param":
                self._params.append((name, tensor))
            self._frontier_values[key] = tensor
            self._fork_source_of[key] = self._add_source(kind, name)
        source = self._fork_source_of[key]
        if ref.index >= 0 and ref.position == 0 and ref.index in self._edited_frontier:
            return self._edited_frontier[ref.index], source
        return self._frontier_values[key], source

    def _frontier_name(self, ref: TensorRef) -> str:
        label = self.source.journal.ops[ref.index].label
        return label if ref.position == 0 else f"{label}[{ref.position}]"

    def _activation(self, ref: TensorRef) -> Tensor:
        """The recorded activation of op output ``ref`` (ReplayError when the capture did not keep it)."""
        if ref.position == 0:
            tensor = self.source.journal.ops[ref.index].activation
        else:
            others = self.recording.other_outputs.get(ref.index)
            tensor = others[ref.position - 1] if others is not None else None
        if tensor is None:
            label = self.source.journal.ops[ref.index].label
            raise ReplayError(
                f"No recorded activation at the frontier: replay needs the output of "
                f"{self._frontier_name(ref)!r}, and the capture did not keep it.",
                code="replay_no_activation",
                remedy=f"Capture with save_activations=True (or a selector that keeps {label!r}).",
            )
        return tensor

    def _fresh_leaf(self, tensor: Tensor, ref: TensorRef) -> Tensor:
        """A new leaf holding ``tensor``'s value (requiring grad when it can); a copy when a replayed op
        writes into it, so the record is never changed."""
        leaf = tensor.detach()
        if self._written_in_place(ref):
            leaf = leaf.clone()
        if leaf.is_floating_point() or leaf.is_complex():
            leaf.requires_grad_(True)
        return leaf

    def _written_in_place(self, ref: TensorRef) -> bool:
        journal = self.source.journal
        for index in self.replayed:
            if journal.ops[index].inplace:
                args = self.recording.calls[index].args
                if args and args[0] == ref:
                    return True
        return False

    def _add_source(self, kind: str, name: str) -> int:
        journal = self.fork.journal
        journal.source_kinds.append(kind)
        journal.source_names.append(name)
        return len(journal.source_names) - 1

    def _edited(self, index: int, outputs: list[Any]) -> list[Any]:
        """Outputs of site op ``index`` with its edits applied to the first."""
        journal = self.source.journal
        entry = journal.ops[index]
        module = journal.call_label(entry.module_call)
        value = outputs[0]
        for intervention, site in self.sites[index].edits:
            if isinstance(intervention.edit, KeepGrad) and not self._warned_keep_grad:
                self._warned_keep_grad = True
                warnings.warn(BacklensWarning(
                    f"{intervention.edit!r} keeps the gradient path through the edit, but under replay that "
                    "path ends at the frontier leaves: no gradient reaches the source run's tensors or "
                    "the parameters upstream of the frontier.",
                    code="keep_grad_replay_frontier",
                ), stacklevel=4)
            ctx = EditContext(site, entry.label, module, None, application=self._applications)
            self._applications += 1
            new = apply_checked(intervention.edit, value, ctx)
            self.fork.forward_edits.append(EditApplication(site, repr(intervention.edit), entry.label, module,
                                                           None, _norm(value), _norm(new)))
            value = new
        return [value, *outputs[1:]]

    # -- the fork's journal and output -----------------------------------------
    def _finish_journal(self, rows: list, entries: list[OpEntry]) -> None:
        """Module calls around the replayed ops (the source's, renumbered), and the op entries."""
        source = self.source.journal
        fork = self.fork.journal
        fork_call_of: dict[int, int] = {}
        calls: list[ModuleCallEntry] = []

        def call_for(source_call: int | None) -> int | None:
            if source_call is None:
                return None
            found = fork_call_of.get(source_call)
            if found is None:
                entry = source.module_calls[source_call]
                parent = call_for(entry.parent)
                found = fork_call_of[source_call] = len(calls)
                calls.append(ModuleCallEntry(found, entry.address, entry.call, parent, op_start=len(entries)))
            return found

        for position, index in enumerate(self.replayed):
            call = call_for(source.ops[index].module_call)
            entries[position].module_call = call
            row = rows[position]
            rows[position] = (row[0], call, *row[2:])
            while call is not None:
                entry = calls[call]
                entry.op_start = min(entry.op_start, position)
                entry.op_end = position + 1
                entry.seq_start = row[2] if entry.seq_start is None else min(entry.seq_start, row[2])
                entry.seq_end = row[3]
                call = entry.parent
        for source_call, fork_call in fork_call_of.items():
            entry = calls[fork_call]
            ref = self.recording.module_outputs.get(source_call)
            value = self._values.get(ref.index) if ref is not None and ref.index in self._fork_op_of else None
            first = value[ref.position] if value is not None else None
            if isinstance(first, Tensor):
                entry.output_shape = tuple(first.shape)
                entry.output_node = first.grad_fn
                entry.output_nr = first.output_nr if first.grad_fn is not None else 0
        calls.sort(key=lambda c: c.index)
        fork.raw_ops.extend(rows)
        fork.restore(entries, calls, dict(source.module_types), fork.source_kinds, fork.source_names)
        self.fork.params = [ParamEntry(name, tuple(p.shape), p.dtype, p.requires_grad, _weak(p))
                            for name, p in self._params]
        self.fork.inputs = [InputEntry(name, tuple(t.shape), t.dtype, t.requires_grad, False)
                            for name, t in self._inputs]

    def _output(self, output: Any) -> Any:
        """``output`` with each tensor replaced by its replayed value (a detached copy where none)."""
        refs = iter(self.recording.output)
        replaced = []
        for tensor, ref in zip(iter_tensors(output), refs):
            if isinstance(ref, TensorRef) and ref.index in self._values:
                replaced.append(self._values[ref.index][ref.position])
            elif isinstance(ref, TensorRef) and ref.position == 0 and ref.index in self._edited_frontier:
                replaced.append(self._edited_frontier[ref.index])
            else:
                replaced.append(tensor.detach())  # not downstream of any site: the source's value
        return map_tensors(output, iter(replaced))

    # -- what the fork's backward recorder needs -------------------------------------
    @property
    def frontier(self) -> dict[str, Tensor]:
        """The fresh leaves, by name (the frontier op's label, or the input's name)."""
        return dict(self._inputs)

    def source_ids(self) -> dict[int, int]:
        """id(leaf or parameter) -> its fork source (what the backward recorder pairs AccumulateGrad by)."""
        kinds = self.fork.journal.source_kinds
        return {id(self._frontier_values[key]): source for key, source in self._fork_source_of.items()
                if kinds[source] in ("input", "param")}


def _weak(tensor: Tensor) -> Any:
    return weakref.ref(tensor)


def _recorded_items(call: Any) -> list[Any]:
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        else:
            found.append(value)

    walk(call.args)
    walk(call.kwargs)
    return found


def _refs(call: Any) -> list[TensorRef]:
    return [item for item in _recorded_items(call) if isinstance(item, TensorRef)]


def map_tensors(value: Any, replacements: Any) -> Any:
    """``value`` rebuilt with its tensors (in reading order) taken from ``replacements``."""
    if isinstance(value, Tensor):
        return next(replacements)
    if isinstance(value, (tuple, list)):
        items = [map_tensors(v, replacements) for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keys"):
        try:
            pairs = list(value.items())
        except Exception:  # noqa: BLE001 - not a container after all
            return value
        rebuilt = copy.copy(value)
        for key, item in pairs:
            rebuilt[key] = map_tensors(item, replacements)
        return rebuilt
    return value
