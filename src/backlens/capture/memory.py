"""What the backward holds in memory: the events a ``memory=True`` capture records.

Forward. While the forward records, a ``saved_tensors_hooks`` pair sees every
tensor autograd saves for the backward. The pack hook notes the tensor's
storage (by identity: the storage object and a weak reference to it, never
``id()`` alone, which is reused) and where it was saved (the op the forward
recorder was inside, read from the journal's row count and the autograd
sequence number, and the module call on top of the recorder's stack), and
returns a small holder of ``tensor.detach()``: the same storage, no reference
back to the node (a saved output holding itself would be a cycle), and the
unpack hook hands the very tensor back, so autograd computes exactly what it
would. The holder is dropped when autograd lets the saved tensor go (a node
releases its saved tensors after it runs, unless the graph is retained; a
graph nobody holds releases all of them), and its ``__del__`` notes the
release against the node call then running.

Backward. At each node fire the backward recorder reports the gradients
arriving at the node (their storages), what an AccumulateGrad call adds to
the held parameter gradients (the parameter's bytes when its ``.grad`` was
None) and, on CUDA, ``torch.cuda.memory_allocated()`` at that node boundary.
When a pass closes, each fire learns which earlier fire of the pass first sent
a gradient to its node (from the graph's edges): the gradient is held from
then until the node consumes it. Non-reentrant checkpoint recomputation (seen
by the checkpoint witness) adds the tensors it recomputes as saves of the node
call that triggered it, each released when its node unpacks it.

Everything lands in a :class:`MemoryJournal` of plain data (the state's
``memory``); records compute rows and curves from it, live or loaded.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch

from backlens import _torch
from backlens._clock import now as _now
from backlens._warn import warn

_disable_torch_function = _torch.torch_function_disabled
Tensor = torch.Tensor
Parameter = torch.nn.Parameter

STORAGE_KINDS = ("saved", "param", "buffer", "grad")
UNREADABLE_STORAGE = ("a saved tensor has no storage backlens can read (a sparse or tensor-subclass tensor); "
                      "it is counted by its own bytes, and may be counted more than once")
OUTER_HOOKS = ("the forward ran inside another saved_tensors_hooks context: backlens counts the tensors "
               "autograd saved before that context's pack hook transformed them (offloaded or compressed "
               "tensors are counted at their original size)")
NO_RECOMPUTED_VIEW = ("this torch's checkpoint keeps its recomputed tensors where backlens cannot read them: "
                      "recomputed saves are not counted")


class MemoryJournal:
    """The memory events of one capture, as plain data (see the module docstring).

    Storages: ``storage_bytes[i]`` and ``storage_kinds[i]`` (``saved``, ``param``,
    ``buffer`` or ``grad``). Saves, one per tensor autograd saved:
    ``saved_storage``, ``saved_op`` (op index, None outside any op),
    ``saved_call`` (module call index), ``saved_recomputed`` (made by a
    checkpoint's recomputation in the backward, not by the forward) and
    ``saved_recomputed_by`` (the node call position that recomputed it; None
    for a forward save, or while its pass runs). Releases, in the
    order they happened: ``(save, pass number, call position, passes started)``
    (pass and call None outside a recorded node call). Fires: ``(call position,
    holds, bytes of parameter gradients it made, allocator bytes at its start or
    None)``, where each hold ``(storage, from, until)`` is a gradient held for
    its input slots from one call to another (see :meth:`MemoryRecorder._held`).
    """

    def __init__(self) -> None:
        self.storage_bytes: list[int] = []
        self.storage_kinds: list[str] = []
        self.saved_storage: list[int] = []
        self.saved_op: list[int | None] = []
        self.saved_call: list[int | None] = []
        self.saved_recomputed: list[bool] = []
        self.saved_recomputed_by: list[int | None] = []
        self.releases: list[tuple[int, int | None, int | None, int]] = []
        self.fires: list[tuple[int, tuple[tuple[int, int | None, int | None], ...], int, int | None]] = []
        self.pass_end_allocator: dict[int, int] = {}  # pass number -> allocator bytes when it closed (CUDA)
        self.module_inputs: dict[int, tuple[int, ...]] = {}  # module call -> storages of its tensor arguments
        self.module_forward_ns: dict[int, int] = {}  # module call -> its forward's duration
        self.reasons: list[str] = []  # why the record is incomplete (empty when complete)
        self.version = 0  # bumped at every change a derived table depends on

    def add_reason(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    def add_storage(self, nbytes: int, kind: str) -> int:
        self.storage_bytes.append(nbytes)
        self.storage_kinds.append(kind)
        return len(self.storage_bytes) - 1

    def add_save(self, storage: int, op: int | None, call: int | None, recomputed: bool = False) -> int:
        self.saved_storage.append(storage)
        self.saved_op.append(op)
        self.saved_call.append(call)
        self.saved_recomputed.append(recomputed)
        self.saved_recomputed_by.append(None)
        self.version += 1
        return len(self.saved_storage) - 1


class _StorageIndex:
    """Storages by identity while they live: the storage object (torch keeps one per
    storage while it lives) checked through a weak reference, so a storage that died
    and one born at the same address get different indices."""

    def __init__(self, journal: MemoryJournal) -> None:
        self._journal = journal
        self._live: dict[int, tuple[weakref.ref, int]] = {}

    def of(self, tensor: torch.Tensor, kind: str) -> int:
        """The index of ``tensor``'s storage (added as ``kind`` when first seen)."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            self._journal.add_reason(UNREADABLE_STORAGE)
            return self._journal.add_storage(tensor.numel() * tensor.element_size(), kind)
        key = id(storage)
        found = self._live.get(key)
        if found is not None and found[0]() is storage:
            return found[1]
        if kind == "saved" and (isinstance(tensor, Parameter) or isinstance(_torch.view_base(tensor), Parameter)):
            kind = "param"  # a parameter the model does not register (FSDP2's unsharded ones), or a view of one
        index = self._journal.add_storage(storage.nbytes(), kind)
        try:
            self._live[key] = (weakref.ref(storage), index)  # a dead one is replaced when its id comes back
        except TypeError:  # a storage object that takes no weak reference: never matched again
            pass
        return index


class _Saved:
    """What autograd keeps for one saved tensor: the tensor (detached: the same storage,
    no reference back to its node) and where its release is reported."""

    __slots__ = ("tensor", "owner", "index")

    def __init__(self, tensor: Any, owner: MemoryRecorder, index: int) -> None:
        self.tensor = tensor
        self.owner = owner
        self.index = index

    def __del__(self) -> None:
        owner = self.owner
        if owner is None:
            return  # a save that could not be recorded
        try:
            owner.released(self.index)
        except Exception:  # noqa: BLE001, S110 - a release note must never disturb autograd (or interpreter exit)
            pass


def _unpack(saved: _Saved) -> Any:
    return saved.tensor


class MemoryRecorder:
    """Fills one capture's :class:`MemoryJournal`: saved-tensor hooks in the forward,
    module-call notes, and (as a backward observer) fires, releases and recomputation.

    It reaches the capture state through a weak reference: the graph's saved
    tensors hold it, and a strong reference would tie the state to the graph
    through nodes the collector cannot see.
    """

    def __init__(self, state: Any, forward_recorder: Any, params: dict, buffers: dict,
                 inputs: list[torch.Tensor]) -> None:
        self._state = weakref.ref(state)
        self.journal = state.memory = MemoryJournal()
        self._storages = _StorageIndex(self.journal)
        try:
            for param in params.values():
                self._storages.of(param, "param")
            for buffer in buffers.values():
                self._storages.of(buffer, "buffer")
        except Exception as exc:  # noqa: BLE001 - bookkeeping never breaks the capture
            self._failed("the model's parameters", exc)
        self._raw = state.journal.raw_ops
        self._stack = forward_recorder._module_stack  # the module calls under way (innermost last)
        self._seq = forward_recorder._seq  # the recorder's own clock: a counter where torch has no sequence numbers
        self._pending: list[tuple[int, int]] = []  # per save: (row count, sequence number) when packed
        self._call_start: dict[int, int] = {}
        # During a pass: (call entry, arrived (slot, storage), accumulated, allocator) per fire, and
        # (call entry, node, slot, storage) per gradient a watched node sent into a slot several send to.
        self._fires: list[tuple[Any, tuple[tuple[int, int], ...], int, int | None]] = []
        self._sent: list[tuple[Any, int, int, int]] = []
        self._release_entries: dict[int, Any] = {}  # release position -> call entry (until its pass closes)
        self._recompute_entries: dict[int, Any] = {}  # save -> the call entry that recomputed it
        # Per node, per output: the (node, input slot) it sends that gradient to (node None: not this capture's).
        self._children: list[tuple[tuple[int | None, int], ...]] = []
        self._slot_senders: dict[tuple[int, int], list[int]] = {}  # (node, slot) -> the nodes sending there
        self._watched: set[int] = set()  # nodes with a post-hook reporting what they send
        self._allocated = _allocator_reader([*params.values(), *buffers.values(), *inputs])

    # -- the forward -------------------------------------------------------------
    def saving(self) -> Any:
        """The saved-tensor hooks to hold around the recorded forward."""
        outer = _torch.top_saved_tensors_hooks()
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.journal.add_reason(OUTER_HOOKS)
        outer_pack, outer_unpack = outer
        pack = self._pack

        def pack_through(tensor: torch.Tensor) -> Any:
            saved = pack(tensor)
            saved.tensor = outer_pack(saved.tensor)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack_through, lambda saved: outer_unpack(saved.tensor))

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        journal = self.journal
        stack = self._stack
        with _disable_torch_function():
            held = tensor.detach()
            try:
                storage = self._storages.of(tensor, "saved")
            except Exception as exc:  # noqa: BLE001 - bookkeeping never breaks the user's forward
                self._failed("a saved tensor", exc)
                return _Saved(held, None, -1)
        self._pending.append((len(self._raw), self._seq()))
        index = journal.add_save(storage, None, stack[-1] if stack else None)
        return _Saved(held, self, index)

    def _failed(self, what: str, error: BaseException) -> None:
        """An internal error in memory bookkeeping: the model runs on untouched; the records
        say what they leave out, and a warning says so once per capture."""
        reason = f"{what} could not be recorded ({type(error).__name__}: {error}); the numbers leave it out"
        first = not any(r.endswith("the numbers leave it out") for r in self.journal.reasons)
        self.journal.add_reason(reason)
        if first:
            warn(f"backlens could not record all of what autograd holds: {reason} (cap.memory.reasons).",
                 "memory_incomplete", in_hook=True)

    def call_started(self, index: int, args: tuple, kwargs: dict) -> None:
        """A module call begins: note the storages of its tensor arguments (those a
        checkpoint of the call would keep) and the time."""
        of = self._storages.of
        try:
            with _disable_torch_function():
                found = [of(a, "saved") for a in args if isinstance(a, Tensor)]
                if kwargs:
                    found += [of(v, "saved") for v in kwargs.values() if isinstance(v, Tensor)]
        except Exception as exc:  # noqa: BLE001 - bookkeeping never breaks the user's forward
            self._failed("a module call's arguments", exc)
            found = []
        self.journal.module_inputs[index] = tuple(dict.fromkeys(found))
        self._call_start[index] = _now()

    def call_ended(self, index: int) -> None:
        start = self._call_start.pop(index, None)
        if start is not None:
            self.journal.module_forward_ns[index] = _now() - start

    def finish_forward(self, forward_journal: Any) -> None:
        """Charge each forward save to the op it was made in.

        A save made inside op ``r`` happened after that op's node was made: the
        sequence number then is past the op's start and within its end. A save
        outside any op is a custom Function's (charged to the last op its forward
        ran) or torch's own (checkpoint keeping its inputs: no op).
        """
        raw = forward_journal.raw_ops
        saved_op = self.journal.saved_op
        for save, (rows, seq) in enumerate(self._pending):
            if saved_op[save] is not None:
                continue
            if rows < len(raw) and raw[rows][2] < seq <= raw[rows][3]:
                saved_op[save] = rows
            elif seq > 0:
                op = forward_journal.op_run_by_custom_node(seq - 1)
                saved_op[save] = op.index if op is not None else None
        self._pending = []
        self.journal.version += 1

    # -- the backward ----------------------------------------------------------------
    def nodes_added(self, table: Any, handles: list[Any]) -> None:
        """Nodes joined the capture's table: note where each sends gradients, and watch
        what is sent into an input slot that several nodes send to (the engine sums
        those there, and what the slot holds meanwhile is the first sender's tensor)."""
        try:
            self._note_edges(table, handles)
        except Exception as exc:  # noqa: BLE001 - never stops the capture's recording
            self._failed("where some nodes send their gradients", exc)

    def _note_edges(self, table: Any, handles: list[Any]) -> None:
        nodes, index_of = table.nodes, table.index_of
        children, senders = self._children, self._slot_senders
        while len(children) < len(nodes):
            sender = len(children)
            edges = []
            for child, slot in nodes[sender].next_functions:
                at = index_of.get(child) if child is not None else None
                edges.append((at, slot))  # one per output, in order (None: not this capture's node)
                if at is not None:
                    senders.setdefault((at, slot), []).append(sender)
            children.append(tuple(edges))
        watch = {sender for found in senders.values() if len(found) > 1 for sender in found} - self._watched
        for sender in sorted(watch):
            handles.append(nodes[sender].register_hook(partial(self._on_sent, sender)))
        self._watched |= watch

    def _on_sent(self, sender: int, grad_inputs: tuple, _grad_outputs: tuple) -> None:
        """A watched node ran: what it sent into each slot that several nodes send to."""
        began = _now()
        entry = None
        try:
            state = self._state()
            entry = state.recorder.open_call() if state is not None and state.recorder is not None else None
            if entry is None or entry.node != sender:
                return None
            senders = self._slot_senders
            for (child, slot), grad in zip(self._children[sender], grad_inputs):
                if grad is not None and child is not None and len(senders[(child, slot)]) > 1:
                    self._sent.append((entry, child, slot, self._storages.of(grad, "grad")))
        except Exception as exc:  # noqa: BLE001 - never into the user's backward
            self._failed("what a node sent", exc)
        finally:
            if entry is not None:
                entry.hook_ns += _now() - began
        return None

    def on_fire(self, entry: Any, node: Any, is_accumulate: bool, arriving: tuple) -> None:
        """A node fires (its pre-hook): the gradients arriving at it, and what it adds to
        the held parameter gradients."""
        try:
            of = self._storages.of
            arrived = []
            slot = 0
            for grad in arriving:
                if grad is not None:
                    arrived.append((slot, of(grad, "grad")))
                slot += 1
            accumulated = 0
            if is_accumulate:
                variable = _torch.accumulate_grad_variable(node)
                if variable is not None and variable.grad is None:
                    accumulated = variable.numel() * variable.element_size()
            allocated = self._allocated() if self._allocated is not None else None
        except Exception as exc:  # noqa: BLE001 - never fails the pass's other records
            self._failed("what reached a node", exc)
            return
        self._fires.append((entry, arrived, accumulated, allocated))

    def released(self, save: int) -> None:
        """Autograd let saved tensor ``save`` go: note the node call running now, if any."""
        journal = self.journal
        state = self._state()
        recorder = state.recorder if state is not None else None
        entry = recorder.open_call() if recorder is not None else None
        passes = len(state.passes) if state is not None else 0
        position = len(journal.releases)
        if entry is None:
            journal.releases.append((save, None, None, passes))
        else:
            journal.releases.append((save, entry.pass_number, None, passes))
            self._release_entries[position] = entry
        journal.version += 1

    def recomputed(self, found: list[tuple[Any, torch.Tensor]] | None, call_entry: Any, module_call: int | None,
                   used: torch.Tensor | None) -> None:
        """A checkpoint recomputed in ``call_entry``: ``found`` pairs each tensor it keeps for
        the nodes still to unpack with torch's handle, which dies when it is unpacked (None:
        this torch keeps them out of sight). ``used`` is the tensor the unpack that triggered
        it returned (consumed by that same call)."""
        journal = self.journal
        if found is None:
            journal.add_reason(NO_RECOMPUTED_VIEW)
            return
        for handle, tensor in found:
            save = journal.add_save(self._storages.of(tensor, "saved"), None, module_call, recomputed=True)
            self._recompute_entries[save] = call_entry
            weakref.finalize(handle, _release_later, weakref.ref(self), save)
        if used is not None:
            save = journal.add_save(self._storages.of(used, "saved"), None, module_call, recomputed=True)
            self._recompute_entries[save] = call_entry
            self.released(save)

    # -- observer: a pass closes ---------------------------------------------------------
    def on_pass_close(self, state: Any, pass_: Any, error: BaseException | None) -> None:
        number = pass_.number
        position_of = {id(state.calls[i]): i for i in pass_.calls}
        journal = self.journal
        releases = journal.releases
        for at, entry in list(self._release_entries.items()):
            if entry.pass_number == number:
                save, passed, _call, passes = releases[at]
                releases[at] = (save, passed, position_of.get(id(entry)), passes)
                del self._release_entries[at]
        for save, entry in list(self._recompute_entries.items()):
            if entry.pass_number == number:
                journal.saved_recomputed_by[save] = position_of.get(id(entry))
                del self._recompute_entries[save]
        sent: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for entry, child, slot, storage in self._sent:
            position = position_of.get(id(entry)) if entry.pass_number == number else None
            if position is not None:
                sent.setdefault((child, slot), []).append((position, storage))
        self._sent = [item for item in self._sent if item[0].pass_number != number]
        fires = [fire for fire in self._fires if fire[0].pass_number == number]
        self._fires = [fire for fire in self._fires if fire[0].pass_number != number]
        calls = state.calls
        senders_in_pass: dict[tuple[int, int], list[int]] = {}
        for position in pass_.calls:
            node = calls[position].node
            for edge in self._children[node] if node < len(self._children) else ():
                if edge[0] is not None:
                    senders_in_pass.setdefault(edge, []).append(position)
        for entry, arrived, accumulated, allocated in fires:
            position = position_of.get(id(entry))
            if position is None:
                continue  # the fire a failed pass left open
            node = calls[position].node
            holds: list[tuple[int, int | None, int | None]] = []
            for slot, storage in arrived:
                senders = [s for s in senders_in_pass.get((node, slot), ()) if s < position]
                holds += self._held(storage, senders, sent.get((node, slot), []))
            journal.fires.append((position, tuple(holds), accumulated, allocated))
        if self._allocated is not None:
            journal.pass_end_allocator[number] = self._allocated()
        journal.version += 1

    def _held(self, storage: int, senders: list[int],
              sent: list[tuple[int, int]]) -> list[tuple[int, int | None, int | None]]:
        """How the gradient that arrived at one input slot was held: ``(storage, from, until)``
        with ``from`` the call after which it is held (None: from before the pass to its
        end, as the seed gradient) and ``until`` the call that stopped holding it (None:
        the call that consumed it).

        ``senders`` are the calls that sent into the slot, in order. One sender: its
        tensor, from its call. Several: the engine keeps the first sender's tensor
        and sums each later one into it, in place when nobody else holds it (then
        the slot keeps that storage throughout), else into a new tensor at each
        later sender's call (sums between the second and the last sender are
        counted at the final sum's size).
        """
        if not senders:
            return [(storage, None, None)]
        first = next((found for position, found in sent if position == senders[0]), None)
        if len(senders) == 1 or first is None or first == storage:
            return [(storage, senders[0], None)]
        holds: list[tuple[int, int | None, int | None]] = [(first, senders[0], senders[1])]
        size = self.journal.storage_bytes[storage]
        for start, until in zip(senders[1:-1], senders[2:]):
            holds.append((self.journal.add_storage(size, "grad"), start, until))  # an intermediate sum
        holds.append((storage, senders[-1], None))
        return holds


def _release_later(recorder_ref: weakref.ref, save: int) -> None:
    recorder = recorder_ref()
    if recorder is not None:
        recorder.released(save)


def _allocator_reader(tensors: list[torch.Tensor]) -> Any:
    """``torch.cuda.memory_allocated`` for the model's CUDA device (None off CUDA)."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            device = tensor.device
            return lambda: torch.cuda.memory_allocated(device)
    return None

