"""Models and checks shared by the live-tracing tests.

The reference for every gradient is plain autograd on the same batch
(``retain_grad`` / ``register_hook``), so where the arithmetic is the same the
comparison is ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


class MLP(nn.Module):
    """Three layers, so there is an earlier, a middle and a later site."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


def reference(model: nn.Module, x: torch.Tensor, names: list[str], loss_fn=lambda out: out.sum()):
    """Plain autograd: the named modules' outputs and the gradients flowing into them."""
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def keep(mod, args, out, name=name):
            out.retain_grad()
            outputs[name] = out

        handles.append(module.register_forward_hook(keep))
    try:
        out = model(x)
        loss_fn(out).backward()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (o.detach(), o.grad) for name, o in outputs.items()}


def assert_clean(model: nn.Module) -> None:
    """No hook left on any module, and a plain backward still behaves as stock."""
    for name, module in model.named_modules():
        assert not module._forward_hooks, f"forward hook left on {name or 'the model'}"
        assert not module._forward_pre_hooks, f"forward pre-hook left on {name or 'the model'}"
    from torch.nn.modules import module as module_mod

    from backlens import _module_calls

    assert not module_mod._global_forward_hooks, "a global forward hook is left"
    ours = {wrapper for _, wrapper in _module_calls._wrappers.values()}
    for cls in {type(module) for module in model.modules()} | {nn.Module}:
        for name in ("_call_impl", "__call__"):
            assert vars(cls).get(name) not in ours, f"the module-call wrapper is left on {cls.__name__}.{name}"
    assert "grad" not in torch.Tensor.__dict__, "Tensor.grad is still patched"
    leaf = torch.ones(3, requires_grad=True)
    result = (leaf * 2).sum().backward()
    assert result is None
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.ones(2).sum().backward()
