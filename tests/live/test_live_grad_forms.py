"""Every way Python assigns, reads or deletes `h.grad` in a backward block.

Each form either edits the gradient exactly as the same edit made by a stock
tensor hook does (the parameters' `.grad` compared with `torch.equal`), or is
refused with a named error before anything runs.
"""

# The unusual spellings (unused targets, getattr with a constant, a loop over its own target) are what is tested.
# ruff: noqa: F841, B009, B010, B020

from __future__ import annotations

import contextlib

import pytest
import torch

from backlens.errors import TraceError


def stock_param_grads(model, x, edits):
    """Parameter gradients of `model(x).sum()` with each module output's gradient edited by a tensor hook."""
    model.zero_grad(set_to_none=True)
    handles = []
    for name, edit in edits.items():

        def hook(module, args, output, edit=edit):
            output.register_hook(edit)

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        model(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return taken_param_grads(model)


def taken_param_grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


def test_a_tuple_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad, o = hidden.grad * 0, 1
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 0}))


def test_a_list_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            [hidden.grad, o] = [hidden.grad * 2, 1]
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 2}))


def test_a_nested_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            (a, (hidden.grad, b)) = (1, (hidden.grad * 3, 2))
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 3}))


def test_a_target_beside_a_starred_one_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            *rest, hidden.grad = (1, 2, hidden.grad * 0.5)
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 0.5}))


def test_a_starred_grad_target_is_refused_as_a_list_would_be_in_place(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            hidden = lens.fc2.output
            with lens.output.sum().backward():
                first, *hidden.grad = (1, hidden.grad)
    assert info.value.code == "replacement_mismatch"


def test_two_gradients_in_one_tuple_target_are_both_edited(mlp, lens, x):
    with lens.trace(x):
        early, late = lens.fc1.output, lens.fc2.output
        with lens.output.sum().backward():
            late.grad, early.grad = late.grad * 2, torch.ones_like(early)
    got = taken_param_grads(mlp)
    assert_same(got, stock_param_grads(mlp, x, {"fc2": lambda g: g * 2, "fc1": torch.ones_like}))


def test_a_chained_assignment_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad = kept = hidden.grad * 4
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 4}))


def test_an_annotated_assignment_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad: torch.Tensor = hidden.grad * 4
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 4}))


def test_an_augmented_assignment_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad *= 3
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 3}))


def test_an_augmented_assignment_reads_its_target_before_its_value(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad += hidden.grad
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g + g}))


def test_an_augmented_assignment_leaves_autograds_own_buffer_untouched(mlp, lens, x):
    seen = {}
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            arrived = hidden.grad
            before = arrived.clone()
            hidden.grad -= 1
            seen["untouched"] = torch.equal(arrived, before)
    assert seen["untouched"]
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g - 1}))


def test_a_for_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            for hidden.grad in [hidden.grad * 2]:
                pass
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 2}))


def test_the_last_value_of_a_for_target_is_the_edit(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            arrived = hidden.grad
            for hidden.grad in (arrived * 5, arrived * 0):
                pass
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 0}))


def test_a_with_as_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            with contextlib.nullcontext(hidden.grad * 3) as hidden.grad:
                pass
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 3}))


def test_a_comprehension_target_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            [None for hidden.grad in [hidden.grad * 2]]
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 2}))


def test_setattr_and_getattr_of_grad_edit_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            setattr(hidden, "grad", getattr(hidden, "grad") * 5)
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 5}))


def test_an_assignment_in_a_function_the_block_defines_edits_the_gradient(mlp, lens, x):
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():

            def double(t):
                t.grad = t.grad * 2

            double(hidden)
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": lambda g: g * 2}))


def test_grad_on_an_object_that_is_not_a_tensor_is_its_own_attribute(mlp, lens, x):
    class Box:
        grad = 1

    box = Box()
    with lens.trace(x):
        with lens.output.sum().backward():
            box.grad, other = 2, 3
            box.grad += 10
            for box.grad in [box.grad * 2]:
                pass
    assert box.grad == 24


@pytest.mark.parametrize(
    "spelled",
    ["del hidden.grad", "del (hidden.grad, other)", "delattr(hidden, 'grad')", "case hidden.grad"],
)
def test_a_form_with_no_meaning_for_a_gradient_is_refused_before_anything_runs(mlp, lens, x, spelled):
    ran = []
    other = None  # noqa: F841  (named in a refused body)
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            ran.append("trace")
            hidden = lens.fc2.output
            with lens.output.sum().backward():
                ran.append("backward")
                if spelled == "del hidden.grad":
                    del hidden.grad
                elif spelled == "del (hidden.grad, other)":
                    del (hidden.grad, other)
                elif spelled == "delattr(hidden, 'grad')":
                    delattr(hidden, "grad")
                else:
                    match 0:
                        case hidden.grad:
                            pass
    error = info.value
    assert error.code == "unsupported_grad_form" and error.remedy
    assert "test_live_grad_forms.py:" in str(error)
    assert ran == []
    assert all(p.grad is None for p in mlp.parameters())


def test_delattr_of_a_computed_grad_name_raises_a_named_error(mlp, lens, x):
    name = "gr" + "ad"
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            hidden = lens.fc2.output
            with lens.output.sum().backward():
                delattr(hidden, name)
    assert info.value.code == "unsupported_grad_form"


def _with_item_zeroed(grad):
    edited = grad.clone()
    edited[:, 0] = 0
    return edited


def test_an_item_assignment_edits_a_copy_of_the_gradient(mlp, lens, x):
    seen = {}
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            arrived = hidden.grad
            before = arrived.clone()
            hidden.grad[:, 0] = 0
            seen["untouched"] = torch.equal(arrived, before)
    assert seen["untouched"]
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": _with_item_zeroed}))


def test_an_augmented_item_assignment_edits_a_copy_of_the_gradient(mlp, lens, x):
    def doubled_row(grad):
        edited = grad.clone()
        edited[1] *= 2
        return edited

    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            hidden.grad[1] *= 2
    assert_same(taken_param_grads(mlp), stock_param_grads(mlp, x, {"fc2": doubled_row}))


def test_an_item_assignment_in_an_invoke_edits_only_its_rows(mlp, lens):
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with lens.trace() as tracer:
        with tracer.invoke(a):
            hidden = lens.fc2.output
            with lens.output.sum().backward(retain_graph=True):
                hidden.grad[:, 0] = 0
        with tracer.invoke(b):
            pass
    got = taken_param_grads(mlp)

    def first_rows_edited(grad):
        edited = grad.clone()
        edited[:2, 0] = 0
        return edited

    hidden = mlp.fc2(mlp.act(mlp.fc1(torch.cat([a, b]))))
    hidden.register_hook(first_rows_edited)
    mlp.fc3(torch.tanh(hidden))[:2].sum().backward()  # invoke 0's rows of the output
    assert_same(got, taken_param_grads(mlp))


@pytest.mark.parametrize("how", ["method", "augmented name"])
def test_changing_a_served_gradient_in_place_stops_the_backward_with_a_named_error(mlp, lens, x, how):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            hidden = lens.fc2.output
            with lens.output.sum().backward():
                if how == "method":
                    hidden.grad.mul_(2)
                else:
                    g = hidden.grad
                    g *= 2
                    hidden.grad = g
    assert info.value.code == "grad_changed_in_place"
    assert "fc2.output.grad" in str(info.value)
