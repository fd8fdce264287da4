"""Forward recording: one journal entry per torch-level op and per module call.

A ``TorchFunctionMode`` sees each torch-level call once (nested calls run with
the mode disabled), so an op is what the model's code called: ``linear``,
``relu``, ``__getitem__``. Module calls are seen through the one module-call
mechanism (``backlens._module_calls``) while a capture records. Each op and module call is
bracketed by autograd sequence numbers, which later pairs every autograd node
with the op and module that created it.

The hot path stores small tuples and nothing that keeps an activation alive;
op entries are built from those rows when first read.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from backlens import _module_calls as module_calls
from backlens import _torch
from backlens._clock import now as _now
from backlens._frames import is_internal
from backlens._nested import first_tensor
from backlens.capture.views import OpView
from backlens.graph.engine import CallSite
from backlens.graph.labels import call_label, op_name, split_call

Tensor = torch.Tensor
_disable_torch_function = _torch.torch_function_disabled
_weak = weakref.ref
_getframe = sys._getframe
# An op's call site is the innermost frame outside torch and backlens (the model's
# line that called ``self.fc1(x)`` for the ``linear`` inside ``nn.Linear``): one
# answer per code object, kept, so the walk costs a dict lookup per frame.
_internal_code: dict[Any, bool] = {}


def _user_site(frame: Any) -> tuple[Any, int] | None:
    """(code, line) of the innermost frame at or above ``frame`` outside torch and backlens."""
    internal = _internal_code
    while frame is not None:
        code = frame.f_code
        skip = internal.get(code)
        if skip is None:
            skip = internal[code] = is_internal(code.co_filename)
        if not skip:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


@dataclass(slots=True)
class OpEntry:
    """One forward op, as journalled (the fields after ``activation`` exist live only)."""

    index: int
    name: str
    label: str
    module_call: int | None
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    num_outputs: int
    parents: list[int]  # op indices
    sources: list[int]  # source indices
    output_nr: int = 0
    inplace: bool = False
    activation: Tensor | None = None
    func: Callable[..., Any] | None = None
    seq_start: int | None = None
    seq_end: int | None = None
    output_node: Any = None
    # When it ran (backlens._clock, None: unknown) and the model's line that called it.
    start_ns: int | None = None
    end_ns: int | None = None
    call_site: Any = None  # a CallSite (graph/engine.py), None: unknown


@dataclass(slots=True)
class ModuleCallEntry:
    """One call of one module, as journalled (the fields after ``output_tracked`` exist live only).

    ``address`` is the module's (``encoder.layer.0``), ``call`` the call's number
    (1-based); the call's label follows from both (``ForwardJournal.call_label``).
    """

    index: int
    address: str
    call: int
    parent: int | None
    op_start: int
    op_end: int | None = None
    output_shape: tuple[int, ...] | None = None
    output_nr: int = 0
    output_tracked: bool = False  # whether its first tensor output had a grad_fn
    start_ns: int | None = None  # when it ran (backlens._clock; None: unknown)
    end_ns: int | None = None
    seq_start: int | None = None
    seq_end: int | None = None
    output_node: Any = None


class ForwardJournal:
    """Everything the forward left behind, in recording order."""

    def __init__(self) -> None:
        self.raw_ops: list[tuple] = []
        # Every op's parent references, back to back (rows hold their start and end):
        # op index >= 0, source -1 - s; repeats are dropped when entries are built.
        self.parent_refs: list[int] = []
        self._ops: list[OpEntry] = []
        self._names: dict[Any, str] = {}
        self._name_counts: dict[str, int] = {}
        self.module_types: dict[str, str] = {}
        self.module_calls: list[ModuleCallEntry] = []
        # Tensors that existed before the forward, by source index: "input" | "param" | "buffer", name.
        self.source_kinds: list[str] = []
        self.source_names: list[str] = []
        self.seq_start: int | None = None
        self.seq_end: int | None = None
        self._op_seq_starts: list[int] | None = None
        self._calls_by_address: dict[str, list[int]] = {}  # module address -> its calls
        self._tree: tuple[int, list[list[int]]] | None = None

    def restore(self, ops: list[OpEntry], module_calls: list[ModuleCallEntry], module_types: dict[str, str],
                source_kinds: list[str], source_names: list[str]) -> None:
        """Fill a fresh journal with entries read back from a bundle."""
        self._ops, self.module_types = ops, module_types
        self.source_kinds, self.source_names = source_kinds, source_names
        self.module_calls, self._calls_by_address = [], {}
        for call in module_calls:
            self.note_call(call)

    # -- module calls: one answer each (the address grammar, API.md §1) ----
    def note_call(self, call: ModuleCallEntry) -> None:
        """Add one module call (in call order)."""
        self.module_calls.append(call)
        self._calls_by_address.setdefault(call.address, []).append(call.index)

    def call_label(self, call: int | None) -> str | None:
        """The label of module call ``call``: its module's address when that module
        has one call so far, else ``address:k``; None for no call."""
        if call is None:
            return None
        entry = self.module_calls[call]
        if len(self._calls_by_address.get(entry.address, ())) > 1:
            return call_label(entry.address, entry.call)
        return entry.address

    def calls_of(self, address: str) -> list[int]:
        """The calls of the module at ``address``, in order (empty when it was never called)."""
        return self._calls_by_address.get(address, [])

    def resolve(self, name: str) -> list[int] | None:
        """The calls an address names: ``"lin"`` every call of ``lin``, ``"lin:2"`` its
        second; None when it names no call (an unknown module, a call it never made)."""
        found = self._calls_by_address.get(name)
        if found:
            return list(found)
        address, number = split_call(name)
        if number is not None:
            calls = self._calls_by_address.get(address, [])
            if 1 <= number <= len(calls):
                return [calls[number - 1]]
        return None

    def placement(self, address: str) -> int | None:
        """The call a module's own work is shown under: its first call or, for a module
        never called itself (``MultiheadAttention.out_proj``), its nearest called ancestor's."""
        while True:
            calls = self._calls_by_address.get(address)
            if calls:
                return calls[0]
            if not address:
                return None
            address = address.rpartition(".")[0]

    def within(self, call: int, root: int) -> bool:
        """Whether module call ``call`` is ``root`` or runs inside it."""
        calls = self.module_calls
        index: int | None = call
        while index is not None:
            if index == root:
                return True
            index = calls[index].parent
        return False

    def _call_tree(self) -> list[list[int]]:
        """Each call's direct children (rebuilt as calls are added)."""
        calls = self.module_calls
        if self._tree is None or self._tree[0] != len(calls):
            children: list[list[int]] = [[] for _ in calls]
            for call in calls:
                if call.parent is not None:
                    children[call.parent].append(call.index)
            self._tree = (len(calls), children)
        return self._tree[1]

    def children(self, call: int) -> list[int]:
        return self._call_tree()[call]

    @property
    def ops(self) -> list[OpEntry]:
        """Every op entry, built from the raw rows on first read."""
        if len(self._ops) < len(self.raw_ops):
            self.op(len(self.raw_ops) - 1)
        return self._ops

    def op(self, index: int) -> OpEntry:
        """Build entries up to ``index`` from the raw rows; labels count in call order."""
        ops = self._ops
        while len(ops) <= index:
            (func, module_call, before, after, shape, dtype, num_outputs, refs_start, refs_end,
             output_node, output_nr, inplace, *timed) = self.raw_ops[len(ops)]
            began, ended, site = timed or (None, None, None)
            parents = dict.fromkeys(self.parent_refs[refs_start:refs_end])
            name = self._names.get(func)
            if name is None:
                name = self._names[func] = op_name(func)
            count = self._name_counts.get(name, 0) + 1
            self._name_counts[name] = count
            ops.append(OpEntry(
                index=len(ops),
                name=name,
                label=f"{name}_{count}",
                func=func,
                module_call=module_call,
                seq_start=before,
                seq_end=after,
                shape=tuple(shape),
                dtype=dtype,
                num_outputs=num_outputs,
                parents=[p for p in parents if p >= 0],
                sources=[-p - 1 for p in parents if p < 0],
                output_node=output_node,
                output_nr=output_nr,
                inplace=inplace,
                start_ns=began,
                end_ns=ended,
                call_site=_call_site(site),
            ))
        return ops[index]

    def op_index_for_sequence_nr(self, seq: int) -> int | None:
        """The index of the op whose bracket contains ``seq`` (the op created that node)."""
        if self._op_seq_starts is None or len(self._op_seq_starts) != len(self.raw_ops):
            self._op_seq_starts = [row[2] for row in self.raw_ops]
        pos = bisect_right(self._op_seq_starts, seq) - 1
        if pos >= 0:
            row = self.raw_ops[pos]
            if row[2] <= seq < row[3]:
                return pos
        return None

    def module_call_of_op(self, index: int) -> int | None:
        """The module call an op ran in (read without building op entries)."""
        return self.raw_ops[index][1]

    def output_node_of_op(self, index: int) -> Any:
        """The node an op's output came from, when the op made several (else None)."""
        if index < len(self._ops):
            return self._ops[index].output_node
        return self.raw_ops[index][9]

    def op_run_by_custom_node(self, seq: int) -> OpEntry | None:
        """The last op a custom Function's forward ran, for its node ``seq``.

        ``Function.apply`` is invisible to the mode and takes its node's sequence
        number before running forward under no_grad, so the ops of that forward
        make no node and sit at ``seq + 1``; the last of them made the output.
        Ops that made no node either may follow it in later module calls (FSDP's
        unsharding before the next unit): only ops inside the module call that
        ran the Function count.
        """
        self.op_index_for_sequence_nr(seq)  # refreshes the bracket index
        call = self.module_call_for_sequence_nr(seq)
        pos = bisect_right(self._op_seq_starts, seq + 1) - 1
        while pos >= 0 and self.raw_ops[pos][2] == seq + 1:
            inside = call is None or (call.op_start <= pos and (call.op_end is None or pos < call.op_end))
            if self.raw_ops[pos][3] == seq + 1 and inside:
                return self.op(pos)
            pos -= 1  # an op after the Function that made nodes of its own, or outside its call
        return None

    def module_call_for_sequence_nr(self, seq: int) -> ModuleCallEntry | None:
        """The innermost module call whose bracket contains ``seq``."""
        best = None
        for call in self.module_calls:
            end = call.seq_end
            if call.seq_start <= seq and (end is None or seq < end):
                if best is None or call.seq_start >= best.seq_start:
                    best = call
        return best

    def drop_nodes(self) -> None:
        """Release every autograd node the journal holds (without building op entries)."""
        for op in self._ops:
            op.output_node = None
        raw = self.raw_ops
        for i in range(len(raw)):  # built entries' rows too: they hold the same node
            if raw[i][9] is not None:
                raw[i] = (*raw[i][:9], None, *raw[i][10:])
        for call in self.module_calls:
            call.output_node = None

    def in_forward(self, seq: int) -> bool:
        return (
            self.seq_start is not None
            and self.seq_end is not None
            and self.seq_start <= seq < self.seq_end
        )


class ActivationPolicy:
    """Which forward outputs to keep: everything, nothing, or a selector."""

    def __init__(self, spec: Any):
        if not (spec is True or spec is False or spec is None or callable(getattr(spec, "matches", None))):
            from backlens.errors import UnsupportedInputError

            raise UnsupportedInputError(
                f"save_activations must be True, False or a selector, not {spec!r} ({type(spec).__name__}).",
                remedy="Pass save_activations=True, False, or a selector such as bl.func('relu').",
            )
        self.spec = spec
        self.keeps_any = spec is not False and spec is not None

    def keeps(self, view: Any) -> bool:
        if self.spec is True:
            return True
        if not self.keeps_any:
            return False
        return bool(self.spec.matches(view))


class ForwardRecorder(TorchFunctionMode):
    """Journals ops (as a TorchFunctionMode) and module calls (as a subscriber of
    ``backlens._module_calls``, for the forward only, ignoring modules outside the
    captured model)."""

    # A subclass method sees every journalled call right after its row:
    # observe_row(index, func, args, kwargs, out). A method, not an attribute set
    # per instance: a bound method stored on the recorder would be a reference cycle.
    observe_row: Callable[..., None] | None = None

    def __init__(self, state: Any, activations: ActivationPolicy,
                 op_hook: Callable[[OpEntry, Any], Any] | None = None):
        super().__init__()
        self.state = state  # the CaptureState whose journal this fills
        journal = self.journal = state.journal
        self.activations = activations
        # An op hook may replace an op's output (activation edits); None keeps the hot path lean.
        self.op_hook = op_hook
        # Where each tensor the forward has seen came from, by id(): op index, or -1 - source.
        # An id outlives its tensor (CPython reuses it), so each is checked against a weak
        # reference to the tensor it was noted for before it counts as a parent.
        self._ids: dict[int, int] = {}
        self._alive: dict[int, weakref.ref] = {}
        self._module_stack: list[int] = []
        self._addresses: dict[int, str] = {}
        self._raw = journal.raw_ops
        self._parent_refs = journal.parent_refs
        # May replace a module call's output (activation edits on module addresses).
        self.module_output_hook: Callable[[ModuleCallEntry, Any], Any] | None = None
        # Records each op's arguments for differentiable replay (capture/replay_record.py), or None.
        self.replay: Any = None
        # Autograd's sequence numbers bracket the nodes each op and module call made. On a torch
        # without them a counter stands in (every op then looks as if it made a node, so none is
        # dropped as an identity) and each op notes its output's node: nodes are paired by identity.
        with_sequence = _torch.HAS_SEQUENCE_NR
        self._seq = _torch.sequence_nr_function() if with_sequence else itertools.count(1).__next__
        self._every_output_node = not with_sequence
        # Set while the recorder reads module outputs itself on a torch without DisableTorchFunction.
        self._own_read = False
        # A memory=True capture's MemoryRecorder (capture/memory.py): told when each module call starts and ends.
        self.memory: Any = None
        self._subscription: Any = None

    def record_replay(self, recording: Any) -> None:
        """Record every op's call into ``recording`` (a ReplayRecording) during the forward."""
        self.replay = recording
        recording.start(self._ids)

    # -- sources ---------------------------------------------------------
    def register_sources(self, kind: str, named: Iterable[tuple[str, Tensor]]) -> list[int]:
        """Note tensors that exist before the forward; returns their source indices."""
        names = self.journal.source_names
        ids, alive = self._ids, self._alive
        start = len(names)
        for name, tensor in named:
            names.append(name)
            ids[id(tensor)] = -len(names)
            alive[id(tensor)] = weakref.ref(tensor)
        self.journal.source_kinds.extend([kind] * (len(names) - start))
        return list(range(start, len(names)))

    # -- module calls ------------------------------------------------------
    def attach(self, addresses: dict[int, str], module_types: dict[str, str]) -> None:
        """Watch the model's module calls (``addresses``: module id -> address) in this thread until ``detach``.

        Through the one module-call mechanism (``backlens._module_calls``):
        modules keep torch's fast path, and other threads' and other models'
        module calls pass straight through.
        """
        self._addresses = addresses
        self.journal.module_types = module_types
        self._subscription = module_calls.subscribe(self)

    def detach(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.cancel()
        self._module_stack.clear()

    def module_called(self, module: Any, args: tuple, kwargs: dict) -> ModuleCallEntry | None:
        """Journal the start of one module call (runs per call: kept flat)."""
        address = self._addresses.get(id(module))
        if address is None:
            return None
        journal = self.journal
        stack = self._module_stack
        index = len(journal.module_calls)
        call = ModuleCallEntry(
            index, address, len(journal.calls_of(address)) + 1, stack[-1] if stack else None,
            op_start=len(self._raw), seq_start=self._seq(),
        )
        journal.note_call(call)
        stack.append(index)
        memory = self.memory
        if memory is not None:
            memory.call_started(index, args, kwargs)
        call.start_ns = _now()
        return call

    def _call_ended(self, call: ModuleCallEntry) -> None:
        call.end_ns = _now()
        self._module_stack.pop()
        if self.memory is not None:
            self.memory.call_ended(call.index)

    def module_raised(self, module: Any, call: ModuleCallEntry) -> None:
        self._call_ended(call)

    def module_returned(self, module: Any, call: ModuleCallEntry, output: Any) -> Any:
        """Journal the end of one module call; an activation edit may replace its output."""
        self._call_ended(call)
        with _disable_torch_function() if _torch.HAS_DISABLE_TORCH_FUNCTION else _OwnRead(self):
            if self.module_output_hook is not None:
                edited = self.module_output_hook(call, output)
                if edited is not output:
                    self._take_place(first_tensor(output), first_tensor(edited))
                output = edited
            call.seq_end = self._seq()
            call.op_end = len(self._raw)
            first = output if isinstance(output, Tensor) else first_tensor(output)
            if self.replay is not None:
                self.replay.module_output(call.index, first)
            if first is not None:
                call.output_shape = tuple(first.shape)
                node = first.grad_fn
                if node is not None:
                    call.output_tracked = True
                    call.output_node = node
                    call.output_nr = first.output_nr
        return output

    # -- ops (hot path) ----------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._own_read:
            return func(*args, **kwargs) if kwargs else func(*args)
        seq = self._seq
        before = seq()
        began = _now()
        out = func(*args, **kwargs) if kwargs else func(*args)
        ended = _now()
        after = seq()
        if isinstance(out, Tensor):
            if after == before and args and out is args[0]:
                return out  # identity (contiguous on a contiguous tensor, .to same dtype)
            outputs = None
            primary = out
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            primary = out[0]
            outputs = out
        elif after != before and args and isinstance(args[0], Tensor):
            primary = args[0]  # in-place op returning None (setitem)
            outputs = None
        else:
            return out
        ids, alive = self._ids, self._alive
        refs = self._parent_refs
        refs_start = len(refs)
        _collect(args, ids, alive, refs)
        if kwargs:
            _collect(kwargs.values(), ids, alive, refs)
        index = len(self._raw)
        if self.replay is not None:
            self.replay.record(index, args, kwargs, outputs, primary)
        if outputs is None:
            ids[id(primary)] = index
            alive[id(primary)] = _weak(primary)
        else:
            for item in outputs:
                if isinstance(item, Tensor):
                    ids[id(item)] = index
                    alive[id(item)] = _weak(item)
        stack = self._module_stack
        output_node = None
        # Always: a single node may hand its op's output any of its outputs
        # (linalg.svdvals returns output 1 of LinalgSvdBackward0).
        output_nr = primary.output_nr
        if after - before > 1 or self._every_output_node:
            # Several nodes were made; remember which one is the output's.
            output_node = primary.grad_fn
        self._raw.append((
            func, stack[-1] if stack else None, before, after, primary.shape, primary.dtype,
            1 if outputs is None else len(outputs), refs_start, len(refs), output_node, output_nr,
            bool(args) and primary is args[0], began, ended, _user_site(_getframe(1)),
        ))
        if self.observe_row is not None:
            self.observe_row(index, func, args, kwargs, out)
        if self.activations.keeps_any or self.op_hook is not None:
            out = self._slow_path(index, out, primary)
        return out

    def _slow_path(self, index: int, out: Any, primary: Tensor) -> Any:
        entry = self.journal.op(index)
        if self.activations.keeps_any and self.activations.keeps(self.state.view(OpView, index)):
            entry.activation = primary.detach().clone()
            if self.replay is not None and out is not primary:
                self.replay.keep_other_outputs(index, out)
        if self.op_hook is not None:
            edited = self.op_hook(entry, out)
            if edited is not out:
                self._take_place(primary, first_tensor(edited))
            out = edited
        return out

    def _take_place(self, original: Tensor | None, edited: Tensor | None) -> None:
        """An edited output stands where the original stood: ops that read it have the
        original's op (or source) as their parent."""
        if original is None or edited is None or edited is original:
            return
        found = self._ids.get(id(original))
        held = self._alive.get(id(original))
        if found is not None and held is not None and held() is original:
            self._ids[id(edited)] = found
            self._alive[id(edited)] = weakref.ref(edited)

    def finish(self, output: Any = None) -> None:
        """Drop the forward-time lookup tables (after the forward that returned ``output``)."""
        if self.replay is not None:
            self.replay.finish(output)
        self._ids = {}
        self._alive = {}


class _OwnRead:
    """The recorder's own reads pass through its function mode (without DisableTorchFunction)."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: ForwardRecorder):
        self.recorder = recorder

    def __enter__(self) -> None:
        self.recorder._own_read = True

    def __exit__(self, *exc: Any) -> None:
        self.recorder._own_read = False


def _call_site(site: tuple[Any, int] | None) -> CallSite | None:
    return CallSite(site[0].co_filename, site[1], site[0].co_name) if site is not None else None




def _collect(items: Any, ids: dict[int, int], alive: dict[int, weakref.ref], refs: list[int]) -> None:
    for item in items:
        if isinstance(item, Tensor):
            found = ids.get(id(item))
            if found is not None and alive[id(item)]() is item:  # not a dead tensor's reused id
                refs.append(found)
        elif isinstance(item, (list, tuple)):
            _collect(item, ids, alive, refs)
