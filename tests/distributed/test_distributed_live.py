"""bl.wrap over a DDP or FSDP2 model, on each rank: the real gradient, and stock parameter gradients."""

from __future__ import annotations

import pytest
import torch
from rank_launch import WORLD_SIZE


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", ["live_ddp", "live_fsdp"])
def test_a_traced_module_outputs_gradient_is_the_one_stock_autograd_computes(world, scenario, rank):
    traced = world.grads_of(scenario, "traced", rank)
    stock = world.grads_of(scenario, "stock", rank)
    assert torch.equal(traced["h.grad"], stock["h.grad"])


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", ["live_ddp", "live_fsdp"])
def test_parameter_gradients_under_a_trace_are_bitwise_stock(world, scenario, rank):
    traced = world.grads_of(scenario, "traced", rank)
    stock = world.grads_of(scenario, "stock", rank)
    assert stock.keys() == traced.keys() and len(stock) > 1
    for name, grad in stock.items():
        assert torch.equal(traced[name], grad), name
