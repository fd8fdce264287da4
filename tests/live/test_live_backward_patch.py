"""`Tensor.backward`, as the first `bl.wrap()` installs it, keeps its stock behaviour unless used as a `with`."""

from __future__ import annotations

import inspect

import pytest
import torch

import backlens.live as bl
from backlens.live.backward import BackwardBlock, _stock_backward


@pytest.fixture(autouse=True)
def installed():
    bl.wrap(torch.nn.Linear(1, 1))


def test_the_patch_is_installed_and_keeps_the_stock_signature():
    assert getattr(torch.Tensor.backward, "__backlens_live__", False)
    assert inspect.signature(torch.Tensor.backward) == inspect.signature(_stock_backward)
    assert torch.Tensor.backward.__doc__ == _stock_backward.__doc__


def test_a_plain_backward_returns_none_and_accumulates_like_stock():
    w = torch.randn(3, requires_grad=True)
    w_stock = w.detach().clone().requires_grad_()
    assert (w * w).sum().backward() is None
    assert _stock_backward((w_stock * w_stock).sum()) is None
    assert torch.equal(w.grad, w_stock.grad)
    (w * w).sum().backward()
    _stock_backward((w_stock * w_stock).sum())
    assert torch.equal(w.grad, w_stock.grad)


def test_a_plain_backward_passes_every_argument_through():
    w = torch.randn(3, requires_grad=True)
    other = torch.randn(3, requires_grad=True)
    out = w * other
    out.backward(torch.ones(3) * 2, retain_graph=True, create_graph=False, inputs=[w])
    assert torch.equal(w.grad, other.detach() * 2) and other.grad is None
    out.backward(torch.ones(3), inputs=[other])  # the graph was retained
    assert torch.equal(other.grad, w.detach())


def test_a_plain_backward_raises_torchs_own_errors_unchanged():
    def message(call):
        with pytest.raises(RuntimeError) as info:
            call()
        return type(info.value), str(info.value)

    plain = message(lambda: torch.ones(2).sum().backward())
    stock = message(lambda: _stock_backward(torch.ones(2).sum()))
    assert plain == stock
    w = torch.randn(2, requires_grad=True)
    assert message(lambda: (w * 2).backward()) == message(lambda: _stock_backward(w * 2))


def test_assigning_the_result_runs_the_backward_at_once():
    w = torch.randn(2, requires_grad=True)
    result = (w * 3).sum().backward()
    assert result is None and torch.equal(w.grad, torch.full((2,), 3.0))


def test_the_result_used_as_a_with_expression_is_a_backward_block():
    w = torch.randn(2, requires_grad=True)
    with (w * 3).sum().backward() as block:
        pass
    assert isinstance(block, BackwardBlock)
    assert torch.equal(w.grad, torch.full((2,), 3.0))


def test_a_backward_block_with_several_context_managers_on_one_line():
    w = torch.randn(2, requires_grad=True)
    h = w * 3
    with torch.enable_grad(), h.sum().backward():
        g = h.grad.save()
    assert torch.equal(g, torch.ones(2))


def test_tensor_subclasses_with_torch_function_still_backpropagate():
    class Tagged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    w = torch.randn(2, requires_grad=True)
    out = (w * 2).sum().as_subclass(Tagged)
    out.backward()
    assert torch.equal(w.grad, torch.full((2,), 2.0))
