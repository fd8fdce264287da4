"""Bundle format version 2: a capture state as JSON, one explicit field list per entry type.

The manifest holds the state's entries (capture/state.py) section by section.
Every entry type has a :class:`Schema`: the exact fields it is written with,
each of a declared :class:`Kind`, and how the entry is built from them.
Reading refuses a missing or unknown field, a value of the wrong kind, and an
index into another section that is out of range, then builds each entry from
its fields only. Nothing is imported or instantiated by a name read from the
file. Tensors are named (``"tensors/3"``) into the bundle's tensor index.

Each kind is the one place that says what its values may be: a stricter
validation of hostile files tightens the kinds, not the code that uses them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from backlens.capture.forward import ModuleCallEntry, OpEntry
from backlens.capture.interventions import EditApplication
from backlens.capture.policy import GradPolicy
from backlens.capture.slots import GradSlots
from backlens.capture.state import (
    CallEntry,
    CaptureState,
    CollectiveEntry,
    InputEntry,
    ParamEntry,
    PassEntry,
)
from backlens.cost.checkpoints import CheckpointEntry, CheckpointJournal, RecomputeEntry
from backlens.cost.journal import CostJournal
from backlens.graph.engine import CallSite
from backlens.graph.table import NodeEntry, NodeTable
from backlens.select import _Opaque, selector_from_json


class RecordedError(Exception):
    """An error a pass raised, read back from a bundle: its type's name and its message.

    ``type(error).__name__`` is the original type's name (a class made for it
    here, never the original imported); ``str(error)`` is the original message.
    """

    type_name = "Exception"


@functools.lru_cache(maxsize=256)
def _recorded_type(name: str) -> type[RecordedError]:
    return type(name, (RecordedError,), {"type_name": name, "__module__": __name__, "__qualname__": name})


class Kind:
    """How one field's value is written as JSON and read back (``ValueError`` when malformed).

    ``write(value, refs)``: ``refs`` stores tensors (``tensor(t) -> name``,
    ``side(handle) -> [name | None]``). ``read(json, ctx)``: ``ctx`` finds
    tensors (``tensor(name)``, ``known(name)``) and section sizes (``size(section)``).
    """

    def __init__(self, write: Callable[[Any, Any], Any], read: Callable[[Any, Any], Any]):
        self.write = write
        self.read = read


def _plain(value: Any, _refs: Any) -> Any:
    return value


def _expect(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"expected {what}, got {str(value)[:80]!r}")


def _typed(python_type: type, what: str) -> Kind:
    def read(value: Any, _ctx: Any) -> Any:
        _expect(type(value) is python_type, what, value)
        return value

    return Kind(_plain, read)


INT = _typed(int, "an integer")
BOOL = _typed(bool, "true or false")
STR = _typed(str, "a string")


def optional(kind: Kind) -> Kind:
    return Kind(lambda v, refs: None if v is None else kind.write(v, refs),
                lambda v, ctx: None if v is None else kind.read(v, ctx))


def list_of(kind: Kind) -> Kind:
    def read(value: Any, ctx: Any) -> list:
        _expect(isinstance(value, list), "a list", value)
        return [kind.read(item, ctx) for item in value]

    return Kind(lambda v, refs: [kind.write(item, refs) for item in v], read)


def row(*kinds: Kind) -> Kind:
    """A fixed-length array of differently kinded values (read as a tuple)."""
    def read(value: Any, ctx: Any) -> tuple:
        _expect(isinstance(value, list) and len(value) == len(kinds), f"a list of {len(kinds)}", value)
        return tuple(kind.read(item, ctx) for kind, item in zip(kinds, value))

    return Kind(lambda v, refs: [kind.write(item, refs) for kind, item in zip(kinds, v)], read)


def _index(section: str, low: int, high_extra: int) -> Kind:
    def read(value: Any, ctx: Any) -> int:
        high = ctx.size(section) + high_extra
        _expect(type(value) is int and low <= value < high, f"an index into {section} ({low}..{high - 1})", value)
        return value

    return Kind(_plain, read)


def ref(section: str) -> Kind:
    """A 0-based position in ``section``."""
    return _index(section, 0, 0)


def upto(section: str) -> Kind:
    """A position in ``section`` or its end (a range bound)."""
    return _index(section, 0, 1)


def number(section: str) -> Kind:
    """A 1-based number in ``section`` (pass numbers)."""
    return _index(section, 1, 1)


def _read_float(value: Any, _ctx: Any) -> float:
    if value in ("nan", "inf", "-inf"):
        return float(value)
    _expect(type(value) in (int, float), "a number", value)
    return float(value)


FLOAT = Kind(lambda v, refs: v if math.isfinite(v) else repr(float(v)), _read_float)
SHAPE = Kind(lambda v, refs: list(v), lambda v, ctx: tuple(list_of(INT).read(v, ctx)))

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _read_dtype(value: Any, _ctx: Any) -> torch.dtype:
    _expect(value in _DTYPES, "a torch dtype name", value)
    return _DTYPES[value]


DTYPE = Kind(lambda v, refs: str(v).removeprefix("torch."), _read_dtype)
TENSOR = Kind(lambda v, refs: refs.tensor(v), lambda v, ctx: ctx.tensor(STR.read(v, ctx)))


def _read_side(value: Any, ctx: Any) -> tuple:
    names = list_of(optional(STR)).read(value, ctx)
    for name in names:
        _expect(name is None or ctx.known(name), "a tensor in the tensor index", name)
    return tuple(names)  # the loaded store's handle: tensor names


SIDE = Kind(lambda v, refs: refs.side(v), _read_side)
CALL_SITE = Kind(lambda v, refs: [v.file, v.line, v.function],
                 lambda v, ctx: CallSite(*row(STR, INT, STR).read(v, ctx)))


def _read_error(value: Any, ctx: Any) -> RecordedError:
    type_name, message = row(STR, STR).read(value, ctx)
    _expect(type_name.isidentifier() and len(type_name) <= 200, "an exception type name", type_name)
    return _recorded_type(type_name)(message)


ERROR = Kind(lambda v, refs: [type(v).__name__, str(v)], _read_error)


def _write_policy(policy: GradPolicy, _refs: Any) -> list:
    spec = policy.spec
    if not isinstance(spec, bool):
        to_json = getattr(spec, "to_json", None)
        spec = to_json() if to_json is not None else {"kind": "opaque", "repr": repr(spec)}
    return [spec, repr(policy)]


def _read_policy(value: Any, ctx: Any) -> GradPolicy:
    _expect(isinstance(value, list) and len(value) == 2, "[selector, repr]", value)
    spec, text = value[0], STR.read(value[1], ctx)
    if isinstance(spec, bool):
        return GradPolicy(spec)
    selector = selector_from_json(spec)  # selectors are rebuilt from a closed set of kinds
    if isinstance(selector, _Opaque) and text.startswith("save_grads="):
        selector = _Opaque(text[len("save_grads="):])
    return GradPolicy(selector)


POLICY = Kind(_write_policy, _read_policy)


def _read_cost(value: Any, _ctx: Any) -> CostJournal:
    _expect(isinstance(value, dict), "the cost journal", value)
    return CostJournal.from_dict(value)


COST = Kind(lambda v, refs: v.to_dict(), _read_cost)


class Schema:
    """One entry type: its fields, each of a kind, and how an entry is built from them.

    ``build(position, **fields)`` makes the entry; ``values(entry)`` gives the
    fields to write (by default the entry's attributes of the same names).
    """

    def __init__(self, fields: dict[str, Kind], build: Callable[..., Any],
                 values: Callable[[Any], dict[str, Any]] | None = None):
        self.fields = fields
        self.build = build
        self.values = values or (lambda entry: {name: getattr(entry, name) for name in fields})

    def write(self, entry: Any, refs: Any) -> dict[str, Any]:
        values = self.values(entry)
        return {name: kind.write(values[name], refs) for name, kind in self.fields.items()}

    def read(self, data: Any, ctx: Any, position: int = 0) -> Any:
        _expect(isinstance(data, dict), "an object", data)
        if data.keys() != self.fields.keys():
            unknown, missing = sorted(set(data) - set(self.fields)), sorted(set(self.fields) - set(data))
            raise ValueError(f"fields differ from the format's (unknown: {unknown}, missing: {missing})")
        fields = {}
        for name, kind in self.fields.items():
            try:
                fields[name] = kind.read(data[name], ctx)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return self.build(position, **fields)


def one(schema: Schema) -> Kind:
    """One entry of a schema (a section that is a single object)."""
    return Kind(schema.write, schema.read)


def entries(schema: Schema) -> Kind:
    """A list of entries of one schema (each built knowing its position)."""
    def read(value: Any, ctx: Any) -> list:
        _expect(isinstance(value, list), "a list", value)
        out = []
        for position, item in enumerate(value):
            try:
                out.append(schema.read(item, ctx, position))
            except ValueError as exc:
                raise ValueError(f"[{position}] {exc}") from None
        return out

    return Kind(lambda v, refs: [schema.write(e, refs) for e in v], read)


def _pass_entry(position: int, **fields: Any) -> PassEntry:
    _expect(fields["number"] == position + 1, f"pass number {position + 1}", fields["number"])
    return PassEntry(**fields)


EDIT = Schema({"site": STR, "edit": STR, "op": optional(STR), "module": optional(STR),
               "pass_number": optional(INT), "norm_before": FLOAT, "norm_after": FLOAT},
              lambda _at, **f: EditApplication(**f))
OP = Schema({"name": STR, "label": STR, "module_call": optional(ref("modules")), "shape": optional(SHAPE),
             "dtype": optional(DTYPE), "num_outputs": INT, "parents": list_of(ref("ops")),
             "sources": list_of(ref("sources")), "output_nr": INT, "inplace": BOOL, "activation": optional(TENSOR)},
            lambda at, **f: OpEntry(index=at, **f))
MODULE_CALL = Schema({"address": STR, "call": INT,
                      "parent": optional(ref("modules")), "op_start": upto("ops"), "op_end": optional(upto("ops")),
                      "output_shape": optional(SHAPE), "output_nr": INT, "output_tracked": BOOL},
                     lambda at, **f: ModuleCallEntry(index=at, **f))
PARAM = Schema({"name": STR, "shape": SHAPE, "dtype": DTYPE, "requires_grad": BOOL, "grad": optional(TENSOR)},
               lambda _at, grad, **f: ParamEntry(saved_grad=grad, **f),
               lambda p: {"name": p.name, "shape": p.shape, "dtype": p.dtype, "requires_grad": p.requires_grad,
                          "grad": _local(p.grad)})
INPUT = Schema({"name": STR, "shape": SHAPE, "dtype": DTYPE, "requires_grad": BOOL, "was_parameter": BOOL},
               lambda _at, **f: InputEntry(**f))
NODE = Schema({"label": STR, "type": STR, "sequence_nr": optional(INT), "op": optional(ref("ops")),
               "module_call": optional(ref("modules")), "module_source": optional(STR), "order": optional(INT),
               "is_custom": BOOL, "param": optional(STR), "source": optional(ref("sources"))},
              lambda at, **f: NodeEntry(index=at, **f))
CALL = Schema({"node": ref("grad_fns"), "pass_number": number("passes"), "ordinal": INT, "start_ns": optional(INT),
               "end_ns": INT, "hook_ns": INT, "wait_ns": INT, "grad_inputs": optional(SIDE),
               "grad_outputs": optional(SIDE),
               "flops": optional(INT), "recompute_flops": optional(INT)},
              lambda _at, **f: CallEntry(**f))
PASS = Schema({"number": INT, "trigger": STR, "call_site": optional(CALL_SITE), "retain_graph": optional(BOOL),
               "create_graph": BOOL, "policy": POLICY, "start_ns": INT, "status": STR, "error": optional(ERROR),
               "end_ns": optional(INT), "orders": list_of(INT), "order_coverage": FLOAT,
               "other_capture_nodes": INT, "edits": entries(EDIT)},
              _pass_entry)
COLLECTIVE = Schema({"pass_number": number("passes"), "kind": STR, "bytes": INT, "start_ns": INT,
                     "end_ns": optional(INT), "params": list_of(STR), "modules": list_of(STR)},
                    lambda _at, params, modules, **f: CollectiveEntry(params=tuple(params), modules=tuple(modules),
                                                                      **f))
CAPTURE = Schema({"inference_only": BOOL, "backward_requested": BOOL, "flops_enabled": BOOL,
                  "inference_cause": optional(STR), "rank": optional(INT), "world_size": optional(INT)},
                 lambda _at, **f: f)
SOURCES = Schema({"kinds": list_of(STR), "names": list_of(STR)},
                 lambda _at, **f: f,
                 lambda journal: {"kinds": journal.source_kinds, "names": journal.source_names})
SLOTS = Schema({"ops": list_of(row(ref("ops"), ref("grad_fns"))),
                "modules": list_of(row(ref("modules"), ref("grad_fns"))),
                "params": list_of(row(STR, ref("grad_fns"))),
                "inputs": list_of(row(ref("inputs"), ref("grad_fns"), INT)),
                "extra_input_grads": list_of(row(ref("inputs"), TENSOR, number("passes")))},
               lambda _at, **f: f,
               lambda fields: fields)
RECOMPUTE = Schema({"pass_number": number("passes"), "call": optional(ref("calls")),
                   "recompute_flops": optional(INT), "duration_ns": optional(INT)},
                  lambda _at, **f: RecomputeEntry(**f))
CHECKPOINT = Schema({"module_call": optional(ref("modules")), "op_start": upto("ops"), "op_end": upto("ops"),
                     "packed": optional(INT), "reentrant": BOOL, "recomputed": entries(RECOMPUTE)},
                    lambda _at, **f: CheckpointEntry(**f),
                    # a recomputation whose pass still runs has no call position yet: not written
                    lambda e: {"module_call": e.module_call, "op_start": e.op_start, "op_end": e.op_end,
                               "packed": e.packed, "reentrant": e.reentrant,
                               "recomputed": [r for r in e.recomputed if r.call_entry is None]})
CHECKPOINTS = Schema({"entries": entries(CHECKPOINT), "reasons": list_of(STR)},
                     lambda _at, **f: CheckpointJournal(**f))


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded (DTensor) gradient is saved as this rank's shard."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _read_module_types(value: Any, ctx: Any) -> dict[str, str]:
    _expect(isinstance(value, dict), "an object", value)
    return {address: STR.read(name, ctx) for address, name in value.items()}


# The sections of a manifest that hold the state, in the order they are written.
SECTIONS: dict[str, Kind] = {
    "capture": one(CAPTURE),
    "sources": one(SOURCES),
    "module_types": Kind(_plain, _read_module_types),
    "ops": entries(OP),
    "modules": entries(MODULE_CALL),
    "params": entries(PARAM),
    "inputs": entries(INPUT),
    "grad_fns": entries(NODE),
    "calls": entries(CALL),
    "passes": entries(PASS),
    "collectives": entries(COLLECTIVE),
    "grad_slots": one(SLOTS),
    "forward_edits": entries(EDIT),
    "cost": optional(COST),
    "checkpoints": optional(one(CHECKPOINTS)),
}


def encode_state(state: CaptureState, refs: Any) -> dict[str, Any]:
    """The manifest sections of ``state``; ``refs`` stores its tensors."""
    state.sync()
    journal, nodes = state.journal, state.nodes
    slots = state.grad_slots()
    values = {
        "capture": state,
        "sources": journal,
        "module_types": dict(journal.module_types),
        "ops": journal.ops,
        "modules": journal.module_calls,
        "params": state.params,
        "inputs": state.inputs,
        "grad_fns": nodes,
        "calls": state.calls,
        "passes": state.passes,
        "collectives": state.collectives,
        "grad_slots": {
            "ops": sorted(slots.op.items()),
            "modules": sorted(slots.module.items()),
            "params": list(slots.param.items()),
            "inputs": [(i, node, nr) for i, (node, nr) in sorted(slots.input.items())],
            "extra_input_grads": state.extra_input_grads,
        },
        "forward_edits": state.forward_edits,
        "cost": state.cost,
        "checkpoints": state.checkpoints,
    }
    return {name: kind.write(values[name], refs) for name, kind in SECTIONS.items()}


def decode_state(body: dict[str, Any], ctx: Any, store: Any) -> CaptureState:
    """A read-only state from a manifest's sections (``ValueError`` naming the first bad field)."""
    sections = {}
    for name, kind in SECTIONS.items():
        try:
            sections[name] = kind.read(body[name], ctx)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    state = CaptureState(store)
    for flag, value in sections["capture"].items():
        setattr(state, flag, value)
    sources = sections["sources"]
    _expect(len(sources["kinds"]) == len(sources["names"]), "one kind per source", sources)
    state.journal.restore(sections["ops"], sections["modules"], sections["module_types"],
                          sources["kinds"], sources["names"])
    state.table = NodeTable.restored(sections["grad_fns"])
    state.params, state.inputs = sections["params"], sections["inputs"]
    state.calls, state.passes = sections["calls"], sections["passes"]
    state.collectives = sections["collectives"]
    state.node_calls.extend([] for _ in state.table.types)
    for position, call in enumerate(state.calls):
        state.node_calls[call.node].append(position)
        state.passes[call.pass_number - 1].calls.append(position)
    slots = sections["grad_slots"]
    state.slots = GradSlots.restored(dict(slots["ops"]), dict(slots["modules"]), dict(slots["params"]),
                                     {i: (node, nr) for i, node, nr in slots["inputs"]}, len(state.table))
    state.extra_input_grads = list(slots["extra_input_grads"])
    state.forward_edits = sections["forward_edits"]
    state.cost = sections["cost"]
    state.checkpoints = sections["checkpoints"]
    return state
