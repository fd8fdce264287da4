"""Autograd errors inside captured passes are explained in model terms; others pass through."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import backlens as bl
from backlens.report.explain import ORIGINAL_PREFIX, explain
from models import MLP, loss_of


class ClearsSavedData(torch.autograd.Function):
    """Like fused-kernel libraries: frees its saved input after the first backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x.clone(), w)  # its own copy (a fused kernel's workspace)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, grad_w = grad @ w.t(), x.t() @ grad
        x.data = torch.empty(0)
        return grad_x, grad_w


class ClearsSavedStorage(ClearsSavedData):
    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, grad_w = grad @ w.t(), x.t() @ grad
        x.untyped_storage().resize_(0)
        return grad_x, grad_w


class FusedBlock(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.function.apply(torch.tanh(x), self.weight)


class WithFused(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.fused = FusedBlock(function)

    def forward(self, x):
        return self.fused(self.inp(x))


@pytest.mark.parametrize("function", [ClearsSavedData, ClearsSavedStorage])
def test_a_once_only_node_is_named_with_its_op_and_module(function):
    cap = bl.capture(WithFused(function), torch.randn(2, 4))
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(bl.BacklensError) as info:
        loss.backward()
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.code == "once_only_node"
    text = str(err)
    node = [g for g in cap.grad_fns if g.is_custom][0]
    assert node.op is cap.ops["matmul_1"]  # the op inside the Function's forward that made its output
    assert node.label in text and "'matmul_1'" in text and "'fused'" in text
    assert "retain_graph=True cannot keep" in text and "maybe_clear_saved_tensors" in text
    assert ORIGINAL_PREFIX in text
    assert cap.passes[1].status == "failed" and cap.passes[1].error is err


class SavesThenModifies(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = torch.sigmoid(self.lin(x))  # sigmoid saves its output for backward
        return self.act(h)              # ...which ReLU(inplace=True) then modifies


def test_an_in_place_edit_of_a_saved_tensor_names_both_ops_and_modules():
    cap = bl.capture(SavesThenModifies(), torch.randn(2, 4))
    with pytest.raises(bl.BacklensError) as info:
        cap.output.sum().backward()
    err = info.value
    assert isinstance(err, RuntimeError) and err.code == "saved_tensor_modified"
    text = str(err)
    assert "'sigmoid_1'" in text and "'relu_1'" in text and "module 'act'" in text
    assert "version 1, expected 0" in text
    assert text.rstrip().split("\n")[-1].startswith(ORIGINAL_PREFIX)


class LogOfRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.deep = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return torch.log(self.deep(self.lin(x)) + 0.0).clamp(min=-10).sum()


def test_detect_nonfinite_stops_at_the_node_that_made_the_first_nan():
    torch.manual_seed(0)
    model = LogOfRelu()
    with torch.no_grad():
        model.deep[0].bias.fill_(-100.0)  # ReLU outputs zeros: log(0) = -inf, its backward inf
    cap = bl.capture(model, torch.randn(3, 4), detect_nonfinite=True)
    with pytest.raises(bl.BacklensError) as info:
        cap.output.backward()
    err = info.value
    assert err.code == "nonfinite_grad"
    text = str(err)
    assert "LogBackward0" in text and "'log_1'" in text and "pass 1" in text


def test_nonfinite_detection_is_off_by_default():
    torch.manual_seed(0)
    model = LogOfRelu()
    with torch.no_grad():
        model.deep[0].bias.fill_(-100.0)
    cap = bl.capture(model, torch.randn(3, 4))
    cap.output.backward()
    assert cap.passes[0].status == "ok"


def test_a_freed_graph_names_the_pass_that_freed_it():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = loss_of(cap.output)
    loss.backward()
    with pytest.raises(bl.FreedGraphError) as info:
        loss.backward()
    text = str(info.value)
    assert isinstance(info.value, RuntimeError) and info.value.code == "freed_graph"
    assert "Backward pass 1 (Tensor.backward at" in text and "test_explain.py" in text
    assert "retain_graph=True" in text
    assert "Trying to backward through the graph a second time" in text


class Unrelated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("something unrelated went wrong")


def test_unrelated_errors_pass_through_untouched():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return Unrelated.apply(self.lin(x))

    cap = bl.capture(Model(), torch.randn(1, 2))
    with pytest.raises(RuntimeError) as info:
        cap.output.sum().backward()
    assert not isinstance(info.value, bl.BacklensError)
    assert str(info.value) == "something unrelated went wrong"
    assert cap.passes[0].status == "failed"


def test_explain_works_on_an_error_caught_without_a_capture():
    w = torch.randn(3, requires_grad=True)
    loss = (w * 2).sum()
    loss.backward()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    explanation = bl.explain(info.value)
    assert explanation.code == "freed_graph"
    assert "retain_graph=True" in str(explanation)
    assert str(explanation).endswith(str(info.value))


def test_explain_says_nothing_new_about_unknown_errors():
    explanation = explain(ValueError("plain value error"))
    assert explanation.code is None and str(explanation) == "plain value error"
    assert explanation.error() is None


def test_a_pass_after_a_translated_failure_still_records():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = loss_of(cap.output)
    loss.backward()
    with pytest.raises(bl.FreedGraphError):
        loss.backward()
    cap2 = bl.capture(MLP(), torch.randn(2, 6))
    loss_of(cap2.output).backward()
    assert cap2.passes[0].status == "ok" and len(cap.passes) == 2
