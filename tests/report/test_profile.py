"""The warm profile: a cold first pass shown apart, medians over the warm passes, FLOPs per pass."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import backlens as bl
from backlens.report.display import flops_text
from backlens.report.profile import build_profile, html_report, run_passes, summary_line
from models import MLP, Sleepy

# Passes of a tiny MLP last about 100 us, so their spread on a shared machine is often over 20% of
# the median: the warning is the machine's, not these tests' subject (the sleeping ones assert it).
pytestmark = pytest.mark.filterwarnings("ignore:Backward times are noisy")


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


def test_flops_come_from_the_cold_pass_and_the_warm_ones_run_without_the_census():
    from backlens.cost.observer import TIMED_WITHOUT_CENSUS

    _model, _x, cap = profiled(3)
    profile = build_profile(cap, "mlp")
    status = bl.report.backward_status(cap)
    assert [p.counted for p in status.passes] == [True, False, False, False]
    assert {p.reason for p in status.passes[1:]} == {TIMED_WITHOUT_CENSUS}
    assert [p.aten_ops is None for p in cap.passes] == [False, True, True, True]
    assert profile.backward_flops == status.passes[0].executed_flops == status.executed_flops
    assert profile.flops_scope == "per pass, counted in pass 1"
    assert profile.timing.passes == [2, 3, 4] and not profile.timing.census_included


def test_the_timed_passes_report_their_median_and_quartiles():
    _model, _x, cap = profiled(5)
    profile = build_profile(cap, "mlp")
    durations = [p.duration for p in cap.passes[1:]]
    q1, _q2, q3 = statistics.quantiles(durations, n=4, method="inclusive")
    assert (profile.timing.median, profile.timing.q1, profile.timing.q3) == (statistics.median(durations), q1, q3)
    assert "interquartile range" in summary_line(profile)


def test_stock_passes_interleaved_with_the_timed_ones_give_the_overhead():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 6)
    cap = bl.capture(model, x)
    run = run_passes(cap, cap.output.pow(2).sum(), 4, list(model.parameters()),
                     stock_loss=lambda: model(x).pow(2).sum())
    assert len(run.captured) == len(run.stock) == 4 and len(cap.passes) == 5  # stock passes are not recorded
    assert run.overhead == statistics.median(run.captured) / statistics.median(run.stock) - 1
    profile = build_profile(cap, "mlp", run=run)
    assert profile.timing.overhead == run.overhead and "4 stock backward passes" in summary_line(profile)


def test_a_backward_that_sleeps_at_random_warns_timing_noisy():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    loss = Sleepy.apply(cap.output.sum())
    run_passes(cap, loss, 8, list(model.parameters()))
    with pytest.warns(bl.BacklensWarning, match="interquartile range") as caught:
        profile = build_profile(cap, "mlp")
    assert {w.message.code for w in caught} == {"timing_noisy"} and profile.timing.noisy


def test_the_gantt_shows_the_pass_whose_module_times_are_nearest_their_medians():
    torch.manual_seed(0)
    model = SlowParts()
    cap = bl.capture(model, torch.randn(2, 4))
    SleepOnce.sleep_on = {("a", 2), ("b", 3)}  # pass 2 is slow in a, pass 3 in b; pass 4 in neither
    SleepOnce.calls.clear()
    run_passes(cap, cap.output.sum(), 3, list(model.parameters()))
    with pytest.warns(bl.BacklensWarning, match="interquartile range"):  # two of three passes slept
        profile = build_profile(cap, "parts")
    durations = {p.number: p.duration for p in cap.passes}
    assert min(durations[2], durations[3]) > durations[4]  # the pass of median duration is a slow one
    assert profile.gantt.title.startswith("Backward timeline of pass 4:")
    assert "closest to their medians" in profile.gantt.note


class SleepOnce(torch.autograd.Function):
    """The identity; its backward in module ``name`` sleeps 30 ms on the passes listed."""

    sleep_on: set = set()
    calls: dict = {}

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        count = SleepOnce.calls[ctx.name] = SleepOnce.calls.get(ctx.name, 0) + 1
        if (ctx.name, count) in SleepOnce.sleep_on:
            time.sleep(0.03)
        return grad, None


class Part(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return SleepOnce.apply(self.fc(x), self.name)


class SlowParts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Part("a"), Part("b")

    def forward(self, x):
        return self.b(self.a(x))


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


def test_the_report_page_writes_numbers_one_way():
    import re

    from backlens.report.html import Gantt, GanttRow, Report

    _model, _x, cap = profiled(2)
    page = html_report(build_profile(cap, "mlp")).to_html()
    visible = re.sub(r"<script.*?</script>", "", page, flags=re.S)
    assert not re.search(r"\d,\d\d\d", visible) and not re.search(r"\de[+-]\d", visible)
    assert flops_text(bl.report.backward_status(cap).executed_flops) in visible  # 5.63K, not 5,632
    long = Report("t", sections=[Gantt("g", [GanttRow("a", 0, [(0.0, 1450.0, "a")])], 1450.0)]).to_html()
    assert "1.450 s" in long and "e+03" not in long


def test_work_of_no_module_has_one_name_everywhere():
    from backlens.graph.labels import NO_FORWARD_OP
    from backlens.report.cost_tree import NO_FORWARD_OP as in_the_tree

    _model, _x, cap = profiled(2)
    profile = build_profile(cap, "mlp")
    assert in_the_tree == NO_FORWARD_OP
    assert NO_FORWARD_OP in [r["module"] for r in profile.modules]
    assert NO_FORWARD_OP in [row.label for row in profile.gantt.rows]
    result = bl.bench.backward(MLP(), torch.randn(4, 6), lambda out: out.pow(2).sum(), repeats=2, warmup=1)
    assert NO_FORWARD_OP in result.by_module
