"""Which autograd nodes a backward will run, and in what order they can arrive.

A backward block asks the running engine whether it will run a requested
tensor's node (``_torch.engine_will_run``), which needs no walk. Where the
engine cannot answer (a leaf's gradient, ``inputs=``, a torch without the
query), :class:`GraphIndex` walks ``next_functions`` from the tensor being
backpropagated, built on the first such request. Node wrappers are only
stable while referenced, so the index holds every node it saw for its own
lifetime (one backward block).
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

    def _expand(self, goal: Any | None, leaf_key: int | None) -> Any | None:
        """Walk on until ``goal`` (a node) or the node of the leaf ``leaf_key`` is found."""
        nodes, stack = self._nodes, self._stack
        leaves = self._leaves
        while stack:
            for child, _ in stack.pop().next_functions:
                if child is None or id(child) in nodes:
                    continue
                nodes[id(child)] = child
                stack.append(child)
                if child is goal:
                    return child
                if leaves is not None and self._note_leaf(child) == leaf_key and leaf_key is not None:
                    return child
        return None

    def _note_leaf(self, node: Any) -> int | None:
        if _torch.is_accumulate_grad(node):
            variable = _torch.accumulate_grad_variable(node)
            if variable is not None:
                self._leaves[id(variable)] = node  # type: ignore[index]
                return id(variable)
        return None

    def node_of(self, tensor: torch.Tensor) -> Any | None:
        """The node whose firing delivers ``tensor``'s gradient, if the roots reach it."""
        grad_fn = tensor.grad_fn
        if grad_fn is not None:
            if self._nodes.get(id(grad_fn)) is grad_fn:
                return grad_fn
            return self._expand(grad_fn, None)
        if self._leaves is None:
            self._leaves = {}
            for node in list(self._nodes.values()):
                self._note_leaf(node)
        found = self._leaves.get(id(tensor))
        return found if found is not None else self._expand(None, id(tensor))


def reaches(start: Any, goal: Any) -> bool:
    """True when ``goal`` lies below ``start`` (so ``start`` runs before ``goal``).

    A node only reaches nodes made before it in the forward, so when
    ``start`` was made first (a lower sequence number) the answer is no
    without a walk; AccumulateGrad nodes carry no such number.
    """
    if start is goal:
        return True
    if not (_torch.is_accumulate_grad(start) or _torch.is_accumulate_grad(goal)):
        first, second = _torch.node_sequence_nr(start), _torch.node_sequence_nr(goal)
        if first is not None and second is not None and first < second:
            return False
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
