"""The one state of a capture: what it recorded, as plain entries.

A :class:`CaptureState` holds the forward journal (op and module call
entries), the node table (node entries), the call and pass entries of the
backward, the gradient slots, the cost journal and the tensor store. A live
capture's recorders write into it; ``bl.load`` fills one from a bundle
(:mod:`backlens.io.schema`), and the same record code reads both. Nothing in
it refers to a record, a report or a bundle.

Records are views keyed by (state, position): :meth:`CaptureState.view` makes
each one once and holds it weakly, and the view holds the state strongly. So
there is no cycle and no second copy: a record read twice is the same object
while anyone holds it, also after the ``Capture`` that read it is gone, and a
field that changes while a pass runs reads its entry as it is now.

A live state also holds its :class:`~backlens.capture.backward.BackwardRecorder`,
which reaches back only weakly: a state nobody holds (no capture, no record)
is freed by reference counting and removes the recorder's hooks as it goes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from backlens._fence import complete
from backlens.capture.forward import ForwardJournal
from backlens.capture.pairing import describe_node
from backlens.capture.slots import GradSlots
from backlens.capture.store import MemoryStore, TensorStore
from backlens.graph.table import NodeEntry, NodeTable


@dataclass(frozen=True)
class EditApplication:
    """One application of an edit (on a pass's ``edits`` or the capture's ``forward_edits``)."""

    site: str
    edit: str
    op: str | None
    module: str | None
    pass_number: int | None
    norm_before: float
    norm_after: float


@dataclass(eq=False, slots=True)
class ParamEntry:
    """One named parameter; ``param`` (live) is a weak reference to it, ``saved_grad``
    (loaded) the ``param.grad`` a bundle kept."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    param: Any = None
    saved_grad: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor | None:
        """The accumulated ``param.grad`` (live), or the one saved with the bundle."""
        if self.param is None:
            return self.saved_grad
        param = self.param()
        return param.grad if param is not None else None


@dataclass(eq=False, slots=True)
class InputEntry:
    """One tensor found in the model's inputs."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    was_parameter: bool


@dataclass(eq=False, slots=True)
class CallEntry:
    """One fire of one node (the fields between ``grad_outputs`` and ``hook_ns`` exist live only)."""

    node: int
    pass_number: int
    ordinal: int
    start_ns: int | None
    end_ns: int
    grad_inputs: tuple | None  # store handles of the kept gradients, None when not kept
    grad_outputs: tuple | None
    seq_start: int | None = None
    seq_end: int | None = None
    hook_ns: int = 0  # time spent in backlens's own post-hook inside the fire (not the node's)
    wait_ns: int = 0  # time inside the fire spent issuing or waiting for collectives (theirs, not the node's)
    flops: int | None = None  # written when the pass closes, by backlens.cost (None: not counted)
    recompute_flops: int | None = None


@dataclass(eq=False)
class PassEntry:
    """One backward engine run over the capture's graph (``calls`` follows from the call
    entries; the fields after it exist live only)."""

    number: int
    trigger: str
    call_site: Any
    retain_graph: bool | None
    create_graph: bool
    policy: Any
    start_ns: int
    status: str = "running"
    # torch.profiler's clock minus start_ns's (backlens._clock), measured as the pass opened; None: unknown.
    clock_offset_ns: int | None = None
    error: BaseException | None = None
    end_ns: int | None = None
    orders: list[int] = field(default_factory=list)
    order_coverage: float = 1.0  # the resolved fraction of the nodes that fired (written at close)
    other_capture_nodes: int = 0  # nodes of the same engine run that other captures recorded
    edits: list[Any] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # call entry indices, in firing order
    run: Any = None  # the engine run (graph/engine.py)
    sides: list[int] = field(default_factory=list)  # per node: which gradients this pass keeps
    node_edits: dict[int, Any] = field(default_factory=dict)  # per node: the edit sites matching it this pass
    kept_inputs: frozenset[int] = frozenset()  # non-leaf inputs whose gradient this pass keeps
    created_roots: list[Any] = field(default_factory=list)
    seq_start: int | None = None
    seq_end: int | None = None
    result: Any = None
    failed_node: int | None = None
    recording_error: BaseException | None = None  # an internal error in a hook (status recording_failed)
    drain_queued: bool = False  # whether its fires end when the engine drains (distributed captures)
    # Per thread, the profiler ranges open for its node calls ((node, handle), innermost last);
    # None when no torch.profiler recorded as the pass opened (then none are made).
    ranges: dict[int, list[tuple[int, Any]]] | None = None


@dataclass(eq=False, slots=True)
class CollectiveEntry:
    """One collective a backward issued (DDP's bucket all-reduce, FSDP's all-gathers and
    reduce-scatters): ``bytes`` of the buffer it reduces or gathers, the parameters it
    carries (by name) and their modules; ``end_ns`` is when its work completed (None
    until seen complete)."""

    pass_number: int
    kind: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    bytes: int
    start_ns: int
    end_ns: int | None
    params: tuple[str, ...]
    modules: tuple[str, ...]


class CaptureState:
    """One capture's recorded state (see the module docstring)."""

    def __init__(self, store: Any = None) -> None:
        self.journal = ForwardJournal()
        self.table = NodeTable()
        self.calls: list[CallEntry] = []
        self.node_calls: list[list[int]] = []  # per node: its call entries, in firing order
        self.passes: list[PassEntry] = []
        self.collectives: list[CollectiveEntry] = []  # in the order they were issued
        self.params: list[ParamEntry] = []
        self.inputs: list[InputEntry] = []
        self.slots = GradSlots()
        # (input, gradient, pass number) that torch.autograd.grad returned for an input.
        self.extra_input_grads: list[tuple[int, torch.Tensor, int]] = []
        self.forward_edits: list[Any] = []
        self.cost: Any = None  # a CostJournal (backlens.cost.journal), None without one
        self.checkpoints: Any = None  # a CheckpointJournal (backlens.cost.checkpoints), None: not witnessed
        self.replay: Any = None  # a ReplayRecording (live, when activations were kept), None otherwise
        self.memory: Any = None  # a MemoryJournal (capture/memory.py) of a memory=True capture, None otherwise
        self.store: TensorStore = store if store is not None else MemoryStore()
        self.inference_only = False
        self.inference_cause: str | None = None
        self.backward_requested = True
        self.backward_unavailable: str | None = None  # why this torch cannot record a backward (a capability)
        self.flops_enabled = False
        # torch.profiler's clock minus the forward's times' (backlens._clock), as it began; None: unknown.
        self.forward_clock_offset_ns: int | None = None
        self.rank: int | None = None  # under torch.distributed: this process's rank and the world size
        self.world_size: int | None = None
        self.recorder: Any = None  # a live capture's BackwardRecorder
        self.closed = False
        self.interrupted: str | None = None  # why recording stopped (an interrupted update), else None
        self._views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._input_of_source: dict[int, int] | None = None

    # -- views -----------------------------------------------------------------
    def view(self, cls: type, at: int) -> Any:
        """The ``cls`` view of entry ``at``: the same object while anyone holds it."""
        key = (cls, at)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = cls(self, at)
        return found

    @property
    def nodes(self) -> list[NodeEntry]:
        """Every discovered node's entry (entries are built when first read)."""
        built = self.table.built()
        if len(built) == len(self.table):
            return built
        return self.table.entries(partial(describe_node, self))

    def sync(self) -> None:
        """Before reading nodes, calls or passes of a live capture: discover the forward
        graph, and close implicit passes whose engine run has drained."""
        recorder = self.recorder
        if recorder is not None:
            if not self.closed and not self.inference_only:
                recorder.discover_forward()
            recorder.close_stale()

    # -- gradients ---------------------------------------------------------------
    def grad_slots(self) -> GradSlots:
        """The gradient slots, mapped up to the last node entry."""
        if self._input_of_source is None:
            kinds = self.journal.source_kinds
            self._input_of_source = {s: i for i, s in enumerate(s for s, k in enumerate(kinds) if k == "input")}
        return self.slots.sync(self.nodes, self._input_of_source)

    def node_of_op(self, index: int) -> int | None:
        return self.grad_slots().op.get(index)

    def node_of_module_call(self, index: int) -> int | None:
        return self.grad_slots().module.get(index)

    def saved_grads(self, node: int | None, output_nr: int = 0) -> list[tuple[torch.Tensor, int]]:
        """(gradient, pass number) for each call of ``node`` that kept output ``output_nr``'s gradient."""
        if node is None:
            return []
        calls, load = self.calls, self.store.load
        grads = []
        for i in self.node_calls[node]:
            entry = calls[i]
            saved = load(entry.grad_outputs) if entry.grad_outputs is not None else None
            if saved is not None and output_nr < len(saved) and saved[output_nr] is not None:
                grads.append((saved[output_nr], entry.pass_number))
        return grads

    def op_grads(self, index: int) -> list[tuple[torch.Tensor, int]]:
        return self.saved_grads(self.node_of_op(index), self.journal.ops[index].output_nr)

    def module_grads(self, index: int) -> list[tuple[torch.Tensor, int]]:
        return self.saved_grads(self.node_of_module_call(index), self.journal.module_calls[index].output_nr)

    def param_increments(self, name: str) -> list[tuple[torch.Tensor, int]]:
        return self.saved_grads(self.grad_slots().param.get(name))

    def input_grads(self, index: int) -> list[tuple[torch.Tensor, int]]:
        grads = self.saved_grads(*self.grad_slots().input.get(index, (None, 0)))
        grads += [(grad, number) for i, grad, number in self.extra_input_grads if i == index]
        return sorted(grads, key=lambda g: g[1])

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook and drop every autograd node; everything recorded stays readable."""
        if self.recorder is not None:
            complete(self.recorder.close)  # every hook goes, also when a Ctrl-C arrives meanwhile
        self.table.clear()
        self.journal.drop_nodes()
        self.slots.drop_nodes()
        self.replay = None  # replay needs the model, which a closed capture lets go of
        self.closed = True

    def __del__(self) -> None:
        # A state nobody holds takes its recorder's hooks and its place in the
        # engine router with it.
        recorder = self.__dict__.get("recorder")
        if recorder is not None:
            try:
                recorder.remove_hooks()
            except Exception:  # noqa: BLE001, S110 - at interpreter exit torch (and this module) may be half gone
                pass
