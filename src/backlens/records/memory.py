"""``cap.memory`` and ``pass_.memory``: what the backward holds, read from a capture's memory journal.

``cap.memory`` has one row per forward op and per module call: the bytes of
the tensors autograd saved there for the backward, counted once per storage
(a view and the tensor it views, or a tensor saved twice, count once), with
parameters and buffers apart; and ``freed``, the pass and node call that
released the last of them (None while any is held).

``pass_.memory`` is the live set through one pass: after every node call, the
bytes held in saved tensors not yet released, gradients produced and not yet
consumed, and parameter gradients accumulated so far (see docs/cost.md for
exactly what this model counts and what it cannot see). Both are computed
from the journal's events (capture/memory.py), so a loaded bundle reads the
same as the live capture.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from backlens._pandas import data_frame
from backlens.errors import LabelNotFoundError
from backlens.graph.labels import call_label, owning_module
from backlens.records.base import Record, RecordList

NON_PARAM = ("saved", "grad")  # storage kinds the live set counts (parameters and buffers are held anyway)


@dataclass(frozen=True)
class Freed:
    """Where saved tensors were released: the pass and the node call then running
    (both None when autograd let them go outside any recorded node call, as when
    the graph was dropped without a backward)."""

    pass_number: int | None
    call: str | None


@dataclass
class _Summary:
    """Per-row sums, computed once per journal version."""

    op_rows: list[tuple[int, int, int, int | None]]  # per op: saved bytes, param bytes, tensors, last release
    call_rows: list[tuple[int, int, int, int | None]]
    saved_bytes: int
    saved_param_bytes: int
    saved_tensors: int
    unattributed_bytes: int
    all_released: bool


def _summary(state: Any) -> _Summary:
    memory = state.memory
    cached = getattr(memory, "_summary_cache", None)
    if cached is not None and cached[0] == memory.version:
        return cached[1]
    journal = state.journal
    kinds, sizes = memory.storage_kinds, memory.storage_bytes
    release_of = {save: at for at, (save, *_rest) in enumerate(memory.releases)}
    op_sets: dict[int, tuple[set, set, list]] = defaultdict(lambda: (set(), set(), [0, -1, True]))
    call_sets: dict[int, tuple[set, set, list]] = defaultdict(lambda: (set(), set(), [0, -1, True]))
    every: tuple[set, set] = (set(), set())
    outside_ops: set[int] = set()
    calls = journal.module_calls

    def add(target: tuple[set, set, list], storage: int, released: int | None) -> None:
        (target[0] if kinds[storage] in NON_PARAM else target[1]).add(storage)
        tally = target[2]
        tally[0] += 1
        if released is None:
            tally[2] = False
        else:
            tally[1] = max(tally[1], released)

    for save, storage in enumerate(memory.saved_storage):
        if memory.saved_recomputed[save]:
            continue  # made in the backward: the recomputing call's, in pass_.memory
        released = release_of.get(save)
        (every[0] if kinds[storage] in NON_PARAM else every[1]).add(storage)
        op = memory.saved_op[save]
        if op is not None:
            add(op_sets[op], storage, released)
        elif kinds[storage] in NON_PARAM:
            outside_ops.add(storage)
        call = memory.saved_call[save]
        while call is not None and call < len(calls):
            add(call_sets[call], storage, released)
            call = calls[call].parent

    def rows(sets: dict, count: int) -> list[tuple[int, int, int, int | None]]:
        out = []
        for at in range(count):
            found = sets.get(at)
            if found is None:
                out.append((0, 0, 0, None))
                continue
            plain, params, (tensors, last, all_released) = found
            out.append((sum(sizes[s] for s in plain), sum(sizes[s] for s in params), tensors,
                        last if all_released else None))
        return out

    summary = _Summary(
        op_rows=rows(op_sets, len(journal.ops)),
        call_rows=rows(call_sets, len(calls)),
        saved_bytes=sum(sizes[s] for s in every[0]),
        saved_param_bytes=sum(sizes[s] for s in every[1]),
        saved_tensors=sum(1 for flag in memory.saved_recomputed if not flag),
        unattributed_bytes=sum(sizes[s] for s in outside_ops),
        all_released=all(memory.saved_recomputed[s] or s in release_of for s in range(len(memory.saved_storage))),
    )
    memory._summary_cache = (memory.version, summary)
    return summary


def _freed(state: Any, release: int | None) -> Freed | None:
    if release is None:
        return None
    _save, number, position, _started = state.memory.releases[release]
    return Freed(number, _call_label(state, position) if position is not None else None)


def _call_label(state: Any, position: int) -> str:
    entry = state.calls[position]
    return call_label(state.nodes[entry.node].label, entry.ordinal)


class MemoryRow(Record):
    """What one forward op (``scope == "op"``) or one module call (``"module"``, its
    whole subtree) saved for the backward."""

    __slots__ = ()
    kind = "memory_row"
    noun = "memory row"
    FIELDS = ("label", "scope", "saved_bytes", "saved_tensors", "saved_param_bytes", "freed")
    COLUMNS = ("label", "scope", "module", "saved_bytes", "saved_tensors", "saved_param_bytes", "freed_pass",
               "freed_call")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        ops = len(state.journal.ops)
        return state.journal.ops[at].label if at < ops else state.journal.call_label(at - ops)

    @property
    def _values(self) -> tuple[int, int, int, int | None]:
        summary = _summary(self._state)
        ops = len(summary.op_rows)
        return summary.op_rows[self._at] if self._at < ops else summary.call_rows[self._at - ops]

    @property
    def label(self) -> str:
        """The op's label (``linear_2``) or the module call's (``encoder.layer.0``)."""
        return self.key_of(self._state, self._at)

    @property
    def scope(self) -> str:
        """``"op"`` or ``"module"`` (a module call's row counts its whole subtree)."""
        return "op" if self._at < len(self._state.journal.ops) else "module"

    @property
    def module(self) -> str | None:
        """The module call the op ran in, or the call itself."""
        journal = self._state.journal
        ops = len(journal.ops)
        return journal.call_label(journal.ops[self._at].module_call if self._at < ops else self._at - ops)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the storages saved here for the backward, each once; parameters and buffers apart."""
        return self._values[0]

    @property
    def saved_param_bytes(self) -> int:
        """Bytes of the parameter and buffer storages saved here, each once."""
        return self._values[1]

    @property
    def saved_tensors(self) -> int:
        """How many tensors autograd saved here (a tensor saved twice counts twice)."""
        return self._values[2]

    @property
    def forward_time(self) -> float | None:
        """Seconds a module call's forward took as recorded (None for an op row)."""
        if self._at < len(self._state.journal.ops):
            return None
        found = self._state.memory.module_forward_ns.get(self._at - len(self._state.journal.ops))
        return found / 1e9 if found is not None else None

    @property
    def freed(self) -> Freed | None:
        """The pass and node call that released the last of them (None while any is held,
        and when nothing was saved here)."""
        values = self._values
        return _freed(self._state, values[3]) if values[2] else None

    def row(self) -> dict[str, Any]:
        freed = self.freed
        return {
            "label": self.label,
            "scope": self.scope,
            "module": self.module,
            "saved_bytes": self.saved_bytes,
            "saved_tensors": self.saved_tensors,
            "saved_param_bytes": self.saved_param_bytes,
            "freed_pass": freed.pass_number if freed is not None else None,
            "freed_call": freed.call if freed is not None else None,
        }

    def __repr__(self) -> str:
        return (f"MemoryRow({self.label!r}, {self.scope}, saved_bytes={self.saved_bytes}, "
                f"saved_tensors={self.saved_tensors}, freed={self.freed!r})")


class MemoryTable(RecordList[MemoryRow]):
    """``cap.memory``: one row per forward op, then one per module call, by position or
    label (an op's label first, then a module call's), with the capture's totals."""

    def __init__(self, state: Any):
        super().__init__(state, MemoryRow, range(len(state.journal.ops) + len(state.journal.module_calls)))

    @property
    def ops(self) -> list[MemoryRow]:
        return [self._record(p) for p in range(len(self._state.journal.ops))]

    @property
    def modules(self) -> list[MemoryRow]:
        ops = len(self._state.journal.ops)
        return [self._record(ops + p) for p in range(len(self._state.journal.module_calls))]

    @property
    def saved_bytes(self) -> int:
        """Bytes of every storage the forward saved for the backward, once each, parameters and buffers apart."""
        return _summary(self._state).saved_bytes

    @property
    def saved_param_bytes(self) -> int:
        return _summary(self._state).saved_param_bytes

    @property
    def saved_tensors(self) -> int:
        return _summary(self._state).saved_tensors

    @property
    def unattributed_bytes(self) -> int:
        """Bytes saved outside any op (torch's own: a checkpoint keeping its inputs), once each;
        they count in their module call's row only."""
        return _summary(self._state).unattributed_bytes

    @property
    def all_freed(self) -> bool:
        """Whether autograd has released every tensor the forward saved."""
        return _summary(self._state).all_released

    @property
    def reasons(self) -> list[str]:
        """Why these numbers are incomplete (empty when they are complete)."""
        return list(self._state.memory.reasons)

    def checkpoint_saving(self, modules: list[str]) -> int:
        """The saved bytes that checkpointing these module calls (labels) together would free
        under non-reentrant ``torch.utils.checkpoint``: what they saved that nothing outside
        them saved, less what their checkpoints would keep that nothing else saved (their
        tensor arguments). Negative when the checkpoints would keep more than they free."""
        calls = []
        for label in modules:
            row = self[label]
            if row.scope != "module":
                raise LabelNotFoundError(
                    f"{label!r} names an op; a checkpoint wraps a module call.", code="not_a_module_call",
                    remedy="Name module calls, as cap.modules labels them ('transformer.h.0').")
            calls.append(row._at - len(self._state.journal.ops))
        return _checkpoint_saving(self._state, calls)

    def __repr__(self) -> str:
        return (f"<cap.memory: {self.saved_bytes:,} saved bytes in {self.saved_tensors} tensors "
                f"(+{self.saved_param_bytes:,} parameter bytes), {len(self)} rows>")


def _checkpoint_saving(state: Any, chosen: list[int]) -> int:
    """See :meth:`MemoryTable.checkpoint_saving` (``chosen``: module call indices)."""
    memory = state.memory
    kinds, sizes = memory.storage_kinds, memory.storage_bytes
    calls = state.journal.module_calls
    chosen_set = set(chosen)
    saved: set[int] = set()
    kept: set[int] = set()
    for save, storage in enumerate(memory.saved_storage):
        if memory.saved_recomputed[save] or kinds[storage] not in NON_PARAM:
            continue
        saved.add(storage)
        call = memory.saved_call[save]
        inside = False
        while call is not None and call < len(calls):
            if call in chosen_set:
                inside = True
                break
            call = calls[call].parent
        if not inside:
            kept.add(storage)
    for call in chosen:
        kept.update(s for s in memory.module_inputs.get(call, ()) if kinds[s] in NON_PARAM)
    return sum(sizes[s] for s in saved) - sum(sizes[s] for s in kept)


@dataclass(frozen=True)
class MemorySample:
    """The bytes held after one node call (``call``), by kind; ``allocator_bytes`` is
    ``torch.cuda.memory_allocated()`` at that node boundary (None off CUDA)."""

    call: str
    bytes: int
    saved_bytes: int
    grad_bytes: int
    param_grad_bytes: int
    allocator_bytes: int | None = None


@dataclass
class PassMemory:
    """The live set through one backward pass (``pass_.memory``).

    ``start_bytes`` is what was held before its first node call: the saved
    tensors (``start_saved_bytes``) and the seed gradient; ``samples`` one :class:`MemorySample` after every node call;
    ``peak_bytes`` their largest, first reached after ``peak_at``;
    ``held_at_peak`` splits it by module address (None: outside every module).
    ``recomputed`` maps each node call that ran a checkpoint's recomputation to
    the bytes of the tensors it recomputed for the backward (parameters apart). ``allocator_start`` is the allocator reading
    before the first node call (CUDA only, else None).
    """

    pass_number: int
    start_bytes: int
    start_saved_bytes: int
    samples: list[MemorySample]
    peak_bytes: int | None
    peak_at: str | None
    held_at_peak: dict[str | None, int]
    recomputed: dict[str, int] = field(default_factory=dict)
    allocator_start: int | None = None
    reasons: list[str] = field(default_factory=list)

    def to_pandas(self):
        columns = ["call", "bytes", "saved_bytes", "grad_bytes", "param_grad_bytes", "allocator_bytes"]
        return data_frame([[getattr(s, c) for c in columns] for s in self.samples], columns)

    def __repr__(self) -> str:
        return (f"<PassMemory pass {self.pass_number}: {len(self.samples)} samples, start {self.start_bytes:,} B, "
                f"peak {self.peak_bytes if self.peak_bytes is None else format(self.peak_bytes, ',')} B "
                f"after {self.peak_at}>")


def pass_memory(state: Any, number: int) -> PassMemory | None:
    """The live set through pass ``number`` (None when the capture did not record memory)."""
    memory = state.memory
    if memory is None:
        return None
    pass_ = state.passes[number - 1]
    # Computed once per pass while the journal stays as it is (reports read it several times).
    key = (memory.version, number, len(pass_.calls))
    cache = memory.__dict__.setdefault("_pass_cache", {})
    found = cache.get(key)
    if found is None:
        if len(cache) > 64:
            cache.clear()
        found = cache[key] = _pass_memory(state, memory, pass_, number)
    return found


def _pass_memory(state: Any, memory: Any, pass_: Any, number: int) -> PassMemory:
    positions = [p for p in pass_.calls]
    rank = {position: k for k, position in enumerate(positions)}
    count = len(positions)
    kinds, sizes = memory.storage_kinds, memory.storage_bytes
    release_of = {save: (passed, position, started) for save, passed, position, started in memory.releases}
    saved = []  # (storage, first sample, end sample, save)
    for save, storage in enumerate(memory.saved_storage):
        if kinds[storage] not in NON_PARAM:
            continue
        released = release_of.get(save)
        if memory.saved_recomputed[save]:
            by = memory.saved_recomputed_by[save]
            if by not in rank:
                continue
            first = rank[by]
        else:
            first = -1
            if released is not None and _released_before(released, number):
                continue
        end = count
        if released is not None and released[0] == number and released[1] in rank:
            end = rank[released[1]]
        if end > first:
            saved.append((storage, first, end, save))
    grads = []  # (storage, first sample, end sample, node)
    accumulated = []  # (first sample, bytes, node)
    allocator: dict[int, int | None] = {}
    for position, holds, added, allocated in memory.fires:
        if position not in rank:
            continue
        consumed = rank[position]
        node = state.calls[position].node
        allocator[consumed] = allocated
        for storage, start, until in holds:
            if start is None or start not in rank:
                grads.append((storage, -1, count, node))  # from before the pass (the seed), to its end
            else:
                grads.append((storage, rank[start], rank.get(until, consumed) if until is not None else consumed,
                              node))
        if added:
            accumulated.append((consumed, added, node))
    curve = _sweep(count, sizes, saved, grads, accumulated)
    start_saved = sum(sizes[s] for s in {storage for storage, first, _e, _s in saved if first < 0})
    start_grads = sum(sizes[s] for s in {storage for storage, first, _e, _n in grads if first < 0})
    samples = []
    for k, (saved_now, grads_now, params_now) in enumerate(curve):
        reading = allocator.get(k + 1) if k + 1 < count else memory.pass_end_allocator.get(number)
        samples.append(MemorySample(_call_label(state, positions[k]), saved_now + grads_now + params_now,
                                    saved_now, grads_now, params_now, reading))
    peak = max(range(len(samples)), key=lambda k: samples[k].bytes) if samples else None
    recomputed: dict[str, set[int]] = defaultdict(set)
    for save, by in enumerate(memory.saved_recomputed_by):
        if memory.saved_recomputed[save] and by in rank and kinds[memory.saved_storage[save]] in NON_PARAM:
            recomputed[_call_label(state, by)].add(memory.saved_storage[save])
    return PassMemory(
        pass_number=number,
        start_bytes=start_saved + start_grads,
        start_saved_bytes=start_saved,
        samples=samples,
        peak_bytes=samples[peak].bytes if peak is not None else None,
        peak_at=samples[peak].call if peak is not None else None,
        held_at_peak=_held_at(state, peak, saved, grads, accumulated) if peak is not None else {},
        recomputed={label: sum(sizes[s] for s in storages) for label, storages in recomputed.items()},
        allocator_start=allocator.get(0),
        reasons=list(memory.reasons),
    )


def _released_before(released: tuple[int | None, int | None, int], number: int) -> bool:
    """Whether a release happened before pass ``number`` began."""
    passed, _position, started = released
    if passed is not None:
        return passed < number
    return started < number


def _sweep(count: int, sizes: list[int], saved: list, grads: list, accumulated: list) -> list[tuple[int, int, int]]:
    """(saved, gradient, parameter gradient) bytes after each of ``count`` node calls; a
    storage counts once while any interval holding it is open (``first <= k < end``)."""
    opens: dict[int, list[tuple[int, int]]] = defaultdict(list)  # sample -> (kind, storage) opening
    closes: dict[int, list[tuple[int, int]]] = defaultdict(list)
    live = [defaultdict(int), defaultdict(int)]
    totals = [0, 0]

    def enter(kind: int, storage: int) -> None:
        live[kind][storage] += 1
        if live[kind][storage] == 1:
            totals[kind] += sizes[storage]

    for kind, items in ((0, saved), (1, grads)):
        for storage, first, end, _who in items:
            if first < 0:
                enter(kind, storage)
            else:
                opens[first].append((kind, storage))
            closes[end].append((kind, storage))
    added: dict[int, int] = defaultdict(int)
    for first, nbytes, _node in accumulated:
        added[first] += nbytes
    params = 0
    out = []
    for k in range(count):
        for kind, storage in opens.get(k, ()):
            enter(kind, storage)
        for kind, storage in closes.get(k, ()):
            live[kind][storage] -= 1
            if live[kind][storage] == 0:
                totals[kind] -= sizes[storage]
        params += added.get(k, 0)
        out.append((totals[0], totals[1], params))
    return out


def _held_at(state: Any, k: int, saved: list, grads: list, accumulated: list) -> dict[str | None, int]:
    """The bytes held after sample ``k``, by module address (each storage once, with the
    first holder that still holds it)."""
    memory = state.memory
    calls = state.journal.module_calls
    sizes = memory.storage_bytes
    held: dict[str | None, int] = defaultdict(int)
    seen: set[tuple[int, int]] = set()
    for storage, first, end, save in saved:
        if first <= k < end and (0, storage) not in seen:
            seen.add((0, storage))
            call = memory.saved_call[save]
            held[calls[call].address if call is not None and call < len(calls) else None] += sizes[storage]
    for storage, first, end, node in grads:
        if first <= k < end and (1, storage) not in seen:
            seen.add((1, storage))
            held[_node_module(state, node)] += sizes[storage]
    for first, nbytes, node in accumulated:
        if first <= k:
            held[_node_module(state, node)] += nbytes
    return dict(held)


def _node_module(state: Any, node: int) -> str | None:
    entry = state.nodes[node]
    if entry.param is not None:
        return owning_module(entry.param)
    calls = state.journal.module_calls
    return calls[entry.module_call].address if entry.module_call is not None else None
