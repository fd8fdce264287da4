"""MLX: ``mx.value_and_grad`` over a module's trainable parameters (or a parameter tree).

A module's parameters are rebound for the derivation (``model.update``) and
restored afterwards, also when ``fn`` raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
from mlx.utils import tree_flatten

from backlens.derive.outputs import check_same_output, input_name, scalar_loss
from backlens.derive.record import DerivedGrads, IntermediateGrads


def _is_float(value: Any) -> bool:
    return isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating)


def _numpy(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:  # numpy has no bfloat16; the widening is exact
        array = array.astype(mx.float32)
    return np.array(array)


def derive(fn: Callable[..., Any], params: Any, inputs: tuple, *, intermediate: bool,
           max_intermediate: int, input_grads: bool) -> DerivedGrads:
    own = scalar_loss(_numpy(_evaluated(fn(params, *inputs))), "mlx")
    positions = [i for i, x in enumerate(inputs) if input_grads and _is_float(x)]
    if isinstance(params, mnn.Module):
        model = params
        tree = model.trainable_parameters()
        original = model.parameters()

        def call(tree: Any, chosen: list) -> Any:
            model.update(tree)
            return mx.reshape(fn(model, *_with(inputs, positions, chosen)), ())
    else:
        model, tree, original = None, params, None

        def call(tree: Any, chosen: list) -> Any:
            return mx.reshape(fn(tree, *_with(inputs, positions, chosen)), ())

    try:
        value, (tree_grads, input_grads_) = mx.value_and_grad(call, argnums=(0, 1))(
            tree, [inputs[i] for i in positions])
        mx.eval(value, tree_grads, input_grads_)
    finally:
        if model is not None:
            model.update(original)
    derived = scalar_loss(_numpy(value), "mlx")
    check_same_output(own, derived, "mlx")
    leaf_grads = {name: _numpy(g) for name, g in tree_flatten(tree_grads) if isinstance(g, mx.array)}
    leaf_grads.update({input_name(i): _numpy(g) for i, g in zip(positions, input_grads_)})
    return DerivedGrads(
        framework="mlx",
        version=mx.__version__,
        output=derived,
        leaf_grads=leaf_grads,
        intermediates=IntermediateGrads.unavailable("MLX") if intermediate else None,
    )


def _evaluated(value: Any) -> Any:
    if isinstance(value, mx.array):
        mx.eval(value)
    return value


def _with(inputs: tuple, positions: list[int], chosen: list) -> tuple:
    replaced = list(inputs)
    for i, value in zip(positions, chosen):
        replaced[i] = value
    return tuple(replaced)
