"""Walking an autograd graph from its roots.

Node wrappers are not weakref-able and their ``id()`` can be reused once the
node is dropped, so callers that remember nodes must hold them strongly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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


@dataclass
class GraphWalk:
    """What one breadth-first walk of ``next_functions`` found.

    ``found``: the nodes it entered, in discovery order. ``stopped``: the nodes it
    reached and did not enter (``stop`` said so), in the order reached. ``led_by``
    (when asked for): each entered node's first predecessor on the walk (None for
    a root).
    """

    found: list[Node] = field(default_factory=list)
    stopped: list[Node] = field(default_factory=list)
    led_by: dict[Node, Node | None] = field(default_factory=dict)


def walk(roots: Iterable[Node], stop: Callable[[Node], bool] | None = None, *,
         parents: bool = False) -> GraphWalk:
    """The one graph walker: breadth first from ``roots``, entering every node ``stop`` does
    not stop at (each node once), noting each entered node's first predecessor when
    ``parents`` is asked for. Every walk of a captured graph goes through it."""
    result = GraphWalk()
    found, stopped, led_by = result.found, result.stopped, result.led_by
    seen: set[Node] = set()
    queue = deque((root, None) for root in roots)
    while queue:
        node, parent = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if stop is not None and stop(node):
            stopped.append(node)
            continue
        found.append(node)
        if parents:
            led_by[node] = parent
        queue.extend((child, node) for child, _ in node.next_functions)
    return result


def walk_new(
    roots: Iterable[Node], is_known: Callable[[Node], bool]
) -> tuple[list[Node], list[Node]]:
    """Breadth-first walk from ``roots`` that does not enter known nodes.

    Returns the unknown nodes in discovery order, and the known nodes the walk
    reached (so the caller can tell whether the graph touches its own).
    """
    done = walk(roots, is_known)
    return done.found, done.stopped


def walk_bounded(
    roots: Iterable[Node], is_known: Callable[[Node], bool], is_outside: Callable[[Node], bool]
) -> tuple[list[Node], list[Node]]:
    """Breadth-first walk from ``roots`` that enters neither known nodes nor nodes outside.

    Returns the unknown nodes inside, in discovery order, and the outside nodes
    the walk reached (where the graph leaves, as into a non-leaf input's history).
    """
    done = walk(roots, lambda node: is_known(node) or is_outside(node))
    return done.found, [node for node in done.stopped if not is_known(node)]
