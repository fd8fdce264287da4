"""``bl.derive``: pick the framework, run its gradient computation, check the output."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from backlens.derive.frameworks import framework_of
from backlens.derive.record import DerivedGrads
from backlens.errors import UnsupportedInputError

DEFAULT_MAX_INTERMEDIATE = 256

# framework key -> (module under backlens.derive, package to import, pip extra)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "jax": ("jax_grads", "jax", "jax"),
    "tinygrad": ("tinygrad_grads", "tinygrad", "tinygrad"),
    "mlx": ("mlx_grads", "mlx.core", "mlx"),
    "paddle": ("paddle_grads", "paddle", "paddle"),
    "tensorflow": ("tensorflow_grads", "tensorflow", "tensorflow"),
    "keras": ("tensorflow_grads", "tensorflow", "tensorflow"),
}


def derive(
    fn: Callable[..., Any],
    params: Any,
    *inputs: Any,
    intermediate: bool = False,
    max_intermediate: int = DEFAULT_MAX_INTERMEDIATE,
    input_grads: bool = True,
    framework: str | None = None,
) -> DerivedGrads:
    """Gradients of ``fn(params, *inputs)`` derived with its framework's own autodiff.

    ``params`` is a pytree of arrays (JAX), a model or a dict of parameters
    (tinygrad, MLX, Paddle, TensorFlow/Keras). ``fn`` must return a scalar
    loss. Leaf gradients cover every float leaf of ``params`` and, with
    ``input_grads=True``, every float array among ``inputs`` (named
    ``"args[i]"``). ``intermediate=True`` adds per-op records where the
    framework can give them exactly (JAX), at most ``max_intermediate``.
    The framework is recognised from ``params`` and ``inputs``; pass
    ``framework="jax"`` (``"tinygrad"``, ``"mlx"``, ``"paddle"``,
    ``"tensorflow"``) when they are plain numpy arrays.

    Raises :class:`~backlens.DeriveError` (``derived_output_mismatch``) when
    the derived computation's loss differs from ``fn``'s own.
    """
    if not callable(fn):
        raise UnsupportedInputError(
            f"bl.derive needs fn(params, *inputs) -> loss as its first argument, got {type(fn).__name__}.",
            code="derive_fn_not_callable",
            remedy="Pass the loss function first: bl.derive(loss_fn, params, *inputs).",
        )
    if isinstance(max_intermediate, bool) or not isinstance(max_intermediate, int) or max_intermediate < 0:
        raise UnsupportedInputError(
            f"bl.derive: max_intermediate must be an int >= 0, got {max_intermediate!r}.",
            code="derive_bad_option",
            remedy="Pass max_intermediate=N with N >= 0.",
        )
    for name, value in (("intermediate", intermediate), ("input_grads", input_grads)):
        if not isinstance(value, bool):
            raise UnsupportedInputError(f"bl.derive: {name} must be True or False, got {value!r}.",
                                        code="derive_bad_option", remedy=f"Pass {name}=True or {name}=False.")
    if framework is not None and not isinstance(framework, str):
        raise UnsupportedInputError(f"bl.derive: framework must be a name such as 'jax', got {framework!r}.",
                                    code="derive_unknown_framework",
                                    remedy="Pass framework='jax' (or 'tinygrad', 'mlx', 'paddle', 'tensorflow').")
    key = _framework_key(framework, params, inputs)
    module_name, package, extra = BACKENDS[key]
    try:
        importlib.import_module(package)
    except ImportError as exc:
        raise UnsupportedInputError(
            f"bl.derive: framework {key!r} is not installed ({exc}).",
            code="framework_not_installed",
            remedy=f"pip install 'backlens[{extra}]'.",
        ) from exc
    backend = importlib.import_module(f"backlens.derive.{module_name}")
    return backend.derive(fn, params, inputs, intermediate=bool(intermediate),
                          max_intermediate=max_intermediate, input_grads=bool(input_grads))


def _framework_key(framework: str | None, params: Any, inputs: tuple) -> str:
    if framework is not None:
        if framework not in BACKENDS:
            raise UnsupportedInputError(
                f"bl.derive: unknown framework {framework!r}.",
                code="derive_unknown_framework",
                remedy=f"Use one of {', '.join(repr(k) for k in BACKENDS if k != 'keras')}.",
            )
        return framework
    found = framework_of(params) or framework_of(*inputs)
    if found is None:
        raise UnsupportedInputError(
            f"bl.derive: cannot tell which framework params of type {type(params).__name__} belong to.",
            code="derive_unknown_framework",
            remedy="Pass framework='jax' (or 'tinygrad', 'mlx', 'paddle', 'tensorflow').",
        )
    key, name = found
    if key == "torch":
        raise UnsupportedInputError(
            "bl.derive is for frameworks other than torch; a torch model gets the full backward record.",
            code="derive_torch_model",
            remedy="Use bl.capture(model, *inputs, save_grads=True) and read cap.params[name].grad.",
        )
    return key
