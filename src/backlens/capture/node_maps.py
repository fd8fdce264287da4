"""Which autograd node made the gradient of each op, module call, parameter and input.

Relations that need node identity are resolved at each discovery, while the
capture holds the nodes; the rest are read from node entries when first asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from backlens.capture.forward import ForwardJournal

NOT_EXPLICIT = object()


@dataclass
class NodeMaps:
    """Node indices by what their gradients belong to.

    Relations that need node identity (a module call's or input's output node,
    the one node of a multi-node op that made its output) are resolved at each
    discovery, while the nodes are held; the rest is read from entries up to
    entry ``mapped``.
    """

    output_node_of_op: dict[int, int] = field(default_factory=dict)
    output_node_of_module: dict[int, int] = field(default_factory=dict)
    node_of_param: dict[str, int] = field(default_factory=dict)
    node_of_input: dict[int, tuple[int, int]] = field(default_factory=dict)
    # op -> index of the node that made its output (None until found), for ops that made several.
    explicit_output_of_op: dict[int, int | None] = field(default_factory=dict)
    mapped: int = 0
    _unresolved: list[tuple[str, int, Any, int]] | None = None

    def resolve(self, journal: ForwardJournal, input_tensors: list[torch.Tensor], index_of: dict) -> None:
        if self._unresolved is None:
            self._unresolved = self._identity_relations(journal, input_tensors)
        still = []
        for kind, key, node, output_nr in self._unresolved:
            index = index_of.get(node)
            if index is None:
                still.append((kind, key, node, output_nr))
            elif kind == "module":
                self.output_node_of_module[key] = index
            elif kind == "op":
                self.explicit_output_of_op[key] = index
            else:
                self.node_of_input[key] = (index, output_nr)
        self._unresolved = still

    def sync(self, entries: list[Any], input_source_index: dict[int, int]) -> NodeMaps:
        """Map the node entries built since the last sync; returns self."""
        for index in range(self.mapped, len(entries)):
            entry = entries[index]
            if entry.op is not None:
                explicit = self.explicit_output_of_op.get(entry.op, NOT_EXPLICIT)
                if explicit is NOT_EXPLICIT or explicit == index:
                    self.output_node_of_op.setdefault(entry.op, index)
            if entry.param is not None:
                self.node_of_param[entry.param] = index
            elif entry.source is not None and entry.source in input_source_index:
                self.node_of_input.setdefault(input_source_index[entry.source], (index, 0))
        self.mapped = len(entries)
        return self

    def drop_nodes(self) -> None:
        """Forget the nodes still unmatched (at close: no discovery follows)."""
        self._unresolved = []

    def _identity_relations(self, journal: ForwardJournal, input_tensors: list[torch.Tensor]) -> list:
        relations = []
        for call in journal.module_calls:
            if call.output_node is not None:
                relations.append(("module", call.index, call.output_node, call.output_nr))
        for index in range(len(journal.raw_ops)):
            node = journal.output_node_of_op(index)
            if node is not None:
                self.explicit_output_of_op[index] = None
                relations.append(("op", index, node, 0))
        for i, tensor in enumerate(input_tensors):
            if tensor.grad_fn is not None:
                relations.append(("input", i, tensor.grad_fn, tensor.output_nr))
        return relations
