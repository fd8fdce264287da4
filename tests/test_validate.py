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


# -- modules called more than once, model state, cleanup ---------------------------------------

class Tied(nn.Module):
    """One child called twice (weight tying)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)

    def forward(self, x):
        return self.shared(torch.relu(self.shared(x)))


class CellLoop(nn.Module):
    """An RNNCell run once per time step."""

    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        for step in x:
            h = self.cell(step, h)
        return self.head(h)


class Counted(nn.Module):
    """Scales by a buffer it increments on every call: a run from other buffers gives other gradients."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_validate_names_each_call_of_a_module_called_twice_like_the_capture():
    torch.manual_seed(0)
    result = bl.validate(Tied(), torch.randn(2, 3), lambda out: out.sum())
    assert result, str(result)
    assert {"module shared:1 output grad", "module shared:2 output grad"} <= set(result.compared)


def test_validate_compares_every_step_of_an_rnn_cell_loop():
    torch.manual_seed(0)
    result = bl.validate(CellLoop(), torch.randn(4, 2, 3), lambda out: out.sum())
    assert result, str(result)
    assert {f"module cell:{k} output grad" for k in range(1, 5)} <= set(result.compared)


def test_validate_reports_a_gradient_changed_in_one_call_of_a_repeated_module_under_that_call():
    torch.manual_seed(0)
    model = Tied()
    runs = {"n": 0}

    def perturb_captured_first_call(module, inputs, output):
        runs["n"] += 1
        if runs["n"] == 3:  # the captured run's first call of `shared` (two calls per run)
            output.register_hook(lambda g: g * 1.5)

    model.shared.register_forward_hook(perturb_captured_first_call)
    result = bl.validate(model, torch.randn(2, 3), lambda out: out.sum())
    assert not result
    assert "module output gradient shared:1" in result.differences
    assert "module output gradient shared:2" not in result.differences  # downstream of the change: untouched


def test_validate_leaves_batchnorm_buffers_and_training_modes_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).train()
    model[3].eval()
    before = {name: b.clone() for name, b in model.named_buffers()}
    assert bl.validate(model, torch.randn(5, 3), lambda out: out.sum())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert [m.training for m in model.modules()] == [True, True, True, True, False]


def test_validate_runs_the_captured_side_from_the_buffers_the_stock_side_started_from():
    torch.manual_seed(0)
    model = Counted()
    result = bl.validate(model, torch.randn(2, 3), lambda out: out.sum())
    assert result, str(result)
    assert float(model.calls) == 0.0


def test_validate_leaves_parameters_that_the_forward_updates_in_place_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].register_forward_pre_hook(lambda module, args: module.bias.data.add_(1.0))
    bias = model[0].bias.detach().clone()
    assert bl.validate(model, torch.randn(2, 3), lambda out: out.sum())
    assert torch.equal(model[0].bias.detach(), bias)


def test_validate_with_dropout_seeds_both_runs_alike_and_leaves_the_rng_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1)).train()
    x = torch.randn(4, 3)
    rng = torch.get_rng_state()
    assert bl.validate(model, x, lambda out: out.sum())
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_exception_in_the_captured_backward_leaves_nothing_installed_and_the_model_as_it_was():
    from backlens import _torch
    from backlens.graph import engine

    torch.manual_seed(0)
    model = MLPWithBatchNorm()
    loss_of(model(torch.randn(4, 6))).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    call_impl = nn.Module._call_impl
    armed = engine._live_participants()  # captures other tests may still hold
    calls = {"n": 0}

    def loss_fn(out):
        calls["n"] += 1
        if calls["n"] == 2:  # the captured run
            out.register_hook(_explode)
        return out.sum()

    with pytest.raises(RuntimeError, match="exploded in the backward"):
        bl.validate(model, torch.randn(4, 6), loss_fn)
    assert engine._live_participants() == armed
    assert _torch.engine_wrapper_installed() == bool(armed or engine._observers)
    assert nn.Module._call_impl is call_impl
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name


class MLPWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


def _explode(grad):
    raise RuntimeError("exploded in the backward")


def test_a_loss_with_no_graph_is_a_named_error_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 1))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(RuntimeError) as info:
        bl.validate(model, torch.randn(3, 4), lambda out: out.detach().sum())
    assert isinstance(info.value, bl.NoGradientPathError)
    assert info.value.code == "loss_without_graph" and "loss_fn" in str(info.value)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert all(p.grad is None for p in model.parameters())
