"""Reference counts and small models for the cost tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from backlens.cost.formulas import EXTRA_FORMULAS


def stock_counts(model, args, kwargs, loss_fn) -> tuple[int, int]:
    """(forward, backward) FLOPs FlopCounterMode counts on a stock run of a copy of ``model``."""
    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        output = twin(*args, **kwargs)
    forward = counter.get_total_flops()
    loss = loss_fn(output)
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        loss.backward()
    return forward, counter.get_total_flops()


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CheckpointedNet(nn.Module):
    """inp -> block (checkpointed, non-reentrant, when ``checkpointed``) -> head."""

    def __init__(self, checkpointed: bool = True, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.block = Block(width)
        self.head = nn.Linear(width, 3)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.head(h)


class FreesSavedByData(torch.autograd.Function):
    """TE-style: releases a saved tensor at the end of backward with ``.data =``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, grad_w = grad @ w.t(), x.t() @ grad
        x.data = torch.empty(0)
        return grad_x, grad_w


class FreesSavedStorage(torch.autograd.Function):
    """TE-style: releases a saved tensor's storage (``untyped_storage().resize_(0)``)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x.clone(), w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, grad_w = grad @ w.t(), x.t() @ grad
        x.untyped_storage().resize_(0)
        return grad_x, grad_w


class FreesCtxTensor(torch.autograd.Function):
    """TE-style: keeps its input on ctx and drops it after backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.inp = x.detach().clone()
        ctx.weight = w
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = grad @ ctx.weight.t(), ctx.inp.t() @ grad
        ctx.inp = None
        return grad_x, grad_w


class FusedLinear(nn.Module):
    def __init__(self, function, width: int = 8):
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x):
        return self.function.apply(torch.relu(x), self.weight)


class FusedNet(nn.Module):
    """pre -> fused (a once-only custom Function) -> post."""

    def __init__(self, function, width: int = 8):
        super().__init__()
        self.pre = nn.Linear(width, width)
        self.fused = FusedLinear(function, width)
        self.post = nn.Linear(width, 2)

    def forward(self, x):
        return self.post(self.fused(self.pre(x)))
