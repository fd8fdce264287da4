"""bl.monitor under DDP (norms of the all-reduced gradients, rank 0 writes) and FSDP2 (norms of
the full parameters, one all-reduce per recorded step), 2 gloo ranks on CPU.

Exact where the arithmetic is the same (a DDP gradient's norm and max |g|); under FSDP2 the
monitor adds the shards' squared norms across ranks where the reference takes the norm of the
gathered tensor (rtol 1e-6), and the update ratio's norms come from the multi-tensor kernel (rtol 1e-6).
"""

from __future__ import annotations

import math

import pandas as pd
from monitor_scenarios import STEPS


def frame_of(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["step", "kind", "name", "stat", "value"])


def value(frame, step, name, stat):
    found = frame[(frame.step == step) & (frame.kind == "param") & (frame.name == name) & (frame.stat == stat)]
    assert len(found) == 1, (step, name, stat)
    return float(found.value.iloc[0])


def test_under_ddp_the_norms_are_of_the_all_reduced_gradients_on_every_rank(world):
    for rank in (0, 1):
        found = world.result("monitor_ddp", rank)
        frame, by_hand = frame_of(found["rows"]), found["by_hand"]
        for step in range(STEPS):
            for name, norm in by_hand["norm"][step].items():
                assert value(frame, step, name, "norm") == norm
                assert value(frame, step, name, "absmax") == by_hand["absmax"][step][name]
    # the reduced gradients are the same on both ranks, and so are the rows
    assert world.result("monitor_ddp", 0)["rows"] == world.result("monitor_ddp", 1)["rows"]


def test_under_ddp_rank_0_alone_writes_the_sinks(world):
    assert world.result("monitor_ddp", 0)["sink_calls"] == list(range(STEPS))
    assert world.result("monitor_ddp", 1)["sink_calls"] == []
    written = pd.read_csv(world.path / "monitor_ddp.csv", keep_default_na=False)
    assert len(written) == len(world.result("monitor_ddp", 0)["rows"])


def test_under_fsdp2_the_statistics_are_of_the_full_parameters(world):
    for rank in (0, 1):
        found = world.result("monitor_fsdp", rank)
        frame, by_hand = frame_of(found["rows"]), found["by_hand"]
        assert sorted(set(frame.step)) == [0, 2]
        for step in (0, 2):
            for name, norm in by_hand["norm"][step].items():
                assert math.isclose(value(frame, step, name, "norm"), norm, rel_tol=1e-6), (rank, step, name)
                assert value(frame, step, name, "absmax") == by_hand["absmax"][step][name]
                assert math.isclose(value(frame, step, name, "update_ratio"), by_hand["update_ratio"][step][name],
                                    rel_tol=1e-6)
    assert world.result("monitor_fsdp", 0)["rows"] == world.result("monitor_fsdp", 1)["rows"]


def test_under_fsdp2_each_recorded_step_costs_one_all_reduce(world):
    assert [world.result("monitor_fsdp", rank)["all_reduces"] for rank in (0, 1)] == [2, 2]
