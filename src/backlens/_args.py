"""Checking the arguments of public entry points at the call, with errors that say what to pass.

Each check raises :class:`~backlens.errors.UnsupportedInputError` (a
``ValueError`` and a ``TypeError``) naming the function, the argument and
what it takes, before anything runs: a wrong value never travels into a
hook and fails in the middle of the user's backward.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from backlens.errors import NoGradientPathError, UnsupportedInputError


def _bad(where: str, name: str, wants: str, value: Any, remedy: str, code: str = "bad_argument") -> UnsupportedInputError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return UnsupportedInputError(f"{where}: {name} must be {wants}, got {shown} ({type(value).__name__}).",
                                 code=code, remedy=remedy)


def flag(value: Any, name: str, where: str) -> bool:
    """``True`` or ``False`` (not a truthy string)."""
    if not isinstance(value, bool):
        raise _bad(where, name, "True or False", value, f"Pass {name}=True or {name}=False.")
    return value


def path(value: Any, name: str, where: str, example: str) -> None:
    if not isinstance(value, (str, os.PathLike)) or os.fspath(value) in ("", b""):
        raise _bad(where, name, "a path (a str or pathlib.Path)", value, f"Pass a path, e.g. {example}.",
                   code="bad_path")


def number(value: Any, name: str, where: str, *, low: float | None = None, above: bool = False,
           finite: bool = False, example: str = "1.0") -> float:
    """A real number (not a bool), at least ``low`` (or more than it with ``above``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _real_scalar(value):
        raise _bad(where, name, "a number", value, f"Pass a number, e.g. {where.split('(')[0]}({example}).")
    real = float(value)
    if math.isnan(real) or (finite and math.isinf(real)):
        raise _bad(where, name, "a finite number", value, f"Pass a finite number, e.g. {example}.")
    if low is not None and (real <= low if above else real < low):
        bound = f"more than {low:g}" if above else f"at least {low:g}"
        raise _bad(where, name, f"a number {bound}", value, f"Pass a number {bound}, e.g. {example}.")
    return real


def _real_scalar(value: Any) -> bool:
    """A 0-d real tensor or numpy scalar counts as a number."""
    try:
        import numpy as np
        import torch
    except ImportError:  # pragma: no cover - both are dependencies
        return False
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (np.integer, np.floating))


def integer(value: Any, name: str, where: str, *, low: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(where, name, f"an integer >= {low}", value, f"Pass e.g. {name}={example}.")
    return value


def callable_(value: Any, name: str, where: str, example: str) -> None:
    if not callable(value):
        raise _bad(where, name, "callable", value, f"Pass a function, e.g. {example}.")


def capture(value: Any, where: str, needs: tuple[str, ...] = ("_state", "passes")) -> None:
    """A capture (live or loaded), or any object with the attributes a report reads (``needs``)."""
    if not all(hasattr(value, name) for name in needs):
        raise UnsupportedInputError(
            f"{where} takes a capture (from bl.capture(...) or bl.load(path)), got {type(value).__name__}.",
            code="not_a_capture",
            remedy=f"Pass the capture itself: {where.split('(')[0]}(cap).",
        )


def close_option(name: str, options: Iterable[str]) -> str | None:
    """The option ``name`` is most likely a misspelling of, if any."""
    options = list(options)
    lowered = {option.lower(): option for option in options}
    found = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.75)
    return lowered[found[0]] if found else None


def forward_parameters(forward: Callable[..., Any]) -> tuple[set[str], bool]:
    """The keyword names ``forward`` takes and whether it takes ``**kwargs`` (all names, True
    when its signature cannot be read)."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    return names, takes_any


def no_mistyped_options(kwargs: dict[str, Any], options: Iterable[str], forward: Callable[..., Any],
                        where: str) -> None:
    """Refuse a keyword meant for the model that is close to one of ``options`` and is not a
    parameter of ``forward`` (``save_grad=True`` for ``save_grads=True``), also when
    ``forward`` takes ``**kwargs``: silently passing it on would save nothing, say nothing."""
    if not kwargs:
        return
    names, _takes_any = forward_parameters(forward)
    for key in kwargs:
        if key in names:
            continue
        option = close_option(key, options)
        if option is not None:
            raise UnsupportedInputError(
                f"{where}: unknown option {key}=; did you mean {option}=? (the model's forward has no "
                f"parameter {key!r}, so it would have been passed to the model.)",
                code="mistyped_option",
                remedy=f"Spell it {option}=.",
            )


def policy(value: Any, name: str, where: str) -> None:
    """``True``, ``False`` or a selector (what ``save_grads=`` and ``save_activations=`` take)."""
    if not (value is True or value is False or callable(getattr(value, "matches", None))):
        raise _bad(where, name, "True, False or a selector", value,
                   f"Pass {name}=True, {name}=False, or a selector such as bl.func('relu').")


def backward_options(where: str, gradient: Any, retain_graph: Any, create_graph: Any, inputs: Any, *,
                     gradient_name: str = "gradient") -> None:
    """The options a backward passes to autograd, checked before any pass starts (so a wrong one
    never reaches torch, which would fail with a raw TypeError after the pass has begun)."""
    import torch

    if retain_graph is not None:
        flag(retain_graph, "retain_graph", where)
    flag(create_graph, "create_graph", where)
    if gradient is not None and not isinstance(gradient, torch.Tensor):
        items = gradient if isinstance(gradient, (tuple, list)) else None
        if items is None or not all(item is None or isinstance(item, torch.Tensor) for item in items):
            raise _bad(where, gradient_name, "a tensor (or a sequence of tensors)", gradient,
                       f"Pass {gradient_name}=torch.ones_like(loss), or leave it out for a scalar loss.")
    if inputs is None:
        return
    edge = getattr(torch.autograd.graph, "GradientEdge", ())
    items = (inputs,) if isinstance(inputs, (torch.Tensor, edge)) else inputs
    if not isinstance(items, (tuple, list)) or not items \
            or not all(isinstance(item, (torch.Tensor, edge)) for item in items):
        raise _bad(where, "inputs", "a tensor or a non-empty sequence of tensors", inputs,
                   "Pass the leaves to accumulate into, e.g. inputs=[model.weight], or leave it out.")


def scalar_loss(loss: Any, where: str, name: str = "loss_fn") -> Any:
    """What ``name`` returned, refused unless it is a one-element tensor (a loss to call backward on)."""
    import torch

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UnsupportedInputError(f"{where}: {name} returned {what}; it must return a scalar tensor (the loss).",
                                    code="loss_required",
                                    remedy=f"Reduce it to a scalar in {name}, e.g. lambda out: out.sum().")
    return loss


def differentiable_loss(loss: Any, where: str, name: str = "loss_fn") -> Any:
    """A scalar loss (as :func:`scalar_loss`) that autograd can backpropagate: one with a graph."""
    scalar_loss(loss, where, name)
    if not loss.requires_grad:
        raise NoGradientPathError(
            f"{where}: {name} returned a loss with no autograd graph (it does not require grad), so there is "
            "no backward to compare.", code="loss_without_graph",
            remedy=f"Compute the loss in {name} from the model's output without .detach(), torch.no_grad() or "
                   ".item(), and leave some parameter or input requiring grad.")
    return loss


def edit_callable(fn: Any, where: str) -> None:
    """An edit callable must take the value and ``ctx=`` (``fn(value, *, ctx)``); checked when the
    edit is made, so a wrong one never aborts the user's backward when it first applies."""
    factory = getattr(fn, "__module__", None) == "backlens.edits" and callable(fn) \
        and getattr(fn, "__name__", "") in ("scale", "zero_ablate", "clamp", "add_noise", "clip_norm", "keep_grad")
    if factory:
        raise UnsupportedInputError(
            f"{where}: bl.{fn.__name__} makes an edit; pass the edit it makes, bl.{fn.__name__}(...), not the "
            "function itself.", code="bad_edit",
            remedy=f"Call it: e.g. bl.{fn.__name__}({_FACTORY_EXAMPLES.get(fn.__name__, '')}).")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a readable signature: it is taken at its word
    try:
        signature.bind(object(), ctx=object())
    except TypeError:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise UnsupportedInputError(
            f"{where}: the edit {name}{signature} cannot be called as fn(value, ctx=...): an edit callable "
            "takes the tensor and a keyword argument ctx.",
            code="bad_edit",
            remedy="Define it as def edit(value, *, ctx): ... and return a tensor of the value's shape and dtype.",
        ) from None


_FACTORY_EXAMPLES = {"scale": "0.5", "zero_ablate": "", "clamp": "-1.0, 1.0", "add_noise": "0.1",
                     "clip_norm": "1.0", "keep_grad": "bl.zero_ablate()"}


def batcher(value: Any, where: str) -> None:
    """An object with the two methods of ``bl.Batcher``: ``size`` and ``combine``."""
    if not all(callable(getattr(value, method, None)) for method in ("size", "combine")):
        raise _bad(where, "batcher", "a Batcher (an object with size(*args, **kwargs) and combine(invokes))", value,
                   "Pass an object with both methods, or leave batcher out to concatenate along dim 0.")


def problem(check: Callable[..., Any], *args: Any, **kwargs: Any) -> UnsupportedInputError | None:
    """The error ``check(*args, **kwargs)`` raises, or None (for entry points that raise it later,
    from the ``with`` line)."""
    try:
        check(*args, **kwargs)
    except UnsupportedInputError as exc:
        return exc
    return None
