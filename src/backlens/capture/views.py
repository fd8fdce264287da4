"""Views of a capture state's entries: what selectors, edits and explanations read.

A view is a position in one of the state's entry lists, read through the
state: nothing is copied, so a field that changes while a pass runs reads as
it is now. :meth:`CaptureState.view <backlens.capture.state.CaptureState.view>`
makes each view once and holds it weakly; the view holds the state. Records
(:mod:`backlens.records`) are these views with the public surface added, and
relate to records where these relate to views (``VIEWS``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from backlens.graph.labels import owning_module


def entry_field(name: str, doc: str | None = None) -> property:
    """A property reading one field of the viewed entry."""
    return property(lambda self: getattr(self._entry, name), doc=doc)


class View:
    """One entry of a capture state: ``_state`` and the entry's position ``_at``."""

    __slots__ = ("_state", "_at", "__weakref__")
    kind: ClassVar[str]
    # The class a related entry of each kind is read as (views relate to views, records to records).
    VIEWS: ClassVar[dict[str, type[View]]] = {}

    def __init__(self, state: Any, at: int):
        self._state = state
        self._at = at

    def _related(self, kind: str, at: int | None) -> Any:
        return None if at is None else self._state.view(self.VIEWS[kind], at)


class OpView(View):
    """One forward op (``linear_2``)."""

    __slots__ = ()
    kind = "op"

    @property
    def _entry(self) -> Any:
        return self._state.journal.ops[self._at]

    @property
    def index(self) -> int:
        """0-based position in the forward."""
        return self._at

    label = entry_field("label", "``{func}_{k}``: the k-th call of that torch function.")
    func = entry_field("name", "The torch function's short name (``linear``, ``relu``).")
    inplace = entry_field("inplace", "Whether the op wrote into its input.")
    shape = entry_field("shape", "Shape of the (first) output.")
    dtype = entry_field("dtype", "Dtype of the (first) output.")
    num_outputs = entry_field("num_outputs", "How many tensors the op returned.")
    activation = entry_field("activation", "The kept output (``save_activations``), else None.")
    call_site = entry_field("call_site", "The model's line that ran it: a ``CallSite(file, line, function)``, "
                                         "the innermost frame outside torch (None: unknown).")

    @property
    def module(self) -> str | None:
        """Label of the innermost module call the op ran in (None outside the model)."""
        return self._state.journal.call_label(self._entry.module_call)

    @property
    def parents(self) -> list[str]:
        """Labels of the ops whose outputs this op read."""
        ops = self._state.journal.ops
        return [ops[p].label for p in self._entry.parents]

    @property
    def param_parents(self) -> list[str]:
        """Names of the parameters this op read."""
        journal = self._state.journal
        return [journal.source_names[s] for s in self._entry.sources if journal.source_kinds[s] == "param"]


class NodeView(View):
    """One autograd node (``addmm_back_1_4``)."""

    __slots__ = ()
    kind = "grad_fn"

    @property
    def _entry(self) -> Any:
        return self._state.nodes[self._at]

    @property
    def index(self) -> int:
        return self._at

    label = entry_field("label", "``{type}_back_{k}_{n}``.")
    type = entry_field("type", "Torch's node class name (``AddmmBackward0``).")
    module_source = entry_field("module_source", "``paired``, ``inferred`` or None.")
    order = entry_field("order", "1 for forward nodes, the creator's order + 1 for nodes a pass made.")
    is_custom = entry_field("is_custom", "Whether it is a custom ``torch.autograd.Function``'s node.")
    param = entry_field("param", "The parameter an AccumulateGrad node accumulates into.")
    sequence_nr = entry_field("sequence_nr")

    @property
    def op(self) -> Any:
        """The forward op this node is paired with (None for the loss, AccumulateGrad...)."""
        return self._related("op", self._entry.op)

    @property
    def module(self) -> str | None:
        """The module call this node belongs to (its label); for AccumulateGrad, its
        parameter's module (the address: all its calls, also when it was never called)."""
        entry = self._entry
        if entry.param is not None:
            return owning_module(entry.param)
        return self._state.journal.call_label(entry.module_call)

    @property
    def module_call(self) -> str | None:
        """The module call its work is shown under in reports: its own; for AccumulateGrad
        its module's first call, or its nearest called ancestor's."""
        return self._state.journal.call_label(self._entry.module_call)

    @property
    def func(self) -> str | None:
        op = self.op
        return op.func if op is not None else None

    @property
    def calls(self) -> list[Any]:
        """This node's call entries (``pass_number`` each), in firing order."""
        calls = self._state.calls
        return [calls[i] for i in self._state.node_calls[self._at]]


View.VIEWS = {"op": OpView, "grad_fn": NodeView}


class InputNode:
    """What a save policy sees for a non-leaf input's gradient: that input, standing
    where a node would (its grad_fn belongs to the graph it came from, not to the
    capture). ``label`` is the input's name (``args[0]``), ``type`` its grad_fn's class."""

    __slots__ = ("label", "type")
    kind = "grad_fn"
    op = None
    module = None
    func = None
    param = None
    order = 1
    is_custom = False
    calls: tuple = ()

    def __init__(self, label: str, type_name: str):
        self.label = label
        self.type = type_name
