"""One backward over two captures: each records the pass with its own nodes, FLOPs and
time, and counts the nodes it left to the other (``pass_.other_capture_nodes``)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import backlens as bl
from backlens.cost.formulas import EXTRA_FORMULAS


def stock_backward_flops(run) -> int:
    """FLOPs FlopCounterMode counts in the backward ``run()`` starts (it returns the loss)."""
    loss = run()
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        loss.backward()
    return counter.get_total_flops()


def executed(cap) -> int:
    (status,) = bl.report.backward_status(cap).passes
    assert status.counted, status.reason
    return status.executed_flops


def encoder_and_head():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return encoder, head, torch.randn(5, 4)


def test_encoder_and_head_captures_each_record_their_own_nodes_of_one_backward():
    encoder, head, x = encoder_and_head()
    ce = bl.capture(encoder, x, save_grads=True)
    ch = bl.capture(head, ce.output, save_grads=True)
    ch.output.sum().backward()
    assert (len(ce.passes), len(ch.passes)) == (1, 1)
    encoder_params = {id(p) for p in encoder.parameters()}
    head_params = {id(p) for p in head.parameters()}
    assert {g.param for g in ce.grad_fns if g.param} == {n for n, _ in encoder.named_parameters()}
    assert {g.param for g in ch.grad_fns if g.param} == {n for n, _ in head.named_parameters()}
    assert encoder_params.isdisjoint(head_params)
    # No node is in both captures: every node of the head's pass is the head's or its loss.
    assert all(g.op is not None or g.param or g.type == "SumBackward0" for g in ch.grad_fns)
    assert all(g.op is not None or g.param for g in ce.grad_fns)
    assert ce.passes[0].other_capture_nodes == len(ch.grad_fns)
    assert ch.passes[0].other_capture_nodes == len(ce.grad_fns)
    # Each pass is counted and timed over its own calls only.
    assert all(c.flops is not None and c.duration is not None for cap in (ce, ch) for c in cap.grad_fn_calls)


def test_encoder_and_head_flops_each_match_the_stock_count_and_add_up_to_the_whole():
    encoder, head, x = encoder_and_head()
    whole = nn.Sequential(copy.deepcopy(encoder), copy.deepcopy(head))
    ce = bl.capture(encoder, x)
    ch = bl.capture(head, ce.output)
    ch.output.sum().backward()
    whole_cap = bl.capture(copy.deepcopy(whole), x)
    whole_cap.output.sum().backward()

    total = stock_backward_flops(lambda: copy.deepcopy(whole)(x).sum())
    twin = copy.deepcopy(whole)
    hidden = twin[0](x).detach().requires_grad_(True)  # the head's backward alone, from its input
    head_only = stock_backward_flops(lambda: twin[1](hidden).sum())
    assert executed(ch) == head_only
    assert executed(ce) == total - head_only
    assert executed(ce) + executed(ch) == executed(whole_cap) == total


def test_encoder_and_head_gradients_equal_stock_autograd():
    encoder, head, x = encoder_and_head()
    whole = nn.Sequential(copy.deepcopy(encoder), copy.deepcopy(head))
    x = x.requires_grad_(True)
    ce = bl.capture(encoder, x, save_grads=True)
    ch = bl.capture(head, ce.output, save_grads=True)
    ch.output.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    hidden = whole[0](x_ref)
    hidden.retain_grad()
    whole[1](hidden).sum().backward()
    for (name, p), p_ref in zip([*encoder.named_parameters(), *head.named_parameters()], whole.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(ce.inputs[0].grad, x_ref.grad)
    # The head's input is the encoder's output: both captures see its gradient.
    assert torch.equal(ch.inputs[0].grad, hidden.grad)
    assert torch.equal(ce.modules[""].output_grad, hidden.grad)


def two_losses_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)), torch.randn(3, 4), torch.randn(5, 4)


def test_two_losses_over_one_model_captured_twice_each_count_their_own_half():
    model, x1, x2 = two_losses_model()
    reference = copy.deepcopy(model)
    first = bl.capture(model, x1, save_grads=True)
    second = bl.capture(model, x2, save_grads=True)
    (first.output.sum() + second.output.pow(2).sum()).backward()
    assert (len(first.passes), len(second.passes)) == (1, 1)

    each = [stock_backward_flops(lambda x=x: copy.deepcopy(reference)(x).sum()) for x in (x1, x2)]
    both = stock_backward_flops(lambda: reference(x1).sum() + reference(x2).pow(2).sum())
    assert [executed(first), executed(second)] == each
    assert executed(first) + executed(second) == both
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    # The parameters are shared: both record their one AccumulateGrad fire (the sum).
    for cap in (first, second):
        assert torch.equal(cap.params["0.weight"].increments[0].tensor, reference[0].weight.grad)
    own = {cap: {g.label for g in cap.grad_fns if g.param is None} for cap in (first, second)}
    assert first.passes[0].other_capture_nodes == len(own[second])
    assert second.passes[0].other_capture_nodes == len(own[first])  # the sum of both losses is the first's


def test_a_capture_alone_counts_no_other_capture_nodes():
    model, x1, _x2 = two_losses_model()
    cap = bl.capture(model, x1)
    cap.output.sum().backward()
    assert cap.passes[0].other_capture_nodes == 0
    assert cap.passes.to_pandas()["other_capture_nodes"].tolist() == [0]


def test_other_capture_nodes_survive_a_bundle_round_trip(tmp_path):
    encoder, head, x = encoder_and_head()
    ce = bl.capture(encoder, x)
    ch = bl.capture(head, ce.output)
    ch.output.sum().backward()
    loaded = bl.load(ch.save(tmp_path / "head"))
    assert loaded.passes[0].other_capture_nodes == ch.passes[0].other_capture_nodes > 0
    assert bl.report.backward_status(loaded).passes[0].executed_flops == executed(ch)


def test_a_non_leaf_input_gradient_is_kept_as_the_policy_says_without_its_history_in_the_records():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    hidden = x * 3  # made before the capture: not its graph
    reference = copy.deepcopy(model)
    hidden_ref = x.detach() * 3
    hidden_ref.requires_grad_(True)
    reference(hidden_ref).sum().backward()
    for policy, kept in ((True, True), (bl.without_op(), True), (bl.label("args[0]"), True),
                         (bl.module("0"), False), (False, False)):
        cap = bl.capture(model, hidden, save_grads=policy)
        cap.output.sum().backward(retain_graph=True)
        assert "MulBackward0" not in {g.type for g in cap.grad_fns}, policy
        grads = cap.inputs[0].grads
        assert len(grads) == int(kept), policy
        if kept:
            assert torch.equal(grads[0].tensor, hidden_ref.grad), policy
