"""``bl.report.timeline(cap)``: the forward and the backward as a timeline of slices.

Backward. One slice per timed node call (named by its call label), nested in
one slice per module call it belongs to (following module nesting: ``encoder``
> ``encoder.layer.0`` > ``encoder.layer.0.attention`` ...) and in one slice per
pass (``"pass k"``). Each ATen call a counted pass dispatched is a slice inside
its node call's (kind ``"aten"``; calls under no node sit in the pass).

Forward (the whole timeline, not one pass): one ``"forward"`` slice, one per
module call (kind ``"forward_module"``, named by call label) and one per op
(kind ``"forward_op"``, named by op label, with its call site), on a track of
their own; a flow arrow leads from each forward op to every call of the node
paired with it.

Clock. Times are those of torch.profiler: nanoseconds since the Unix epoch
(``Timeline.origin_ns`` is the time of the timeline's 0, and the Trace Event
file states it as ``baseTimeNanoseconds``, as torch.profiler's own files do).
``timeline(cap, profiler=prof)`` puts a finished ``torch.profiler.profile`` of
the same step (or the trace file it exported) in the same file, its events
moved onto the same base, so one viewer shows both aligned. A capture saved by
an older backlens did not record its clock: its passes are laid end to end
from 0, without the forward, and cannot be merged.

``.save(path)`` writes the Trace Event format (JSON) that Perfetto and
``chrome://tracing`` open; the HTML report draws the module slices of one pass
as a Gantt view. Times inside the timeline are integer nanoseconds from its
origin, so a parent slice contains its children exactly. A module slice spans
its nodes' fires from the first start to the last end. Where the engine leaves
a module call and comes back to it (sibling branches interleaved), the call has
one slice per stretch, each with ``args["stretch"] = "i/n"``. Fires that
overlap in time (an engine running nodes on several threads) go on separate
tracks.

Collectives (``pass_.collectives``, under ``torch.distributed``) are slices of
their own (kind ``"collective"``, named by their label, ``all_reduce_1:1``),
from their issue to their completion, on tracks of their own
(``COLLECTIVE_TRACK`` and up: they run beside the nodes, and overlapping ones
each get a track).

Counter tracks (Trace Event ``"C"`` events: a value sampled over time, such as
the memory a pass holds) are ``Timeline.counters``; a report that samples one
appends its :class:`CounterSample` list in :func:`timeline`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backlens import _args
from backlens._output import write_text
from backlens._pandas import data_frame
from backlens.errors import UnsupportedInputError
from backlens.graph.labels import ROOT_NAME
from backlens.report.memory_view import COUNTER_NAME, memory_counter_events
from backlens.report.profiler_trace import ProfilerTrace, read_profiler_trace

COLLECTIVE_TRACK = 101  # the first track of collectives; node tracks count from 1
FORWARD_TRACK = 100  # shown first
_PID = 1
FLOW_NAME = "forward op -> backward"


@dataclass(frozen=True)
class Slice:
    """One bar of the timeline; ``kind`` is ``"pass"``, ``"module"``, ``"node"``, ``"aten"``,
    ``"collective"``, ``"forward"``, ``"forward_module"`` or ``"forward_op"``.

    ``start_ns`` and ``duration_ns`` count from the timeline's origin
    (``Timeline.origin_ns``). ``pass_number`` is None for the forward. ``depth`` is 0
    for a pass (and the forward), then one per level; ``track`` numbers lanes.
    """

    name: str
    kind: str
    pass_number: int | None
    start_ns: int
    duration_ns: int
    depth: int
    track: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def start(self) -> float:
        """Seconds from the timeline's origin."""
        return self.start_ns / 1e9

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.duration_ns / 1e9

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    def event(self, shift_ns: int = 0, pid: int = _PID) -> dict[str, Any]:
        """This slice as a Trace Event format complete event (microseconds from the
        file's base, ``shift_ns`` after it at the timeline's origin)."""
        return {
            "name": self.name, "cat": self.kind, "ph": "X", "ts": (shift_ns + self.start_ns) / 1e3,
            "dur": self.duration_ns / 1e3, "pid": pid, "tid": self.track, "args": self.args,
        }


@dataclass(frozen=True)
class Flow:
    """An arrow from a forward op's slice to one call of the node paired with it: it leaves
    at ``from_ns`` on ``from_track`` and arrives at ``to_ns`` on ``to_track``, each a time
    inside that slice (and inside none of its children)."""

    id: int
    op: str
    call: str
    from_ns: int
    from_track: int
    to_ns: int
    to_track: int


@dataclass(frozen=True)
class CounterSample:
    """One sample of a counter track: at ``at_ns`` (from the origin), ``values`` (series
    name -> number) of the counter ``name``."""

    name: str
    at_ns: int
    values: dict[str, float]


@dataclass
class Timeline:
    """The slices of the forward and every timed pass (see the module docstring).

    ``untimed_calls`` counts node calls without timing (a ``timing=False``
    capture); ``reason`` says why the timeline is empty when it is.
    ``origin_ns``: torch.profiler's clock at the timeline's 0 (None: not known).
    """

    slices: list[Slice]
    passes: list[int]
    untimed_calls: int = 0
    reason: str | None = None
    origin_ns: int | None = None
    flows: list[Flow] = field(default_factory=list)
    counters: list[CounterSample] = field(default_factory=list)
    profiler: ProfilerTrace | None = None

    def __iter__(self):
        return iter(self.slices)

    def __len__(self) -> int:
        return len(self.slices)

    def for_pass(self, number: int) -> list[Slice]:
        return [s for s in self.slices if s.pass_number == number]

    def to_trace(self) -> dict[str, Any]:
        """The Trace Event format object: ``{"traceEvents": [...], ...}``."""
        profiler = self.profiler
        base = self.origin_ns
        if profiler is not None and base is not None:
            earliest = profiler.earliest_ns()
            if earliest is not None:
                base = min(base, earliest)
        if base is not None:
            base -= base % 1000  # a whole microsecond: the profiler's times stay exact after the move
        shift = self.origin_ns - base if base is not None and self.origin_ns is not None else 0
        pid = _PID
        if profiler is not None:
            taken = profiler.pids()
            while pid in taken:
                pid += 1
        tracks = sorted({s.track for s in self.slices}) or [1]
        metadata: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "backlens"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": -1}},
        ]
        for track in tracks:
            metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": track,
                             "args": {"name": _track_name(track)}})
            metadata.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": track,
                             "args": {"sort_index": 0 if track == FORWARD_TRACK else track}})
        events = metadata + [s.event(shift, pid) for s in self.slices]
        for flow in self.flows:
            common = {"name": FLOW_NAME, "cat": "backlens_flow", "id": flow.id, "pid": pid}
            events.append({**common, "ph": "s", "ts": (shift + flow.from_ns) / 1e3, "tid": flow.from_track,
                           "args": {"op": flow.op}})
            events.append({**common, "ph": "f", "bp": "e", "ts": (shift + flow.to_ns) / 1e3,
                           "tid": flow.to_track, "args": {"call": flow.call}})
        for sample in self.counters:
            events.append({"name": sample.name, "ph": "C", "ts": (shift + sample.at_ns) / 1e3, "pid": pid,
                           "tid": 0, "args": dict(sample.values)})
        other: dict[str, Any] = {"producer": "backlens", "passes": list(self.passes),
                                 "untimed_calls": self.untimed_calls}
        if self.reason:
            other["reason"] = self.reason
        document: dict[str, Any] = {}
        if profiler is not None:
            move = (profiler.base_ns - base) / 1e3 if base is not None else 0.0
            document.update(profiler.other)
            events += [dict(e, ts=e["ts"] + move) if isinstance(e.get("ts"), (int, float)) else e
                       for e in profiler.events]
            other["profiler"] = "torch.profiler trace merged (its events keep their own processes)"
        document.update({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other})
        if base is not None:
            document["baseTimeNanoseconds"] = base
        return document

    def save(self, path: str) -> str:
        """Write the Trace Event format JSON to ``path``; returns ``path``."""
        _args.path(path, "path", "Timeline.save", "timeline.save('backward.json')")
        return write_text(path, json.dumps(self.to_trace()), "Timeline.save")

    def to_pandas(self):
        """One row per slice: name, kind, pass, start and duration (seconds), depth, track, args."""
        columns = ["name", "kind", "pass_number", "start", "duration", "depth", "track", "args"]
        return data_frame([[s.name, s.kind, s.pass_number, s.start, s.duration, s.depth, s.track, s.args]
                             for s in self.slices], columns=columns)

    def module_bars(self, number: int, max_depth: int | None = None) -> list[tuple[str, int, list[Slice]]]:
        """Pass ``number``'s module slices grouped per module call, in order of first
        appearance: ``(call label, depth, slices)``; depth 0 is the model."""
        rows: dict[str, tuple[int, list[Slice]]] = {}
        for piece in self.for_pass(number):
            if piece.kind != "module" or (max_depth is not None and piece.depth - 1 > max_depth):
                continue
            label = piece.args["module_call"]
            rows.setdefault(label, (piece.depth - 1, []))[1].append(piece)
        return [(label, depth, pieces) for label, (depth, pieces) in rows.items()]


def _track_name(track: int) -> str:
    if track == FORWARD_TRACK:
        return "forward"
    if track >= COLLECTIVE_TRACK:
        lane = track - COLLECTIVE_TRACK + 1
        return "collectives" if lane == 1 else f"collectives (overlapping {lane})"
    return "backward" if track == 1 else f"backward (concurrent fires {track})"


def timeline(cap: Any, pass_: int | None = None, profiler: Any = None) -> Timeline:
    """The forward and backward of ``cap`` (or pass ``pass_`` alone) as a :class:`Timeline`;
    ``profiler``: a finished ``torch.profiler.profile`` of the same step, or the path of
    the trace it exported, to merge (see the module docstring)."""
    _args.capture(cap, "bl.report.timeline(cap)", needs=("passes",))
    passes = list(cap.passes) if pass_ is None else [cap.passes.for_pass(pass_)]
    clock = _Clock.of(cap)
    merged = read_profiler_trace(profiler) if profiler is not None and clock is not None else None
    forward = _forward_parts(clock) if pass_ is None and clock is not None else None
    starts = [clock.pass_start(p.number) for p in passes] if clock is not None else []
    origin = min([*starts, *([forward.start] if forward is not None else [])], default=None)
    chain_of = _module_chains(cap)
    slices: list[Slice] = []
    untimed = 0
    laid_end = 0  # without a clock: passes end to end from 0
    numbers = []
    for position, backward_pass in enumerate(passes):
        calls = list(backward_pass.calls)
        timed = [c for c in calls if c.start is not None and c.duration is not None]
        untimed += len(calls) - len(timed)
        # (a pass record without collectives: a stand-in from a test or another tool)
        collectives = [c for c in getattr(backward_pass, "collectives", ()) if c.duration is not None]
        end = max((_ns(c.start) + _ns(c.duration) for c in [*timed, *collectives]), default=0)
        span = max(end, _ns(backward_pass.duration) if backward_pass.duration is not None else 0)
        if not timed and backward_pass.duration is None:
            continue
        at = starts[position] - origin if clock is not None else laid_end
        numbers.append(backward_pass.number)
        slices.append(Slice(f"pass {backward_pass.number}", "pass", backward_pass.number, at, span, 0, 1, {
            "pass": backward_pass.number,
            "trigger": backward_pass.trigger,
            "call_site": str(backward_pass.call_site) if backward_pass.call_site is not None else None,
            "status": backward_pass.status,
            "node_calls": len(calls),
            "fire_time_us": sum(_ns(c.duration) for c in timed) / 1e3,
            "collectives": len(collectives),
        }))
        nodes = _pass_slices(backward_pass.number, timed, at, chain_of)
        slices += nodes
        slices += _aten_slices(backward_pass, nodes, at, span)
        slices += _collective_slices(backward_pass.number, collectives, at)
        laid_end += span
    flows: list[Flow] = []
    if forward is not None:
        slices = forward.slices(origin) + slices
        flows = _flows(slices)
    # Counter tracks: values sampled over time (the memory a pass holds).
    counters = [CounterSample(COUNTER_NAME, at, values) for at, values in memory_counter_events(cap, slices)]
    if profiler is not None and clock is None:
        raise UnsupportedInputError(
            "This capture did not record its clock (a bundle saved by an older backlens), so its "
            "timeline cannot be laid beside a torch.profiler trace.", code="timeline_without_clock",
            remedy="Capture the step again with this backlens, inside the profiler.")
    reason = None
    if not any(s.kind == "pass" for s in slices):
        reason = ("no backward pass has run over this capture" if not passes
                  else "no node call was timed (capture with timing=True)")
    return Timeline(slices, numbers, untimed, reason, origin if clock is not None else None, flows, counters,
                    merged)


class _Clock:
    """Where a capture's passes began on torch.profiler's clock (None: not recorded)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    @classmethod
    def of(cls, cap: Any) -> _Clock | None:
        state = getattr(cap, "_state", None)  # (a stand-in capture from a test or another tool has none)
        if state is None or any(p.clock_offset_ns is None for p in state.passes):
            return None
        return cls(state)

    def pass_start(self, number: int) -> int:
        entry = self.state.passes[number - 1]
        return entry.start_ns + entry.clock_offset_ns


@dataclass
class _Forward:
    """The forward's module calls and ops on torch.profiler's clock (absolute nanoseconds)."""

    start: int
    end: int
    modules: list[tuple[int, int, int, str, dict[str, Any]]]  # (start, end, depth, name, args)
    ops: list[tuple[int, int, int, str, dict[str, Any]]]

    def slices(self, origin: int) -> list[Slice]:
        out = [Slice("forward", "forward", None, self.start - origin, self.end - self.start, 0, FORWARD_TRACK,
                     {"module_calls": len(self.modules), "ops": len(self.ops)})]
        for kind, rows in (("forward_module", self.modules), ("forward_op", self.ops)):
            out += [Slice(name, kind, None, start - origin, end - start, depth, FORWARD_TRACK, args)
                    for start, end, depth, name, args in rows]
        return out


def _forward_parts(clock: _Clock) -> _Forward | None:
    """The forward's slices, when the capture recorded when its module calls and ops ran."""
    state = clock.state
    offset = state.forward_clock_offset_ns
    journal = state.journal
    calls = journal.module_calls
    if offset is None or not calls or any(c.start_ns is None for c in calls):
        return None
    depth_of: list[int] = []
    modules = []
    for call in calls:
        depth = depth_of[call.parent] + 1 if call.parent is not None else 1
        depth_of.append(depth)
        label = journal.call_label(call.index)
        modules.append((call.start_ns + offset, call.end_ns + offset, depth, label or ROOT_NAME,
                        {"module_call": label, "type": journal.module_types.get(call.address)}))
    ops = []
    cost = state.cost
    for op in journal.ops:
        if op.start_ns is None:
            continue
        depth = depth_of[op.module_call] + 1 if op.module_call is not None else 1
        site = op.call_site
        ops.append((op.start_ns + offset, op.end_ns + offset, depth, op.label, {
            "func": op.name,
            "module": journal.call_label(op.module_call),
            "call_site": f"{site.file}:{site.line} ({site.function})" if site is not None else None,
            "forward_flops": cost.op_flops(op.index) if cost is not None else None,
        }))
    start = min(m[0] for m in modules)
    end = max(m[1] for m in modules)
    return _Forward(start, end, modules, ops)


def _aten_slices(backward_pass: Any, nodes: list[Slice], at: int, span: int) -> list[Slice]:
    """A counted pass's ATen calls, each inside its node call's slice (calls under no
    recorded node call: in the pass). Times are clamped into the slice they belong to."""
    aten = getattr(backward_pass, "aten_ops", None)
    parent_of = {s.name: s for s in nodes if s.kind == "node"}
    if not aten or not parent_of:
        return []  # (untimed node calls: no slice to hold their ATen calls)
    out = []
    for op in aten:
        parent = parent_of.get(op.call) if op.call is not None else None
        if op.start is None or (op.call is not None and parent is None):
            continue
        low, high = (parent.start_ns, parent.end_ns) if parent is not None else (at, at + span)
        start = min(max(at + _ns(op.start), low), high)
        end = min(max(start + _ns(op.duration), start), high)
        out.append(Slice(op.name, "aten", backward_pass.number, start, end - start,
                         parent.depth + 1 if parent is not None else 1, parent.track if parent is not None else 1,
                         {"call": op.call, "flops": op.flops, "grad_enabled": op.grad_enabled}))
    return out


def _flows(slices: list[Slice]) -> list[Flow]:
    """One arrow per node call from the forward op paired with its node."""
    ops = {s.name: s for s in slices if s.kind == "forward_op"}
    first_child: dict[tuple[int, int], int] = {}  # (track, node start) -> earliest ATen start inside it
    nodes = [s for s in slices if s.kind == "node"]
    by_track: dict[int, list[Slice]] = {}
    for piece in slices:
        if piece.kind == "aten":
            by_track.setdefault(piece.track, []).append(piece)
    for node in nodes:
        inside = [a.start_ns for a in by_track.get(node.track, ()) if node.start_ns <= a.start_ns < node.end_ns
                  and a.depth == node.depth + 1]
        if inside:
            first_child[(node.track, node.start_ns)] = min(inside)
    flows = []
    for node in nodes:
        op = ops.get(node.args.get("op"))
        if op is None:
            continue
        # Inside the slice and before its first child, so a viewer binds the arrow to the slice itself.
        until = first_child.get((node.track, node.start_ns), node.end_ns)
        flows.append(Flow(len(flows) + 1, op.name, node.name, op.start_ns + op.duration_ns // 2, op.track,
                          node.start_ns + (until - node.start_ns) // 2, node.track))
    return flows


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _module_chains(cap: Any):
    """A function: a node's module (a call label, or a module's address) -> [(name, type)]
    from the model down to it.

    A module's address that is no call's label names the module itself: an
    AccumulateGrad node belongs to its parameter's module, whose calls may be
    several (a slice for the module under its first call's parent) or none
    (``MultiheadAttention.out_proj``: under its nearest called ancestor).
    """
    parent: dict[str, str] = {}
    kind: dict[str, str | None] = {}
    calls_of: dict[str, list[str]] = {}
    type_of: dict[str, str | None] = {}
    for record in cap.modules:
        label = record.label
        kind[label] = type_of[record.address] = getattr(record, "module_type", None)
        calls_of.setdefault(record.address, []).append(label)
        for child in record.children:
            parent[child] = label
    cache: dict[str | None, list[tuple[str, str | None]]] = {None: []}

    def anchor_of(address: str) -> str | None:
        calls = calls_of.get(address)
        if calls:
            return parent.get(calls[0])
        while address:
            address = address.rpartition(".")[0]
            if address in kind or address in calls_of:
                return address
        return None

    def chain(label: str | None) -> list[tuple[str, str | None]]:
        found = cache.get(label)
        if found is not None:
            return found
        assert label is not None
        if label in kind:
            result = [*chain(parent.get(label)), (label, kind[label])]
        else:
            result = [*chain(anchor_of(label)), (label, type_of.get(label))]
        cache[label] = result
        return result

    return chain


def _saved_bytes(call: Any) -> int:
    total = 0
    for side in (call.grad_inputs, call.grad_outputs):
        for tensor in side or ():
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


@dataclass
class _Open:
    label: str
    module_type: str | None
    depth: int
    start: int
    end: int
    nodes: int = 0


def _pass_slices(number: int, calls: list[Any], origin: int, chain_of) -> list[Slice]:
    ordered = sorted(calls, key=lambda c: (_ns(c.start), -_ns(c.duration)))
    track_ends: list[int] = []
    stacks: list[list[_Open]] = []
    out: list[Slice] = []

    def close(track: int, keep: int) -> None:
        stack = stacks[track - 1]
        while len(stack) > keep:
            done = stack.pop()
            out.append(Slice(done.label or ROOT_NAME, "module", number, done.start, done.end - done.start,
                             done.depth, track, {"module_call": done.label, "type": done.module_type,
                                                 "node_calls": done.nodes}))

    for call in ordered:
        start = origin + _ns(call.start)
        end = start + _ns(call.duration)
        track = next((i + 1 for i, last in enumerate(track_ends) if last <= start), None)
        if track is None:
            track_ends.append(end)
            stacks.append([])
            track = len(track_ends)
        track_ends[track - 1] = end
        grad_fn = call.grad_fn
        chain = chain_of(grad_fn.module) if grad_fn.module is not None else []
        stack = stacks[track - 1]
        common = 0
        while common < min(len(stack), len(chain)) and stack[common].label == chain[common][0]:
            common += 1
        close(track, common)
        for depth, (label, module_type) in enumerate(chain[common:], start=common + 1):
            stack.append(_Open(label, module_type, depth, start, end))
        for entry in stack:
            entry.end = max(entry.end, end)
        if stack:
            stack[-1].nodes += 1
        op = grad_fn.op
        out.append(Slice(call.label, "node", number, start, end - start, len(chain) + 1, track, {
            "node": grad_fn.label,
            "type": grad_fn.type,
            "op": op.label if op is not None else None,
            "module": grad_fn.module,
            "pass": number,
            "flops": call.flops,
            "recompute_flops": call.recompute_flops,
            "saved_grad_bytes": _saved_bytes(call),
        }))
    for track in range(1, len(stacks) + 1):
        close(track, 0)
    _number_stretches(out)
    out.sort(key=lambda s: (s.track, s.start_ns, -s.duration_ns, s.depth))
    return out


def _collective_slices(number: int, collectives: list[Any], origin: int) -> list[Slice]:
    """One slice per collective, each on the first collective track free at its start."""
    track_ends: list[int] = []
    out = []
    for collective in sorted(collectives, key=lambda c: c.start):
        start = origin + _ns(collective.start)
        end = start + _ns(collective.duration)
        lane = next((i for i, last in enumerate(track_ends) if last <= start), None)
        if lane is None:
            lane = len(track_ends)
            track_ends.append(end)
        track_ends[lane] = end
        out.append(Slice(collective.label, "collective", number, start, end - start, 1, COLLECTIVE_TRACK + lane, {
            "kind": collective.kind,
            "bytes": collective.bytes,
            "params": list(collective.params),
            "modules": list(collective.modules),
            "pass": number,
        }))
    return out


def _number_stretches(slices: list[Slice]) -> None:
    by_call: dict[str, list[Slice]] = {}
    for piece in slices:
        if piece.kind == "module":
            by_call.setdefault(piece.args["module_call"], []).append(piece)
    for pieces in by_call.values():
        if len(pieces) > 1:
            pieces.sort(key=lambda s: s.start_ns)
            for i, piece in enumerate(pieces, start=1):
                piece.args["stretch"] = f"{i}/{len(pieces)}"
