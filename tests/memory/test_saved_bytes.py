"""cap.memory: what the forward saved for the backward, per op and per module call."""

from __future__ import annotations

import pytest
import torch
from memory_refs import ViewsAndTwice, saved_by_op, saved_rows, stock_grads

import backlens as bl
import models
from backlens.records.memory import Freed


def views_case():
    torch.manual_seed(0)
    return ViewsAndTwice(), (torch.randn(3, 6, requires_grad=True),), {}


def build(name):
    return views_case() if name == "views" else models.build(name)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "views"])
def test_saved_bytes_per_op_equal_those_our_own_hooks_see_in_a_stock_forward(name):
    model, args, kwargs = build(name)
    reference = saved_by_op(model, *args, **kwargs)
    cap = bl.capture(model, *args, memory=True, **kwargs)
    assert reference and saved_rows(cap) == reference


def test_a_tensor_saved_twice_counts_its_storage_once_and_its_tensors_twice():
    model, args, _ = views_case()
    cap = bl.capture(model, *args, memory=True)
    h = cap.ops["linear_1"]
    row = cap.memory["mul_1"]
    assert row.saved_tensors == 2
    assert row.saved_bytes == torch.Size(h.shape).numel() * 4


def test_views_of_one_storage_saved_by_two_ops_count_once_in_the_total():
    model, args, _ = views_case()
    cap = bl.capture(model, *args, memory=True)
    a_bytes = 3 * 8 * 4
    assert cap.memory["sin_1"].saved_bytes == cap.memory["cos_1"].saved_bytes == a_bytes  # each the whole storage
    by_op = sum(row.saved_bytes for row in cap.memory.ops)
    assert cap.memory.saved_bytes == by_op - a_bytes  # a's storage once, not twice


def test_parameters_are_counted_apart_from_activations():
    model, args, _ = views_case()
    cap = bl.capture(model, *args, memory=True)
    linear = cap.memory["linear_1"]
    assert linear.saved_param_bytes == model.lin.weight.numel() * 4  # its transpose is a view of the weight
    assert linear.saved_bytes == args[0].numel() * 4
    assert cap.memory.saved_param_bytes == linear.saved_param_bytes


def test_a_module_call_row_counts_its_subtree_once_per_storage():
    model, args, kwargs = models.build("gpt2")
    cap = bl.capture(model, *args, memory=True, **kwargs)
    block = cap.memory["transformer.h.0"]
    inside = [cap.memory[label] for label in cap.modules["transformer.h.0"].ops]
    assert block.scope == "module" and block.saved_tensors == sum(r.saved_tensors for r in inside)
    assert 0 < block.saved_bytes <= sum(r.saved_bytes for r in inside)
    assert cap.memory[""].saved_bytes == cap.memory.saved_bytes  # the model's own call holds everything


def test_memory_rows_to_pandas_has_one_row_per_op_and_per_module_call():
    model, args, kwargs = models.build("mlp")
    cap = bl.capture(model, *args, memory=True, **kwargs)
    frame = cap.memory.to_pandas()
    assert list(frame.columns) == ["label", "scope", "module", "saved_bytes", "saved_tensors",
                                   "saved_param_bytes", "freed_pass", "freed_call"]
    assert len(frame) == len(cap.ops) + len(cap.modules)
    assert list(frame["label"][: len(cap.ops)]) == [op.label for op in cap.ops]


def test_a_capture_without_memory_has_no_memory_records():
    model, args, kwargs = models.build("mlp")
    cap = bl.capture(model, *args, **kwargs)
    models.loss_of(cap.output).backward()
    assert cap.memory is None and cap.passes[0].memory is None


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_memory_true_never_changes_a_gradient(name):
    model, args, kwargs = models.build(name)
    stock = stock_grads(model, models.loss_of, *args, **kwargs)
    cap = bl.capture(model, *args, memory=True, **kwargs)
    models.loss_of(cap.output).backward()
    assert stock.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for param_name, param in model.named_parameters():
        assert torch.equal(param.grad, stock[param_name]), param_name


def test_dropping_the_graph_without_a_backward_releases_every_save_outside_any_node_call():
    model, args, _ = views_case()
    cap = bl.capture(model, *args, memory=True)
    assert not cap.memory.all_freed and all(row.freed is None for row in cap.memory.ops)
    cap.close()
    cap.output = None  # the last reference to the graph, and so to every saved tensor
    assert cap.memory.all_freed
    assert {row.freed for row in cap.memory.ops if row.saved_tensors} == {Freed(None, None)}
