"""Executed backward FLOPs: counts equal FlopCounterMode's, attribution sums exactly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cost_refs import stock_counts

import backlens as bl
from backlens.cost.journal import CostJournal
from models import MLP, SmallCNN, build, loss_of

MODELS = ["mlp", "cnn", "gpt2", "bert"]


def captured(name, loss_fn=loss_of, **options):
    model, args, kwargs = build(name)
    cap = bl.capture(model, *args, **options, **kwargs)
    return cap, loss_fn(cap.output)


@pytest.mark.parametrize("name", MODELS)
def test_executed_flops_equal_flop_counter_backward_count_on_a_stock_run(name):
    model, args, kwargs = build(name)
    _forward, backward = stock_counts(model, args, kwargs, loss_of)
    cap = bl.capture(model, *args, **kwargs)
    loss_of(cap.output).backward()
    status = bl.report.backward_status(cap)
    assert backward > 0
    assert status.executed_flops == backward


@pytest.mark.parametrize("name", MODELS)
def test_forward_flops_per_op_sum_to_flop_counter_forward_count(name):
    model, args, kwargs = build(name)
    forward, _backward = stock_counts(model, args, kwargs, loss_of)
    cap = bl.capture(model, *args, **kwargs)
    assert sum(op.forward_flops for op in cap.ops) == forward
    assert bl.report.backward_status(cap).forward_flops == forward


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_conv_net_counts_like_flop_counter_whether_or_not_the_input_requires_grad(input_requires_grad):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8, requires_grad=input_requires_grad)
    _forward, backward = stock_counts(model, (x,), {}, lambda out: out.sum())
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    assert bl.report.backward_status(cap).executed_flops == backward


def test_first_conv_does_less_backward_work_when_its_input_needs_no_grad():
    # convolution_backward skips grad_input when the input needs none (its output_mask).
    torch.manual_seed(0)
    model = SmallCNN().eval()
    flops = {}
    for requires_grad in (False, True):
        x = torch.randn(2, 3, 8, 8, requires_grad=requires_grad)
        cap = bl.capture(model, x)
        cap.output.sum().backward()
        (attr,) = bl.report.backward_status(cap).flops_attributions
        flops[requires_grad] = attr.flops_by_op()["conv2d_1"]
    assert 0 < flops[False] < flops[True]


@pytest.mark.parametrize("name", MODELS)
def test_rows_plus_unattributed_equal_executed_flops_exactly(name):
    cap, loss = captured(name)
    loss.backward()
    status = bl.report.backward_status(cap)
    (attr,) = status.flops_attributions
    assert sum(r.flops for r in attr.rows) + attr.unattributed_flops == status.executed_flops
    assert attr.executed_flops == status.executed_flops


def test_every_node_call_of_a_counted_pass_has_one_row():
    cap, loss = captured("mlp")
    loss.backward()
    (attr,) = bl.report.backward_status(cap).flops_attributions
    assert [r.call_label for r in attr.rows] == cap.grad_fn_calls.labels()
    for row in attr.rows:
        assert row.call_label == f"{row.grad_fn_label}:{row.call_index}"


def test_call_records_carry_the_flops_of_their_rows():
    cap, loss = captured("gpt2")
    loss.backward()
    (attr,) = bl.report.backward_status(cap).flops_attributions
    for row in attr.rows:
        call = cap.grad_fn_calls[row.call_label]
        assert (call.flops, call.recompute_flops) == (row.flops, row.recompute_flops)
    frame = cap.grad_fn_calls.to_pandas()
    assert frame["flops"].sum() + attr.unattributed_flops == attr.executed_flops


def test_flops_by_op_charges_each_node_to_its_forward_op():
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    cap.output.sum().backward()
    (attr,) = bl.report.backward_status(cap).flops_attributions
    by_op = attr.flops_by_op()
    # linear_1 (6 -> 16) needs no grad_input: only grad_weight (2*4*16*6); the others do both.
    assert by_op["linear_1"] == 2 * 4 * 16 * 6
    assert by_op["linear_2"] == 2 * (2 * 4 * 16 * 16)
    assert by_op["linear_3"] == 2 * (2 * 4 * 16 * 3)
    assert sum(by_op.values()) + attr.unattributed_flops == attr.executed_flops


def test_each_pass_is_counted_and_attributed_separately():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    cap.backward(loss)
    status = bl.report.backward_status(cap)
    assert [p.number for p in status.passes] == [1, 2, 3]
    assert all(p.counted for p in status.passes)
    assert [a.pass_number for a in status.flops_attributions] == [1, 2, 3]
    assert status.executed_flops == sum(p.executed_flops for p in status.passes)
    assert status.for_pass(2).executed_flops == status.passes[1].executed_flops
    for attr in status.flops_attributions:
        assert sum(r.flops for r in attr.rows) + attr.unattributed_flops == attr.executed_flops
        assert {r.pass_number for r in attr.rows} == {attr.pass_number}


def test_work_under_no_node_is_named_in_the_unattributed_bucket():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    extra = torch.randn(5, 7)

    def queue_matmul(grad):
        # Engine callbacks run after every node, under none (as DDP's bucket finalisation does).
        torch.autograd.Variable._execution_engine.queue_callback(lambda: extra @ extra.t())
        return None

    cap.output.register_hook(queue_matmul)
    cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    (attr,) = status.flops_attributions
    assert attr.unattributed_flops == 2 * 5 * 7 * 5
    (op,) = [o for o in attr.unattributed_ops if o.flops]
    assert op.op == "aten.mm" and op.under is None and op.calls == 1
    assert "aten.mm under no node" in str(op)
    assert sum(r.flops for r in attr.rows) + attr.unattributed_flops == status.executed_flops


def test_a_pass_that_raised_has_no_count_and_says_why():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))

    def explode(grad):
        raise ValueError("boom from a hook")

    cap.output.register_hook(explode)
    with pytest.raises(ValueError):
        cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    (failed,) = status.passes
    assert failed.status == "failed" and not failed.counted
    assert failed.executed_flops is None and "raised ValueError" in failed.reason
    assert status.executed_flops is None and status.flops_attributions == ()
    assert status.state == "not_counted" and "raised ValueError" in status.reason
    assert all(c.flops is None and c.recompute_flops is None for c in cap.grad_fn_calls)


def test_an_implicit_pass_has_no_count_and_says_why():
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = cap.output.sum()
    engine = torch.autograd.Variable._execution_engine
    engine.run_backward((loss,), (torch.ones(()),), False, False, (), True, True)
    (implicit,) = bl.report.backward_status(cap).passes
    assert implicit.status == "ok" and not implicit.counted
    assert implicit.executed_flops is None and "implicit pass" in implicit.reason
    assert all(c.flops is None for c in cap.grad_fn_calls)


def test_flops_off_records_no_count_and_says_why():
    cap, loss = captured("mlp", flops=False)
    loss.backward()
    status = bl.report.backward_status(cap)
    assert status.executed_flops is None and status.state == "flops_off"
    assert "flops=False" in status.reason and "flops=False" in status.passes[0].reason
    assert all(op.forward_flops is None for op in cap.ops)
    assert all(c.flops is None for c in cap.grad_fn_calls)


def test_no_backward_yet_reads_none_with_the_reason():
    cap, _loss = captured("mlp")
    status = bl.report.backward_status(cap)
    assert status.passes == [] and status.executed_flops is None
    assert status.state == "no_backward" and "no backward pass has run" in status.reason
    with pytest.raises(KeyError, match="no FLOP count"):
        status.for_pass(1)


# llama: silu_backward has a CPU kernel and a decomposition; counting must not swap one for the other.
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert", "llama", "t5"])
def test_parameter_gradients_with_flops_on_equal_a_stock_run_bitwise(name):
    model, args, kwargs = build(name)
    twin = copy.deepcopy(model)
    loss_of(model(*args, **kwargs)).backward()
    cap = bl.capture(twin, *args, flops=True, **kwargs)
    loss_of(cap.output).backward()
    for (key, stock), (_, counted) in zip(model.named_parameters(), twin.named_parameters()):
        if stock.grad is None:
            assert counted.grad is None, key
        else:
            assert torch.equal(stock.grad, counted.grad), key
    assert bl.report.backward_status(cap).executed_flops > 0


def test_cost_data_is_plain_data_that_round_trips():
    cap, loss = captured("gpt2")
    loss.backward()
    data = json.loads(json.dumps(cap._state.cost.to_dict()))
    restored = CostJournal.from_dict(data)
    assert restored == cap._state.cost
    assert restored.forward_flops == bl.report.backward_status(cap).forward_flops


def test_status_renders_as_a_rich_table_and_pandas_frames():
    from rich.console import Console

    cap, loss = captured("mlp")
    loss.backward()
    status = bl.report.backward_status(cap)
    console = Console(record=True, width=160)
    console.print(status)
    text = console.export_text()
    assert "backward passes" in text and "addmm_back" in text
    assert list(status.to_pandas()["executed_flops"]) == [status.executed_flops]
    frame = status.flops_attributions[0].to_pandas()
    assert frame["flops"].sum() + status.flops_attributions[0].unattributed_flops == status.executed_flops


def test_a_counted_create_graph_pass_gives_the_same_gradients_as_a_stock_one():
    model, args, kwargs = build("gpt2")
    twin = copy.deepcopy(model)
    stock = torch.autograd.grad(loss_of(model(*args, **kwargs)), list(model.parameters()), create_graph=True)
    cap = bl.capture(twin, *args, **kwargs)
    counted = torch.autograd.grad(loss_of(cap.output), list(twin.parameters()), create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(stock, counted))
    assert bl.report.backward_status(cap).passes[0].counted


def test_the_census_modes_dispatch_without_a_dynamo_disable_wrapper_per_aten_call():
    from backlens.cost.census import BackwardCensus
    from backlens.cost.counting import CountingMode
    from backlens.cost.forward_count import _MetaCounter

    for mode in (CountingMode, BackwardCensus, _MetaCounter):
        dispatch = mode.__torch_dispatch__
        assert not hasattr(dispatch, "__wrapped__"), mode  # torch's wrapper is functools.wraps'd
        assert dispatch.__module__.startswith("backlens."), mode
