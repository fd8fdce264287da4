"""Tensors inside nested inputs and outputs: tuples, lists, dicts and ModelOutputs.

One reading order for all of backlens: depth first, in order (a mapping in the
order of its items). The *first tensor* of a module output is the first in
that order, ``a`` in ``((a,), b)`` and in ``{"x": a, "y": b}``: its gradient is
the call's ``output_grad``, ``bl.validate`` compares it with a stock run, and a
module-site edit replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor


def _items(value: Any) -> list[tuple[Any, Any]]:
    """``(key, item)`` pairs of a container (none for anything else)."""
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keys"):
        try:
            return list(value.items())
        except Exception:  # noqa: BLE001 - objects with a broken items() are not containers
            return []
    return []


def iter_named_tensors(value: Any, path: str = "") -> Iterator[tuple[str, Tensor]]:
    """``(path, tensor)`` for every tensor inside a nested structure, in reading order."""
    if isinstance(value, Tensor):
        yield path, value
        return
    for key, item in _items(value):
        yield from iter_named_tensors(item, f"{path}[{key!r}]")


def iter_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor inside a nested structure, in reading order."""
    for _path, tensor in iter_named_tensors(value):
        yield tensor


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor inside ``value`` in reading order (runs per module call: no paths built)."""
    if isinstance(value, Tensor):
        return value
    for _key, item in _items(value):
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def replace_first_tensor(value: Any, replace: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with its first tensor replaced by ``replace(tensor)``.

    Tuples and lists on the way are rebuilt (a named tuple as its own type);
    mappings are changed in place, as a module's own code would.
    """
    if isinstance(value, Tensor):
        return replace(value)
    for key, item in _items(value):
        if first_tensor(item) is None:
            continue
        new = replace_first_tensor(item, replace)
        if isinstance(value, (list, tuple)):
            items = [*value[:key], new, *value[key + 1:]]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        value[key] = new
        return value
    return value
