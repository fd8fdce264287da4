"""Witnessing ``torch.utils.checkpoint`` in a captured forward, and its recomputation in each pass.

While a capture records its forward, every checkpoint invocation in the
process goes through backlens (``_torch`` swaps torch's non-reentrant hooks
class for a subclass and wraps the reentrant Function's forward, once, and
puts them back when the last recording capture is done):

* in the capture's own thread the invocation becomes a :class:`CheckpointEntry`:
  the ops and module call that ran inside it, how many tensors its
  saved-tensor hook packed, and, through a wrapper of its unpack hook, each
  recomputation: the first unpack in an engine run recomputes (torch keys
  its recomputation by the run), under the node call then firing, with the
  FLOPs the pass's census saw meanwhile;
* in another thread it cannot be told apart from other models' work, so the
  capture's verdict becomes ``unknown`` with that reason.

A reentrant checkpoint is an autograd Function: its recomputation is its
node's call, and it packs nothing through saved-tensor hooks; its evidence is
incomplete by nature (its verdict is ``unknown``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from backlens import _torch
from backlens._clock import now as _now
from backlens.cost.checkpoints import CheckpointEntry, CheckpointJournal, RecomputeEntry

_task_id = _torch.graph_task_id_function()

NO_HOOK_CLASS = ("this torch has no torch.utils.checkpoint._checkpoint_hook, so non-reentrant "
                 "checkpoints cannot be witnessed")
NO_REENTRANT_FUNCTION = ("this torch has no torch.utils.checkpoint.CheckpointFunction.forward to wrap, so "
                         "reentrant checkpoints cannot be witnessed")
REENTRANT = ("a reentrant checkpoint (use_reentrant=True) ran: it keeps its inputs instead of packing "
             "through saved-tensor hooks and recomputes inside its own node with a nested backward, so "
             "what it packed is unknown")
OTHER_THREAD = ("a checkpoint ran on another thread while this forward was recorded; it cannot be "
                "told apart from other work, so this forward's invocations may be incomplete")
COMPILED_OPAQUE = ("the model ran as compiled regions (compiled='opaque'): checkpoints inside them "
                   "are not witnessed")


class CheckpointWitness:
    """Fills one capture's :class:`CheckpointJournal` (the state's ``checkpoints``).

    One of the capture's backward observers too: when a pass closes, each
    recomputation in it learns its node call's position, a reentrant
    checkpoint's node calls become its recomputations, and an uncounted
    pass's recompute FLOPs read None.
    """

    def __init__(self, state: Any) -> None:
        self._state = weakref.ref(state)
        self.journal = state.checkpoints = CheckpointJournal()
        self.thread = threading.get_ident()
        self.memory: Any = None  # a memory=True capture's MemoryRecorder: told what each recomputation keeps
        if not _torch.HAS_CHECKPOINT_HOOK_CLASS:
            self.journal.add_reason(NO_HOOK_CLASS)
        if not _torch.HAS_REENTRANT_CHECKPOINT_FUNCTION:
            self.journal.add_reason(NO_REENTRANT_FUNCTION)

    # -- the forward -------------------------------------------------------
    def __enter__(self) -> CheckpointWitness:
        _INVOCATIONS.push(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()
        state = self._state()
        if state is not None:
            for entry in self.journal.entries:
                _resolve_module(state.journal, entry)

    def leave(self) -> None:
        """Stop witnessing (idempotent): with no capture recording left, torch's checkpoint
        classes are put back. Run to completion by the capture's cleanup, also on Ctrl-C."""
        _INVOCATIONS.pop(self)

    def open(self, reentrant: bool, sequence_nr: int | None = None) -> CheckpointEntry:
        journal = self._state().journal
        calls = journal.module_calls
        enclosing = next((c.index for c in reversed(calls) if c.op_end is None), None)
        entry = CheckpointEntry(module_call=None, op_start=len(journal.raw_ops), op_end=len(journal.raw_ops),
                                packed=None if reentrant else 0, reentrant=reentrant, sequence_nr=sequence_nr,
                                calls=(enclosing, len(calls)))
        self.journal.entries.append(entry)
        if reentrant:
            self.journal.add_reason(REENTRANT)
        return entry

    def close(self, entry: CheckpointEntry) -> None:
        entry.op_end = len(self._state().journal.raw_ops)

    def elsewhere(self) -> None:
        self.journal.add_reason(OTHER_THREAD)

    # -- the backward --------------------------------------------------------
    def unpack_hook(self, unpack: Any, entry: CheckpointEntry, frame: Any = None) -> Any:
        """``unpack`` (torch's), noting the recomputation the first unpack of each engine run does
        (``frame``: a weak reference to torch's checkpoint frame, which keeps what it recomputed)."""
        witness = weakref.ref(self)
        recomputed_in: set[int] = set()

        def unpack_hook(holder: Any) -> Any:
            task = _task_id()
            this = witness()
            if this is None or task == -1 or task in recomputed_in:
                return unpack(holder)
            recomputed_in.add(task)
            return this._recompute(unpack, holder, entry, frame)

        return unpack_hook

    def _recompute(self, unpack: Any, holder: Any, entry: CheckpointEntry, frame: Any = None) -> Any:
        state = self._state()
        recorder = state.recorder if state is not None else None
        call = recorder.open_call() if recorder is not None else None
        if call is None:
            return unpack(holder)  # a run this capture does not record
        census = _census_of(recorder, call.pass_number)
        mark = len(census.charged) if census is not None else 0
        start = _now()
        try:
            result = unpack(holder)
            if self.memory is not None:
                self._note_recomputed(frame, call, entry, result)
            return result
        finally:
            flops = None
            if census is not None and census.recompute_known:
                rows = census.charged[mark:]
                if all(recomputed is not None for _n, _f, _c, recomputed in rows):
                    flops = sum(count for _n, _f, count, recomputed in rows if recomputed)
            entry.recomputed.append(RecomputeEntry(call.pass_number, None, flops, _now() - start, call_entry=call))

    def _note_recomputed(self, frame: Any, call: Any, entry: CheckpointEntry, result: Any) -> None:
        """Tell the memory recorder what this recomputation keeps for the nodes still to unpack."""
        memory = self.memory
        try:
            held = frame() if frame is not None else None
            found = _torch.checkpoint_recomputed(held) if held is not None else None
            memory.recomputed(found, call, entry.module_call, result if isinstance(result, torch.Tensor) else None)
        except Exception as exc:  # noqa: BLE001 - a memory note never disturbs the user's backward
            memory.journal.add_reason(f"a recomputation could not be counted ({type(exc).__name__}: {exc})")

    def on_pass_close(self, state: Any, pass_: Any, error: BaseException | None) -> None:
        cost = state.cost.pass_cost(pass_.number) if state.cost is not None else None
        counted = cost is not None and cost["counted"]
        position_of = {id(state.calls[i]): i for i in pass_.calls}
        nodes = None
        for entry in self.journal.entries:
            if entry.reentrant:
                nodes = nodes if nodes is not None else state.nodes
                entry.recomputed += _reentrant_recomputes(state, entry, pass_, nodes)
                continue
            for recompute in entry.recomputed:
                if recompute.call_entry is None or recompute.pass_number != pass_.number:
                    continue
                recompute.call = position_of.get(id(recompute.call_entry))
                recompute.call_entry = None
                if not counted:
                    recompute.recompute_flops = None


def _resolve_module(journal: Any, entry: CheckpointEntry) -> None:
    """The checkpointed module: the one call that is all of the invocation's body, started inside
    it (``checkpoint(block, x)``) or around it (a module that checkpoints its own forward)."""
    if entry.calls is None:
        return
    (enclosing, first), entry.calls = entry.calls, None
    calls = journal.module_calls
    inside = [c for c in calls[first:] if c.op_start < entry.op_end and (c.parent is None or c.parent < first)]
    candidates = inside[:1] if len(inside) == 1 else []
    if enclosing is not None:
        candidates.append(calls[enclosing])
    for call in candidates:
        if call.op_start == entry.op_start and call.op_end == entry.op_end:
            entry.module_call = call.index
            return


def _reentrant_recomputes(state: Any, entry: CheckpointEntry, pass_: Any, nodes: list) -> list[RecomputeEntry]:
    """A reentrant checkpoint's node calls in ``pass_``: each recomputed it."""
    found = []
    for position in pass_.calls:
        call = state.calls[position]
        node = nodes[call.node]
        if node.sequence_nr == entry.sequence_nr and node.is_custom:
            duration = call.end_ns - call.start_ns - call.hook_ns if call.start_ns is not None else None
            found.append(RecomputeEntry(pass_.number, position, call.recompute_flops, duration))
    return found


def _census_of(recorder: Any, pass_number: int) -> Any:
    for observer in recorder.observers:
        census_of = getattr(observer, "census_of", None)
        if census_of is not None:
            return census_of(pass_number)
    return None


class _Invocations:
    """The one interception of checkpoint invocations, installed while any capture records.

    Per thread, a stack of recording witnesses; the innermost witnesses an
    invocation in its thread; one in a thread with none is reported to all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, list[CheckpointWitness]] = {}
        self._original_hook_class: type | None = None
        self._original_forward: Any = None
        self._installed = False

    def push(self, witness: CheckpointWitness) -> None:
        with self._lock:
            self._by_thread.setdefault(threading.get_ident(), []).append(witness)
            if not self._installed:
                self._install()

    def pop(self, witness: CheckpointWitness) -> None:
        with self._lock:
            for thread, stack in list(self._by_thread.items()):
                if witness in stack:
                    stack.remove(witness)
                if not stack:
                    del self._by_thread[thread]
            if not self._by_thread and self._installed:
                self._uninstall()

    def current(self) -> CheckpointWitness | None:
        """The witness of this thread's invocation (None: reported to every recording capture)."""
        stack = self._by_thread.get(threading.get_ident())
        if stack:
            return stack[-1]
        with self._lock:
            for others in self._by_thread.values():
                for witness in others:
                    witness.elsewhere()
        return None

    def _install(self) -> None:
        self._installed = True  # first: an install cut short (a Ctrl-C) is still undone by _uninstall
        original = _torch.checkpoint_hook_class()
        if original is not None:
            self._original_hook_class = original
            _torch.set_checkpoint_hook_class(_witnessed_hook_class(original))
        forward = _torch.reentrant_checkpoint_forward()
        if forward is not None:
            self._original_forward = forward
            _torch.set_reentrant_checkpoint_forward(_witnessed_forward(forward))

    def _uninstall(self) -> None:
        if self._original_hook_class is not None:
            _torch.set_checkpoint_hook_class(self._original_hook_class)
        if self._original_forward is not None:
            _torch.set_reentrant_checkpoint_forward(self._original_forward)
        self._original_hook_class = self._original_forward = None
        self._installed = False


_INVOCATIONS = _Invocations()
_hook_classes: dict[type, type] = {}


def _witnessed_hook_class(original: type) -> type:
    """A subclass of torch's non-reentrant hooks class that reports to the thread's witness."""
    found = _hook_classes.get(original)
    if found is not None:
        return found

    class WitnessedCheckpointHook(original):  # type: ignore[misc, valid-type]
        def __init__(self, frame: Any) -> None:
            super().__init__(frame)
            self._backlens_witness = None
            witness = _INVOCATIONS.current()
            if witness is None:
                return
            entry = witness.open(reentrant=False)
            pack = self.pack_hook

            def pack_hook(tensor: Any) -> Any:
                entry.packed += 1
                return pack(tensor)

            self.pack_hook = pack_hook
            self.unpack_hook = witness.unpack_hook(self.unpack_hook, entry, weakref.ref(frame))
            self._backlens_witness = (weakref.ref(witness), entry)

        def __exit__(self, *exc: Any) -> None:
            try:
                super().__exit__(*exc)
            finally:
                found = self._backlens_witness
                if found is not None:
                    witness = found[0]()
                    if witness is not None:
                        witness.close(found[1])

    WitnessedCheckpointHook.__qualname__ = original.__qualname__
    _hook_classes[original] = WitnessedCheckpointHook
    return WitnessedCheckpointHook


def _witnessed_forward(original: Any) -> Any:
    """The reentrant checkpoint Function's forward, reporting to the thread's witness."""

    def forward(ctx: Any, run_function: Any, preserve_rng_state: Any, *args: Any) -> Any:
        witness = _INVOCATIONS.current()
        if witness is None:
            return original(ctx, run_function, preserve_rng_state, *args)
        entry = witness.open(reentrant=True, sequence_nr=_torch.node_sequence_nr(ctx))
        try:
            return original(ctx, run_function, preserve_rng_state, *args)
        finally:
            witness.close(entry)

    return forward
