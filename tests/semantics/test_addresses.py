"""One address grammar in records, selectors, edit sites and reports: ``"lin"`` names the
module and all its calls, ``"lin:2"`` its second call (1-based)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import backlens as bl


class CalledTwice(nn.Module):
    """forward = lin(tanh(lin(x))): module calls lin:1 and lin:2."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def model_and_input():
    torch.manual_seed(0)
    return CalledTwice(), torch.randn(3, 4)


def stock(model, x, first_hook=None, second_hook=None):
    """Stock autograd run of ``model`` with tensor hooks on each call's output: the
    gradients of both outputs and of the parameters."""
    model = copy.deepcopy(model)
    first = model.lin(x)
    first.retain_grad()
    if first_hook is not None:
        first.register_hook(first_hook)
    second = model.lin(torch.tanh(first))
    second.retain_grad()
    if second_hook is not None:
        second.register_hook(second_hook)
    second.sum().backward()
    return first.grad, second.grad, model.lin.weight.grad, model.lin.bias.grad


def test_module_records_name_each_call_and_refuse_the_ambiguous_address():
    model, x = model_and_input()
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    assert [m.label for m in cap.modules] == ["", "lin:1", "lin:2"]
    assert [m.address for m in cap.modules] == ["", "lin", "lin"]
    assert [m.call for m in cap.modules] == [1, 1, 2]
    assert cap.modules[""].children == ["lin:1", "lin:2"] and cap.modules["lin:2"].parent == ""
    with pytest.raises(bl.AmbiguousLabelError) as caught:
        cap.modules["lin"]
    assert "lin:1" in str(caught.value) and "lin:2" in str(caught.value)
    assert caught.value.code == "ambiguous_label" and isinstance(caught.value, KeyError)
    with pytest.raises(bl.AmbiguousLabelError):
        cap["lin"]
    with pytest.raises(bl.LabelNotFoundError):
        cap.modules["lin:3"]
    assert "lin:2" in cap.modules and "lin" not in cap.modules
    assert [op.module for op in cap.ops] == ["lin:1", "", "lin:2"]
    first, second, _w, _b = stock(model, x)
    assert torch.equal(cap.modules["lin:1"].output_grad, first)
    assert torch.equal(cap.modules["lin:2"].output_grad, second)
    frame = cap.modules.to_pandas()
    assert frame["label"].tolist() == ["", "lin:1", "lin:2"] and frame["call"].tolist() == [1, 1, 2]


def test_a_module_called_once_answers_to_its_address_and_to_its_first_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    cap = bl.capture(model, torch.randn(2, 4))
    assert cap.modules["0"] is cap.modules["0:1"]
    assert cap.modules["0"].label == "0" and cap.modules["0"].call == 1
    with pytest.raises(bl.LabelNotFoundError):
        cap.modules["0:2"]


def test_a_parameter_node_belongs_to_the_module_not_to_one_of_its_calls():
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    accumulators = [g for g in cap.grad_fns if g.param is not None]
    assert {g.module for g in accumulators} == {"lin"}
    assert {g.module_source for g in accumulators} == {"paired"}


def saved_modules(cap) -> set[str]:
    return {op.module for op in cap.ops if op.grads}


def test_a_selector_by_address_keeps_every_call_and_by_call_only_that_call():
    model, x = model_and_input()
    first, second, weight, _bias = stock(model, x)
    every = bl.capture(model, x, save_grads=bl.module("lin") & bl.grad_output())
    every.output.sum().backward()
    assert saved_modules(every) == {"lin:1", "lin:2"}
    assert torch.equal(every.modules["lin:1"].output_grad, first)
    assert torch.equal(every.params["lin.weight"].increments[0].tensor, weight)

    model.zero_grad()
    for call, expected in (("lin:1", first), ("lin:2", second)):
        only = bl.capture(model, x, save_grads=bl.module(call) & bl.grad_output())
        only.output.sum().backward()
        assert saved_modules(only) == {call}
        assert torch.equal(only.modules[call].output_grad, expected)
        # The parameters serve both calls: their increments are the module's, not one call's.
        assert only.params["lin.weight"].increments == []


def test_call_one_selects_the_parameters_of_a_module_called_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    cap = bl.capture(model, torch.randn(2, 4), save_grads=bl.module("0:1"))
    cap.output.sum().backward()
    assert len(cap.params["0.weight"].increments) == 1
    assert torch.equal(cap.params["0.weight"].increments[0].tensor, model[0].weight.grad)


def test_a_gradient_site_by_address_edits_every_call():
    model, x = model_and_input()
    halve = lambda g: g * 0.5  # noqa: E731
    cap = bl.capture(model, x, intervene=bl.when(bl.grad("lin"), bl.scale(0.5)))
    cap.output.sum().backward()
    _f, _s, weight, bias = stock(model, x, first_hook=halve, second_hook=halve)
    assert torch.equal(model.lin.weight.grad, weight) and torch.equal(model.lin.bias.grad, bias)
    assert sorted(e.module for e in cap.passes[0].edits) == ["lin:1", "lin:2"]


@pytest.mark.parametrize("call", [1, 2])
def test_a_gradient_site_by_call_edits_that_call_only(call):
    model, x = model_and_input()
    halve = lambda g: g * 0.5  # noqa: E731
    cap = bl.capture(model, x, intervene=bl.when(bl.grad(f"lin:{call}"), bl.scale(0.5)))
    cap.output.sum().backward()
    hooks = {"first_hook": halve} if call == 1 else {"second_hook": halve}
    _f, _s, weight, bias = stock(model, x, **hooks)
    assert torch.equal(model.lin.weight.grad, weight) and torch.equal(model.lin.bias.grad, bias)
    assert [(e.site, e.module) for e in cap.passes[0].edits] == [(f"lin:{call}", f"lin:{call}")]


def test_an_activation_site_by_call_edits_that_call_only_and_names_it():
    model, x = model_and_input()
    cap = bl.capture(model, x, intervene=bl.when("lin:1", bl.zero_ablate()))
    twin = copy.deepcopy(model)
    assert torch.equal(cap.output, twin.lin(torch.tanh(torch.zeros(3, 4))))
    assert [(e.site, e.module) for e in cap.forward_edits] == [("lin:1", "lin:1")]
    every = bl.capture(model, x, intervene=bl.when("lin", bl.zero_ablate()))
    assert torch.equal(every.output, torch.zeros(3, 4))
    assert [e.module for e in every.forward_edits] == ["lin:1", "lin:2"]


def test_a_site_naming_a_call_that_never_ran_is_refused():
    model, x = model_and_input()
    with pytest.raises(bl.LabelNotFoundError):
        bl.capture(model, x, intervene=bl.when(bl.grad("lin:3"), bl.scale(0.5)))


def test_the_cost_tree_has_a_row_per_call_and_refuses_the_ambiguous_address():
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    tree = bl.report.cost_tree(cap)
    assert [row.address for row in tree.rows if row.kind == "module"] == ["", "lin:1", "lin:2"]
    assert tree["lin:2"].self_forward_mac_flops == 2 * 3 * 4 * 4
    with pytest.raises(bl.AmbiguousLabelError):
        tree["lin"]
    assert sum(row.self_backward_flops for row in tree.rows) == tree.executed_flops
