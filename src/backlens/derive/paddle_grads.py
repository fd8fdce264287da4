"""Paddle: ``paddle.grad`` over a layer's trainable parameters and the float inputs.

``paddle.grad`` returns the gradients without accumulating into ``.grad``.
Inputs enter the derivation as detached copies that require gradients, so
the caller's tensors are not changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle

from backlens.derive.outputs import check_same_output, input_name, scalar_loss
from backlens.derive.record import DerivedGrads, IntermediateGrads


def _is_float(value: Any) -> bool:
    return isinstance(value, paddle.Tensor) and value.is_floating_point()


def _numpy(tensor: paddle.Tensor) -> np.ndarray:
    if tensor.dtype == paddle.bfloat16:  # numpy has no bfloat16; the widening is exact
        tensor = tensor.astype("float32")
    return tensor.numpy()


def declared_parameters(params: Any) -> dict[str, paddle.Tensor]:
    """A layer's trainable parameters by name, or a dict's float tensors."""
    if isinstance(params, paddle.nn.Layer):
        return {name: p for name, p in params.named_parameters() if not p.stop_gradient}
    if isinstance(params, paddle.Tensor):
        return {"params": params}
    return {str(name): p for name, p in dict(params).items() if _is_float(p)}


def derive(fn: Callable[..., Any], params: Any, inputs: tuple, *, intermediate: bool,
           max_intermediate: int, input_grads: bool) -> DerivedGrads:
    own = scalar_loss(_numpy(fn(params, *inputs)), "paddle")
    named = declared_parameters(params)
    leaves = list(named.items())
    call_inputs = list(inputs)
    if input_grads:
        for i, x in enumerate(inputs):
            if _is_float(x):
                copy = x.detach()
                copy.stop_gradient = False
                call_inputs[i] = copy
                leaves.append((input_name(i), copy))
    # A dict's tensors may be created with stop_gradient=True (paddle's default).
    frozen = [t for _, t in leaves if t.stop_gradient]
    for tensor in frozen:
        tensor.stop_gradient = False
    try:
        loss = fn(params, *call_inputs)
        grads = paddle.grad([loss], [t for _, t in leaves], allow_unused=True) if leaves else []
    finally:
        for tensor in frozen:
            tensor.stop_gradient = True
    derived = scalar_loss(_numpy(loss), "paddle")
    check_same_output(own, derived, "paddle")
    leaf_grads = {
        name: np.zeros(tensor.shape, dtype=_numpy(tensor).dtype) if grad is None else _numpy(grad)
        for (name, tensor), grad in zip(leaves, grads)
    }
    return DerivedGrads(
        framework="paddle",
        version=paddle.__version__,
        output=derived,
        leaf_grads=leaf_grads,
        intermediates=IntermediateGrads.unavailable("Paddle") if intermediate else None,
    )
