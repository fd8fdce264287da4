"""bl.monitor under DDP and FSDP2, run by each rank of the test world (rank_worker.py).

Each scenario trains a few steps with a monitor and keeps, by hand, the statistics of the
gradients and parameters the optimizer saw (under FSDP2 of the full tensors, gathered with
``full_tensor()``), for test_distributed_monitor.py to compare.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import backlens as bl

STEPS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _rows(mon) -> list:
    return [list(row) for row in mon.to_pandas().itertuples(index=False, name=None)]


def _train(model, optimizer, rank, by_hand) -> None:
    names = [n for n, _p in getattr(model, "module", model).named_parameters()]  # as the model names them

    def pre(_opt, _args, _kwargs):
        grads = [full(p.grad) for p in model.parameters()]
        by_hand["norm"].append({n: float(torch.linalg.vector_norm(g)) for n, g in zip(names, grads)})
        by_hand["absmax"].append({n: float(g.abs().max()) for n, g in zip(names, grads)})
        by_hand["before"].append([full(p.detach()).clone() for p in model.parameters()])

    def post(_opt, _args, _kwargs):
        before = by_hand["before"][-1]
        by_hand["update_ratio"].append({
            n: float(torch.linalg.vector_norm(full(p.detach()) - b)) / float(torch.linalg.vector_norm(b))
            for n, p, b in zip(names, model.parameters(), before)})

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    for step in range(STEPS):
        model(batch(rank, step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    del by_hand["before"]


def ddp(out: Path, rank: int) -> dict:
    """DDP: the norms of the all-reduced gradients; rank 0 alone writes the sinks."""
    model = DDP(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    by_hand = {"norm": [], "absmax": [], "before": [], "update_ratio": []}
    mon = bl.monitor(model, optimizer, sink=[str(out / "monitor_ddp.csv"), lambda step, rows: calls.append(step)])
    _train(model, optimizer, rank, by_hand)
    mon.close()
    return {"rows": _rows(mon), "by_hand": by_hand, "sink_calls": calls}


def fsdp(out: Path, rank: int) -> dict:
    """FSDP2: the norms of the full parameters' gradients, one all-reduce per recorded step."""
    model = mlp()
    for unit in (model[0], model[2], model[4]):
        fully_shard(unit)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    by_hand = {"norm": [], "absmax": [], "before": [], "update_ratio": []}
    all_reduces = []
    stock_all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        all_reduces.append(1)
        return stock_all_reduce(*args, **kwargs)

    mon = bl.monitor(model, optimizer, every=2)
    dist.all_reduce = counting
    try:
        _train(model, optimizer, rank, by_hand)
    finally:
        dist.all_reduce = stock_all_reduce
    mon.close()
    return {"rows": _rows(mon), "by_hand": by_hand, "all_reduces": len(all_reduces)}
