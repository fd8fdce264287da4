"""A module returning a nested output: its first tensor is the same one everywhere.

``((a,), b)`` and ``{"x": a, "y": b}``: ``a`` comes first in reading order.
The call's ``output_grad``, ``bl.validate`` and a module-site edit all act on
``a``, checked against plain PyTorch references.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import backlens as bl


class Inner(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.first = nn.Linear(4, 3)
        self.second = nn.Linear(4, 3)

    def forward(self, x):
        a, b = self.first(x), self.second(x) * 3
        return ((a,), b) if self.shape == "tuple" else {"x": a, "y": b}


class Outer(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.inner = Inner(shape)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        out = self.inner(x)
        a, b = (out[0][0], out[1]) if isinstance(out, tuple) else (out["x"], out["y"])
        return self.head(a).pow(2).sum() + (b * b).sum() * 0.5


def first_of(output):
    return output[0][0] if isinstance(output, tuple) else output["x"]


def setup(shape):
    torch.manual_seed(0)
    return Outer(shape), torch.randn(5, 4)


def stock(model, x, hook_first):
    """Parameter gradients of a stock run; ``hook_first(a)`` may register a hook or return a replacement."""
    model = copy.deepcopy(model)

    def on_output(_module, _inputs, output):
        replaced = hook_first(first_of(output))
        if replaced is None:
            return None
        if isinstance(output, tuple):
            return ((replaced,), output[1])
        return {**output, "x": replaced}

    handle = model.inner.register_forward_hook(on_output)
    model(x).backward()
    handle.remove()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_grads(model, reference):
    for name, p in model.named_parameters():
        expected = reference[name]
        assert (p.grad is None) == (expected is None), name
        assert expected is None or torch.equal(p.grad, expected), name


SHAPES = ["tuple", "dict"]


@pytest.mark.parametrize("shape", SHAPES)
def test_output_grad_is_the_gradient_of_the_first_tensor_in_reading_order(shape):
    model, x = setup(shape)
    seen = {}
    stock(model, x, lambda a: a.register_hook(lambda g: seen.setdefault("a", g)) and None)
    cap = bl.capture(model, x, save_grads=True)
    cap.output.backward()
    call = cap.modules["inner"]
    assert torch.equal(call.output_grad, seen["a"])
    assert call.output_shape == (5, 3)


@pytest.mark.parametrize("shape", SHAPES)
def test_validate_finds_an_untouched_nested_output_model_valid(shape):
    model, x = setup(shape)
    result = bl.validate(model, x, lambda out: out)
    assert result, str(result)
    assert "module inner output grad" in result.compared


@pytest.mark.parametrize("shape", SHAPES)
def test_a_module_site_activation_edit_replaces_the_first_tensor(shape):
    model, x = setup(shape)
    reference = stock(model, x, lambda a: torch.zeros_like(a))
    edited = copy.deepcopy(model)
    cap = bl.capture(edited, x, intervene=bl.when("inner", bl.zero_ablate()))
    cap.output.backward()
    (application,) = cap.forward_edits
    assert application.module == "inner" and application.norm_after == 0.0
    assert_same_grads(edited, reference)
    assert edited.inner.first.weight.grad is None  # nothing upstream of a zeroed activation


@pytest.mark.parametrize("shape", SHAPES)
def test_a_module_site_gradient_edit_scales_the_first_tensors_gradient(shape):
    model, x = setup(shape)
    reference = stock(model, x, lambda a: a.register_hook(lambda g: g * 2) and None)
    edited = copy.deepcopy(model)
    cap = bl.capture(edited, x, intervene=bl.when(bl.grad("inner"), bl.scale(2)))
    cap.output.backward()
    assert_same_grads(edited, reference)
    assert [e.module for e in cap.last_pass.edits] == ["inner"]
