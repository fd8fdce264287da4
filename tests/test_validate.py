"""bl.validate: a captured run equals a stock run, and never passes vacuously."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import build, loss_of


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2_cache", "bert"])
def test_validate_passes_on_models_whose_capture_changes_nothing(name):
    model, args, kwargs = build(name)
    inputs = kwargs | {"input_ids": args[0]} if kwargs else args
    result = bl.validate(model, inputs, loss_of)
    assert result, str(result)
    assert any(c.startswith("module ") for c in result.compared)
    assert any(c.startswith("param ") for c in result.compared)
    assert all(p.grad is None for p in model.parameters())


def test_validate_leaves_existing_gradients_in_place():
    model, args, _ = build("mlp")
    loss_of(model(*args)).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert bl.validate(model, args, loss_of)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, before[name])


def test_a_model_without_child_modules_returns_false_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = bl.validate(nn.Linear(3, 2), torch.randn(4, 3), lambda out: out.sum())
    assert not result
    codes = [w.message.code for w in caught if isinstance(w.message, bl.BacklensWarning)]
    assert codes == ["backward_validation_no_module_output_evidence"]


def test_a_gradient_perturbed_in_the_captured_run_is_reported():
    model, args, _ = build("mlp")
    calls = {"n": 0}

    def perturb_second_run(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 2:
            output.register_hook(lambda g: g * 1.5)

    model.net[2].register_forward_hook(perturb_second_run)
    result = bl.validate(model, args, loss_of)
    assert not result
    assert "parameter gradient net.0.weight" in result.differences
    assert "module output gradient net.0" in result.differences
