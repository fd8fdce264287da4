"""Module containment: AccumulateGrad belongs to its parameter's module, also one never
called itself; a custom Function's node is paired with the op inside its forward."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import backlens as bl
from models import Double


class Attends(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.mha(x, x, x, need_weights=False)[0])


def attends():
    torch.manual_seed(0)
    return Attends(), torch.randn(2, 5, 8)


def test_out_proj_parameters_belong_to_out_proj_though_it_is_never_called():
    model, x = attends()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    assert "mha.out_proj" not in {m.address for m in cap.modules}  # MultiheadAttention reads its weights
    nodes = {g.param: g for g in cap.grad_fns if g.param is not None}
    for name in ("mha.out_proj.weight", "mha.out_proj.bias"):
        assert nodes[name].module == "mha.out_proj"
        assert nodes[name].module_source == "paired"
        assert nodes[name].module_call == "mha"  # reports show it under its nearest called ancestor
    assert nodes["mha.in_proj_weight"].module == "mha"


def test_saving_the_attention_module_keeps_the_out_proj_increments():
    model, x = attends()
    reference = copy.deepcopy(model)
    cap = bl.capture(model, x, save_grads=bl.module("mha"))
    cap.output.sum().backward()
    reference(x).sum().backward()
    for name, param in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].grad, param.grad), name
        increments = cap.params[name].increments
        if name.startswith("mha."):
            assert len(increments) == 1, name
            assert torch.equal(increments[0].tensor, param.grad), name
        else:
            assert increments == [], name


def test_out_proj_work_lands_in_the_attention_rows_of_reports():
    model, x = attends()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    tree = bl.report.cost_tree(cap)
    out_proj = [c for c in cap.grad_fn_calls if c.grad_fn.module == "mha.out_proj"]
    assert len(out_proj) == 2
    mha_calls = sum(1 for c in cap.grad_fn_calls if c.grad_fn.module_call == "mha")
    assert tree["mha"].backward_calls == mha_calls
    no_op = [row for row in tree.rows if row.kind == "no_forward_op"][0]
    assert no_op.backward_calls == 1  # the loss's sum alone
    timeline = bl.report.timeline(cap)
    slices = [s for s in timeline if s.kind == "module" and s.name == "mha.out_proj"]
    assert slices and all(s.depth == 3 for s in slices)  # pass > (model) > mha > mha.out_proj
    mha = [s for s in timeline if s.kind == "module" and s.name == "mha"]
    assert all(any(m.start_ns <= s.start_ns and s.end_ns <= m.end_ns for m in mha) for s in slices)


class UsesFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Double.apply(self.lin(x))


def test_a_custom_function_node_is_paired_with_the_op_inside_its_forward():
    torch.manual_seed(0)
    model, x = UsesFunction(), torch.randn(3, 4)
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    (custom,) = [g for g in cap.grad_fns if g.is_custom]
    assert custom.op is not None and custom.op.func == "mul"
    assert custom.module == "" and custom.module_source == "paired"
    reference = copy.deepcopy(model)
    hidden = reference.lin(x)
    hidden.retain_grad()
    (hidden * 2).sum().backward()
    assert torch.equal(model.lin.weight.grad, reference.lin.weight.grad)
    assert torch.equal(cap.modules["lin"].output_grad, hidden.grad)
