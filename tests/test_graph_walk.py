"""The one graph walker (graph/discovery.Walk) and the one freed-graph detector (graph/freed.py)."""

from __future__ import annotations

import pytest
import torch

import backlens as bl
from backlens.graph.discovery import Walk, reaches, walk_bounded
from backlens.graph.freed import is_freed_graph
from backlens.live.freed import BackwardCall, freed_graph_error


def chain(length):
    """A graph of ``length`` multiplications; the nodes from the output down."""
    x = torch.ones(2, requires_grad=True)
    h = x
    for _ in range(length):
        h = h * 2
    nodes, node = [], h.grad_fn
    while node is not None and node.next_functions:
        nodes.append(node)
        node = node.next_functions[0][0]
    return h, nodes + [node]


def test_a_walk_stops_as_soon_as_it_meets_what_it_looks_for():
    out, nodes = chain(30)
    walk = Walk([out.grad_fn])
    assert walk.advance(lambda node: node is nodes[3]) is nodes[3]
    assert len(walk.met) == 4


def test_a_walk_resumes_where_it_stopped():
    out, nodes = chain(30)
    walk = Walk([out.grad_fn])
    walk.advance(lambda node: node is nodes[3])
    assert walk.advance(lambda node: node is nodes[20]) is nodes[20]
    assert walk.advance(lambda node: node is nodes[3]) is None  # met before: not met again
    assert len(walk.met) == len(nodes)


def test_reaches_looks_below_a_node_only():
    out, nodes = chain(5)
    assert reaches(nodes[0], nodes[4]) and not reaches(nodes[4], nodes[0])
    assert reaches(nodes[2], nodes[2])


def test_sequence_numbers_say_which_of_two_nodes_the_forward_made_first():
    from backlens import _torch

    out, nodes = chain(5)
    assert _torch.made_before(nodes[4], nodes[0]) is True
    assert _torch.made_before(nodes[0], nodes[4]) is False
    leaf_node = nodes[-1]  # the input's AccumulateGrad carries no sequence number
    assert type(leaf_node).__name__ == "AccumulateGrad"
    assert _torch.made_before(leaf_node, nodes[0]) is None


def test_the_order_of_two_nodes_is_unknown_without_sequence_numbers(monkeypatch):
    from backlens import _torch

    out, nodes = chain(5)
    monkeypatch.setattr(_torch, "HAS_SEQUENCE_NR", False)
    assert _torch.made_before(nodes[4], nodes[0]) is None
    assert not reaches(nodes[4], nodes[0])  # answered by the walk instead


def test_a_bounded_walk_neither_enters_known_nor_outside_nodes():
    out, nodes = chain(6)
    found, outside = walk_bounded([out.grad_fn], lambda node: node is nodes[2], lambda node: node is nodes[1])
    assert found == [nodes[0]] and outside == [nodes[1]]


def _freed_error():
    w = torch.ones(2, requires_grad=True)
    loss = (w * w).sum()
    loss.backward()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    return info.value


def test_torchs_freed_graph_error_is_recognised():
    assert is_freed_graph(_freed_error())


def test_other_errors_and_our_own_are_not_taken_for_torchs_freed_graph_error():
    error = _freed_error()
    assert not is_freed_graph(RuntimeError("something else: " + str(error)))
    assert not is_freed_graph(ValueError(str(error)))
    assert not is_freed_graph(bl.FreedGraphError(f"explained.\nOriginal error from torch.autograd: {error}"))


def test_explain_keeps_the_code_and_torchs_text_of_a_freed_graph_error_a_trace_raised():
    # The error a trace raises (live/freed.py), made from torch's own without running a trace.
    earlier = BackwardCall(0, False, "train.py", 3)
    failing = BackwardCall(1, False, "train.py", 7)
    error = freed_graph_error(_freed_error(), failing, [earlier])
    explanation = bl.explain(error)
    assert explanation.code == "freed_graph"
    assert explanation.original.startswith("Trying to backward through the graph a second time")
    assert "Original error" not in explanation.message and "train.py:3" in explanation.message
