"""Forward FLOPs of the commonest FLOP-bearing ops, straight from their shapes.

A meta replay (see :mod:`backlens.cost.forward_count`) is exact for any op but
costs from 50 µs to over a millisecond (``addmm`` and attention run Python
meta decompositions). For ``linear``, ``addmm``, ``mm``, ``bmm``, ``baddbmm``
and ``scaled_dot_product_attention`` the ATen kernel each runs is known, and
so is its count: the registry formula of that kernel, on the shapes it would
see (``linear`` folds leading dimensions into one matmul row count; attention
counts as ``sdpa_flop_count`` whichever fused or math kernel runs). Anything
unusual (shapes a formula rejects) raises, and the op is replayed instead.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import torch
import torch.nn.functional as F

from backlens import _torch
from backlens.cost.formulas import sdpa_count

aten = torch.ops.aten


# The registry's shape-level formulas (unwrapped where torch allows): the registered
# ``addmm`` and ``baddbmm`` call the *wrapped* ``mm``/``bmm``, whose pytree walk costs
# more than the count and leaves cyclic garbage per call. Looked up when counting,
# never at import; a torch without them raises here, and the op is replayed instead.
def _mm(a_shape: Any, b_shape: Any, out_shape: Any = None) -> int:
    return _torch.flop_formula(aten.mm)(a_shape, b_shape, out_shape=out_shape)


def _bmm(a_shape: Any, b_shape: Any, out_shape: Any = None) -> int:
    return _torch.flop_formula(aten.bmm)(a_shape, b_shape, out_shape=out_shape)


def _arg(args: tuple, kwargs: dict | None, position: int, name: str) -> Any:
    if len(args) > position:
        return args[position]
    if kwargs and name in kwargs:
        return kwargs[name]
    raise TypeError(f"missing argument {name}")


def _linear(args: tuple, kwargs: dict | None, out: Any) -> int:
    x, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    if weight.dim() != 2 or x.dim() == 0:
        raise ValueError("linear with an unusual weight or input")
    features = x.shape[-1]
    return _mm((prod(x.shape) // features if features else 0, features), (features, weight.shape[0]))


def _plus_product(formula: Callable[..., int], names: tuple[str, str, str]) -> Callable[[tuple, dict | None, Any], int]:
    """``addmm``/``baddbmm``: the count of the product of the last two arguments (as the registry's)."""
    def count(args: tuple, kwargs: dict | None, out: Any) -> int:
        return formula(_arg(args, kwargs, 1, names[1]).shape, _arg(args, kwargs, 2, names[2]).shape)

    return count


def _two(formula: Callable[..., int]) -> Callable[[tuple, dict | None, Any], int]:
    def count(args: tuple, kwargs: dict | None, out: Any) -> int:
        first = _arg(args, kwargs, 0, "input")
        second = _arg(args, kwargs, 1, "mat2")
        return formula(first.shape, second.shape, out_shape=out.shape)

    return count


def _attention(args: tuple, kwargs: dict | None, out: Any) -> int:
    query, key, value = (_arg(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if all(len(s) == 3 for s in shapes):
        shapes = [(1, *s) for s in shapes]
    if any(len(s) != 4 for s in shapes):
        raise ValueError("attention with other than 3 or 4 dimensions")
    return sdpa_count(*shapes)  # raises for shapes no fused kernel takes: replayed instead


#: torch-level function -> ``count(args, kwargs, out) -> int`` (raises when unsure).
SHAPE_COUNTS: dict[Any, Callable[[tuple, dict | None, Any], int]] = {
    F.linear: _linear,
    torch.addmm: _plus_product(_mm, ("input", "mat1", "mat2")),
    torch.Tensor.addmm: _plus_product(_mm, ("input", "mat1", "mat2")),
    torch.baddbmm: _plus_product(_bmm, ("input", "batch1", "batch2")),
    torch.Tensor.baddbmm: _plus_product(_bmm, ("input", "batch1", "batch2")),
    torch.mm: _two(_mm),
    torch.Tensor.mm: _two(_mm),
    torch.bmm: _two(_bmm),
    torch.Tensor.bmm: _two(_bmm),
    F.scaled_dot_product_attention: _attention,
}
