"""``_torch.add_tensor_hook``: ``Tensor.register_hook`` without its Python, for live reads."""

from __future__ import annotations

import pytest
import torch

from backlens import _torch


def _graph():
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    h = w * 2
    loss = (h * h).sum()
    return w, h, loss


def _stock_grad_of(tensor_of, edit=None):
    """The gradient reaching ``tensor_of(graph)`` through a stock hook, and ``w.grad`` after it."""
    w, h, loss = _graph()
    seen = []

    def hook(grad):
        seen.append(grad)
        return edit(grad) if edit is not None else None

    tensor_of((w, h)).register_hook(hook)
    loss.backward()
    return seen[0], w.grad


@pytest.mark.parametrize("which", ["result", "leaf"])
def test_an_added_hook_sees_the_gradient_a_stock_hook_sees(which):
    pick = (lambda pair: pair[1]) if which == "result" else (lambda pair: pair[0])
    stock_seen, stock_w_grad = _stock_grad_of(pick)
    w, h, loss = _graph()
    seen = []
    _torch.add_tensor_hook(pick((w, h)), seen.append)
    loss.backward()
    assert torch.equal(seen[0], stock_seen)
    assert torch.equal(w.grad, stock_w_grad)


def test_a_value_the_added_hook_returns_replaces_the_gradient_as_a_stock_hook_s_does():
    stock_seen, stock_w_grad = _stock_grad_of(lambda pair: pair[1], edit=lambda grad: grad * 3)
    w, h, loss = _graph()
    _torch.add_tensor_hook(h, lambda grad: grad * 3)
    loss.backward()
    assert torch.equal(w.grad, stock_w_grad)


def test_hooks_run_in_the_order_they_were_added_whichever_way():
    w, h, loss = _graph()
    order = []
    h.register_hook(lambda grad: order.append("stock 1"))
    _torch.add_tensor_hook(h, lambda grad: order.append("added"))
    h.register_hook(lambda grad: order.append("stock 2"))
    loss.backward()
    assert order == ["stock 1", "added", "stock 2"]


def test_a_removed_hook_does_not_run_and_removing_it_again_does_nothing():
    w, h, loss = _graph()
    seen = []
    handle = _torch.add_tensor_hook(h, seen.append)
    handle.remove()
    handle.remove()
    loss.backward()
    assert seen == []


def test_removing_an_added_hook_leaves_a_stock_hook_on_the_same_tensor():
    w, h, loss = _graph()
    stock, added = [], []
    h.register_hook(stock.append)
    _torch.add_tensor_hook(h, added.append).remove()
    loss.backward()
    assert len(stock) == 1 and added == []


def test_a_tensor_that_does_not_require_grad_gets_torch_s_own_error():
    with pytest.raises(RuntimeError, match="doesn't require grad"):
        _torch.add_tensor_hook(torch.ones(2), lambda grad: None)


def test_a_tensor_subclass_goes_through_its_own_register_hook():
    calls = []

    class Logged(torch.Tensor):
        def register_hook(self, hook):
            calls.append(hook)
            return super().register_hook(hook)

    w = torch.ones(2, requires_grad=True)
    h = (w * 2).as_subclass(Logged)
    seen = []
    _torch.add_tensor_hook(h, seen.append)
    h.sum().backward()
    assert len(calls) == 1 and len(seen) == 1


def test_without_the_hook_dictionary_register_hook_is_used(monkeypatch):
    monkeypatch.setattr(_torch, "HAS_TENSOR_HOOK_DICT", False)
    w, h, loss = _graph()
    handle = _torch.add_tensor_hook(h, lambda grad: None)
    assert isinstance(handle, torch.utils.hooks.RemovableHandle)
