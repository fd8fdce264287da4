"""bl.report.memory_plan: what checkpointing module calls would save, and the closed loop that shows it."""

from __future__ import annotations

import pytest
import torch
from memory_refs import SideBySide, stock_grads

import backlens as bl
import models
from backlens.errors import UnsupportedInputError


def gpt2_capture():
    model, args, kwargs = models.build("gpt2")
    cap = bl.capture(model, *args, memory=True, **kwargs)
    models.loss_of(cap.output).backward()
    return model, args, cap


@pytest.fixture(scope="module")
def gpt2_captured():
    """One GPT-2 capture for the tests that only read it (and leave the model as they found it)."""
    return gpt2_capture()


@pytest.mark.parametrize("share", [0.5, None])
def test_checkpointing_the_planned_calls_saves_what_the_plan_predicted(share):
    model, args, cap = gpt2_capture()
    stock = stock_grads(model, models.loss_of, *args)
    budget = None if share is None else int(cap.memory.saved_bytes * share)
    plan = bl.report.memory_plan(cap, budget_bytes=budget)
    assert plan.chosen and plan.saving > 0
    with plan.apply(model):
        again = bl.capture(model, *args, memory=True)
        models.loss_of(again.output).backward()
    measured = cap.memory.saved_bytes - again.memory.saved_bytes
    assert abs(plan.saving - measured) <= 0.10 * measured
    assert {c.module for c in again.checkpoints} == set(plan.chosen)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, stock[name]), name
    if budget is not None:
        assert plan.within_budget and again.memory.saved_bytes <= budget


def test_candidates_are_ranked_by_bytes_freed_per_recompute_flop(gpt2_captured):
    _model, _args, cap = gpt2_captured
    plan = bl.report.memory_plan(cap)
    ratios = [row.bytes_per_flop for row in plan.rows]
    assert ratios == sorted(ratios, reverse=True)
    for row in plan.rows:
        assert row.saved_bytes == cap.memory.checkpoint_saving([row.module]) > 0
        flops = sum(cap.ops[label].forward_flops for label in cap.modules[row.module].ops)
        assert row.recompute_flops == flops
        assert row.bytes_per_flop == (row.saved_bytes / flops if flops else float("inf"))
    assert plan.to_pandas()["module"].tolist() == [row.module for row in plan.rows]


def test_without_a_budget_no_chosen_call_contains_another(gpt2_captured):
    _model, _args, cap = gpt2_captured
    plan = bl.report.memory_plan(cap)
    for outer in plan.chosen:
        for inner in plan.chosen:
            if inner != outer:
                assert not inner.startswith(outer + ".") and outer != ""


def test_the_saving_of_calls_side_by_side_is_computed_together_not_summed():
    torch.manual_seed(0)
    model = SideBySide()
    cap = bl.capture(model, torch.randn(4, 8), memory=True)
    relu_output = 4 * 8 * 4
    first, second = cap.memory.checkpoint_saving(["first"]), cap.memory.checkpoint_saving(["second"])
    assert first == cap.memory["first"].saved_bytes - 4 * 8 * 4  # all it saved but its input x
    both = cap.memory.checkpoint_saving(["first", "second"])
    assert both == first + second - relu_output  # second's checkpoint keeps first's output
    plan = bl.report.memory_plan(cap, budget_bytes=cap.memory.saved_bytes - first - second)
    assert plan.saving == cap.memory.checkpoint_saving(plan.chosen)
    with plan.apply(model):
        again = bl.capture(model, torch.randn(4, 8), memory=True)
    assert cap.memory.saved_bytes - again.memory.saved_bytes == plan.saving


def test_apply_leaves_the_model_as_it_was(gpt2_captured):
    model, _args, cap = gpt2_captured
    plan = bl.report.memory_plan(cap, budget_bytes=cap.memory.saved_bytes // 2)
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    with plan.apply(model):
        assert any(model.get_submodule(a).__dict__.get("forward") is not None
                   for a in {r.address for r in plan.rows if r.chosen})
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == before
    assert not model._forward_pre_hooks


def test_a_budget_nothing_reaches_says_so(gpt2_captured):
    _model, _args, cap = gpt2_captured
    plan = bl.report.memory_plan(cap, budget_bytes=0)
    assert plan.within_budget is False and any("budget" in note for note in plan.notes)


def test_the_plan_needs_a_memory_capture_and_a_byte_budget():
    model, args, kwargs = models.build("mlp")
    with pytest.raises(UnsupportedInputError) as caught:
        bl.report.memory_plan(bl.capture(model, *args, **kwargs))
    assert caught.value.code == "memory_not_recorded"
    cap = bl.capture(model, *args, memory=True, **kwargs)
    with pytest.raises(UnsupportedInputError):
        bl.report.memory_plan(cap, budget_bytes=-1)
    with pytest.raises(UnsupportedInputError):
        bl.report.memory_plan("not a capture")
