"""Which framework an object belongs to, read from type names alone.

Nothing here imports a framework: a model's classes (and, for frameworks
whose models are plain Python objects, such as tinygrad, its attributes) are
matched by the top-level package of their ``__module__``.
"""

from __future__ import annotations

import types
from typing import Any

from backlens.errors import UnsupportedFrameworkError

# top-level package -> (framework key, name a person reads)
PACKAGES: dict[str, tuple[str, str]] = {
    "jax": ("jax", "JAX"),
    "jaxlib": ("jax", "JAX"),
    "flax": ("jax", "JAX (Flax)"),
    "equinox": ("jax", "JAX (Equinox)"),
    "haiku": ("jax", "JAX (Haiku)"),
    "tinygrad": ("tinygrad", "tinygrad"),
    "mlx": ("mlx", "MLX"),
    "paddle": ("paddle", "Paddle"),
    "tensorflow": ("tensorflow", "TensorFlow"),
    "tf_keras": ("tensorflow", "TensorFlow (Keras)"),
    "keras": ("keras", "Keras"),
    "torch": ("torch", "PyTorch"),
}

# How far into containers and plain objects' attributes to look, and how many
# objects at most: enough for a model object or a params dict, bounded for anything.
_DEPTH = 3
_BUDGET = 256


def _package_of(cls: type) -> str:
    return (getattr(cls, "__module__", None) or "").partition(".")[0]


def _by_type(obj: Any) -> tuple[str, str] | None:
    for cls in type(obj).__mro__:
        found = PACKAGES.get(_package_of(cls))
        if found is not None:
            return found
    return None


def framework_of(*objects: Any) -> tuple[str, str] | None:
    """``(key, display name)`` of the first framework found among ``objects``, or None.

    Looks at each object's class hierarchy, then breadth-first into dict,
    list and tuple items and plain objects' instance attributes.
    """
    frontier = list(objects)
    seen: set[int] = set()
    budget = _BUDGET
    for _depth in range(_DEPTH + 1):
        next_frontier: list[Any] = []
        for obj in frontier:
            if id(obj) in seen or budget <= 0:
                continue
            seen.add(id(obj))
            budget -= 1
            found = _by_type(obj)
            if found is not None:
                return found
            next_frontier.extend(_children(obj))
        frontier = next_frontier
        if not frontier:
            break
    return None


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())[:64]
    if isinstance(obj, (list, tuple)):
        return list(obj)[:64]
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)):
        return []
    try:  # instance attributes only: no property runs (a lazy proxy may still refuse)
        attributes = vars(obj)
    except Exception:
        return []
    if not isinstance(attributes, dict):
        return []
    return [v for k, v in list(attributes.items())[:64] if not k.startswith("__")]


def refuse_other_framework(model: Any, args: tuple, kwargs: dict, entry: str) -> None:
    """Raise :class:`UnsupportedFrameworkError` when ``model`` (or its inputs) is not torch's.

    Called by torch-only entry points on a model that is not an ``nn.Module``;
    returns quietly when no other framework is recognised.
    """
    found = framework_of(model)
    if found is None:
        found = framework_of(*args, *kwargs.values())
    if found is None or found[0] == "torch":
        return
    key, name = found
    extra = {
        "tensorflow": " (derived gradients through tf.GradientTape)",
        "keras": " (derived gradients through tf.GradientTape, with Keras on the TensorFlow backend)",
    }.get(key, "")
    kind = type(model)
    what = (f"a {name} model ({kind.__module__}.{kind.__qualname__})" if _by_type(model) == found
            else f"a {kind.__qualname__} holding {name} values")
    raise UnsupportedFrameworkError(
        f"{entry} records torch's autograd, and got {what}. Backward capture and live editing are "
        f"torch-only; for {name}, bl.derive(fn, params, *inputs) gives gradients derived with its "
        f"own autodiff{extra}.",
        framework=name,
        remedy=f"Call bl.derive(fn, params, *inputs), where fn(params, *inputs) returns the loss, "
               f"for {name} gradients; use {entry} on torch models.",
    )
