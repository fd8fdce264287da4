"""Bundle format version 3: a capture state as JSON, one explicit field list per entry type.

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
from backlens.capture.memory import STORAGE_KINDS, MemoryJournal
from backlens.capture.policy import GradPolicy
from backlens.capture.slots import GradSlots
from backlens.capture.state import (
    CallEntry,
    CaptureState,
    CollectiveEntry,
    EditApplication,
    InputEntry,
    ParamEntry,
    PassEntry,
)
from backlens.cost.checkpoints import CheckpointEntry, CheckpointJournal, RecomputeEntry
from backlens.cost.journal import FORMAT_VERSION as COST_FORMAT_VERSION
from backlens.cost.journal import CostJournal
from backlens.graph.engine import CallSite
from backlens.graph.table import NodeEntry, NodeTable
from backlens.io.files import is_plain_name
from backlens.io.shards import DTYPES as SHARD_DTYPES
from backlens.io.shards import TensorEntry
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


BOOL = _typed(bool, "true or false")
STR = _typed(str, "a string")
_INT64_MAX = 2**63 - 1


def natural(low: int = 0) -> Kind:
    """An integer from ``low`` up (never negative: a negative position would count from the end)."""
    def read(value: Any, _ctx: Any) -> int:
        _expect(type(value) is int and low <= value <= _INT64_MAX, f"an integer >= {low}", value)
        return value

    return Kind(_plain, read)


NAT = natural(0)
POSITIVE = natural(1)


def one_of(*values: str) -> Kind:
    """A string from a closed set."""
    def read(value: Any, _ctx: Any) -> str:
        _expect(type(value) is str and value in values, f"one of {', '.join(values)}", value)
        return value

    return Kind(_plain, read)


def optional(kind: Kind) -> Kind:
    return Kind(lambda v, refs: None if v is None else kind.write(v, refs),
                lambda v, ctx: None if v is None else kind.read(v, ctx))


def list_of(kind: Kind, most: int | None = None) -> Kind:
    def read(value: Any, ctx: Any) -> list:
        _expect(isinstance(value, list) and (most is None or len(value) <= most),
                "a list" if most is None else f"a list of at most {most}", value)
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


def _write_float(value: float, _refs: Any) -> Any:
    return value if math.isfinite(value) else repr(float(value))


def _read_fraction(value: Any, ctx: Any) -> float:
    fraction = _read_float(value, ctx)
    _expect(0.0 <= fraction <= 1.0, "a fraction from 0 to 1", value)
    return fraction


FLOAT = Kind(_write_float, _read_float)
FRACTION = Kind(_write_float, _read_fraction)
MAX_DIMS = 64
# A shape whose sizes multiply past this (zeros counted as ones: torch's strides are products of the
# later sizes even in an empty tensor) overflows torch's 64-bit sizes and strides.
MAX_SHAPE_PRODUCT = 2**62


def _read_shape(value: Any, ctx: Any) -> tuple[int, ...]:
    shape = tuple(list_of(NAT, MAX_DIMS).read(value, ctx))
    _expect(math.prod(max(size, 1) for size in shape) <= MAX_SHAPE_PRODUCT,
            "a shape whose sizes multiply to at most 2**62", value)
    return shape


SHAPE = Kind(lambda v, refs: list(v), _read_shape)

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _read_dtype(value: Any, _ctx: Any) -> torch.dtype:
    _expect(type(value) is str and value in _DTYPES, "a torch dtype name", value)
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
                 lambda v, ctx: CallSite(*row(STR, NAT, STR).read(v, ctx)))


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
    _expect(isinstance(spec, dict), "a selector object", spec)
    selector = selector_from_json(spec)  # selectors are rebuilt from a closed set of kinds
    if isinstance(selector, _Opaque) and text.startswith("save_grads="):
        selector = _Opaque(text[len("save_grads="):])
    return GradPolicy(selector)


POLICY = Kind(_write_policy, _read_policy)


def one_of_int(*values: int) -> Kind:
    """An integer from a closed set (a format version)."""
    def read(value: Any, _ctx: Any) -> int:
        _expect(type(value) is int and value in values, f"one of {values}", value)
        return value

    return Kind(_plain, read)


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
            unknown, missing = sorted(set(data) - set(self.fields))[:10], sorted(set(self.fields) - set(data))
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


def _op_entry(position: int, **fields: Any) -> OpEntry:
    # An op's inputs were made before it: a parent at or after it would be a cycle.
    _expect(all(parent < position for parent in fields["parents"]), f"parents before op {position}",
            fields["parents"])
    _ordered_times(fields)
    return OpEntry(index=position, **fields)


def _ordered_times(fields: dict[str, Any]) -> None:
    start, end = fields["start_ns"], fields["end_ns"]
    _expect((start is None) == (end is None) and (start is None or start <= end),
            f"end_ns >= start_ns ({start}), both set or both null", end)


def _module_call_entry(position: int, **fields: Any) -> ModuleCallEntry:
    parent, start, end = fields["parent"], fields["op_start"], fields["op_end"]
    _expect(parent is None or parent < position, f"a parent call before call {position}", parent)
    _expect(end is None or start <= end, f"op_end >= op_start ({start})", end)
    _ordered_times(fields)
    return ModuleCallEntry(index=position, **fields)


def _collective_entry(_position: int, params: list, modules: list, **fields: Any) -> CollectiveEntry:
    start, end = fields["start_ns"], fields["end_ns"]
    _expect(end is None or start <= end, f"end_ns >= start_ns ({start})", end)
    return CollectiveEntry(params=tuple(params), modules=tuple(modules), **fields)


def _capture_flags(_position: int, **fields: Any) -> dict[str, Any]:
    rank, world_size = fields["rank"], fields["world_size"]
    _expect((rank is None) == (world_size is None), "rank and world_size both set or both null", [rank, world_size])
    _expect(rank is None or rank < world_size, f"a rank below world_size ({world_size})", rank)
    return fields


def _checkpoint_entry(_position: int, **fields: Any) -> CheckpointEntry:
    start, end = fields["op_start"], fields["op_end"]
    _expect(start <= end, f"op_end >= op_start ({start})", end)
    _expect((fields["packed"] is None) == fields["reentrant"], "packed null exactly for a reentrant checkpoint",
            fields["packed"])
    return CheckpointEntry(**fields)


PASS_STATUSES = ("running", "ok", "failed", "recording_failed")
SOURCE_KINDS = ("input", "param", "buffer")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")

EDIT = Schema({"site": STR, "edit": STR, "op": optional(STR), "module": optional(STR),
               "pass_number": optional(number("passes")), "norm_before": FLOAT, "norm_after": FLOAT},
              lambda _at, **f: EditApplication(**f))
OP = Schema({"name": STR, "label": STR, "module_call": optional(ref("modules")), "shape": optional(SHAPE),
             "dtype": optional(DTYPE), "num_outputs": NAT, "parents": list_of(ref("ops")),
             "sources": list_of(ref("sources")), "output_nr": NAT, "inplace": BOOL, "activation": optional(TENSOR),
             "start_ns": optional(NAT), "end_ns": optional(NAT), "call_site": optional(CALL_SITE)},
            _op_entry)
MODULE_CALL = Schema({"address": STR, "call": POSITIVE,
                      "parent": optional(ref("modules")), "op_start": upto("ops"), "op_end": optional(upto("ops")),
                      "output_shape": optional(SHAPE), "output_nr": NAT, "output_tracked": BOOL,
                      "start_ns": optional(NAT), "end_ns": optional(NAT)},
                     _module_call_entry)
PARAM = Schema({"name": STR, "shape": SHAPE, "dtype": DTYPE, "requires_grad": BOOL, "grad": optional(TENSOR)},
               lambda _at, grad, **f: ParamEntry(saved_grad=grad, **f),
               lambda p: {"name": p.name, "shape": p.shape, "dtype": p.dtype, "requires_grad": p.requires_grad,
                          "grad": _local(p.grad)})
INPUT = Schema({"name": STR, "shape": SHAPE, "dtype": DTYPE, "requires_grad": BOOL, "was_parameter": BOOL},
               lambda _at, **f: InputEntry(**f))
NODE = Schema({"label": STR, "type": STR, "sequence_nr": optional(NAT), "op": optional(ref("ops")),
               "module_call": optional(ref("modules")), "module_source": optional(one_of("paired", "inferred")),
               "order": optional(POSITIVE), "is_custom": BOOL, "param": optional(STR),
               "source": optional(ref("sources"))},
              lambda at, **f: NodeEntry(index=at, **f))
CALL = Schema({"node": ref("grad_fns"), "pass_number": number("passes"), "ordinal": POSITIVE,
               "start_ns": optional(NAT), "end_ns": NAT, "hook_ns": NAT, "wait_ns": NAT,
               "grad_inputs": optional(SIDE), "grad_outputs": optional(SIDE), "flops": optional(NAT),
               "recompute_flops": optional(NAT)},
              lambda _at, **f: CallEntry(**f))
PASS = Schema({"number": POSITIVE, "trigger": STR, "call_site": optional(CALL_SITE), "retain_graph": optional(BOOL),
               "create_graph": BOOL, "policy": POLICY, "start_ns": NAT, "clock_offset_ns": optional(NAT),
               "status": one_of(*PASS_STATUSES),
               "error": optional(ERROR), "end_ns": optional(NAT), "orders": list_of(POSITIVE),
               "order_coverage": FRACTION, "other_capture_nodes": NAT, "edits": entries(EDIT)},
              _pass_entry)
COLLECTIVE = Schema({"pass_number": number("passes"), "kind": one_of(*COLLECTIVE_KINDS), "bytes": NAT,
                     "start_ns": NAT, "end_ns": optional(NAT), "params": list_of(STR), "modules": list_of(STR)},
                    _collective_entry)
# More ranks than any run has had: a bound checked before anything is built per rank.
MAX_WORLD_SIZE = 1 << 20


def _world_size(value: Any, _ctx: Any) -> int:
    _expect(type(value) is int and 1 <= value <= MAX_WORLD_SIZE, f"a world size from 1 to {MAX_WORLD_SIZE}", value)
    return value


CAPTURE = Schema({"inference_only": BOOL, "backward_requested": BOOL, "flops_enabled": BOOL,
                  "inference_cause": optional(STR), "rank": optional(NAT),
                  "world_size": optional(Kind(_plain, _world_size)),
                  "forward_clock_offset_ns": optional(NAT)},
                 _capture_flags)
SOURCES = Schema({"kinds": list_of(one_of(*SOURCE_KINDS)), "names": list_of(STR)},
                 lambda _at, **f: f,
                 lambda journal: {"kinds": journal.source_kinds, "names": journal.source_names})
SLOTS = Schema({"ops": list_of(row(ref("ops"), ref("grad_fns"))),
                "modules": list_of(row(ref("modules"), ref("grad_fns"))),
                "params": list_of(row(STR, ref("grad_fns"))),
                "inputs": list_of(row(ref("inputs"), ref("grad_fns"), NAT)),
                "extra_input_grads": list_of(row(ref("inputs"), TENSOR, number("passes")))},
               lambda _at, **f: f,
               lambda fields: fields)
RECOMPUTE = Schema({"pass_number": number("passes"), "call": optional(ref("calls")),
                   "recompute_flops": optional(NAT), "duration_ns": optional(NAT)},
                  lambda _at, **f: RecomputeEntry(**f))
CHECKPOINT = Schema({"module_call": optional(ref("modules")), "op_start": upto("ops"), "op_end": upto("ops"),
                     "packed": optional(NAT), "reentrant": BOOL, "recomputed": entries(RECOMPUTE)},
                    _checkpoint_entry,
                    # a recomputation whose pass still runs has no call position yet: not written
                    lambda e: {"module_call": e.module_call, "op_start": e.op_start, "op_end": e.op_end,
                               "packed": e.packed, "reentrant": e.reentrant,
                               "recomputed": [r for r in e.recomputed if r.call_entry is None]})
CHECKPOINTS = Schema({"entries": entries(CHECKPOINT), "reasons": list_of(STR)},
                     lambda _at, **f: CheckpointJournal(**f))


def _memory_journal(_position: int, storages: list, saves: list, releases: list, fires: list,
                    pass_end_allocator: list, module_inputs: list, module_forward_ns: list,
                    reasons: list) -> MemoryJournal:
    count = len(storages)
    _expect(all(s < count for save in saves for s in save[:1]), f"saves naming storages below {count}", saves)
    _expect(all(s < count for _call, found in module_inputs for s in found),
            f"module inputs naming storages below {count}", module_inputs)
    _expect(all(s < count for fire in fires for s, _start, _until in fire[1]),
            f"fires naming storages below {count}", fires)
    released = [release[0] for release in releases]
    _expect(all(save < len(saves) for save in released), f"releases naming saves below {len(saves)}", releases)
    _expect(len(set(released)) == len(released), "each save released at most once", releases)
    _expect(all(save[4] is None or save[3] for save in saves), "a recomputing call only on a recomputed save",
            saves)
    journal = MemoryJournal()
    for nbytes, kind in storages:
        journal.add_storage(nbytes, kind)
    for storage, op, call, recomputed, recomputed_by in saves:
        journal.add_save(storage, op, call, recomputed)
        journal.saved_recomputed_by[-1] = recomputed_by
    journal.releases = [tuple(release) for release in releases]
    journal.fires = [(call, tuple(tuple(hold) for hold in holds), added, allocated)
                     for call, holds, added, allocated in fires]
    journal.pass_end_allocator = dict(pass_end_allocator)
    journal.module_inputs = {call: tuple(found) for call, found in module_inputs}
    journal.module_forward_ns = dict(module_forward_ns)
    journal.reasons = list(reasons)
    return journal


def _memory_values(journal: MemoryJournal) -> dict[str, Any]:
    return {
        "storages": list(zip(journal.storage_bytes, journal.storage_kinds)),
        "saves": list(zip(journal.saved_storage, journal.saved_op, journal.saved_call, journal.saved_recomputed,
                          journal.saved_recomputed_by)),
        "releases": list(journal.releases),
        "fires": list(journal.fires),
        "pass_end_allocator": sorted(journal.pass_end_allocator.items()),
        "module_inputs": sorted(journal.module_inputs.items()),
        "module_forward_ns": sorted(journal.module_forward_ns.items()),
        "reasons": list(journal.reasons),
    }


# What a memory=True capture recorded (capture/memory.py): storages, saves, releases, fires.
MEMORY = Schema({"storages": list_of(row(NAT, one_of(*STORAGE_KINDS))),
                 "saves": list_of(row(NAT, optional(ref("ops")), optional(ref("modules")), BOOL,
                                      optional(ref("calls")))),
                 "releases": list_of(row(NAT, optional(number("passes")), optional(ref("calls")), NAT)),
                 "fires": list_of(row(ref("calls"), list_of(row(NAT, optional(ref("calls")), optional(ref("calls")))),
                                      NAT, optional(NAT))),
                 "pass_end_allocator": list_of(row(number("passes"), NAT)),
                 "module_inputs": list_of(row(ref("modules"), list_of(NAT))),
                 "module_forward_ns": list_of(row(ref("modules"), NAT)),
                 "reasons": list_of(STR)},
                _memory_journal, _memory_values)


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded (DTensor) gradient is saved as this rank's shard."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


# The cost journal (cost/journal.py): plain data, read back field by field.
FORWARD_FAILURE = Schema({"op_index": ref("ops"), "func": STR, "error": STR}, lambda _at, **f: f)
FORWARD_COST = Schema({"op_flops": list_of(optional(NAT)), "replay_failures": entries(FORWARD_FAILURE)},
                      lambda _at, **f: f)
UNATTRIBUTED_OP = Schema({"op": STR, "under": optional(STR), "calls": NAT, "flops": NAT}, lambda _at, **f: f)


def _aten_columns(_position: int, **columns: Any) -> dict[str, list]:
    calls = len(columns["op"])
    _expect(all(len(column) == calls for name, column in columns.items() if name != "names" and column is not None),
            f"op, call, flops, grad_enabled, start_ns and end_ns of one length ({calls})",
            {k: len(v) if v is not None else None for k, v in columns.items()})
    starts, ends = columns["start_ns"], columns["end_ns"]
    _expect((starts is None) == (ends is None) and (starts is None or all(a <= b for a, b in zip(starts, ends))),
            "start_ns and end_ns both null, or each start at or before its end", [starts, ends])
    names = len(columns["names"])
    _expect(all(op < names for op in columns["op"]), f"op indices into names (0..{names - 1})", columns["op"])
    return columns


# A pass's ATen calls, as columns (cost/aten_ops.py).
ATEN_OPS = Schema({"names": list_of(STR), "op": list_of(NAT), "call": list_of(optional(ref("calls"))),
                   "flops": list_of(NAT), "grad_enabled": list_of(BOOL),
                   "start_ns": optional(list_of(NAT)), "end_ns": optional(list_of(NAT))},
                  _aten_columns)


def _pass_cost(_position: int, **fields: Any) -> dict[str, Any]:
    aten_ops, aten_calls = fields["aten_ops"], fields["aten_calls"]
    _expect(aten_ops is None or aten_calls == len(aten_ops["op"]), "aten_calls equal to the ATen calls listed",
            aten_calls)
    return fields


PASS_COST = Schema({"pass": number("passes"), "counted": BOOL, "reason": optional(STR),
                    "executed_flops": optional(NAT), "unattributed_flops": optional(NAT),
                    "unattributed_ops": entries(UNATTRIBUTED_OP), "recompute_known": BOOL,
                    "recompute_flops": optional(NAT), "attributed": BOOL, "aten_calls": optional(NAT),
                    "aten_ops": optional(one(ATEN_OPS))},
                   _pass_cost)
COST_JOURNAL = Schema({"version": one_of_int(COST_FORMAT_VERSION), "forward": optional(one(FORWARD_COST)),
                       "passes": entries(PASS_COST)},
                      lambda _at, **f: f)


def _read_cost(value: Any, ctx: Any) -> CostJournal:
    return CostJournal.from_dict(COST_JOURNAL.read(value, ctx))


COST = Kind(lambda v, refs: v.to_dict(), _read_cost)


# The tensor index (the manifest's "tensors" section, io/shards.py): every shard file and every tensor.
def _read_hex64(value: Any, _ctx: Any) -> str:
    _expect(type(value) is str and len(value) == 64 and all(c in "0123456789abcdef" for c in value),
            "a sha256 (64 lowercase hex digits)", value)
    return value


def _read_shard_name(value: Any, _ctx: Any) -> str:
    _expect(is_plain_name(value) and value.endswith(".safetensors"),
            "a shard file name in the bundle directory (name.safetensors)", value)
    return value


def _tensor_entry(_position: int, offsets: tuple, **fields: Any) -> TensorEntry:
    _expect(offsets[0] <= offsets[1], "offsets [begin, end] with begin <= end", list(offsets))
    return TensorEntry(offsets=list(offsets), shape=list(fields.pop("shape")), **fields)


SHA256 = Kind(_plain, _read_hex64)
SHARD_NAME = Kind(_plain, _read_shard_name)
SHARD_FILE = Schema({"bytes": NAT, "sha256": SHA256}, lambda _at, **f: f)
TENSOR_ENTRY = Schema({"file": SHARD_NAME, "dtype": one_of(*SHARD_DTYPES), "shape": SHAPE,
                       "offsets": row(NAT, NAT), "sha256": SHA256},
                      _tensor_entry)


def mapping_of(kind: Kind) -> Kind:
    """An object whose values are of one kind (keys are the names)."""
    def read(value: Any, ctx: Any) -> dict[str, Any]:
        _expect(isinstance(value, dict), "an object", value)
        out = {}
        for key, item in value.items():
            try:
                out[key] = kind.read(item, ctx)
            except ValueError as exc:
                raise ValueError(f"[{key[:80]!r}] {exc}") from None
        return out

    return Kind(_plain, read)


TENSOR_SECTION = Schema({"files": mapping_of(one(SHARD_FILE)), "index": mapping_of(one(TENSOR_ENTRY))},
                        lambda _at, **f: f)


def read_tensor_section(value: Any) -> tuple[dict[str, dict[str, Any]], dict[str, TensorEntry]]:
    """The shard files (name -> bytes, sha256) and tensor entries of a manifest's ``tensors``
    section; ValueError naming the first bad field, or a tensor in a file not listed."""
    try:
        section = TENSOR_SECTION.read(value, None)
    except ValueError as exc:
        raise ValueError(f"tensors: {exc}") from None
    for name in section["files"]:
        try:
            _read_shard_name(name, None)
        except ValueError as exc:
            raise ValueError(f"tensors: files: {exc}") from None
    for name, entry in section["index"].items():
        _expect(entry.file in section["files"], f"tensors: index[{name[:80]!r}]: a file listed in tensors.files",
                entry.file)
    return section["files"], section["index"]


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
    "memory": optional(one(MEMORY)),
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
        "memory": state.memory,
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
    state.memory = sections["memory"]
    _check_calls_in_their_passes(state)
    return state


def _check_calls_in_their_passes(state: CaptureState) -> None:
    """A node call named by a pass's ATen census or a recomputation is a call of that pass."""
    calls = state.calls

    def check(where: str, number: int, positions: Any) -> None:
        for position in positions:
            if position is not None and calls[position].pass_number != number:
                raise ValueError(f"{where}: call {position} is a call of pass {calls[position].pass_number}, "
                                 f"not of pass {number}")

    for at, pass_cost in enumerate(state.cost.passes if state.cost is not None else ()):
        if pass_cost["aten_ops"] is not None:
            check(f"cost: passes: [{at}] aten_ops: call", pass_cost["pass"], pass_cost["aten_ops"]["call"])
    for at, entry in enumerate(state.checkpoints.entries if state.checkpoints is not None else ()):
        for recompute in entry.recomputed:
            check(f"checkpoints: entries: [{at}] recomputed", recompute.pass_number, [recompute.call])
    memory = state.memory
    if memory is not None:
        for at, (_save, number, position, _started) in enumerate(memory.releases):
            if number is not None:
                check(f"memory: releases: [{at}]", number, [position])
            elif position is not None:
                raise ValueError(f"memory: releases: [{at}]: a call position without its pass")
