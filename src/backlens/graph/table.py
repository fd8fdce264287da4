"""The capture's table of autograd nodes: identity, and one entry per node.

A live capture holds its nodes strongly (their wrappers are not weakref-able
and ids are reused once dropped) until ``clear()``. Each batch of newly
discovered nodes is indexed in creation order (sequence number), AccumulateGrad
nodes after the rest in walk order, so the same model and input always give
the same labels.

Discovery runs inside the user's backward call, so it only indexes nodes and
notes the few facts that need the node object (type, sequence number, custom
or not, the source behind an AccumulateGrad). Entries (label, pairing with the
forward, order) are built from those facts in index order when first read,
also after ``clear()``; a table read back from a bundle holds its entries from
the start (``restored``).
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
    """How a node relates to the forward (see capture/pairing.py)."""

    op: int | None = None
    module_call: int | None = None
    module_source: str | None = None
    order: int | None = 1
    param: str | None = None
    source: int | None = None


# describe(type_name, sequence_nr, is_custom, leaf_source, index) -> Pairing
Describe = Callable[[str, "int | None", bool, "int | None", int], Pairing]


class NodeTable:
    """Autograd nodes by index (while a live capture holds them), and their entries."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.index_of: dict[Any, int] = {}
        self.types: list[str] = []
        # Per node: sequence number, custom Function or not, the source an AccumulateGrad feeds.
        self._facts: list[tuple[int | None, bool, int | None]] = []
        self._entries: list[NodeEntry] = []
        self._type_counts: dict[str, int] = {}
        self._building = False

    @classmethod
    def restored(cls, entries: list[NodeEntry]) -> NodeTable:
        """A table of entries read back from a bundle (no nodes)."""
        table = cls()
        table._entries = list(entries)
        table.types = [e.type for e in entries]
        table._facts = [(e.sequence_nr, e.is_custom, e.source) for e in entries]
        return table

    def __len__(self) -> int:
        return len(self.types)

    def is_custom(self, index: int) -> bool:
        return self._facts[index][1]

    def leaf_source(self, index: int) -> int | None:
        """The source an AccumulateGrad node accumulates into (None for other nodes)."""
        return self._facts[index][2]

    def knows(self, node: Any) -> bool:
        return node in self.index_of

    def add(self, found: Iterable[Any], leaf_source: Callable[[Any], int | None]) -> list[int]:
        """Index newly found nodes (creation order); returns their indices.

        ``leaf_source(node)`` names the source an AccumulateGrad node feeds.
        """
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
            self._facts.append((None if unsequenced else seq, _torch.is_custom_function_node(node),
                                leaf_source(node) if type_name == "AccumulateGrad" else None))
            index_of[node] = index
            added.append(index)
        return added

    def repair(self) -> None:
        """After an ``add`` cut short (a Ctrl-C): keep only the nodes every list has."""
        size = min(len(self.nodes), len(self.types), len(self._facts))
        del self.nodes[size:], self.types[size:], self._facts[size:]
        self.index_of = {node: index for node, index in self.index_of.items() if index < size}

    def entries(self, describe: Describe) -> list[NodeEntry]:
        """Every node's entry, building those not built yet with ``describe``."""
        if len(self._entries) < len(self.types) and not self._building:
            self._build(describe)
        return self._entries

    def built(self) -> list[NodeEntry]:
        """The entries built so far (what ``describe`` may read while it builds)."""
        return self._entries

    def _build(self, describe: Describe) -> None:
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
                sequence_nr, is_custom, source = self._facts[index]
                pairing = describe(type_name, sequence_nr, is_custom, source, index)
                entries.append(NodeEntry(
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
                ))
        finally:
            self._building = False

    def clear(self) -> None:
        """Drop every strong reference to autograd nodes; entries stay buildable and readable."""
        self.nodes = []
        self.index_of = {}
