"""Forward recording: one journal entry per torch-level op and per module call.

A ``TorchFunctionMode`` sees each torch-level call once (nested calls run with
the mode disabled), so an op is what the model's code called: ``linear``,
``relu``, ``__getitem__``. Module calls come from forward pre/post hooks. Each
op and module call is bracketed by autograd sequence numbers, which later
pairs every autograd node with the op and module that created it.

The hot path stores small tuples and nothing that keeps an activation alive;
records are built from the journal when read.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from backlens import _torch
from backlens.graph.labels import op_name

Tensor = torch.Tensor
_sequence_nr = _torch.sequence_nr


@dataclass
class OpEntry:
    """One forward op, as journalled."""

    index: int
    name: str
    label: str
    func: Callable[..., Any]
    module_call: int | None
    seq_start: int
    seq_end: int
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    num_outputs: int
    parents: list[int]
    sources: list[int]
    output_node: Any = None
    output_nr: int = 0
    activation: Tensor | None = None


@dataclass
class ModuleCallEntry:
    """One call of one module, as journalled."""

    index: int
    address: str
    module_address: str
    call_number: int
    parent: int | None
    seq_start: int
    op_start: int
    children: list[int] = field(default_factory=list)
    seq_end: int | None = None
    op_end: int | None = None
    output_node: Any = None
    output_nr: int = 0
    output_shape: tuple[int, ...] | None = None


@dataclass
class Source:
    """A tensor that existed before the forward: a model input or a parameter."""

    kind: str  # "input" | "param" | "buffer"
    name: str


class ForwardJournal:
    """Everything the forward left behind, in recording order."""

    def __init__(self) -> None:
        self.ops: list[OpEntry] = []
        self.module_calls: list[ModuleCallEntry] = []
        self.sources: list[Source] = []
        self.seq_start: int | None = None
        self.seq_end: int | None = None
        self._op_seq_starts: list[int] | None = None

    def op_for_sequence_nr(self, seq: int) -> OpEntry | None:
        """The op whose bracket contains ``seq`` (the op created that node)."""
        if self._op_seq_starts is None or len(self._op_seq_starts) != len(self.ops):
            self._op_seq_starts = [op.seq_start for op in self.ops]
        pos = bisect_right(self._op_seq_starts, seq) - 1
        if pos >= 0:
            op = self.ops[pos]
            if op.seq_start <= seq < op.seq_end:
                return op
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

    def in_forward(self, seq: int) -> bool:
        return (
            self.seq_start is not None
            and self.seq_end is not None
            and self.seq_start <= seq < self.seq_end
        )


class ActivationPolicy:
    """Which forward outputs to keep: everything, nothing, or a selector."""

    def __init__(self, spec: Any):
        self.spec = spec
        self.keeps_any = spec is not False and spec is not None

    def keeps(self, view: Any) -> bool:
        if self.spec is True:
            return True
        if not self.keeps_any:
            return False
        return bool(self.spec.matches(view))


@dataclass
class OpView:
    """What a selector sees of an op while the forward runs."""

    label: str
    func: str
    module: str | None
    kind: str = "op"


class ForwardRecorder(TorchFunctionMode):
    """Journals ops (as a TorchFunctionMode) and module calls (as hooks)."""

    def __init__(self, journal: ForwardJournal, activations: ActivationPolicy,
                 op_hook: Callable[[OpEntry, Any], Any] | None = None):
        super().__init__()
        self.journal = journal
        self.activations = activations
        # An op hook may replace an op's output (activation edits); None keeps the hot path lean.
        self.op_hook = op_hook
        self._ids: dict[int, int] = {}
        self._names: dict[Any, str] = {}
        self._name_counts: dict[str, int] = {}
        self._module_stack: list[int] = []
        self._module_call_counts: dict[str, int] = {}
        self._handles: list[Any] = []

    # -- sources ---------------------------------------------------------
    def register_source(self, tensor: Tensor, kind: str, name: str) -> None:
        self.journal.sources.append(Source(kind, name))
        self._ids[id(tensor)] = -len(self.journal.sources)

    # -- module hooks ----------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        for address, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(address)))
            self._handles.append(
                module.register_forward_hook(self._post_hook(), always_call=True)
            )

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, address: str):
        journal = self.journal
        stack = self._module_stack
        counts = self._module_call_counts

        def pre(module, args):
            number = counts.get(address, 0) + 1
            counts[address] = number
            parent = stack[-1] if stack else None
            call = ModuleCallEntry(
                index=len(journal.module_calls),
                address=address if number == 1 else f"{address}:{number}",
                module_address=address,
                call_number=number,
                parent=parent,
                seq_start=_sequence_nr() or 0,
                op_start=len(journal.ops),
            )
            if parent is not None:
                journal.module_calls[parent].children.append(call.index)
            journal.module_calls.append(call)
            stack.append(call.index)

        return pre

    def _post_hook(self):
        journal = self.journal
        stack = self._module_stack

        def post(module, args, output):
            if not stack:
                return None
            call = journal.module_calls[stack.pop()]
            call.seq_end = _sequence_nr() or 0
            call.op_end = len(journal.ops)
            first = _first_tensor(output)
            if first is not None:
                call.output_shape = tuple(first.shape)
                if first.grad_fn is not None:
                    call.output_node = first.grad_fn
                    call.output_nr = first.output_nr
            return None

        return post

    # -- ops -------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        before = _sequence_nr()
        out = func(*args, **kwargs)
        after = _sequence_nr()
        if isinstance(out, Tensor):
            primary = out
            outputs = None
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            primary = out[0]
            outputs = out
        elif after != before and args and isinstance(args[0], Tensor):
            primary = args[0]  # in-place op returning None (setitem)
            outputs = None
        else:
            return out
        if after == before and args and primary is args[0]:
            return out  # identity (contiguous on a contiguous tensor, .to same dtype)
        entry = self._record(func, args, kwargs, primary, outputs, before or 0, after or 0)
        if self.op_hook is not None:
            out = self.op_hook(entry, out)
        return out

    def _record(self, func, args, kwargs, primary, outputs, before, after) -> OpEntry:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = op_name(func)
        count = self._name_counts.get(name, 0) + 1
        self._name_counts[name] = count
        ids = self._ids
        parents: list[int] = []
        sources: list[int] = []
        for arg in args:
            _collect(arg, ids, parents, sources)
        for arg in kwargs.values():
            _collect(arg, ids, parents, sources)
        journal = self.journal
        index = len(journal.ops)
        stack = self._module_stack
        entry = OpEntry(
            index=index,
            name=name,
            label=f"{name}_{count}",
            func=func,
            module_call=stack[-1] if stack else None,
            seq_start=before,
            seq_end=after,
            shape=tuple(primary.shape),
            dtype=primary.dtype,
            num_outputs=len(outputs) if outputs is not None else 1,
            parents=parents,
            sources=sources,
        )
        if after - before > 1:
            # Several nodes were made; remember which one is the output's.
            entry.output_node = primary.grad_fn
            entry.output_nr = primary.output_nr
        if outputs is None:
            ids[id(primary)] = index
        else:
            for item in outputs:
                if isinstance(item, Tensor):
                    ids[id(item)] = index
        if self.activations.keeps_any:
            module = journal.module_calls[entry.module_call].address if entry.module_call is not None else None
            if self.activations.keeps(OpView(entry.label, name, module)):
                entry.activation = primary.detach().clone()
        journal.ops.append(entry)
        return entry


def _collect(arg: Any, ids: dict[int, int], parents: list[int], sources: list[int]) -> None:
    if isinstance(arg, Tensor):
        found = ids.get(id(arg))
        if found is not None:
            if found >= 0:
                if found not in parents:
                    parents.append(found)
            elif found not in sources:
                sources.append(found)
    elif isinstance(arg, (list, tuple)):
        for item in arg:
            if isinstance(item, Tensor):
                _collect(item, ids, parents, sources)


def _first_tensor(value: Any) -> Tensor | None:
    for tensor in iter_tensors(value):
        return tensor
    return None


def iter_tensors(value: Any, path: str = ""):
    """Yield the tensors inside nested tuples, lists, dicts and ModelOutputs."""
    for _path, tensor in iter_named_tensors(value, path):
        yield tensor


def iter_named_tensors(value: Any, path: str = ""):
    """Yield ``(path, tensor)`` for every tensor inside a nested structure."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keys"):
        try:
            items = list(value.items())
        except Exception:  # noqa: BLE001 - objects with a broken items() are not containers
            return
        for key, item in items:
            yield from iter_named_tensors(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from iter_named_tensors(item, f"{path}[{position}]")
