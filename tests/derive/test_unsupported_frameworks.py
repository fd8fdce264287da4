"""Torch-only entry points refuse other frameworks' models, naming the framework and bl.derive."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import mlx.core as mx
import mlx.nn as mnn
import paddle
import pytest
import torch
from tinygrad import Tensor, nn

import backlens as bl

FRAMEWORK_MODULES = ("jax", "jaxlib", "flax", "tinygrad", "mlx", "paddle", "tensorflow", "keras", "tf_keras")


class TinyModel:  # tinygrad models are plain Python objects holding tinygrad layers
    def __init__(self):
        self.fc = nn.Linear(3, 2)

    def __call__(self, x):
        return self.fc(x)


def stand_in(module: str, name: str = "Model") -> object:
    """An object whose class claims to live in ``module`` (a framework not installed here)."""
    return type(name, (), {"__module__": module, "__call__": lambda self, x: x})()


MODELS = {
    "jax params": (lambda: {"w": jnp.ones((3, 2))}, "JAX"),
    "flax module": (lambda: stand_in("flax.linen.module", "Dense"), "JAX (Flax)"),
    "tinygrad model": (TinyModel, "tinygrad"),
    "mlx module": (lambda: mnn.Linear(3, 2), "MLX"),
    "paddle layer": (lambda: paddle.nn.Linear(3, 2), "Paddle"),
    "tensorflow module": (lambda: stand_in("tensorflow.python.module.module", "Module"), "TensorFlow"),
    "keras model": (lambda: stand_in("keras.src.models.sequential", "Sequential"), "Keras"),
}


def _call(entry, model):
    if entry == "capture":
        return bl.capture(model, torch.ones(2, 3))
    return bl.wrap(model)


@pytest.mark.parametrize("entry", ["capture", "wrap"])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_torch_only_entry_points_refuse_another_frameworks_model(entry, which):
    make, name = MODELS[which]
    with pytest.raises(bl.UnsupportedFrameworkError) as info:
        _call(entry, make())
    error = info.value
    assert error.framework == name and error.code == "unsupported_framework"
    assert f"bl.{entry}" in str(error) and name in str(error) and "bl.derive" in str(error)
    assert "bl.derive" in error.remedy
    # Catchable as before (a non-module was an UnsupportedInputError) and as the builtin.
    assert isinstance(error, bl.UnsupportedInputError) and isinstance(error, NotImplementedError)
    assert isinstance(error, bl.BacklensError)


def test_tensorflow_and_keras_refusals_point_to_gradient_tape():
    for model in (stand_in("tensorflow.python.module.module"), stand_in("keras.src.models.model")):
        with pytest.raises(bl.UnsupportedFrameworkError, match="tf.GradientTape"):
            bl.capture(model, torch.ones(1))


def test_a_callable_fed_another_frameworks_arrays_is_refused_by_its_inputs():
    with pytest.raises(bl.UnsupportedFrameworkError) as info:
        bl.capture(lambda x: x * 2, mx.ones((2, 3)))
    assert info.value.framework == "MLX"
    with pytest.raises(bl.UnsupportedFrameworkError) as info:
        bl.capture(lambda x: x * 2, Tensor.ones(2, 3))
    assert info.value.framework == "tinygrad"


def test_anything_else_that_is_not_a_module_keeps_the_plain_error():
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.capture(lambda x: x * 2, torch.ones(2))
    assert not isinstance(info.value, bl.UnsupportedFrameworkError)
    assert info.value.code == "not_a_module"


def test_the_error_survives_pickling_with_its_framework():
    import pickle

    with pytest.raises(bl.UnsupportedFrameworkError) as info:
        bl.wrap(TinyModel())
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is bl.UnsupportedFrameworkError
    assert (again.framework, again.code, str(again)) == (info.value.framework, info.value.code, str(info.value))


def _fresh_python(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_import_backlens_imports_no_other_framework():
    loaded = _fresh_python(f"""
        import sys
        import backlens
        print(" ".join(m for m in {FRAMEWORK_MODULES!r} if m in sys.modules) or "none")
    """)
    assert loaded == ["none"]


def test_recognising_a_framework_imports_none():
    loaded = _fresh_python(f"""
        import sys
        import torch
        import backlens as bl
        for module in ("paddle.nn.layer", "tinygrad.nn", "mlx.nn.layers.base", "jax._src.array",
                       "tensorflow.python.module.module", "keras.src.models"):
            model = type("Model", (), {{"__module__": module}})()
            try:
                bl.capture(model, torch.ones(1))
            except bl.UnsupportedFrameworkError as error:
                assert error.framework, error
            else:
                raise AssertionError(module)
        print(" ".join(m for m in {FRAMEWORK_MODULES!r} if m in sys.modules) or "none")
    """)
    assert loaded == ["none"]
