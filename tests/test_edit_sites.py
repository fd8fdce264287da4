"""Gradient edit sites built from backward-kind selectors resolve to the node calls they match
in each pass, and equal the same edit made with a stock tensor hook."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import backlens as bl
from backlens.graph import engine
from models import MLP


def model_and_input():
    torch.manual_seed(0)
    return MLP(), torch.randn(4, 6)


def two_passes(model, x, run):
    """Parameter gradients after each of two backward passes over one retained graph."""
    out = run(model, x)
    loss = out.sum()
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    second = {n: p.grad.clone() for n, p in model.named_parameters()}
    return first, second


def stock_relu_hooks(model, x, passes, factor=0.5):
    """Reference: a tensor hook on every ReLU output scales its gradient in ``passes`` only."""
    model = copy.deepcopy(model)

    def keep(module, inputs, out):
        count = {"pass": 0}

        def hook(grad):
            count["pass"] += 1
            return grad * factor if count["pass"] in passes else grad

        out.register_hook(hook)

    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.register_forward_hook(keep)
    return two_passes(model, x, lambda m, x: m(x))


def captured(model, x, site, edit=None):
    model = copy.deepcopy(model)
    holder = {}

    def run(m, x):
        holder["cap"] = bl.capture(m, x, intervene=bl.when(site, edit or bl.scale(0.5)))
        return holder["cap"].output

    first, second = two_passes(model, x, run)
    return first, second, holder["cap"]


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_node_type_site_edits_each_matching_node_in_every_pass_as_a_tensor_hook_does():
    model, x = model_and_input()
    first, second, cap = captured(model, x, bl.grad(bl.grad_fn("ReluBackward0")))
    expected_first, expected_second = stock_relu_hooks(model, x, passes={1, 2})
    assert_same(first, expected_first)
    assert_same(second, expected_second)
    assert [[(e.op, e.module) for e in p.edits] for p in cap.passes] == [
        [("relu_2", "net.3"), ("relu_1", "net.1")]] * 2


def test_a_forward_selector_limited_to_one_pass_edits_that_pass_only():
    model, x = model_and_input()
    first, second, cap = captured(model, x, bl.grad(bl.func("relu") & bl.in_pass(2)))
    expected_first, expected_second = stock_relu_hooks(model, x, passes={2})
    assert_same(first, expected_first)
    assert_same(second, expected_second)
    assert [len(p.edits) for p in cap.passes] == [0, 2]


def test_an_op_output_node_limited_to_one_pass_edits_that_op_s_output_gradient_in_that_pass():
    model, x = model_and_input()
    first, second, _cap = captured(
        model, x, bl.grad(bl.func("linear") & bl.grad_fn("AddmmBackward0") & bl.in_pass(2)))
    reference = copy.deepcopy(model)

    def keep(module, inputs, out):
        count = {"pass": 0}

        def hook(grad):
            count["pass"] += 1
            return grad * 0.5 if count["pass"] == 2 else grad

        out.register_hook(hook)

    for module in reference.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(keep)
    expected_first, expected_second = two_passes(reference, x, lambda m, x: m(x))
    assert_same(first, expected_first)
    assert_same(second, expected_second)


def test_a_node_label_site_edits_that_node():
    model, x = model_and_input()
    label = bl.capture(model, x).ops["relu_1"].grad_fn.label
    first, second, cap = captured(model, x, bl.grad(bl.label(label)))
    reference = copy.deepcopy(model)
    reference.net[1].register_forward_hook(lambda m, i, out: [out.register_hook(lambda g: g * 0.5)] and None)
    expected_first, expected_second = two_passes(reference, x, lambda m, x: m(x))
    assert_same(first, expected_first)
    assert_same(second, expected_second)


def test_an_accumulategrad_site_edits_the_gradient_reaching_those_parameters():
    model, x = model_and_input()
    first, _second, _cap = captured(model, x, bl.grad(bl.grad_fn("AccumulateGrad") & bl.module("net.0")))
    reference = copy.deepcopy(model)
    for p in reference.net[0].parameters():
        p.register_hook(lambda g: g * 0.5)
    expected_first, _ = two_passes(reference, x, lambda m, x: m(x))
    assert_same(first, expected_first)


def test_a_site_without_a_forward_op_edits_the_loss_gradient():
    model, x = model_and_input()
    first, _second, cap = captured(model, x, bl.grad(bl.without_op() & ~bl.grad_fn("AccumulateGrad")))
    reference = copy.deepcopy(model)
    loss = reference(x).sum()
    loss.register_hook(lambda g: g * 0.5)
    loss.backward()
    for name, p in reference.named_parameters():
        assert torch.equal(first[name], p.grad), name
    assert [e.op for e in cap.passes[0].edits] == [None]


def test_a_gradient_site_selecting_grad_input_is_refused_when_the_capture_is_made():
    model, x = model_and_input()
    armed = engine._live_participants()
    with pytest.raises(bl.UnsupportedInputError) as caught:
        bl.capture(model, x, intervene=bl.when(bl.grad(bl.grad_fn("ReluBackward0") & bl.grad_input()),
                                               bl.scale(2.0)))
    assert caught.value.code == "grad_input_edit_site"
    assert engine._live_participants() == armed
    assert nn.Module._call_impl.__qualname__ == "Module._call_impl"  # no recording forward left behind


def test_an_activation_site_with_backward_terms_is_refused_when_the_capture_is_made():
    model, x = model_and_input()
    with pytest.raises(bl.UnsupportedInputError) as caught:
        bl.capture(model, x, intervene=bl.when(bl.func("relu") & bl.in_pass(1), bl.scale(2.0)))
    assert caught.value.code == "activation_site_backward_selector"
    assert "bl.grad(" in caught.value.remedy


def codes(caught):
    return [w.message.code for w in caught if isinstance(w.message, bl.BacklensWarning)]


def test_a_gradient_site_matching_no_node_warns_in_each_pass():
    model, x = model_and_input()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured(model, x, bl.grad(bl.grad_fn("TanhBackward0")))
    assert codes(caught) == ["edit_site_matched_nothing"] * 2


def test_a_gradient_site_whose_passes_never_come_warns_once():
    model, x = model_and_input()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured(model, x, bl.grad(bl.func("relu") & bl.in_pass(5)))
    assert codes(caught) == ["edit_site_matched_nothing"]
    assert "no pass before pass 5" in str(caught[0].message)


def test_an_activation_selector_site_matching_no_op_warns_after_the_forward():
    model, x = model_and_input()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap = bl.capture(model, x, intervene=bl.when(bl.func("tanh"), bl.scale(2.0)))
    assert codes(caught) == ["edit_site_matched_nothing"]
    assert cap.forward_edits == []
