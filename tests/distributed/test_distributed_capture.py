"""Per-rank capture under DDP and FSDP2: stock gradients, and the collectives of the backward."""

from __future__ import annotations

import pytest
import torch
from rank_launch import WORLD_SIZE

import backlens as bl
from backlens.graph.labels import owning_module

RANKS = range(WORLD_SIZE)


def assert_same_grads(world, scenario, kind, rank):
    stock = world.grads_of(scenario, "stock", rank)
    other = world.grads_of(scenario, kind, rank)
    assert stock and other.keys() == stock.keys()
    for name, grad in stock.items():
        assert torch.equal(other[name], grad), (scenario, kind, rank, name)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["ddp_mlp", "ddp_gpt2"])
def test_ddp_captured_gradients_are_bitwise_those_of_stock_ddp(world, scenario, rank):
    assert_same_grads(world, scenario, "captured", rank)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["ddp_mlp", "ddp_gpt2"])
def test_a_ddp_model_steps_as_stock_after_its_capture_closed(world, scenario, rank):
    assert_same_grads(world, scenario, "after_close", rank)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["fsdp_mlp", "fsdp_gpt2"])
def test_fsdp_captured_gradient_shards_are_bitwise_those_of_stock_fsdp(world, scenario, rank):
    assert_same_grads(world, scenario, "captured", rank)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["ddp_mlp", "ddp_gpt2"])
def test_each_ddp_bucket_all_reduce_is_recorded_with_the_buckets_bytes_and_parameters(world, scenario, rank):
    buckets = world.result(scenario, rank)["buckets"]  # torch's GradBuckets, seen by torch's own hook
    assert len(buckets) > 1, "the scenario should make several buckets"
    (backward,) = bl.load(world.path / scenario)[rank].passes
    recorded = [[c.bytes, list(c.params)] for c in backward.collectives]
    assert recorded == buckets
    assert {c.kind for c in backward.collectives} == {"all_reduce"}


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["ddp_mlp", "fsdp_mlp", "fsdp_gpt2"])
def test_a_collective_names_the_modules_owning_its_parameters_and_completes_in_its_pass(world, scenario, rank):
    cap = bl.load(world.path / scenario)[rank]
    (backward,) = cap.passes
    assert len(backward.collectives)
    for collective in backward.collectives:
        assert collective.modules == tuple(dict.fromkeys(owning_module(name) for name in collective.params))
        assert collective.pass_number == 1
        assert 0 <= collective.start and collective.duration is not None and collective.duration >= 0
        assert collective.start + collective.duration <= backward.duration


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["fsdp_mlp", "fsdp_gpt2"])
def test_fsdp_reduce_scatters_carry_each_units_unsharded_bytes_once(world, scenario, rank):
    units = {tuple(names): size for names, size in world.result(scenario, rank)["units"]}
    (backward,) = bl.load(world.path / scenario)[rank].passes
    scatters = [c for c in backward.collectives if c.kind == "reduce_scatter"]
    assert sorted(tuple(sorted(c.params)) for c in scatters) == sorted(units)
    for collective in scatters:
        assert collective.bytes == units[tuple(sorted(collective.params))]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["fsdp_mlp", "fsdp_gpt2"])
def test_fsdp_all_gathers_in_the_backward_carry_a_units_gathered_bytes(world, scenario, rank):
    units = {tuple(names): size for names, size in world.result(scenario, rank)["units"]}
    (backward,) = bl.load(world.path / scenario)[rank].passes
    gathers = [c for c in backward.collectives if c.kind == "all_gather"]
    assert gathers, "units resharded after the forward are gathered again in the backward"
    for collective in gathers:
        assert collective.bytes == units[tuple(sorted(collective.params))]
    assert {c.kind for c in backward.collectives} == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("scenario", ["ddp_mlp", "fsdp_gpt2"])
def test_a_rank_bundle_reads_back_the_collectives_and_call_durations_of_the_live_capture(world, scenario, rank):
    live = world.result(scenario, rank)
    loaded = bl.load(world.path / scenario)[rank]
    rows = loaded.collectives.to_pandas().to_dict("records")
    assert [{k: (v if v == v else None) for k, v in row.items()} for row in rows] == live["collectives"]
    assert [call.duration for call in loaded.grad_fn_calls] == live["call_durations"]


def test_a_comm_hook_registered_after_a_capture_runs_and_is_recorded(world):
    for rank in RANKS:
        found = world.result("hooks", rank)
        assert found["user_hook_calls"] >= 1
        assert found["recorded_with_user_hook"] == found["user_hook_calls"]


def test_a_ddp_model_with_its_own_comm_hook_is_captured_with_a_warning_and_no_collectives(world):
    for rank in RANKS:
        found = world.result("hooks", rank)
        assert "collectives_not_recorded" in found["warned"]
        assert found["recorded_with_own_hook"] == 0


@pytest.mark.parametrize("rank", RANKS)
def test_collectives_are_rows_of_the_cost_tree(world, rank):
    cap = bl.load(world.path / "fsdp_mlp")[rank]
    tree = bl.report.cost_tree(cap)
    for kind in ("all_gather", "reduce_scatter"):
        row = tree[f"({kind})"]
        mine = [c for c in cap.collectives if c.kind == kind]
        assert row.kind == "collective" and row.backward_calls == len(mine)
        assert row.self_backward_time == pytest.approx(sum(c.duration for c in mine))
        assert row.self_backward_flops == 0
    assert sum(r.self_backward_flops for r in tree.rows) == tree.executed_flops


@pytest.mark.parametrize("rank", RANKS)
def test_collectives_are_slices_of_their_own_in_the_timeline(world, rank):
    cap = bl.load(world.path / "ddp_gpt2")[rank]
    line = bl.report.timeline(cap)
    slices = [s for s in line if s.kind == "collective"]
    assert sorted(s.name for s in slices) == sorted(c.label for c in cap.collectives)
    (whole,) = [s for s in line if s.kind == "pass"]
    assert all(whole.start_ns <= s.start_ns and s.end_ns <= whole.end_ns for s in slices)
    assert {s.track for s in slices}.isdisjoint({s.track for s in line if s.kind == "node"})
    names = {e["args"]["name"] for e in line.to_trace()["traceEvents"] if e["name"] == "thread_name"}
    assert "collectives" in names
