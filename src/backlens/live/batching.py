"""Combining several invokes' inputs into one batch.

``bl.wrap(model, batcher=...)`` takes any object with the two methods of
:class:`Batcher`. The default, :class:`ConcatBatcher`, concatenates tensors
(also inside dicts, lists and tuples, such as a tokenizer's output) along
dim 0 and passes equal non-tensor arguments through once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from backlens._nested import first_tensor
from backlens.errors import UnsupportedInputError

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@runtime_checkable
class Batcher(Protocol):
    """How a lens turns its invokes' inputs into one forward call.

    ``size(*args, **kwargs)`` is the number of batch rows one invoke's inputs
    hold; ``combine(invokes)`` takes each invoke's ``(args, kwargs)`` in order
    and returns the ``(args, kwargs)`` of the single batched call, whose
    rows must be the invokes' rows one after another along dim 0.
    """

    def size(self, *args: Any, **kwargs: Any) -> int: ...

    def combine(self, invokes: Sequence[Inputs]) -> Inputs: ...


class ConcatBatcher:
    """The default batcher: ``torch.cat`` along dim 0, recursively."""

    def size(self, *args: Any, **kwargs: Any) -> int:
        tensor = first_tensor((args, kwargs))
        if tensor is None or tensor.dim() == 0:
            raise UnsupportedInputError(
                "an invoke's inputs hold no tensor with a batch dimension, so the default "
                "batcher cannot tell how many rows they are.",
                code="unbatchable_input",
                remedy="Pass tensors whose first dimension is the batch, or give bl.wrap a batcher.",
            )
        return int(tensor.shape[0])

    def combine(self, invokes: Sequence[Inputs]) -> Inputs:
        if len(invokes) == 1:
            return invokes[0]
        args = _combine([list(inv[0]) for inv in invokes], "positional inputs")
        kwargs = _combine([dict(inv[1]) for inv in invokes], "keyword inputs")
        return tuple(args), kwargs


def _combine(values: list[Any], where: str) -> Any:
    first = values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        shapes = [tuple(v.shape) for v in values]
        if any(len(s) == 0 for s in shapes) or any(s[1:] != shapes[0][1:] for s in shapes):
            raise _cannot(
                where,
                "tensors whose shapes differ after the first dimension: "
                + ", ".join(f"invoke {i}: {list(s)}" for i, s in enumerate(shapes)),
                "Pad every invoke's inputs to the same length (e.g. tokenizer padding) or pass a custom batcher.",
            )
        return torch.cat(values, dim=0)
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        keys = [set(v) for v in values]
        if any(k != keys[0] for k in keys):
            raise _cannot(
                where,
                "dicts with different keys: " + ", ".join(f"invoke {i}: {sorted(map(str, k))}" for i, k in enumerate(keys)),
                "Give every invoke the same arguments.",
            )
        combined = {key: _combine([v[key] for v in values], f"{where}[{key!r}]") for key in first}
        try:
            return type(first)(combined)
        except TypeError:
            return combined
    if isinstance(first, (list, tuple)) and all(isinstance(v, (list, tuple)) for v in values):
        if any(len(v) != len(first) for v in values):
            raise _cannot(
                where,
                "argument lists of different lengths: " + ", ".join(f"invoke {i}: {len(v)}" for i, v in enumerate(values)),
                "Give every invoke the same arguments.",
            )
        items = [_combine([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    if all(_equal(v, first) for v in values[1:]):
        return first
    raise _cannot(
        where,
        "values that are neither tensors nor equal: " + ", ".join(f"invoke {i}: {type(v).__name__}" for i, v in enumerate(values)),
        "Pass tensors (they are concatenated) or the same value to every invoke, or pass a custom batcher.",
    )


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _cannot(where: str, what: str, remedy: str) -> UnsupportedInputError:
    return UnsupportedInputError(
        f"the default batcher cannot combine the invokes' {where} into one batch: they are {what}.",
        code="uncombinable_inputs",
        remedy=remedy,
    )
