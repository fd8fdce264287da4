"""``calls.for_pass(k)``, ``order_coverage`` on every pass, ``None`` for missing strings in
tables, and the real cause of a missing module gradient under reentrant checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import backlens as bl
from models import MLP


def test_for_pass_gives_the_one_call_of_that_pass():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 6)
    cap = bl.capture(model, x, save_grads=True)
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    node = cap.ops["linear_2"].grad_fn
    second = node.calls.for_pass(2)
    assert isinstance(second, bl.GradFnCall)
    assert second.pass_number == 2 and second.label == f"{node.label}:2"
    reference = copy.deepcopy(model)
    hidden = reference.net[2](torch.relu(reference.net[0](x)))  # linear_2's output
    hidden.retain_grad()
    (2 * reference.net[4](torch.relu(hidden)).sum()).backward()
    assert torch.equal(second.grad_outputs[0], hidden.grad)


def test_for_pass_explains_a_pass_the_node_did_not_fire_in():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    cap.output.sum().backward()
    node = cap.ops["linear_1"].grad_fn
    with pytest.raises(bl.LabelNotFoundError) as caught:
        node.calls.for_pass(2)
    assert "fired in passes [1]" in str(caught.value)


def test_every_pass_has_an_order_coverage_of_one_when_nothing_is_unresolved():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert [p.order_coverage for p in cap.passes] == [1.0, 1.0]
    assert cap.passes.to_pandas()["order_coverage"].tolist() == [1.0, 1.0]


def test_order_coverage_covers_the_higher_order_pass_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3, requires_grad=True)
    cap = bl.capture(model, x)
    (gx,) = torch.autograd.grad(cap.output.sum(), [x], create_graph=True)
    gx.pow(2).sum().backward()
    second = cap.passes[1]
    assert 2 in second.orders
    fired = [c.grad_fn.order for c in second.calls]
    assert second.order_coverage == sum(o is not None for o in fired) / len(fired) == 1.0


def test_missing_strings_in_tables_are_none():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    cap.output.sum().backward()
    grad_fns = cap.grad_fns.to_pandas()
    loss_row = grad_fns[grad_fns["type"] == "SumBackward0"].iloc[0]
    assert loss_row["op"] is None and loss_row["module"] is None and loss_row["module_source"] is None
    assert grad_fns["param"].tolist().count(None) == sum(1 for g in cap.grad_fns if g.param is None)
    passes = cap.passes.to_pandas()
    assert passes["error"].tolist() == [None]
    modules = cap.modules.to_pandas()
    assert modules["parent"].tolist()[0] is None
    calls = cap.grad_fn_calls.to_pandas()
    assert all(v is None or isinstance(v, str) for v in calls["op"])
    assert any(v is None for v in calls["op"])


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = checkpoint(self.block, self.inp(x), use_reentrant=True)
        return self.head(h)


def test_a_reentrant_checkpointed_block_says_its_output_had_no_grad_fn():
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    reference(x).sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    assert len(cap.passes) == 1
    with pytest.raises(bl.AmbiguousGradError) as caught:
        _ = cap.modules["block"].output_grad
    message = str(caught.value)
    assert "no grad_fn" in message and "use_reentrant=True" in message
    assert "no pass ran" not in message


def test_no_saved_gradient_before_any_pass_says_no_pass_ran():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    with pytest.raises(bl.AmbiguousGradError, match="no backward pass has run"):
        _ = cap.modules["net.0"].output_grad
