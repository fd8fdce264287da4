"""Ownership: a capture records an engine run only when the run reaches a node its own
forward made; a run reaching it through a leaf input or a shared parameter is not its pass."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import MLP


def test_a_plain_backward_after_the_captured_one_is_not_recorded_through_the_input_leaf():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 6, requires_grad=True)
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    first = x.grad.clone()
    (3 * model(x)).sum().backward()  # no capture: shares only the leaf x and the parameters
    assert len(cap.passes) == 1
    assert {c.pass_number for c in cap.grad_fn_calls} == {1}
    assert torch.equal(cap.inputs[0].grad, first)
    reference, x_ref = copy.deepcopy(model), x.detach().clone().requires_grad_(True)
    reference.zero_grad()
    reference(x_ref).sum().backward()
    (3 * reference(x_ref)).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)  # autograd itself is untouched


def _ascend(model: nn.Module, x0: torch.Tensor, steps: int, capture: bool, keep: list | None = None):
    """Activation maximisation of output unit 0 by SGD on the input, one capture per step."""
    x = x0.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([x], lr=0.1)
    for _ in range(steps):
        if capture:
            cap = bl.capture(model, x, save_grads=True)
            output = cap.output
            if keep is not None:
                keep.append(cap)
        else:
            output = model(x)
        (-output[:, 0].sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return x.detach()


def test_a_capture_per_step_records_exactly_one_pass_each():
    torch.manual_seed(0)
    model, x0 = MLP(), torch.randn(2, 6)
    captures: list = []
    ascended = _ascend(model, x0, 10, capture=True, keep=captures)
    assert [len(c.passes) for c in captures] == [1] * 10
    assert all({call.pass_number for call in c.grad_fn_calls} == {1} for c in captures)
    reference = _ascend(copy.deepcopy(model), x0, 10, capture=False)
    assert torch.equal(ascended, reference)
    # Each capture's only pass kept the stimulus gradient of its own step.
    x = x0.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([x], lr=0.1)
    for cap in captures:
        (-model(x)[:, 0].sum()).backward()
        assert torch.equal(cap.inputs[0].grad, x.grad)
        optimizer.step()
        optimizer.zero_grad()


def test_memory_stays_flat_over_a_hundred_captured_steps():
    torch.manual_seed(0)
    model, x0 = MLP(), torch.randn(2, 6)
    x = x0.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([x], lr=0.1)
    states = []
    gc.collect()
    gc.disable()  # reference counting alone must free each step's capture
    try:
        for _ in range(100):
            cap = bl.capture(model, x, save_grads=True)
            states.append(weakref.ref(cap._state))
            (-cap.output[:, 0].sum()).backward()
            assert len(cap.passes) == 1
            optimizer.step()
            optimizer.zero_grad()
            alive = sum(1 for ref in states if ref() is not None)
            assert alive == 1, f"{alive} capture states alive at step {len(states)}"
    finally:
        gc.enable()
    reference = _ascend(copy.deepcopy(model), x0, 100, capture=False)
    assert torch.equal(x.detach(), reference)


def test_kept_captures_hold_only_their_own_pass_over_a_hundred_steps():
    torch.manual_seed(0)
    model, x0 = MLP(), torch.randn(2, 6)
    captures: list = []
    _ascend(model, x0, 100, capture=True, keep=captures)
    calls = [len(c.grad_fn_calls) for c in captures]
    assert len(set(calls)) == 1  # the same graph each step: no capture grows with later steps
    saved = [sum(1 for call in c.grad_fn_calls if call.grad_outputs is not None) for c in captures]
    assert saved == [saved[0]] * 100


def test_a_second_capture_of_the_same_model_does_not_take_the_first_ones_pass():
    model = MLP()
    a = bl.capture(model, torch.randn(2, 6))
    b = bl.capture(model, torch.randn(3, 6))
    a.output.sum().backward()  # reaches b only through the shared parameters
    assert (len(a.passes), len(b.passes)) == (1, 0)
    b.output.sum().backward()
    assert (len(a.passes), len(b.passes)) == (1, 1)


def test_cap_backward_with_a_loss_that_never_reaches_the_capture_raises_before_running():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 6, requires_grad=True)
    cap = bl.capture(model, x, save_grads=True)
    foreign = (2 * model(x)).sum()  # another forward: shares x and the parameters only
    with pytest.raises(bl.NoGradientPathError) as caught:
        cap.backward(foreign)
    assert caught.value.code == "loss_not_from_capture"
    assert "does not depend on this capture" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)
    # Nothing ran, nothing half-done: no gradient, no pass, and the capture still works.
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert len(cap.passes) == 0
    cap.backward(cap.output.sum())
    assert len(cap.passes) == 1 and cap.passes[0].trigger == "cap.backward"
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name


def test_cap_backward_with_an_unrelated_tensor_raises_the_same_error():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(bl.NoGradientPathError):
        cap.backward((w * 2).sum())
    assert w.grad is None and len(cap.passes) == 0
