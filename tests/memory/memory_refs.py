"""References for the memory tests, computed without backlens: what a stock forward saves."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from backlens.graph.labels import op_name


class _SavingOps(TorchFunctionMode):
    """Names every torch-level call and says which one is running (nested calls run with the mode off)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.current: int | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(op_name(func))
        previous, self.current = self.current, len(self.names) - 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = previous


def saved_by_op(model: nn.Module, *args, **kwargs) -> list[tuple[str, int, int, int]]:
    """Run ``model`` stock under our own saved-tensor hooks; for every torch-level call that
    saved something, in order: (function name, bytes of the storages it saved once each,
    bytes of the parameter and buffer storages it saved once each, tensors saved)."""
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ops = _SavingOps()
    seen: list[tuple[int | None, torch.Tensor]] = []

    def pack(tensor):
        seen.append((ops.current, tensor))  # kept alive: no storage address is reused meanwhile
        return tensor.detach()

    with ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    rows: dict[int, tuple[dict, dict, list]] = {}
    for op, tensor in seen:
        plain, params, count = rows.setdefault(op, ({}, {}, [0]))
        storage = tensor.untyped_storage()
        (params if storage.data_ptr() in fixed else plain)[storage.data_ptr()] = storage.nbytes()
        count[0] += 1
    del out
    return [(ops.names[op] if op is not None else None, sum(plain.values()), sum(params.values()), count[0])
            for op, (plain, params, count) in sorted(rows.items(), key=lambda item: (item[0] is None, item[0]))]


def saved_rows(cap) -> list[tuple[str, int, int, int]]:
    """The same, read from a memory=True capture's op rows."""
    return [(row.label.rsplit("_", 1)[0], row.saved_bytes, row.saved_param_bytes, row.saved_tensors)
            for row in cap.memory.ops if row.saved_tensors]


def stock_grads(model: nn.Module, loss_fn, *args, **kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model(*args, **kwargs)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


class ViewsAndTwice(nn.Module):
    """Saves a tensor twice (``h * h``), views of one storage from two ops, and a transposed view."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        h = self.lin(x)                  # addmm saves x and the weight's transpose (a view of a parameter)
        a = h * h                        # mul saves h twice: one storage
        flat = a.view(-1)
        head = flat[:8].sin()            # sin saves a view of a's storage...
        tail = flat[8:].cos()            # ...and so does cos: one storage between them
        return head.sum() + tail.sum() + a.t().exp().sum()   # exp saves its own result


class HandNet(nn.Module):
    """Two bias-free linears around a tanh: small enough to work its live set out by hand."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8, bias=False)
        self.act = nn.Tanh()
        self.lin2 = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class Residual(nn.Module):
    """An input not saved by its first op, a residual branch (a gradient summed from two senders)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x + 1))    # add makes a new tensor: the test's input is not saved
        h = h + torch.relu(self.b(h))
        return self.c(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class CheckpointedBlocks(nn.Module):
    """A block run under non-reentrant checkpoint (or not), between two plain layers."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.head(h)


class Producer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))   # relu saves its output: nothing after it saves that again


class Consumer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, r):
        return torch.tanh(self.lin(r + 1))   # saves nothing of r itself: r + 1 is a new tensor


class SideBySide(nn.Module):
    """Two calls where checkpointing both keeps what checkpointing the first alone frees (the
    second's checkpoint keeps its input, the first's output)."""

    def __init__(self):
        super().__init__()
        self.first = Producer()
        self.second = Consumer()

    def forward(self, x):
        return self.second(self.first(x))


def build_hand():
    """A `backlens profile` factory: HandNet, a 3x4 input, a sum loss."""
    torch.manual_seed(0)
    return HandNet(), torch.randn(3, 4), lambda out: out.sum()
