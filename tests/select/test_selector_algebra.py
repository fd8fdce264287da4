"""Selector values: readable repr, composition rules, input checks, plain-data round trip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import backlens as bl
from backlens.select import (
    Selector,
    func,
    grad_fn,
    grad_input,
    grad_output,
    in_pass,
    label,
    module,
    selector_from_json,
    without_op,
)
from models import MLP, loss_of

EXAMPLES = [
    func("relu"),
    func("linear", "relu"),
    label("linear_2"),
    label("addmm_back_1_4:2"),
    module("encoder.layer.0"),
    module(""),
    grad_fn("AddmmBackward0"),
    grad_fn(label="addmm"),
    grad_fn("AddmmBackward0", label="addmm"),
    without_op(),
    grad_input(),
    grad_output(),
    in_pass(2),
    func("relu") & in_pass(2),
    (func("relu") | label("linear_1")) & grad_output(),
    ~(module("net.0") & grad_input()) | ~without_op(),
]


@pytest.mark.parametrize("selector", EXAMPLES, ids=repr)
def test_repr_is_the_code_that_builds_it(selector):
    names = ("func", "label", "module", "grad_fn", "without_op", "grad_input", "grad_output", "in_pass")
    user_bl = SimpleNamespace(**{name: globals()[name] for name in names})
    rebuilt = eval(repr(selector), {"bl": user_bl})  # noqa: S307 - reading back a repr we wrote
    assert repr(rebuilt) == repr(selector)


@pytest.mark.parametrize("selector", EXAMPLES, ids=repr)
def test_json_round_trip_rebuilds_an_equal_selector(selector):
    assert selector_from_json(selector.to_json()) == selector


def test_and_binds_tighter_than_or_in_the_repr():
    assert repr(func("a") | func("b") & in_pass(1)) == "bl.func('a') | bl.func('b') & bl.in_pass(1)"
    assert repr((func("a") | func("b")) & in_pass(1)) == "(bl.func('a') | bl.func('b')) & bl.in_pass(1)"
    assert repr(~(func("a") & in_pass(1))) == "~(bl.func('a') & bl.in_pass(1))"


def test_chains_flatten_and_double_negation_cancels():
    assert repr(func("a") & func("b") & func("c")) == "bl.func('a') & bl.func('b') & bl.func('c')"
    assert ~~func("a") == func("a")


def test_save_policy_repr_shows_the_selector():
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=func("relu") & in_pass(1))
    loss_of(cap.output).backward()
    assert repr(cap.passes[0].save_grads_policy) == "save_grads=bl.func('relu') & bl.in_pass(1)"
    assert cap.passes.to_pandas()["save_grads_policy"][0] == "save_grads=bl.func('relu') & bl.in_pass(1)"


def test_pass_scope_is_three_valued_over_in_pass():
    assert in_pass(2).pass_scope(1) is False
    assert func("relu").pass_scope(1) is None
    assert (func("relu") & in_pass(2)).pass_scope(1) is False
    assert (func("relu") & in_pass(2)).pass_scope(2) is None
    assert (func("relu") | in_pass(2)).pass_scope(2) is True
    assert (~in_pass(2)).pass_scope(1) is True


@pytest.mark.parametrize("make", [
    lambda: func(), lambda: func(3), lambda: label(""), lambda: label(2), lambda: module(None),
    lambda: grad_fn(),
    lambda: grad_fn(label=""), lambda: in_pass(0), lambda: in_pass(True), lambda: in_pass(),
])
def test_bad_arguments_raise_a_clear_error(make):
    with pytest.raises(bl.BacklensError) as info:
        make()
    assert isinstance(info.value, ValueError) and info.value.remedy


def test_composing_with_a_non_selector_is_a_type_error():
    with pytest.raises(TypeError):
        func("relu") & True  # noqa: B018


class EvenOps(Selector):
    """A user selector: ops at even positions in the forward."""

    def matches(self, obj):
        return getattr(obj, "kind", None) == "op" and int(obj.label.rsplit("_", 1)[1]) % 2 == 0

    def __repr__(self):
        return "EvenOps()"


def test_a_user_subclass_composes_with_built_in_selectors():
    cap = bl.capture(MLP(), torch.randn(2, 6), save_activations=EvenOps() & func("linear"))
    assert [op.label for op in cap.ops if op.activation is not None] == ["linear_2"]


def test_selectors_filter_records_after_the_fact():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    loss.backward()
    relu_ops = [op.label for op in cap.ops if func("relu").matches(op)]
    assert relu_ops == ["relu_1", "relu_2"]
    nodes = [g.type for g in cap.grad_fns if (func("relu") | without_op()).matches(g)]
    assert "ReluBackward0" in nodes and "AccumulateGrad" in nodes and "AddmmBackward0" not in nodes
    relu_node = cap.ops["relu_1"].grad_fn.label
    calls = [c.label for c in cap.grad_fn_calls if (label(relu_node) & in_pass(2)).matches(c)]
    assert calls == [f"{relu_node}:2"]
    assert [c.label for c in cap.grad_fn_calls if label(f"{relu_node}:1").matches(c)] == [f"{relu_node}:1"]
