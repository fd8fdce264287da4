"""tinygrad: ``loss.gradient(*leaves)`` over a model's (or dict's) float tensors.

``Tensor.gradient`` is tinygrad's own autodiff and, unlike ``backward()``,
writes no ``.grad``: the derivation leaves the user's tensors as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from tinygrad import Tensor
from tinygrad.nn.state import get_state_dict

from backlens.derive.outputs import check_same_output, input_name, scalar_loss
from backlens.derive.record import DerivedGrads, IntermediateGrads


def _is_float(tensor: Any) -> bool:
    return isinstance(tensor, Tensor) and tensor.is_floating_point()


def declared_leaves(params: Any, inputs: tuple, input_grads: bool) -> dict[str, Tensor]:
    """Parameter names (``get_state_dict``: ``"l1.weight"``) and ``"args[i]"`` inputs."""
    leaves = {"params": params} if isinstance(params, Tensor) else get_state_dict(params)
    named = {name: t for name, t in leaves.items() if _is_float(t)}
    if input_grads:
        named.update({input_name(i): x for i, x in enumerate(inputs) if _is_float(x)})
    return named


def derive(fn: Callable[..., Any], params: Any, inputs: tuple, *, intermediate: bool,
           max_intermediate: int, input_grads: bool) -> DerivedGrads:
    own = scalar_loss(fn(params, *inputs).numpy(), "tinygrad")
    leaves = declared_leaves(params, inputs, input_grads)
    loss = fn(params, *inputs).reshape(())  # a loss of shape (1,) too
    grads = loss.gradient(*leaves.values()) if leaves else []
    derived = scalar_loss(loss.numpy(), "tinygrad")
    check_same_output(own, derived, "tinygrad")
    leaf_grads = {}
    for (name, leaf), grad in zip(leaves.items(), grads):
        if grad.device is None:  # a leaf the loss does not reach: a device-less zero
            grad = grad.clone(device=leaf.device)
        leaf_grads[name] = grad.numpy()
    return DerivedGrads(
        framework="tinygrad",
        version=_version(),
        output=derived,
        leaf_grads=leaf_grads,
        intermediates=IntermediateGrads.unavailable("tinygrad") if intermediate else None,
    )


def _version() -> str:
    try:
        return version("tinygrad")
    except PackageNotFoundError:  # pragma: no cover - a source checkout
        return "unknown"
