"""Which autograd nodes a backward will run, and in what order they can arrive.

A backward block asks the running engine whether it will run a requested
tensor's node (``_torch.engine_will_run``), which needs no walk. Where the
engine cannot answer (a leaf's gradient, ``inputs=``, a torch without the
query), :class:`GraphIndex` walks the graph from the tensor being
backpropagated (with the one walker, ``graph/discovery.py``), built on the
first such request. Node wrappers are only stable while referenced, so the
index holds every node it saw for its own lifetime (one backward block).
"""

from __future__ import annotations

from typing import Any

import torch

from backlens import _torch
from backlens.graph.discovery import Walk
from backlens.graph.discovery import reaches as graph_reaches


class GraphIndex:
    """The nodes reachable from some roots, found lazily (one :class:`~backlens.graph.discovery.Walk`).

    The walk from the roots stops as soon as the node asked about is found
    and resumes from where it stopped for the next question, so a block that
    asks about late layers only walks the top of the graph. Which leaf an
    AccumulateGrad node feeds is read only when a leaf's gradient is asked for.
    """

    def __init__(self, roots: list[Any]):
        self._walk = Walk(roots)
        self._leaves: dict[int, Any] | None = None

    def _note_leaf(self, node: Any) -> int | None:
        if self._leaves is not None and _torch.is_accumulate_grad(node):
            variable = _torch.accumulate_grad_variable(node)
            if variable is not None:
                self._leaves[id(variable)] = node
                return id(variable)
        return None

    def node_of(self, tensor: torch.Tensor) -> Any | None:
        """The node whose firing delivers ``tensor``'s gradient, if the roots reach it."""
        walk = self._walk
        grad_fn = tensor.grad_fn
        if grad_fn is not None:
            if walk.knows(grad_fn):
                return grad_fn
            return walk.advance(self._until(grad_fn, None))
        if self._leaves is None:
            self._leaves = {}
            for node in list(walk.met.values()):
                self._note_leaf(node)
        found = self._leaves.get(id(tensor))
        return found if found is not None else walk.advance(self._until(None, id(tensor)))

    def _until(self, goal: Any, leaf: int | None) -> Any:
        """What the walk looks for: ``goal`` or the node of the leaf with id ``leaf`` (noting
        every leaf it meets once leaves are asked about)."""

        def found(node: Any) -> bool:
            key = self._note_leaf(node)
            return node is goal or (leaf is not None and key == leaf)

        return found


def met_within(root: Any, goal: Any, limit: int) -> bool:
    """Whether a breadth-first walk from ``root`` meets ``goal`` among its first ``limit`` nodes
    (False says only that it was not met so far).

    A few nodes below a loss, before its backward starts: a flat loop, which
    costs less there than the general walker, and less than the hook the
    engine would otherwise call at its first node to ask it.
    """
    queue = [root]
    met = {id(root)}
    for node in queue:  # grows as it goes
        for child, _ in node.next_functions:
            if child is goal:
                return True
            if child is not None and id(child) not in met:
                if len(met) >= limit:
                    return False
                met.add(id(child))
                queue.append(child)
    return False


def reaches(start: Any, goal: Any) -> bool:
    """True when ``goal`` lies below ``start`` (so ``start`` runs before ``goal``).

    A node only reaches nodes made before it in the forward, so when
    ``start`` was made first (a lower sequence number) the answer is no
    without a walk; AccumulateGrad nodes carry no such number.
    """
    if start is goal:
        return True
    if _torch.made_before(start, goal):
        return False
    return graph_reaches(start, goal)
