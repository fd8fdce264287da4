"""The capture's table of autograd nodes: identity, labels, pairing, order.

Nodes are held strongly for the capture's life (their wrappers are not
weakref-able and ids are reused once dropped); ``clear()`` releases them.
Each batch of newly discovered nodes is indexed in creation order (sequence
number), AccumulateGrad nodes after the rest in walk order, so the same model
and input always give the same labels.

Discovery runs inside the user's backward call, so it only indexes nodes
and notes the few facts that need the node object (type, sequence number,
custom or not, the leaf behind an AccumulateGrad); entries (label, pairing
with the forward, order) are built from those facts in index order when first
read, also after ``clear()`` has dropped the nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from backlens import _torch
from backlens.graph.labels import node_label, node_type_stem

_NO_SEQUENCE = 2**63  # AccumulateGrad and friends carry UINT64_MAX


@dataclass(slots=True)
class NodeEntry:
    """What backlens knows of one autograd node."""

    index: int
    label: str
    type: str
    sequence_nr: int | None
    op: int | None
    module_call: int | None
    module_source: str | None
    order: int | None
    is_custom: bool
    param: str | None
    source: int | None  # source index (ForwardJournal.source_names) for AccumulateGrad of a source


@dataclass(slots=True)
class Pairing:
    """How a node relates to the forward: filled in by the capture."""

    op: int | None = None
    module_call: int | None = None
    module_source: str | None = None
    order: int | None = 1
    param: str | None = None
    source: int | None = None


class NodeTable:
    """Autograd nodes by index, and their entries (built on read).

    ``describe(type_name, sequence_nr, is_custom, leaf_source)`` pairs a node
    with the forward; ``leaf_source(node)`` names the source an AccumulateGrad
    node accumulates into (None for other leaves).
    """

    def __init__(
        self,
        describe: Callable[[str, int | None, bool, int | None], Pairing],
        leaf_source: Callable[[Any], int | None],
    ):
        self._describe = describe
        self._leaf_source = leaf_source
        self.nodes: list[Any] = []
        self.types: list[str] = []
        self.is_custom: list[bool] = []
        self.index_of: dict[Any, int] = {}
        self._sequence_nrs: list[int | None] = []
        self._leaf_sources: dict[int, int | None] = {}
        self._entries: list[NodeEntry] = []
        self._type_counts: dict[str, int] = {}
        self._building = False

    def __len__(self) -> int:
        return len(self.types)

    def leaf_source(self, index: int) -> int | None:
        """The source an AccumulateGrad node accumulates into (None for other nodes)."""
        return self._leaf_sources.get(index)

    def knows(self, node: Any) -> bool:
        return node in self.index_of

    def add(self, found: Iterable[Any]) -> list[int]:
        """Index newly found nodes (creation order); returns their indices."""
        keyed = []
        for position, node in enumerate(found):
            seq = _torch.node_sequence_nr(node)
            unsequenced = seq is None or seq >= _NO_SEQUENCE
            keyed.append((1 if unsequenced else 0, 0 if unsequenced else seq, position, node))
        keyed.sort(key=lambda item: item[:3])
        added = []
        index_of = self.index_of
        for unsequenced, seq, _position, node in keyed:
            if node in index_of:
                continue
            index = len(self.types)
            type_name = type(node).__name__
            self.nodes.append(node)
            self.types.append(type_name)
            self.is_custom.append(_torch.is_custom_function_node(node))
            self._sequence_nrs.append(None if unsequenced else seq)
            if type_name == "AccumulateGrad":
                self._leaf_sources[index] = self._leaf_source(node)
            index_of[node] = index
            added.append(index)
        return added

    @property
    def entries(self) -> list[NodeEntry]:
        """Every node's entry, built up to the last indexed node on read."""
        if len(self._entries) < len(self.types) and not self._building:
            self._build()
        return self._entries

    def _build(self) -> None:
        # Describing a node may read earlier entries (a created node's creator):
        # those are built already, and re-entrant reads see the partial list.
        self._building = True
        try:
            entries = self._entries
            for index in range(len(entries), len(self.types)):
                type_name = self.types[index]
                stem = node_type_stem(type_name)
                k = self._type_counts.get(stem, 0) + 1
                self._type_counts[stem] = k
                sequence_nr = self._sequence_nrs[index]
                is_custom = self.is_custom[index]
                # None once the capture is gone (a fire under way when it was collected).
                pairing = self._describe(type_name, sequence_nr, is_custom, self.leaf_source(index)) or Pairing()
                entries.append(
                    NodeEntry(
                        index=index,
                        label=node_label(type_name, k, index + 1),
                        type=type_name,
                        sequence_nr=sequence_nr,
                        op=pairing.op,
                        module_call=pairing.module_call,
                        module_source=pairing.module_source,
                        order=pairing.order,
                        is_custom=is_custom,
                        param=pairing.param,
                        source=pairing.source,
                    )
                )
        finally:
            self._building = False

    def clear(self) -> None:
        """Drop every strong reference to autograd nodes; entries stay buildable and readable."""
        self.nodes = []
        self.index_of = {}
