"""TensorFlow / Keras (TensorFlow backend): ``tf.GradientTape`` over trainable variables.

``params`` is a ``tf.Module`` or Keras model (its ``trainable_variables``), a
dict of variables, or one variable. Float input tensors are watched too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from backlens.derive.outputs import check_same_output, input_name, scalar_loss
from backlens.derive.record import DerivedGrads, IntermediateGrads
from backlens.errors import UnsupportedInputError


def _variable_name(variable: Any) -> str:
    path = getattr(variable, "path", None)  # Keras 3: "dense/kernel"
    if isinstance(path, str) and path:
        return path
    name = str(getattr(variable, "name", "variable"))
    return name[:-2] if name.endswith(":0") else name


def _is_float_variable(value: Any) -> bool:
    """A trainable tf.Variable or Keras variable (which wraps one) holding floats."""
    if not hasattr(value, "assign") or not hasattr(value, "dtype") or not getattr(value, "trainable", True):
        return False
    try:
        return tf.as_dtype(value.dtype).is_floating
    except TypeError:
        return False


def declared_variables(params: Any) -> dict[str, Any]:
    if isinstance(params, dict):
        return {str(k): v for k, v in params.items() if _is_float_variable(v)}
    if _is_float_variable(params):
        return {"params": params}
    variables = getattr(params, "trainable_variables", None)
    if variables is None:
        raise UnsupportedInputError(
            f"bl.derive (tensorflow): params of type {type(params).__name__} has no trainable_variables.",
            code="derive_bad_params",
            remedy="Pass a tf.Module or Keras model, a dict of tf.Variable, or one tf.Variable.",
        )
    named: dict[str, Any] = {}
    for variable in variables:
        name = _variable_name(variable)
        while name in named:  # two variables may share a display name
            name += "'"
        named[name] = variable
    return named


def _check_keras_backend(params: Any) -> None:
    """A Keras model on another backend runs no TensorFlow ops a tape could see."""
    if (getattr(type(params), "__module__", "") or "").partition(".")[0] != "keras":
        return
    keras = sys.modules.get("keras")
    backend = keras.backend.backend() if keras is not None else "tensorflow"
    if backend != "tensorflow":
        raise UnsupportedInputError(
            f"bl.derive: this Keras model runs on the {backend!r} backend; tf.GradientTape sees only "
            "TensorFlow ops.",
            code="derive_keras_backend",
            remedy="Set KERAS_BACKEND=tensorflow before importing keras (on the torch backend the "
                   "model is a torch module: use bl.capture).",
        )


def derive(fn: Callable[..., Any], params: Any, inputs: tuple, *, intermediate: bool,
           max_intermediate: int, input_grads: bool) -> DerivedGrads:
    _check_keras_backend(params)
    own = scalar_loss(np.asarray(fn(params, *inputs)), "tensorflow")
    variables = declared_variables(params)
    watched = {input_name(i): x for i, x in enumerate(inputs)
               if input_grads and tf.is_tensor(x) and x.dtype.is_floating}
    # Trainable variables are watched as they are read (Keras variables too);
    # input tensors are watched explicitly.
    with tf.GradientTape() as tape:
        for value in watched.values():
            tape.watch(value)
        loss = fn(params, *inputs)
    sources = [*variables.values(), *watched.values()]
    grads = tape.gradient(loss, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    derived = scalar_loss(np.asarray(loss), "tensorflow")
    check_same_output(own, derived, "tensorflow")
    names = [*variables, *watched]
    return DerivedGrads(
        framework="tensorflow",
        version=tf.__version__,
        output=derived,
        leaf_grads={name: np.asarray(tf.convert_to_tensor(g)) for name, g in zip(names, grads)},
        intermediates=IntermediateGrads.unavailable("TensorFlow") if intermediate else None,
    )
