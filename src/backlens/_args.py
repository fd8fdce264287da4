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

from backlens.errors import UnsupportedInputError


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
