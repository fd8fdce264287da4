"""A loaded state's records must agree with each other and with their tensors.

The schema (io/schema.py) checks each field on its own: its kind, its range,
that an index points into its section. What it cannot see is a record that
contradicts another, which a hostile or damaged bundle can hold as easily as
a wrong type, and which would read back as a silent wrong answer (a lookup by
label finding another op, a report summing other FLOPs). So after the state is
built, :func:`check_state` checks, raising ``ValueError`` naming the first
disagreement:

* names that look records up are unique: op labels, node labels, parameter
  and input names, module calls (address and call number); a node's calls are
  numbered 1, 2, ... in firing order;
* names that refer to records resolve: a node's or a gradient slot's
  parameter, an edit's op;
* times run forward: a node call ends after it starts and spends no more in
  backlens's hooks and collectives than it lasted; a pass ends after it starts;
* every tensor agrees with its record: an activation has its op's shape and
  dtype, a parameter's gradient its parameter's (a shard of it under
  torch.distributed), an input's gradient its input's, a node's kept
  gradients as many entries in every call, the one an op, a module call or
  an input reads (``output_nr``) among them and of that record's shape;
* the cost journal agrees with the calls: one forward count per op, one cost
  per pass, and in a counted pass the calls' FLOPs plus the unattributed ones
  equal the executed count (recomputed FLOPs likewise).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from backlens.io.shards import CODES, TensorEntry


def check_state(state: Any, entries: dict[str, TensorEntry]) -> None:
    """Raise ValueError naming the first place where ``state``'s records disagree (module docstring)."""
    _unique_names(state)
    _call_ordinals(state)
    _references(state)
    _times(state)
    _tensors(state)
    _gradient_sides(state, entries)
    _cost(state)


def _fail(where: str, what: str) -> None:
    raise ValueError(f"{where}: {what}")


def _repeated(names: Iterable[Any]) -> Any:
    counts = Counter(names)
    return next((name for name, count in counts.items() if count > 1), None)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unique_names(state: Any) -> None:
    journal = state.journal
    for section, names in (
        ("ops", (op.label for op in journal.ops)),
        ("grad_fns", (node.label for node in state.nodes)),
        ("params", (param.name for param in state.params)),
        ("inputs", (entry.name for entry in state.inputs)),
        ("modules", ((call.address, call.call) for call in journal.module_calls)),
    ):
        repeated = _repeated(names)
        if repeated is not None:
            what = f"{repeated[0]}:{repeated[1]}" if section == "modules" else repeated
            _fail(section, f"two records share the name {_shown(what)} (a lookup by it would find only one)")
    last_call: dict[str, int] = {}
    for position, call in enumerate(journal.module_calls):
        if call.call <= last_call.get(call.address, 0):
            _fail(f"modules: [{position}]", f"call {call.call} of {_shown(call.address)} comes after its call "
                  f"{last_call[call.address]} (calls are numbered in order)")
        last_call[call.address] = call.call


def _call_ordinals(state: Any) -> None:
    fired: dict[int, int] = {}
    for position, call in enumerate(state.calls):
        expected = fired.get(call.node, 0) + 1
        if call.ordinal != expected:
            _fail(f"calls: [{position}] ordinal", f"{call.ordinal}, but it is call {expected} of node {call.node} "
                  "(a node's calls are numbered 1, 2, ... in firing order)")
        fired[call.node] = expected


def _references(state: Any) -> None:
    params = {param.name for param in state.params}
    for position, node in enumerate(state.nodes):
        if node.param is not None and node.param not in params:
            _fail(f"grad_fns: [{position}] param", f"{_shown(node.param)} is not a parameter of the capture")
    for name in state.slots.param:
        if name not in params:
            _fail("grad_slots: params", f"{_shown(name)} is not a parameter of the capture")
    labels = {op.label for op in state.journal.ops}
    edits = [(f"passes: [{p.number - 1}] edits", edit) for p in state.passes for edit in p.edits]
    edits += [("forward_edits", edit) for edit in state.forward_edits]
    for where, edit in edits:
        if edit.op is not None and edit.op not in labels:
            _fail(f"{where} op", f"{_shown(edit.op)} is not an op of the capture")


def _times(state: Any) -> None:
    for position, call in enumerate(state.calls):
        if call.start_ns is None:
            continue
        if call.end_ns < call.start_ns:
            _fail(f"calls: [{position}] end_ns", f"{call.end_ns} is before its start_ns {call.start_ns}")
        if call.hook_ns + call.wait_ns > call.end_ns - call.start_ns:
            _fail(f"calls: [{position}]", f"hook_ns + wait_ns ({call.hook_ns} + {call.wait_ns}) are more than the "
                  f"call lasted ({call.end_ns - call.start_ns} ns)")
    for position, pass_ in enumerate(state.passes):
        if pass_.end_ns is not None and pass_.end_ns < pass_.start_ns:
            _fail(f"passes: [{position}] end_ns", f"{pass_.end_ns} is before its start_ns {pass_.start_ns}")


def _same(where: str, tensor: torch.Tensor | None, shape: Any, dtype: torch.dtype | None, *,
          shard: bool = False) -> None:
    if tensor is None:
        return
    if dtype is not None and tensor.dtype != dtype:
        _fail(where, f"a tensor of dtype {tensor.dtype}, but its record says {dtype}")
    if shape is None:
        return
    shape, got = tuple(shape), tuple(tensor.shape)
    # A distributed capture keeps this rank's shard of a sharded parameter's gradient.
    fits = got == shape or (shard and len(got) == len(shape) and all(g <= s for g, s in zip(got, shape)))
    if not fits:
        _fail(where, f"a tensor of shape {list(got)}, but its record says {list(shape)}")


def _tensors(state: Any) -> None:
    for op in state.journal.ops:
        _same(f"ops: [{op.index}] activation", op.activation, op.shape, op.dtype)
    sharded = state.rank is not None
    for position, param in enumerate(state.params):
        _same(f"params: [{position}] grad", param.saved_grad, param.shape, param.dtype, shard=sharded)
    for position, (index, grad, _number) in enumerate(state.extra_input_grads):
        entry = state.inputs[index]
        _same(f"grad_slots: extra_input_grads: [{position}]", grad, entry.shape, entry.dtype)


def _gradient_sides(state: Any, entries: dict[str, TensorEntry]) -> None:
    """Every call of a node keeps as many gradients per side; what a record reads is among them."""
    widths: dict[tuple[int, str], int] = {}
    for position, call in enumerate(state.calls):
        for side in ("grad_inputs", "grad_outputs"):
            handle = getattr(call, side)
            if handle is None:
                continue
            width = widths.setdefault((call.node, side), len(handle))
            if len(handle) != width:
                _fail(f"calls: [{position}] {side}", f"{len(handle)} gradients, but node {call.node}'s other calls "
                      f"keep {width}")
    journal, slots = state.journal, state.slots
    readers = [(f"ops: [{i}]", node, journal.ops[i].output_nr, journal.ops[i].shape, journal.ops[i].dtype,
                journal.ops[i].num_outputs) for i, node in slots.op.items()]
    readers += [(f"modules: [{i}]", node, journal.module_calls[i].output_nr, journal.module_calls[i].output_shape,
                 None, None) for i, node in slots.module.items()]
    readers += [(f"grad_slots: inputs: [{i}]", node, nr, state.inputs[i].shape, state.inputs[i].dtype, None)
                for i, (node, nr) in slots.input.items()]
    for where, node, output_nr, shape, dtype, outputs in readers:
        width = widths.get((node, "grad_outputs"))
        if width is None:
            # No call kept this node's gradients: the record's own outputs bound the number.
            if outputs is not None and output_nr >= max(outputs, 1):
                _fail(f"{where} output_nr", f"{output_nr}, but the op has {outputs} output(s)")
            continue
        if output_nr >= width:
            _fail(f"{where} output_nr", f"{output_nr}, but its node's calls keep {width} gradient(s)")
        for position in state.node_calls[node]:
            handle = state.calls[position].grad_outputs
            name = handle[output_nr] if handle is not None else None
            entry = entries.get(name) if isinstance(name, str) else None
            if entry is None:
                continue
            if shape is not None and tuple(entry.shape) != tuple(shape):
                _fail(f"calls: [{position}] grad_outputs", f"the gradient {where} reads is of shape "
                      f"{list(entry.shape)}, but that record's shape is {list(shape)}")
            if dtype is not None and CODES.get(dtype) != entry.dtype:
                _fail(f"calls: [{position}] grad_outputs", f"the gradient {where} reads is of dtype {entry.dtype}, "
                      f"but that record's dtype is {dtype}")


def _cost(state: Any) -> None:
    cost = state.cost
    if cost is None:
        return
    forward = cost.forward
    if forward is not None:
        ops = len(state.journal.ops)
        if len(forward["op_flops"]) != ops:
            _fail("cost: forward: op_flops", f"{len(forward['op_flops'])} counts for {ops} ops")
        for failure in forward["replay_failures"]:
            if forward["op_flops"][failure["op_index"]] is not None:
                _fail("cost: forward: replay_failures", f"op {failure['op_index']} failed to count but has a count")
    repeated = _repeated(entry["pass"] for entry in cost.passes)
    if repeated is not None:
        _fail("cost: passes", f"two costs for pass {repeated}")
    calls_of: dict[int, list[Any]] = {}
    for call in state.calls:
        calls_of.setdefault(call.pass_number, []).append(call)
    counted = set()
    for position, entry in enumerate(cost.passes):
        _pass_cost(f"cost: passes: [{position}]", entry, calls_of.get(entry["pass"], []))
        _aten_rows(f"cost: passes: [{position}] aten_ops", entry, state.calls)
        if entry["counted"] and entry["attributed"]:
            counted.add(entry["pass"])
    for position, call in enumerate(state.calls):
        if call.flops is not None and call.pass_number not in counted:
            _fail(f"calls: [{position}] flops", f"{call.flops}, but pass {call.pass_number} has no attributed count")


def _pass_cost(where: str, entry: dict[str, Any], calls: list[Any]) -> None:
    executed, unattributed = entry["executed_flops"], entry["unattributed_flops"]
    listed = sum(op["flops"] for op in entry["unattributed_ops"])
    if not entry["counted"]:
        if executed is not None or unattributed is not None or entry["recompute_flops"] is not None:
            _fail(where, "a pass with no count has FLOP totals")
        return
    if executed is None or unattributed is None:
        _fail(where, "a counted pass has no executed_flops or unattributed_flops")
    if unattributed != listed:
        _fail(f"{where} unattributed_flops", f"{unattributed}, but its unattributed_ops add up to {listed}")
    if (entry["recompute_flops"] is None) == entry["recompute_known"]:
        _fail(f"{where} recompute_flops", "known exactly when recompute_known is true")
    if not entry["attributed"]:
        if unattributed != executed:
            _fail(where, f"an unattributed pass's unattributed_flops ({unattributed}) are not its executed_flops "
                  f"({executed})")
        return
    rows = [call.flops for call in calls]
    if any(flops is None for flops in rows):
        _fail(where, f"pass {entry['pass']} is counted, but some of its calls have no FLOPs")
    if sum(rows) + unattributed != executed:
        _fail(where, f"its calls' FLOPs ({sum(rows)}) plus unattributed_flops ({unattributed}) are not its "
              f"executed_flops ({executed})")
    for call in calls:
        if call.recompute_flops is not None and call.recompute_flops > call.flops:
            _fail(where, f"a call recomputed more FLOPs ({call.recompute_flops}) than it ran ({call.flops})")
    if entry["recompute_known"]:
        recomputed = [call.recompute_flops for call in calls]
        if any(flops is None for flops in recomputed) or sum(recomputed) != entry["recompute_flops"]:
            _fail(f"{where} recompute_flops", f"{entry['recompute_flops']}, but its calls recomputed "
                  f"{sum(f or 0 for f in recomputed)}")


def _aten_rows(where: str, entry: dict[str, Any], calls: list[Any]) -> None:
    """A counted pass's ATen rows add up to its executed FLOPs, those under each node call to that
    call's FLOPs, and those under none to its unattributed FLOPs."""
    aten = entry["aten_ops"]
    if aten is None or not entry["counted"]:
        return
    if sum(aten["flops"]) != entry["executed_flops"]:
        _fail(where, f"its rows' FLOPs add up to {sum(aten['flops'])}, but the pass's executed_flops are "
              f"{entry['executed_flops']}")
    if not entry["attributed"]:
        return
    under: dict[int | None, int] = {}
    for position, flops in zip(aten["call"], aten["flops"]):
        under[position] = under.get(position, 0) + flops
    for position, flops in under.items():
        expected = entry["unattributed_flops"] if position is None else calls[position].flops
        if flops != expected:
            named = "under no node call" if position is None else f"under call {position}"
            _fail(where, f"its rows {named} add up to {flops} FLOPs, but that "
                  f"{'pass has' if position is None else 'call has'} {expected}")
