"""Checks every framework's derivation shares: a scalar loss, and the same loss as ``fn``'s own."""

from __future__ import annotations

from typing import Any

import numpy as np

from backlens.errors import DeriveError, UnsupportedInputError


def input_name(position: int) -> str:
    """The leaf name of positional input ``position`` (as bl.capture names its inputs)."""
    return f"args[{position}]"


def scalar_loss(value: Any, framework: str) -> np.ndarray:
    """``fn``'s output as a numpy scalar array; refused when it is not one number."""
    try:
        array = np.asarray(value)
    except Exception as exc:  # a framework object numpy cannot read
        raise UnsupportedInputError(
            f"bl.derive ({framework}): fn returned {type(value).__name__}, which is not an array.",
            code="derive_loss_not_scalar",
            remedy="Return the scalar loss from fn (reduce it with .sum() or .mean()).",
        ) from exc
    if array.size != 1 or array.dtype.kind not in "f" and array.dtype.name != "bfloat16":
        raise UnsupportedInputError(
            f"bl.derive ({framework}): fn must return a scalar float loss, got "
            f"shape {array.shape} dtype {array.dtype}.",
            code="derive_loss_not_scalar",
            remedy="Return the scalar loss from fn (reduce it with .sum() or .mean()).",
        )
    return array.reshape(())


def check_same_output(own: np.ndarray, derived: np.ndarray, framework: str) -> None:
    """Refuse a derivation whose loss is not exactly the function's own loss."""
    if own.shape == derived.shape and own.dtype == derived.dtype and np.array_equal(own, derived, equal_nan=True):
        return
    raise DeriveError(
        f"bl.derive ({framework}): the derived computation's loss {derived!r} ({derived.dtype}) differs "
        f"from fn's own output {own!r} ({own.dtype}), so its gradients would not describe fn's run. "
        "fn is not a pure function of (params, *inputs): it draws fresh randomness, reads or changes "
        "state outside its arguments, or runs in a different mode on the second call.",
        code="derived_output_mismatch",
        remedy="Make fn deterministic and pure: pass random keys and state in as arguments, "
               "fix dropout/training mode, and do not update state inside fn.",
    )
