"""Activation checkpointing: recomputed forward kernels are their node's recompute_flops."""

from __future__ import annotations

import pytest
import torch
from cost_refs import CheckpointedNet, stock_counts

import backlens as bl
from backlens import _torch

BLOCK_MODULES = {"block.fc1", "block.fc2"}


def run(checkpointed=True, create_graph=False):
    torch.manual_seed(0)
    model = CheckpointedNet(checkpointed=checkpointed)
    x = torch.randn(4, 8)
    cap = bl.capture(model, x)
    loss = cap.output.sum()
    if create_graph:
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    else:
        loss.backward()
    return model, x, cap


def test_recompute_flops_land_on_a_row_of_the_checkpointed_block():
    _model, _x, cap = run()
    (attr,) = bl.report.backward_status(cap).flops_attributions
    recomputing = [r for r in attr.rows if r.recompute_flops]
    assert recomputing and all(r.module in BLOCK_MODULES for r in recomputing)
    # Recomputation re-runs fc1's forward addmm: 2 * batch 4 * 8 in * 16 out.
    assert sum(r.recompute_flops for r in recomputing) == 2 * 4 * 8 * 16
    assert attr.recompute_flops == 2 * 4 * 8 * 16


def test_rows_outside_the_checkpointed_block_recompute_nothing():
    _model, _x, cap = run()
    (attr,) = bl.report.backward_status(cap).flops_attributions
    outside = [r for r in attr.rows if r.module not in BLOCK_MODULES]
    assert outside and all(r.recompute_flops == 0 for r in outside)


def test_a_row_s_flops_include_its_recompute_flops():
    _model, _x, plain = run(checkpointed=False)
    _model, _x, cap = run()
    plain_by_call = {r.call_label: r.flops for r in bl.report.backward_status(plain).flops_attributions[0].rows}
    for row in bl.report.backward_status(cap).flops_attributions[0].rows:
        if row.recompute_flops:
            assert row.flops >= row.recompute_flops
    total = bl.report.backward_status(cap).executed_flops
    assert total == sum(plain_by_call.values()) + 2 * 4 * 8 * 16


def test_checkpointed_executed_flops_equal_flop_counter_including_recompute():
    torch.manual_seed(0)
    model = CheckpointedNet()
    x = torch.randn(4, 8)
    forward, backward = stock_counts(model, (x,), {}, lambda out: out.sum())
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    assert status.executed_flops == backward
    assert status.forward_flops == forward


def test_forward_rows_of_checkpointed_ops_are_counted_once():
    _model, _x, plain = run(checkpointed=False)
    _model, _x, cap = run()
    assert cap.ops.labels() == plain.ops.labels()
    assert [op.forward_flops for op in cap.ops] == [op.forward_flops for op in plain.ops]


def test_a_pass_without_checkpointing_reads_zero_recompute_not_none():
    _model, _x, cap = run(checkpointed=False)
    status = bl.report.backward_status(cap)
    assert status.passes[0].recompute_flops == 0
    assert all(r.recompute_flops == 0 for r in status.flops_attributions[0].rows)


def test_a_create_graph_pass_tells_recompute_apart_by_the_checkpoint_hook():
    _model, _x, cap = run(create_graph=True)
    (attr,) = bl.report.backward_status(cap).flops_attributions
    assert attr.recompute_flops == 2 * 4 * 8 * 16
    assert all(r.module in BLOCK_MODULES for r in attr.rows if r.recompute_flops)


def test_a_create_graph_pass_without_evidence_reads_recompute_none(monkeypatch):
    monkeypatch.setattr(_torch, "HAS_TOP_SAVED_TENSORS_HOOKS", False)
    _model, _x, cap = run(create_graph=True)
    status = bl.report.backward_status(cap)
    (attr,) = status.flops_attributions
    assert status.passes[0].counted and status.passes[0].recompute_flops is None
    assert attr.recompute_flops is None and all(r.recompute_flops is None for r in attr.rows)
    assert sum(r.flops for r in attr.rows) + attr.unattributed_flops == attr.executed_flops


@pytest.mark.parametrize("create_graph", [False, True])
def test_cost_tree_shows_recompute_on_the_block_rows(create_graph):
    _model, _x, cap = run(create_graph=create_graph)
    tree = bl.report.cost_tree(cap)
    assert tree["block"].subtree_recompute_flops == 2 * 4 * 8 * 16
    assert tree["inp"].self_recompute_flops == 0 and tree["head"].self_recompute_flops == 0
