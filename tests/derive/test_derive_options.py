"""bl.derive's arguments: what it refuses, and how."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import backlens as bl


def loss(p, x):
    return jnp.sum(x @ p["w"])


def test_fn_must_be_callable():
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive({"w": jnp.ones((2, 2))}, jnp.ones((1, 2)))
    assert info.value.code == "derive_fn_not_callable"


@pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
def test_max_intermediate_must_be_a_non_negative_int(bad):
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(loss, {"w": jnp.ones((2, 2))}, jnp.ones((1, 2)), intermediate=True, max_intermediate=bad)
    assert info.value.code == "derive_bad_option"


def test_an_unknown_framework_name_lists_the_known_ones():
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(loss, {"w": np.ones((2, 2))}, np.ones((1, 2)), framework="caffe")
    assert info.value.code == "derive_unknown_framework" and "'jax'" in info.value.remedy


def test_a_torch_model_is_sent_to_bl_capture():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(lambda m, x: m(x).sum(), model, torch.ones(1, 2))
    assert info.value.code == "derive_torch_model" and "bl.capture" in info.value.remedy


def test_a_framework_that_is_not_installed_names_its_extra(monkeypatch):
    assert "tensorflow" not in sys.modules
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow -> ImportError
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(loss, {"w": np.ones((2, 2))}, np.ones((1, 2)), framework="tensorflow")
    assert info.value.code == "framework_not_installed"
    assert "backlens[tensorflow]" in info.value.remedy


def test_a_keras_model_is_recognised_as_needing_tensorflow(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    keras_model = type("Sequential", (), {"__module__": "keras.src.models.sequential"})()
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(lambda m, x: x, keras_model, np.ones(1))
    assert info.value.code == "framework_not_installed"
