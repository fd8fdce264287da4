"""``bl.report.timeline(cap)``: the backward as a timeline of slices.

One slice per timed node call (named by its call label), nested in one slice
per module call it belongs to (following module nesting: ``encoder`` >
``encoder.layer.0`` > ``encoder.layer.0.attention`` ...) and in one slice
per pass (``"pass k"``). ``.save(path)`` writes the Trace Event format (JSON)
that Perfetto and ``chrome://tracing`` open; the HTML report draws the module
slices of one pass as a Gantt view.

Built only from the public records (``cap.passes``, their calls' ``start``,
``duration``, ``flops``, ``grad_fn``, and ``cap.modules``), so a live capture
and a loaded bundle give the same timeline.

Time. A call's ``start`` counts from its pass's start, so passes are laid end
to end in pass order, each as long as its recorded duration; what ran between
passes (the forward, an optimizer step) is not on the timeline. Times are
kept as integer nanoseconds, so a parent slice contains its children exactly.
A module slice spans its nodes' fires from the first start to the last end.
Where the engine leaves a module call and comes back to it (sibling branches
interleaved), the call has one slice per stretch, each with
``args["stretch"] = "i/n"``. Fires that overlap in time (an engine running
nodes on several threads) go on separate tracks.

Collectives (``pass_.collectives``, under ``torch.distributed``) are slices of
their own (kind ``"collective"``, named by their label, ``all_reduce_1:1``),
from their issue to their completion, on tracks of their own
(``COLLECTIVE_TRACK`` and up: they run beside the nodes, and overlapping ones
each get a track).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backlens import _args
from backlens._pandas import data_frame
from backlens.report.memory_view import memory_counter_events

ROOT_NAME = "(model)"
COLLECTIVE_TRACK = 101  # the first track of collectives; node tracks count from 1
_PID = 1


@dataclass(frozen=True)
class Slice:
    """One bar of the timeline; ``kind`` is ``"pass"``, ``"module"``, ``"node"`` or ``"collective"``.

    ``start_ns`` and ``duration_ns`` count from the timeline's origin (the
    start of its first pass). ``depth`` is 0 for a pass, then one per module
    level; ``track`` numbers concurrent lanes from 1.
    """

    name: str
    kind: str
    pass_number: int
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

    def event(self) -> dict[str, Any]:
        """This slice as a Trace Event format complete event (microseconds)."""
        return {
            "name": self.name, "cat": self.kind, "ph": "X", "ts": self.start_ns / 1e3,
            "dur": self.duration_ns / 1e3, "pid": _PID, "tid": self.track, "args": self.args,
        }


@dataclass
class Timeline:
    """The slices of every timed pass (see the module docstring).

    ``untimed_calls`` counts node calls without timing (a ``timing=False``
    capture); ``reason`` says why the timeline is empty when it is.
    """

    slices: list[Slice]
    passes: list[int]
    untimed_calls: int = 0
    reason: str | None = None
    counters: list[dict[str, Any]] = field(default_factory=list)  # "C" events (report/memory_view.py)

    def __iter__(self):
        return iter(self.slices)

    def __len__(self) -> int:
        return len(self.slices)

    def for_pass(self, number: int) -> list[Slice]:
        return [s for s in self.slices if s.pass_number == number]

    def to_trace(self) -> dict[str, Any]:
        """The Trace Event format object: ``{"traceEvents": [...], ...}``."""
        tracks = sorted({s.track for s in self.slices}) or [1]
        metadata: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "args": {"name": "backlens backward"}},
        ]
        for track in tracks:
            if track >= COLLECTIVE_TRACK:
                lane = track - COLLECTIVE_TRACK + 1
                name = "collectives" if lane == 1 else f"collectives (overlapping {lane})"
            else:
                name = "backward" if track == 1 else f"backward (concurrent fires {track})"
            metadata.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": track, "args": {"name": name}})
            metadata.append({"name": "thread_sort_index", "ph": "M", "pid": _PID, "tid": track,
                             "args": {"sort_index": track}})
        other: dict[str, Any] = {"producer": "backlens", "passes": list(self.passes),
                                 "untimed_calls": self.untimed_calls}
        if self.reason:
            other["reason"] = self.reason
        return {"traceEvents": metadata + [s.event() for s in self.slices] + self.counters, "displayTimeUnit": "ms",
                "otherData": other}

    def save(self, path: str) -> str:
        """Write the Trace Event format JSON to ``path``; returns ``path``."""
        _args.path(path, "path", "Timeline.save", "timeline.save('backward.json')")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_trace(), handle)
        return path

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


def timeline(cap: Any, pass_: int | None = None) -> Timeline:
    """The backward of ``cap`` (every pass, or pass ``pass_`` alone) as a :class:`Timeline`."""
    _args.capture(cap, "bl.report.timeline(cap)", needs=("passes",))
    passes = list(cap.passes) if pass_ is None else [cap.passes.for_pass(pass_)]
    chain_of = _module_chains(cap)
    slices: list[Slice] = []
    untimed = 0
    origin = 0
    numbers = []
    for backward_pass in passes:
        calls = list(backward_pass.calls)
        timed = [c for c in calls if c.start is not None and c.duration is not None]
        untimed += len(calls) - len(timed)
        # (a pass record without collectives: a stand-in from a test or another tool)
        collectives = [c for c in getattr(backward_pass, "collectives", ()) if c.duration is not None]
        end = max((_ns(c.start) + _ns(c.duration) for c in [*timed, *collectives]), default=0)
        span = max(end, _ns(backward_pass.duration) if backward_pass.duration is not None else 0)
        if not timed and backward_pass.duration is None:
            continue
        numbers.append(backward_pass.number)
        slices.append(Slice(f"pass {backward_pass.number}", "pass", backward_pass.number, origin, span, 0, 1, {
            "pass": backward_pass.number,
            "trigger": backward_pass.trigger,
            "call_site": str(backward_pass.call_site) if backward_pass.call_site is not None else None,
            "status": backward_pass.status,
            "node_calls": len(calls),
            "fire_time_us": sum(_ns(c.duration) for c in timed) / 1e3,
            "collectives": len(collectives),
        }))
        slices += _pass_slices(backward_pass.number, timed, origin, chain_of)
        slices += _collective_slices(backward_pass.number, collectives, origin)
        origin += span
    reason = None
    if not slices:
        reason = ("no backward pass has run over this capture" if not passes
                  else "no node call was timed (capture with timing=True)")
    return Timeline(slices, numbers, untimed, reason, memory_counter_events(cap, slices))


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
