"""An invoke's rows of a batched value, and writing them back.

All invokes run as one batch, so every hooked value (a module's output or
inputs, a gradient) holds every invoke's rows along dim 0. :func:`take` cuts
one invoke's rows out of a (possibly nested) value; :func:`put` writes an
invoke's replacement rows back into the full value out of place
(``torch.slice_scatter``), so the other invokes' rows, and the autograd graph
through them, are untouched.

A tensor counts as batched when its first dimension equals the batch size;
everything else (masks without a batch dim, ``None``, caches) passes through
as is. An invoke that holds the whole batch gets the value itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from backlens.errors import TraceError

Rows = tuple[int, int]


def _is_batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def take(
    value: Any,
    rows: Rows | None,
    batch: int,
    on_tensor: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> Any:
    """``value`` with every batched tensor cut to ``rows`` (``None``: the whole value).

    ``on_tensor(view, full)`` is called for every tensor handed out, so the
    caller can remember where a view came from (to serve its ``.grad``).
    (A plain recursive function: a closure calling itself would be a
    reference cycle holding the model's activations until a collection.)
    """
    if rows is None:  # the whole batch: the value itself, its tensors remembered
        if on_tensor is not None:
            _each_tensor(value, on_tensor)
        return value
    if isinstance(value, torch.Tensor):
        if not _is_batched(value, batch):
            if on_tensor is not None:
                on_tensor(value, value)
            return value
        view = value[rows[0] : rows[1]]
        if on_tensor is not None:
            on_tensor(view, value)
        return view
    if isinstance(value, (tuple, list)):
        return _rebuild_sequence(value, [take(v, rows, batch, on_tensor) for v in value])
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: take(v, rows, batch, on_tensor) for k, v in value.items()})
    return value


def _each_tensor(value: Any, on_tensor: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    if isinstance(value, torch.Tensor):
        on_tensor(value, value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _each_tensor(item, on_tensor)
    elif isinstance(value, Mapping):
        for item in value.values():
            _each_tensor(item, on_tensor)


def put(full: Any, part: Any, rows: Rows | None, batch: int, site: str) -> Any:
    """``full`` with ``rows`` replaced by ``part`` (``None`` rows: ``part`` itself)."""
    if rows is None:
        return part
    if isinstance(full, torch.Tensor):
        if not _is_batched(full, batch):
            if part is full:
                return full
            if isinstance(part, torch.Tensor) and part.shape == full.shape:
                # Not batched (no per-invoke rows): the replacement applies to all.
                return part
            raise _mismatch(site, full, part, rows)
        if not isinstance(part, torch.Tensor):
            raise _mismatch(site, full, part, rows)
        expected = (rows[1] - rows[0], *full.shape[1:])
        if tuple(part.shape) != expected:
            raise _mismatch(site, full, part, rows)
        if part.dtype != full.dtype or part.device != full.device:
            part = part.to(dtype=full.dtype, device=full.device)
        return torch.slice_scatter(full, part, dim=0, start=rows[0], end=rows[1])
    if isinstance(full, (tuple, list)) and isinstance(part, (tuple, list)) and len(full) == len(part):
        items = [put(f, p, rows, batch, f"{site}[{i}]") for i, (f, p) in enumerate(zip(full, part))]
        return _rebuild_sequence(full, items)
    if isinstance(full, Mapping) and isinstance(part, Mapping) and set(full) == set(part):
        items = {k: put(full[k], part[k], rows, batch, f"{site}[{k!r}]") for k in full}
        return _rebuild_mapping(full, items)
    if part is full or _same_plain(part, full):
        return full
    raise _mismatch(site, full, part, rows)


def put_gradient(full: torch.Tensor, part: Any, rows: Rows | None, batch: int, site: str) -> torch.Tensor:
    """A gradient with ``rows`` replaced by ``part``; the whole of it when ``rows`` is None.

    The autograd engine only takes a replacement of the gradient's own shape,
    so a whole replacement is checked here, where the user set it.
    """
    if rows is not None:
        return put(full, part, rows, batch, site)
    if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(full.shape):
        what = f"a tensor of shape {list(part.shape)}" if isinstance(part, torch.Tensor) else f"a {type(part).__name__}"
        raise TraceError(
            f"the value set for {site} is {what}, but the gradient is a tensor of shape "
            f"{list(full.shape)}; a gradient can only be replaced with a tensor of its own shape.",
            code="replacement_mismatch",
            remedy="Build the replacement from the gradient you read (for example h.grad * 2), so it keeps its shape.",
        )
    if part.dtype != full.dtype or part.device != full.device:
        part = part.to(dtype=full.dtype, device=full.device)
    return part


def _same_plain(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _mismatch(site: str, full: Any, part: Any, rows: Rows) -> TraceError:
    def describe(v: Any, cut: bool) -> str:
        if isinstance(v, torch.Tensor):
            shape = list(v.shape)
            if cut and shape:
                shape[0] = rows[1] - rows[0]
            return f"a tensor of shape {shape}"
        return f"a {type(v).__name__}"

    return TraceError(
        f"the value set for {site} is {describe(part, False)}, but this invoke's rows "
        f"{rows[0]}..{rows[1] - 1} of it are {describe(full, True)}; an invoke can only replace "
        "its own rows with a value of the same shape and structure.",
        code="replacement_mismatch",
        remedy="Build the replacement from the value you read (for example h * 0), so it keeps its shape.",
    )


def _rebuild_sequence(like: Any, items: list[Any]) -> Any:
    if isinstance(like, list):
        return items
    if hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    try:
        return type(like)(items)
    except TypeError:
        return tuple(items)


def _rebuild_mapping(like: Any, items: dict[Any, Any]) -> Any:
    cls = type(like)
    if cls is dict:
        return items
    # transformers' ModelOutput is a dataclass and an OrderedDict: keyword
    # construction keeps its type, so `.last_hidden_state` still works.
    try:
        return cls(**items)
    except TypeError:
        pass
    try:
        return cls(items)
    except TypeError:
        return dict(items)
