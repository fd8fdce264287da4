"""The warm profile: a cold first pass shown apart, medians over the warm passes, FLOPs per pass."""

from __future__ import annotations

import statistics

import torch

import backlens as bl
from backlens.report.profile import build_profile, run_passes
from models import MLP


def profiled(repeats: int, **options):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 6)
    cap = bl.capture(model, x, **options)
    run_passes(cap, cap.output.pow(2).sum(), repeats, list(model.parameters()))
    return model, x, cap


def test_repeated_passes_leave_the_gradients_of_one_stock_backward():
    model, x, cap = profiled(3)
    torch.manual_seed(0)
    stock = MLP()
    stock(x).pow(2).sum().backward()
    for (name, mine), (_n, theirs) in zip(model.named_parameters(), stock.named_parameters()):
        assert torch.equal(mine.grad, theirs.grad), name


def test_only_the_cold_pass_saves_gradients():
    _model, _x, cap = profiled(2, save_grads=True)
    assert [g.pass_number for g in cap.ops["relu_1"].grads] == [1]


def test_module_times_are_medians_of_the_warm_passes_with_the_cold_pass_apart():
    _model, _x, cap = profiled(4)
    profile = build_profile(cap, "mlp")
    assert profile.cold_pass == 1 and profile.warm_passes == [2, 3, 4, 5]
    trees = {n: bl.report.cost_tree(cap, pass_=n) for n in range(1, 6)}
    for row in profile.modules:
        address = row["module"].strip()
        address = "" if address == "(model)" else address
        warm = [trees[n][address].subtree_backward_time for n in range(2, 6)]
        known = [t for t in warm if t is not None]
        assert row["backward_time"] == (statistics.median(known) if known else None)
        assert row["cold_time"] == trees[1][address].subtree_backward_time


def added_in_order(values) -> float:
    """Left to right, as the profile adds call times (``sum`` of floats compensates from 3.12)."""
    total = 0.0
    for value in values:
        total += value
    return total


def test_node_type_times_are_medians_of_the_warm_passes():
    _model, _x, cap = profiled(4)
    profile = build_profile(cap, "mlp")
    for row in profile.node_types:
        per_pass = [added_in_order(c.duration for c in cap.passes.for_pass(n).calls if c.grad_fn.type == row["type"])
                    for n in range(1, 6)]
        assert row["time"] == statistics.median(per_pass[1:]) and row["cold_time"] == per_pass[0]
        assert row["fires"] == sum(1 for c in cap.passes[0].calls if c.grad_fn.type == row["type"])


def test_flops_are_per_pass_not_summed_over_the_repeats():
    _model, _x, cap = profiled(3)
    profile = build_profile(cap, "mlp")
    assert profile.backward_flops == bl.report.backward_status(cap).executed_flops // 4
    assert profile.flops_scope == "per pass"


def test_one_pass_has_no_cold_pass_and_shows_its_own_times():
    _model, _x, cap = profiled(0)
    profile = build_profile(cap, "mlp")
    assert profile.cold_pass is None and profile.warm_passes == [1]
    tree = bl.report.cost_tree(cap)
    assert [r["backward_time"] for r in profile.modules] == [r.subtree_backward_time for r in tree.rows]


def test_a_loaded_bundle_profiles_the_same(tmp_path):
    _model, _x, cap = profiled(2)
    cap.save(str(tmp_path / "b"))
    loaded = build_profile(bl.load(str(tmp_path / "b")), "mlp")
    live = build_profile(cap, "mlp")
    assert (loaded.modules, loaded.node_types, loaded.passes) == (live.modules, live.node_types, live.passes)
    assert loaded.gantt == live.gantt
