"""A save selector that matches nothing warns (selector_matched_nothing); one that matches does not."""

from __future__ import annotations

import warnings

import pytest
import torch

import backlens as bl
from backlens.select import func, grad_input, grad_output, in_pass, label
from models import MLP, BackwardExplodes, loss_of


def unmatched(record):
    return [w for w in record if getattr(w.message, "code", None) == "selector_matched_nothing"]


def passes(save_grads, count=1, **capture_kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=save_grads, **capture_kwargs)
        loss = loss_of(cap.output)
        for _ in range(count):
            loss.backward(retain_graph=True)
    return cap, unmatched(record)


def test_a_selector_that_matches_nothing_warns_once_per_pass():
    _cap, found = passes(func("rleu"), count=2)
    assert len(found) == 2
    message = str(found[0].message)
    assert "save_grads=bl.func('rleu')" in message and "pass 1" in message
    assert "ReluBackward0" in message  # says what did run
    assert isinstance(found[0].message, bl.BacklensWarning)


def test_the_warning_points_at_the_users_line():
    _cap, found = passes(func("rleu"))
    assert found[0].filename == __file__


def test_a_selector_that_matches_does_not_warn():
    _cap, found = passes(func("relu") | label("nothing_1"), count=2)
    assert found == []


def test_contradictory_sides_warn():
    _cap, found = passes(grad_input() & grad_output())
    assert len(found) == 1


def test_a_pass_that_in_pass_rules_out_does_not_warn():
    _cap, found = passes(func("relu") & in_pass(2), count=2)
    assert found == []


def test_a_ruled_in_pass_that_matches_nothing_still_warns():
    _cap, found = passes(func("rleu") & in_pass(2), count=2)
    assert [str(w.message).count("pass 2") for w in found] == [1]


def test_true_and_false_never_warn():
    assert passes(True)[1] == [] and passes(False)[1] == []


def test_a_per_pass_selector_given_to_cap_backward_warns_for_its_pass():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    with pytest.warns(bl.BacklensWarning, match=r"save_grads=bl.label\('linear_9'\) matched nothing"):
        cap.backward(loss_of(cap.output), save_grads=label("linear_9"))


class WithExploding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return BackwardExplodes.apply(self.lin(x))


def test_a_failed_pass_does_not_add_a_selector_warning():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cap = bl.capture(WithExploding(), torch.randn(2, 3), save_grads=func("rleu"))
        with pytest.raises(RuntimeError, match="exploded"):
            cap.output.sum().backward()
    assert unmatched(record) == []


def test_save_activations_that_match_no_op_warn_after_the_forward():
    with pytest.warns(bl.BacklensWarning, match=r"save_activations=bl.func\('rleu'\) matched no op") as record:
        bl.capture(MLP(), torch.randn(2, 6), save_activations=func("rleu"))
    assert record[0].message.code == "selector_matched_nothing"
    assert "relu" in str(record[0].message)  # lists what ran


def test_save_activations_that_match_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bl.capture(MLP(), torch.randn(2, 6), save_activations=func("relu"))
