"""Gradient slots: which node output carries the gradient of each op, module call, parameter and input.

A slot is a node (its index) and, for ops, module calls and inputs, which of
its forward outputs (``output_nr``, on the op or call entry): an op's or call's
gradient is that output's gradient as it arrives at the node. Relations that
need node identity (a module call's or input's output node, the one node of a
multi-node op that made its output) are resolved at each discovery, while the
capture holds the nodes; the rest are read from node entries when first asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_NOT_EXPLICIT = object()


@dataclass
class GradSlots:
    """Node indices by what their gradients belong to (see the module docstring)."""

    op: dict[int, int] = field(default_factory=dict)
    module: dict[int, int] = field(default_factory=dict)
    param: dict[str, int] = field(default_factory=dict)
    input: dict[int, tuple[int, int]] = field(default_factory=dict)  # input -> (node, output_nr)
    # op -> index of the node that made its output (None until found), for ops that made several.
    _explicit_op: dict[int, int | None] = field(default_factory=dict)
    # node index -> the first op whose output it made (the node's pairing where sequence numbers are missing).
    op_of_node: dict[int, int] = field(default_factory=dict)
    _mapped: int = 0
    _unresolved: list[tuple[str, int, Any, int]] | None = None

    @classmethod
    def restored(cls, op: dict[int, int], module: dict[int, int], param: dict[str, int],
                 input: dict[int, tuple[int, int]], num_nodes: int) -> GradSlots:  # noqa: A002 - the slot kind
        """Slots read back from a bundle: complete, nothing left to map."""
        return cls(op, module, param, input, _mapped=num_nodes, _unresolved=[])

    def resolve(self, journal: Any, input_tensors: list[torch.Tensor], index_of: dict) -> None:
        """Match the forward's output nodes with the nodes discovered so far (live only)."""
        if self._unresolved is None:
            self._unresolved = self._identity_relations(journal, input_tensors)
        still = []
        for kind, key, node, output_nr in self._unresolved:
            index = index_of.get(node)
            if index is None:
                still.append((kind, key, node, output_nr))
            elif kind == "module":
                self.module[key] = index
            elif kind == "op":
                self._explicit_op[key] = index
                self.op.setdefault(key, index)
                self.op_of_node.setdefault(index, key)
            else:
                self.input[key] = (index, output_nr)
        self._unresolved = still

    def sync(self, entries: list[Any], input_of_source: dict[int, int]) -> GradSlots:
        """Map the node entries built since the last sync; returns self."""
        for index in range(self._mapped, len(entries)):
            entry = entries[index]
            if entry.op is not None:
                explicit = self._explicit_op.get(entry.op, _NOT_EXPLICIT)
                if explicit is _NOT_EXPLICIT or explicit == index:
                    self.op.setdefault(entry.op, index)
            if entry.param is not None:
                self.param[entry.param] = index
            elif entry.source is not None and entry.source in input_of_source:
                self.input.setdefault(input_of_source[entry.source], (index, 0))
        self._mapped = len(entries)
        return self

    def drop_nodes(self) -> None:
        """Forget the nodes still unmatched (at close: no discovery follows)."""
        self._unresolved = []

    def _identity_relations(self, journal: Any, input_tensors: list[torch.Tensor]) -> list:
        relations = []
        for call in journal.module_calls:
            if call.output_node is not None:
                relations.append(("module", call.index, call.output_node, call.output_nr))
        for index in range(len(journal.raw_ops)):
            node = journal.output_node_of_op(index)
            if node is not None:
                self._explicit_op[index] = None
                relations.append(("op", index, node, 0))
        for i, tensor in enumerate(input_tensors):
            if tensor.grad_fn is not None:
                relations.append(("input", i, tensor.grad_fn, tensor.output_nr))
        return relations
