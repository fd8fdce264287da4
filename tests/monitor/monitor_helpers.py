"""A small model with nested modules, and a training loop that keeps, by hand, what each
optimizer step saw: the gradients, the parameters before and after, the module outputs'
gradients (through retain_grad, not the monitor's tensor hooks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(6, 16)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(self.act(self.encoder(x))))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * step + micro))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


@dataclass
class Seen:
    """What step ``k`` saw, kept by hand: ``grads[k][name]``, ``before[k][name]``, ``after[k][name]``,
    ``outputs[k][address]`` (the gradients reaching each module output, one per call)."""

    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    before: list[dict[str, torch.Tensor]] = field(default_factory=list)
    after: list[dict[str, torch.Tensor]] = field(default_factory=list)
    outputs: list[dict[str, list[torch.Tensor]]] = field(default_factory=list)


def keep_by_hand(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Seen, list]:
    """Optimizer hooks that copy the gradients and parameters at each step (removed by the caller)."""
    seen = Seen()

    def pre(_opt, _args, _kwargs):
        seen.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        seen.before.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def post(_opt, _args, _kwargs):
        seen.after.append({n: p.detach().clone() for n, p in model.named_parameters()})

    return seen, [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def train(model, optimizer, steps: int, micro: int = 1, seen: Seen | None = None, inject=None) -> None:
    """``steps`` optimizer steps of ``micro`` accumulated micro-batches each; with ``seen``, the
    module outputs' gradients are kept by hand (retain_grad) per step."""
    for step in range(steps):
        kept: dict[str, list[torch.Tensor]] = {}
        outputs = []
        handles = []
        if seen is not None:
            handles = [m.register_forward_hook(partial(_retain, outputs, n)) for n, m in model.named_modules()]
        for k in range(micro):
            loss_of(model(batch(step, k))).div(micro).backward()
        for handle in handles:
            handle.remove()
        for name, output in outputs:
            kept.setdefault(name, []).append(output.grad.detach().clone())
        if seen is not None:
            seen.outputs.append(kept)
        if inject is not None:
            inject(step, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _retain(outputs: list, name: str, _module, _args, output) -> None:
    output.retain_grad()
    outputs.append((name, output))


def value(frame, step: int, kind: str, name: str, stat: str) -> float:
    found = frame[(frame.step == step) & (frame.kind == kind) & (frame.name == name) & (frame.stat == stat)]
    assert len(found) == 1, (step, kind, name, stat, len(found))
    return float(found.value.iloc[0])


def module_params(model: nn.Module, address: str) -> list[str]:
    """Names of the parameters module ``address`` holds (its children's included)."""
    module = model.get_submodule(address) if address else model
    ids = {id(p) for p in module.parameters()}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def norm64(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.flatten().double() for t in tensors])))


def sq_norm_sum(tensors) -> float:
    """sqrt of the sum of each tensor's squared float32 norm, in float64 (several outputs together)."""
    return float(np.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in tensors)))
