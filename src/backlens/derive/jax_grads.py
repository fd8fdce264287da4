"""JAX: ``jax.value_and_grad`` over the float leaves of ``(params, *inputs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from backlens.derive.outputs import check_same_output, input_name, scalar_loss
from backlens.derive.record import DerivedGrads


def key_text(key: Any) -> str:
    """One pytree path entry as text: a dict key, a list index or an attribute name."""
    for attribute in ("key", "idx", "name"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def leaf_name(path: tuple) -> str:
    """``params`` leaves by dotted path (``"layers.0.w"``), inputs as ``"args[i]"`` (+ path)."""
    head, rest = key_text(path[0]), ".".join(key_text(k) for k in path[1:])
    if head == "0":
        return rest or "params"
    base = input_name(int(head) - 1)
    return f"{base}.{rest}" if rest else base


def is_float_leaf(leaf: Any) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
    except TypeError:
        return False


def derive(fn: Callable[..., Any], params: Any, inputs: tuple, *, intermediate: bool,
           max_intermediate: int, input_grads: bool) -> DerivedGrads:
    own = scalar_loss(fn(params, *inputs), "jax")
    flat, treedef = jax.tree_util.tree_flatten_with_path((params, *inputs))
    leaves = [leaf for _, leaf in flat]
    names = [leaf_name(path) for path, _ in flat]
    chosen = [i for i, (path, leaf) in enumerate(flat)
              if is_float_leaf(leaf) and (input_grads or key_text(path[0]) == "0")]

    def call(all_leaves: list) -> Any:
        rebuilt_params, *rebuilt_inputs = jax.tree_util.tree_unflatten(treedef, all_leaves)
        return fn(rebuilt_params, *rebuilt_inputs)

    def of_chosen(values: list) -> Any:
        all_leaves = list(leaves)
        for i, value in zip(chosen, values):
            all_leaves[i] = value
        return jnp.reshape(call(all_leaves), ())  # a loss of shape (1,) too

    value, grads = jax.value_and_grad(of_chosen)([leaves[i] for i in chosen])
    derived = scalar_loss(value, "jax")
    check_same_output(own, derived, "jax")
    records = None
    if intermediate:
        from backlens.derive.jax_intermediates import intermediate_grads

        records = intermediate_grads(call, leaves, own, max_intermediate)
    return DerivedGrads(
        framework="jax",
        version=jax.__version__,
        output=derived,
        leaf_grads={names[i]: np.asarray(g) for i, g in zip(chosen, grads)},
        intermediates=records,
    )
