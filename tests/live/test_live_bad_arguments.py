"""Live tracing's entry points check their arguments at the call: a named error from the user's own
``with`` line, before any body runs, and the trace leaves the model and autograd as they were."""

from __future__ import annotations

import pytest
import torch
from live_helpers import assert_clean

import backlens.live as bl
from backlens.errors import UnsupportedInputError


def test_keep_graph_that_is_not_a_bool_is_refused_naming_it(mlp, lens, x):
    ran = []
    with pytest.raises(UnsupportedInputError, match="keep_graph must be True or False, got 'no'"):
        with lens.trace(x, keep_graph="no"):
            ran.append(True)
    assert ran == []
    assert_clean(mlp)


@pytest.mark.parametrize(("options", "named"), [
    ({"retain_graph": "yes"}, "retain_graph"),
    ({"create_graph": None}, "create_graph"),
    ({"inputs": 5}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"gradient": [1.0]}, "gradient"),
], ids=["retain_graph_a_string", "create_graph_none", "inputs_a_number", "inputs_empty", "gradient_a_list"])
def test_a_bad_option_of_a_backward_block_is_refused_at_its_with_line(mlp, lens, x, options, named):
    ran = []
    with pytest.raises(UnsupportedInputError, match=f"loss.backward: {named} must be") as info:
        with lens.trace(x):
            loss = lens.output.sum()
            with loss.backward(**options):
                ran.append(True)
    assert ran == [] and info.value.code == "bad_argument"
    assert all(p.grad is None for p in mlp.parameters())  # no backward ran
    assert_clean(mlp)


def test_a_backward_block_with_good_options_still_runs(mlp, lens, x):
    with lens.trace(x):
        h = lens.fc1.output
        loss = lens.output.sum()
        with loss.backward(retain_graph=False, inputs=[mlp.fc1.weight]):
            g = h.grad.save()
    assert g is not None and mlp.fc1.weight.grad is not None and mlp.fc2.weight.grad is None


def test_a_batcher_without_its_methods_is_refused_by_wrap(mlp):
    with pytest.raises(UnsupportedInputError, match="batcher must be a Batcher"):
        bl.wrap(mlp, batcher=5)
    with pytest.raises(UnsupportedInputError, match="batcher"):
        bl.wrap(mlp, batcher=torch.cat)
