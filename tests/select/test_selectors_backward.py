"""Each backward save selector keeps exactly what it says, equal to plain-autograd gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from selector_refs import MODULE_OF, OPS, mlp_and_input, references, saved_ops

import backlens as bl
from backlens.select import (
    func,
    grad_fn,
    grad_input,
    grad_output,
    in_pass,
    label,
    module,
    without_op,
)
from models import loss_of


def run(save_grads, scales=(1.0,)):
    model, x = mlp_and_input()
    ref = references(model, x, scales)
    cap = bl.capture(model, x, save_grads=save_grads)
    loss = loss_of(cap.output)
    for scale in scales:
        (loss * scale).backward(retain_graph=True)
    return cap, ref, model, x


def assert_op_grads_equal(cap, ref, labels, pass_=1):
    for op_label in labels:
        expected = ref["grads"][pass_ - 1][MODULE_OF[op_label]]
        assert torch.equal(cap.ops[op_label].grad_for(pass_=pass_), expected), op_label


def test_func_saves_the_gradients_of_that_functions_ops_only():
    cap, ref, _m, _x = run(func("relu"))
    assert saved_ops(cap) == ["relu_1", "relu_2"]
    assert_op_grads_equal(cap, ref, ["relu_1", "relu_2"])


def test_func_keeps_the_grad_input_of_paired_nodes_too():
    cap, ref, _m, _x = run(func("relu"))
    relu_node = cap.ops["relu_1"].grad_fn
    (call,) = relu_node.calls
    # ReluBackward's input gradient is the gradient of relu's input, linear_1's output.
    assert torch.equal(call.grad_inputs[0], ref["grads"][0]["net.0"])


def test_func_accepts_the_torch_function_itself():
    cap, _ref, _m, _x = run(func(torch.relu))
    assert saved_ops(cap) == ["relu_1", "relu_2"]


def test_label_saves_one_op():
    cap, ref, _m, _x = run(label("linear_2"))
    assert saved_ops(cap) == ["linear_2"]
    assert_op_grads_equal(cap, ref, ["linear_2"])


def test_label_of_a_node_saves_that_node_only():
    model, x = mlp_and_input()
    probe = bl.capture(model, x)
    node_label = probe.ops["relu_2"].grad_fn.label
    cap, ref, _m, _x = run(label(node_label))
    saved_nodes = {c.grad_fn.label for c in cap.grad_fn_calls if c.grad_outputs is not None}
    assert saved_nodes == {node_label}
    assert_op_grads_equal(cap, ref, ["relu_2"])


# A call label names one fire, so the other pass saves nothing and says so.
@pytest.mark.filterwarnings("ignore::backlens.BacklensWarning")
def test_label_of_a_node_call_saves_that_call_only():
    model, x = mlp_and_input()
    node_label = bl.capture(model, x).ops["relu_2"].grad_fn.label
    cap, ref, _m, _x = run(label(f"{node_label}:2"), scales=(1.0, 2.0))
    saved = [c.label for c in cap.grad_fn_calls if c.grad_outputs is not None]
    assert saved == [f"{node_label}:2"]
    assert [g.pass_number for g in cap.ops["relu_2"].grads] == [2]
    assert_op_grads_equal(cap, ref, ["relu_2"], pass_=2)


def test_module_saves_ops_in_its_subtree_and_its_parameters_increments():
    cap, ref, model, _x = run(module("net.2"))
    assert saved_ops(cap) == ["linear_2"]
    assert_op_grads_equal(cap, ref, ["linear_2"])
    (increment,) = cap.params["net.2.weight"].increments
    assert torch.equal(increment.tensor, ref["params"][0]["net.2.weight"])
    assert cap.params["net.0.weight"].increments == []


def test_root_module_saves_every_op_of_the_model():
    cap, ref, _m, _x = run(module(""))
    assert saved_ops(cap) == OPS
    assert_op_grads_equal(cap, ref, OPS)


def test_grad_fn_by_class_name_saves_those_nodes():
    cap, ref, _m, _x = run(grad_fn("AddmmBackward0"))
    assert saved_ops(cap) == ["linear_1", "linear_2", "linear_3"]
    assert_op_grads_equal(cap, ref, ["linear_1", "linear_2", "linear_3"])
    types = {c.grad_fn.type for c in cap.grad_fn_calls if c.grad_outputs is not None}
    assert types == {"AddmmBackward0"}


def test_grad_fn_by_label_substring_saves_those_nodes():
    cap, ref, _m, _x = run(grad_fn(label="relu"))
    assert saved_ops(cap) == ["relu_1", "relu_2"]
    assert_op_grads_equal(cap, ref, ["relu_1", "relu_2"])


def test_without_op_saves_parameter_and_input_gradients_but_no_op_gradient():
    cap, ref, model, x = run(without_op())
    assert saved_ops(cap) == []
    for name, expected in ref["params"][0].items():
        assert torch.equal(cap.params[name].increments[0].tensor, expected), name
    assert torch.equal(cap.inputs[0].grad, ref["inputs"][0])
    assert torch.equal(cap.inputs[0].grad, x.grad)


def test_grad_output_keeps_only_what_reaches_each_node():
    cap, ref, _m, _x = run(grad_output())
    assert saved_ops(cap) == OPS
    assert_op_grads_equal(cap, ref, OPS)
    assert all(c.grad_inputs is None and c.grad_outputs is not None for c in cap.grad_fn_calls)


def test_grad_input_keeps_only_what_leaves_each_node():
    cap, ref, _m, _x = run(grad_input())
    assert saved_ops(cap) == []
    assert all(c.grad_outputs is None and c.grad_inputs is not None for c in cap.grad_fn_calls)
    (relu_call,) = cap.ops["relu_2"].grad_fn.calls
    assert torch.equal(relu_call.grad_inputs[0], ref["grads"][0]["net.2"])


def test_in_pass_saves_that_pass_only():
    cap, ref, _m, _x = run(in_pass(2), scales=(1.0, 2.0))
    assert {c.pass_number for c in cap.grad_fn_calls if c.grad_outputs is not None} == {2}
    assert all(len(cap.ops[op].grads) == 1 for op in OPS)
    assert_op_grads_equal(cap, ref, OPS, pass_=2)


def test_func_and_in_pass_saves_that_function_in_that_pass():
    cap, ref, _m, _x = run(func("relu") & in_pass(2), scales=(1.0, 2.0))
    assert saved_ops(cap) == ["relu_1", "relu_2"]
    assert [g.pass_number for g in cap.ops["relu_1"].grads] == [2]
    assert_op_grads_equal(cap, ref, ["relu_1", "relu_2"], pass_=2)


def test_not_in_pass_saves_every_other_pass():
    cap, ref, _m, _x = run(label("linear_3") & ~in_pass(1), scales=(1.0, 2.0, 3.0))
    assert [g.pass_number for g in cap.ops["linear_3"].grads] == [2, 3]
    assert_op_grads_equal(cap, ref, ["linear_3"], pass_=3)


def test_or_saves_the_union():
    cap, ref, _m, _x = run(label("linear_1") | func("relu"))
    assert saved_ops(cap) == ["linear_1", "relu_1", "relu_2"]
    assert_op_grads_equal(cap, ref, ["linear_1", "relu_1", "relu_2"])


def test_not_saves_the_complement():
    cap, ref, _m, _x = run(~func("relu"))
    assert saved_ops(cap) == ["linear_1", "linear_2", "linear_3"]
    assert_op_grads_equal(cap, ref, ["linear_1", "linear_2", "linear_3"])
    assert cap.params["net.0.weight"].increments  # AccumulateGrad is not relu


def test_forward_and_backward_selectors_compose():
    cap, ref, _m, _x = run(func("linear") & grad_fn("AddmmBackward0") & grad_output())
    saved = [c for c in cap.grad_fn_calls if c.grad_outputs is not None or c.grad_inputs is not None]
    assert {c.grad_fn.type for c in saved} == {"AddmmBackward0"}  # linear's TBackward0 is left out
    assert all(c.grad_inputs is None for c in saved)
    assert_op_grads_equal(cap, ref, ["linear_1", "linear_2", "linear_3"])


def test_module_and_side_compose():
    cap, ref, _m, _x = run(module("net.0") & grad_output())
    assert saved_ops(cap) == ["linear_1"]
    assert_op_grads_equal(cap, ref, ["linear_1"])
    assert all(c.grad_inputs is None for c in cap.grad_fn_calls)


def test_cap_backward_takes_a_selector_for_its_pass_only():
    model, x = mlp_and_input()
    ref = references(model, x, scales=(1.0, 2.0))
    cap = bl.capture(model, x, save_grads=func("relu"))
    loss = loss_of(cap.output)
    (loss * 1.0).backward(retain_graph=True)
    cap.backward(loss * 2.0, save_grads=label("linear_3"), retain_graph=True)
    assert [g.pass_number for g in cap.ops["relu_1"].grads] == [1]
    assert [g.pass_number for g in cap.ops["linear_3"].grads] == [2]
    assert torch.equal(cap.ops["linear_3"].grad, ref["grads"][1]["net.4"])
    assert repr(cap.passes[0].save_grads_policy) == "save_grads=bl.func('relu')"
    assert repr(cap.passes[1].save_grads_policy) == "save_grads=bl.label('linear_3')"


class Twice(nn.Module):
    """One block called twice: module calls block and block:2."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return self.block(self.block(x))


def test_module_with_a_call_suffix_saves_that_call_only():
    torch.manual_seed(0)
    model, x = Twice(), torch.randn(3, 4)
    cap = bl.capture(model, x, save_grads=module("block:2") & grad_output())
    cap.output.sum().backward()
    assert saved_ops(cap) == ["linear_2", "relu_2"]
    # Reference: the gradient of the second call's output is the seed (ones).
    assert torch.equal(cap.ops["relu_2"].grad, torch.ones(3, 4))


def test_module_without_a_call_suffix_saves_every_call():
    torch.manual_seed(0)
    cap = bl.capture(Twice(), torch.randn(3, 4), save_grads=module("block.1") & grad_output())
    cap.output.sum().backward()
    assert saved_ops(cap) == ["relu_1", "relu_2"]
