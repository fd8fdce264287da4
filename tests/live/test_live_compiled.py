"""A lens over a compiled model (``torch.compile``) sees and runs the original module tree."""

from __future__ import annotations

import pytest
import torch
from live_helpers import assert_clean, reference

import backlens.live as bl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")


def test_a_compiled_model_is_navigated_and_traced_through_its_original_modules(mlp, x):
    compiled = torch.compile(mlp)
    lens = bl.wrap(compiled)
    assert repr(lens.fc2) == "Lens(fc2: Linear)"
    assert lens.fc1.in_features == 4
    expected = reference(mlp, x, ["fc2"])["fc2"]
    mlp.zero_grad()
    with lens.trace(x):
        h = lens.fc2.output.save()
        with lens.output.sum().backward():
            g = h.grad.save()
    assert torch.equal(h, expected[0]) and torch.equal(g, expected[1])
    assert_clean(mlp)
