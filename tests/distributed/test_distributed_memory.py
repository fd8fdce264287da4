"""memory=True under DDP and FSDP2: each rank records what its own replica or shard saves."""

from __future__ import annotations

import pytest
import torch
from rank_launch import WORLD_SIZE

import backlens as bl

RANKS = range(WORLD_SIZE)
SCENARIOS = ["memory_ddp", "memory_fsdp"]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_op_saves_on_every_rank_what_it_saves_in_the_bare_module(world, scenario, rank):
    result = world.result(scenario, rank)
    assert result["bare"] and result["captured"] == result["bare"]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_memory_true_leaves_distributed_gradients_bitwise_stock(world, scenario, rank):
    stock = world.grads_of(scenario, "stock", rank)
    captured = world.grads_of(scenario, "captured", rank)
    assert stock and captured.keys() == stock.keys()
    for name, grad in stock.items():
        assert torch.equal(captured[name], grad), (scenario, rank, name)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_rank_has_a_live_set_through_its_pass_and_frees_every_save(world, scenario, rank):
    result = world.result(scenario, rank)
    assert result["samples"] == result["calls"] > 0 and result["peak"] > 0 and result["all_freed"]
    loaded = bl.load(world.path / scenario)[rank]
    assert loaded.passes[0].memory.peak_bytes == result["peak"]
