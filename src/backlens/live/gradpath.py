"""Which autograd nodes a backward will run, and in what order they can arrive.

Built once per backward block, on the first gradient a body asks for, by
walking ``next_functions`` from the tensor being backpropagated. Node
wrappers are only stable while referenced, so the index holds every node it
saw for its own lifetime (one backward block).
"""

from __future__ import annotations

from typing import Any

import torch

from backlens import _torch


class GraphIndex:
    """The nodes reachable from some roots, found lazily.

    The walk from the roots stops as soon as the node asked about is found
    and resumes from where it stopped for the next question, so a block that
    asks about late layers only walks the top of the graph. Which leaf an
    AccumulateGrad node feeds is read only when a leaf's gradient is asked for.
    """

    def __init__(self, roots: list[Any]):
        self._nodes: dict[int, Any] = {}
        self._leaves: dict[int, Any] | None = None
        self._stack: list[Any] = []
        for node in roots:
            if node is not None and id(node) not in self._nodes:
                self._nodes[id(node)] = node
                self._stack.append(node)

    def _walk_until(self, found: Any) -> Any | None:
        nodes, stack = self._nodes, self._stack
        while True:
            hit = found()
            if hit is not None:
                return hit
            if not stack:
                return None
            for child, _ in stack.pop().next_functions:
                if child is not None and id(child) not in nodes:
                    nodes[id(child)] = child
                    stack.append(child)
                    if self._leaves is not None:
                        self._note_leaf(child)

    def _note_leaf(self, node: Any) -> None:
        if _torch.is_accumulate_grad(node):
            variable = _torch.accumulate_grad_variable(node)
            if variable is not None:
                self._leaves[id(variable)] = node  # type: ignore[index]

    def node_of(self, tensor: torch.Tensor) -> Any | None:
        """The node whose firing delivers ``tensor``'s gradient, if the roots reach it."""
        grad_fn = tensor.grad_fn
        nodes = self._nodes
        if grad_fn is not None:
            key = id(grad_fn)
            return self._walk_until(lambda: grad_fn if nodes.get(key) is grad_fn else None)
        if self._leaves is None:
            self._leaves = {}
            for node in list(nodes.values()):
                self._note_leaf(node)
        leaves, key = self._leaves, id(tensor)
        return self._walk_until(lambda: leaves.get(key))

    def reaches(self, start: Any, goal: Any) -> bool:
        """True when ``goal`` lies below ``start`` (so ``start`` runs before ``goal``)."""
        if start is goal:
            return True
        seen: dict[int, Any] = {id(start): start}
        stack = [start]
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None or id(child) in seen:
                    continue
                if child is goal:
                    return True
                seen[id(child)] = child
                stack.append(child)
        return False
