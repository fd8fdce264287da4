"""Forward selectors choose which activations save_activations keeps."""

from __future__ import annotations

import pytest
import torch
from selector_refs import MODULE_OF, OPS, mlp_and_input, references

import backlens as bl
from backlens.select import func, grad_fn, in_pass, label, module


def kept(save_activations):
    model, x = mlp_and_input()
    ref = references(model, x)
    cap = bl.capture(model, x, save_activations=save_activations)
    labels = [op.label for op in cap.ops if op.activation is not None]
    for op_label in labels:
        assert torch.equal(cap.ops[op_label].activation, ref["outputs"][MODULE_OF[op_label]]), op_label
    return labels


def test_func_keeps_that_functions_outputs():
    assert kept(func("relu")) == ["relu_1", "relu_2"]


def test_label_keeps_one_op():
    assert kept(label("linear_2")) == ["linear_2"]


def test_module_keeps_its_subtree():
    assert kept(module("net.3", "net.4")) == ["relu_2", "linear_3"]


def test_root_module_keeps_every_op():
    assert kept(module("")) == OPS


def test_and_intersects():
    assert kept(func("linear") & module("net.4")) == ["linear_3"]


def test_or_unites():
    assert kept(label("relu_1") | label("linear_3")) == ["relu_1", "linear_3"]


def test_not_complements():
    assert kept(~func("relu")) == ["linear_1", "linear_2", "linear_3"]


def test_a_not_of_a_backward_selector_keeps_every_op():
    assert kept(~in_pass(1)) == OPS


@pytest.mark.filterwarnings("ignore::backlens.BacklensWarning")
def test_backward_selectors_keep_no_activation():
    assert kept(grad_fn("ReluBackward0")) == []
    assert kept(in_pass(1)) == []
