"""Walking an autograd graph from its roots.

Node wrappers are not weakref-able and their ``id()`` can be reused once the
node is dropped, so callers that remember nodes must hold them strongly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

# torch.autograd.graph.Node: C++ node classes are registered as virtual subclasses
# (isinstance holds, they are not in its MRO) and are not weakref-able.
Node = Any


def root_nodes(tensors_or_edges: Iterable[Any]) -> list[Node]:
    """The grad_fn (or AccumulateGrad) behind each root tensor or GradientEdge."""
    roots = []
    for item in tensors_or_edges:
        if isinstance(item, torch.Tensor):
            node = item.grad_fn
            if node is None and item.requires_grad:
                node = _accumulator(item)
        else:
            node = getattr(item, "node", None)
        if node is not None:
            roots.append(node)
    return roots


def _accumulator(leaf: torch.Tensor) -> Node | None:
    # view_as gives a throwaway node whose only edge is the leaf's AccumulateGrad.
    try:
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]
    except (AttributeError, IndexError, RuntimeError):
        return None


def walk_new(
    roots: Iterable[Node], is_known: Callable[[Node], bool]
) -> tuple[list[Node], list[Node]]:
    """Breadth-first walk from ``roots`` that does not enter known nodes.

    Returns the unknown nodes in discovery order, and the known nodes the walk
    reached (so the caller can tell whether the graph touches its own).
    """
    return _walk(roots, is_known)


def walk_bounded(
    roots: Iterable[Node], is_known: Callable[[Node], bool], is_outside: Callable[[Node], bool]
) -> tuple[list[Node], list[Node]]:
    """Breadth-first walk from ``roots`` that enters neither known nodes nor nodes outside.

    Returns the unknown nodes inside, in discovery order, and the outside nodes
    the walk reached (where the graph leaves, as into a non-leaf input's history).
    """
    found, stopped = _walk(roots, lambda node: is_known(node) or is_outside(node))
    return found, [node for node in stopped if not is_known(node)]


def _walk(roots: Iterable[Node], stop: Callable[[Node], bool]) -> tuple[list[Node], list[Node]]:
    """The nodes a breadth-first walk from ``roots`` entered, in order, and those it stopped at."""
    seen: set[Node] = set()
    found: list[Node] = []
    stopped: list[Node] = []
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if stop(node):
            stopped.append(node)
            continue
        found.append(node)
        queue.extend(next_node for next_node, _ in node.next_functions)
    return found, stopped
