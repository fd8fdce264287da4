"""pass_.aten_ops: every ATen call of a counted pass, summing to its executed FLOPs."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from cost_refs import CheckpointedNet
from torch.utils.flop_counter import FlopCounterMode

import backlens as bl
from backlens.cost.formulas import EXTRA_FORMULAS
from models import build, loss_of


def captured(name, **options):
    model, args, kwargs = build(name)
    twin = copy.deepcopy(model)
    cap = bl.capture(model, *args, **options, **kwargs)
    loss_of(cap.output).backward()
    return cap, (twin, args, kwargs)


def stock_backward_counts_by_op(twin, args, kwargs) -> dict[str, int]:
    loss = loss_of(twin(*args, **kwargs))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        loss.backward()
    return {str(packet): flops for packet, flops in counter.get_flop_counts()["Global"].items() if flops}


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_the_calls_sum_to_the_pass_s_executed_flops(name):
    cap, _stock = captured(name)
    status = bl.report.backward_status(cap)
    assert sum(op.flops for op in cap.passes[0].aten_ops) == status.executed_flops > 0


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_flops_per_op_equal_flop_counter_mode_s_counts(name):
    cap, stock = captured(name)
    per_op: Counter = Counter()
    for op in cap.passes[0].aten_ops:
        if op.flops:
            per_op[op.name.rsplit(".", 1)[0]] += op.flops  # aten.mm.default -> aten.mm
    assert dict(per_op) == stock_backward_counts_by_op(*stock)


def test_each_call_names_its_overload_and_the_node_call_that_ran_it():
    cap, _stock = captured("mlp")
    ops = cap.passes[0].aten_ops
    labels = set(cap.grad_fn_calls.labels())
    mms = [op for op in ops if op.name == "aten.mm.default"]
    assert mms and all(op.call in labels for op in mms)
    assert all(cap.grad_fn_calls[op.call].grad_fn.type in ("AddmmBackward0", "MmBackward0") for op in mms)


def test_calls_are_charged_to_the_node_call_s_own_flops():
    cap, _stock = captured("gpt2")
    by_call: Counter = Counter()
    for op in cap.passes[0].aten_ops:
        if op.call is not None:
            by_call[op.call] += op.flops
    for call in cap.grad_fn_calls:
        assert by_call.get(call.label, 0) == call.flops, call.label


def test_recomputed_kernels_run_with_grad_enabled_and_sum_to_the_recompute_flops():
    torch.manual_seed(0)
    cap = bl.capture(CheckpointedNet(), torch.randn(4, 8))
    cap.output.sum().backward()
    ops = cap.passes[0].aten_ops
    recomputed = [op for op in ops if op.grad_enabled]
    assert recomputed and {op.call for op in recomputed} == {"addmm_back_3_7:1"}
    assert sum(op.flops for op in recomputed) == bl.report.backward_status(cap).passes[0].recompute_flops


def test_to_pandas_is_one_row_per_call():
    cap, _stock = captured("mlp")
    ops = cap.passes[0].aten_ops
    frame = ops.to_pandas()
    assert list(frame.columns) == ["name", "call", "flops", "grad_enabled", "start", "duration"]
    assert len(frame) == len(ops) == bl.report.backward_status(cap).passes[0].aten_calls
    assert frame["flops"].sum() == sum(op.flops for op in ops)


def test_each_atenop_is_timed_inside_its_node_call():
    cap, _stock = captured("mlp")
    backward_pass = cap.passes[0]
    calls = {call.label: call for call in backward_pass.calls}
    ops = backward_pass.aten_ops
    assert ops and all(op.start is not None and op.duration >= 0 for op in ops)
    assert [op.start for op in ops] == sorted(op.start for op in ops)  # dispatch order is time order
    for op in ops:
        if op.call is not None:
            call = calls[op.call]
            assert call.start <= op.start and op.start + op.duration <= call.start + call.duration + 1e-9


def test_a_pass_without_a_count_has_no_census():
    cap, _stock = captured("mlp", flops=False)
    assert cap.passes[0].aten_ops is None


def test_the_census_reads_back_from_a_bundle(tmp_path):
    cap, _stock = captured("gpt2")
    loaded = bl.load(cap.save(tmp_path / "b"))
    assert loaded.passes[0].aten_ops == cap.passes[0].aten_ops
