"""Walking an autograd graph from its roots: the one walker (:class:`Walk`), told by predicates.

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


class Walk:
    """A breadth-first walk of ``next_functions`` from ``roots``, advanced on demand.

    Every walk of an autograd graph in backlens is one of these, told by
    predicates where to stop and what to look for. ``met`` maps the id of
    every node met so far to the node (held: a dropped node's id is reused);
    nodes for which ``stop(node)`` holds are met but not entered.
    :meth:`advance` walks on until a newly met node satisfies ``until`` and
    returns it, so a question about the top of a big graph walks only the
    top, and the next question resumes where the last one stopped. With
    ``parents``, ``led_by`` maps each node met to the node whose edge the walk
    first met it by (None for a root).
    """

    __slots__ = ("met", "entered", "stopped", "led_by", "_queue", "_stop")

    def __init__(self, roots: Iterable[Node], stop: Callable[[Node], bool] | None = None, *,
                 parents: bool = False):
        self.met: dict[int, Node] = {}
        self.entered: list[Node] = []  # in the order the walk entered them
        self.stopped: list[Node] = []  # met, and not entered because ``stop`` held
        self.led_by: dict[Node, Node | None] | None = {} if parents else None
        self._queue: deque[Node] = deque()
        self._stop = stop
        for node in roots:
            if node is not None and id(node) not in self.met:
                self.met[id(node)] = node
                self._queue.append(node)
                if parents:
                    self.led_by[node] = None

    def knows(self, node: Node) -> bool:
        return self.met.get(id(node)) is node

    def advance(self, until: Callable[[Node], bool] | None = None) -> Node | None:
        """Walk on until a newly met node satisfies ``until`` (returned), or to the end (None)."""
        met, queue, stop, entered, led_by = self.met, self._queue, self._stop, self.entered, self.led_by
        while queue:
            node = queue.popleft()
            if stop is not None and stop(node):
                self.stopped.append(node)
                continue
            entered.append(node)
            for child, _ in node.next_functions:
                if child is None or id(child) in met:
                    continue
                met[id(child)] = child
                queue.append(child)
                if led_by is not None:
                    led_by[child] = node
                if until is not None and until(child):
                    return child
        return None


@dataclass
class GraphWalk:
    """What a whole walk found: ``found``, the nodes it entered, in discovery order;
    ``stopped``, the nodes it reached and did not enter (``stop`` said so), in the
    order reached; ``led_by`` (when asked for), each entered node's first
    predecessor on the walk (None for a root)."""

    found: list[Node] = field(default_factory=list)
    stopped: list[Node] = field(default_factory=list)
    led_by: dict[Node, Node | None] = field(default_factory=dict)


def walk(roots: Iterable[Node], stop: Callable[[Node], bool] | None = None, *,
         parents: bool = False) -> GraphWalk:
    """A :class:`Walk` taken to its end: breadth first from ``roots``, entering every node
    ``stop`` does not stop at (each node once)."""
    done = Walk(roots, stop, parents=parents)
    done.advance()
    return GraphWalk(done.entered, done.stopped, done.led_by if parents else {})


def reaches(start: Node, goal: Node) -> bool:
    """True when ``goal`` lies below ``start`` in the graph (``start`` itself included)."""
    return start is goal or Walk([start]).advance(lambda node: node is goal) is not None


def walk_bounded(
    roots: Iterable[Node], is_known: Callable[[Node], bool], is_outside: Callable[[Node], bool]
) -> tuple[list[Node], list[Node]]:
    """Breadth-first walk from ``roots`` that enters neither known nodes nor nodes outside.

    Returns the unknown nodes inside, in discovery order, and the outside nodes
    the walk reached (where the graph leaves, as into a non-leaf input's history).
    """
    done = walk(roots, lambda node: is_known(node) or is_outside(node))
    return done.found, [node for node in done.stopped if not is_known(node)]
