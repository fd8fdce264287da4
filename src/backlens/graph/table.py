"""The capture's table of autograd nodes: identity, labels, pairing, order.

Nodes are held strongly for the capture's life (their wrappers are not
weakref-able and ids are reused once dropped); ``clear()`` releases them.
Each batch of newly discovered nodes is labelled in creation order (sequence
number), AccumulateGrad nodes after the rest in walk order, so the same model
and input always give the same labels.
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
    source: int | None  # index into ForwardJournal.sources for AccumulateGrad of a source


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
    def __init__(self, describe: Callable[[Any, str, int | None], Pairing]):
        self._describe = describe
        self.nodes: list[Any] = []
        self.entries: list[NodeEntry] = []
        self.index_of: dict[Any, int] = {}
        self._type_counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def knows(self, node: Any) -> bool:
        return node in self.index_of

    def add(self, found: Iterable[Any]) -> list[int]:
        """Label and pair newly found nodes; returns their indices."""
        batch = list(found)
        keyed = []
        for position, node in enumerate(batch):
            seq = _torch.node_sequence_nr(node)
            unsequenced = seq is None or seq >= _NO_SEQUENCE
            keyed.append((1 if unsequenced else 0, 0 if unsequenced else seq, position, node))
        keyed.sort(key=lambda item: item[:3])
        added = []
        for _unsequenced, seq, _position, node in keyed:
            if node in self.index_of:
                continue
            type_name = type(node).__name__
            stem = node_type_stem(type_name)
            k = self._type_counts.get(stem, 0) + 1
            self._type_counts[stem] = k
            index = len(self.nodes)
            sequence_nr = None if _unsequenced else seq
            pairing = self._describe(node, type_name, sequence_nr)
            self.nodes.append(node)
            self.index_of[node] = index
            self.entries.append(
                NodeEntry(
                    index=index,
                    label=node_label(type_name, k, index + 1),
                    type=type_name,
                    sequence_nr=sequence_nr,
                    op=pairing.op,
                    module_call=pairing.module_call,
                    module_source=pairing.module_source,
                    order=pairing.order,
                    is_custom=_torch.is_custom_function_node(node),
                    param=pairing.param,
                    source=pairing.source,
                )
            )
            added.append(index)
        return added

    def clear(self) -> None:
        """Drop every strong reference to autograd nodes; entries stay readable."""
        self.nodes = []
        self.index_of = {}
