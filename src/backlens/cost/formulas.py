"""FLOP formulas: ``torch.utils.flop_counter``'s registry, plus the ops it misses.

Counts follow ``FlopCounterMode``'s conventions (2 x multiply-accumulates, only
matmul, convolution and attention carry FLOPs) so a backlens count can be
checked against it. The registry has no entry for the attention kernels CPU
``scaled_dot_product_attention`` dispatches to (nor the ``overrideable`` ones of
out-of-tree backends); :data:`EXTRA_FORMULAS` has them, in the registry's
shape-level form, and the first count registers them with torch's own
``register_flop_formula`` (where torch has none), so ``FlopCounterMode`` counts
exactly what backlens counts (on a torch without that registration, pass
``custom_mapping=EXTRA_FORMULAS``). The registry is reached through
``backlens._torch`` (``flop_registry``, ``flop_formula``).

:func:`plan_for` decides once per ATen overload what a counting mode does with
it: evaluate a formula, let a composite op with no kernel of its own decompose
(as ``FlopCounterMode`` does, so the matmuls inside are seen) or just run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backlens import _torch

__all__ = ["DECOMPOSE", "EXTRA_FORMULAS", "op_name", "plan_for"]

aten = torch.ops.aten
Tensor = torch.Tensor


def _bmm(a_shape: Any, b_shape: Any) -> int:
    """The registry's batched-matmul count on shapes (unwrapped where torch allows: its
    wrapper maps shapes with a pytree walk that costs more than the count)."""
    return _torch.flop_formula(aten.bmm)(a_shape, b_shape)


def sdpa_count(query_shape, key_shape, value_shape) -> int:
    """``torch.utils.flop_counter.sdpa_flop_count`` (same checks, same count) on unwrapped ``bmm``."""
    b, h_q, s_q, d_q = query_shape
    b_k, h_kv, s_k, d_k = key_shape
    b_v, h_v, s_v, d_v = value_shape
    if not (b == b_k == b_v and h_kv == h_v and d_q == d_k and s_k == s_v) or h_q < h_kv or h_q % h_kv:
        raise AssertionError(f"attention shapes no fused kernel takes: q={query_shape}, k={key_shape}, "
                             f"v={value_shape}")
    n = b * h_q
    return _bmm((n, s_q, d_q), (n, d_q, s_k)) + _bmm((n, s_q, s_k), (n, s_k, d_v))


def sdpa_backward_count(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """``torch.utils.flop_counter.sdpa_backward_flop_count`` (same checks, same count) on unwrapped ``bmm``."""
    b, h_q, s_q, d_q = query_shape
    b_k, h_kv, s_k, d_k = key_shape
    b_v, h_v, s_v, d_v = value_shape
    b_g, h_g, s_g, d_g = grad_out_shape
    if (not (b == b_k == b_v == b_g and h_kv == h_v and h_q == h_g) or h_q < h_kv or h_q % h_kv
            or not (d_q == d_k and d_v == d_g and s_k == s_v and s_q == s_g)):
        raise AssertionError(f"attention backward shapes no fused kernel takes: grad_out={grad_out_shape}, "
                             f"q={query_shape}, k={key_shape}, v={value_shape}")
    n = b * h_q
    return (
        _bmm((n, s_q, d_q), (n, d_q, s_k))    # recomputed scores
        + _bmm((n, s_q, d_v), (n, d_v, s_k))  # grad of the scores
        + _bmm((n, s_k, s_q), (n, s_q, d_v))  # grad of v
        + _bmm((n, s_q, s_k), (n, s_k, d_q))  # grad of q
        + _bmm((n, d_q, s_q), (n, s_q, s_k))  # grad of k
    )


def cpu_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Fused attention forward (CPU flash kernel): the registry's sdpa count."""
    return sdpa_count(query_shape, key_shape, value_shape)


def cpu_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                out_shape=None, **kwargs) -> int:
    """Fused attention backward (CPU flash kernel): the registry's sdpa backward count."""
    return sdpa_backward_count(grad_out_shape, query_shape, key_shape, value_shape)


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    wanted = {
        "_scaled_dot_product_flash_attention_for_cpu": cpu_attention_flop,
        "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_attention_backward_flop,
        "_scaled_dot_product_fused_attention_overrideable": cpu_attention_flop,
        "_scaled_dot_product_fused_attention_overrideable_backward": cpu_attention_backward_flop,
    }
    found = {}
    for name, formula in wanted.items():
        packet = getattr(aten, name, None)  # older torch builds lack some of these
        if packet is not None:
            found[packet] = formula
    return found


#: Shape-level formulas for ops ``flop_registry`` misses; pass to
#: ``FlopCounterMode(custom_mapping=EXTRA_FORMULAS)`` for a matching reference.
EXTRA_FORMULAS: dict[Any, Callable[..., int]] = _extra_formulas()
_extra_registered = False


def _register_extra_formulas() -> None:
    """Once, at the first count (never at import): torch's registry gets the formulas it lacks."""
    global _extra_registered
    if not _extra_registered:
        _extra_registered = True
        _torch.register_flop_formulas(EXTRA_FORMULAS)


def _extra_counter(packet: Any) -> Callable[[tuple, dict | None, Any], int] | None:
    """A counter for an op of :data:`EXTRA_FORMULAS` that the registry does not hold."""
    formula = EXTRA_FORMULAS.get(packet)
    if formula is None:
        return None

    def count(args: tuple, kwargs: dict | None, out: Any) -> int:
        shapes = [a.shape if isinstance(a, Tensor) else a for a in args]
        kwargs = {k: v.shape if isinstance(v, Tensor) else v for k, v in (kwargs or {}).items()}
        out_shape = out.shape if isinstance(out, Tensor) else (
            tuple(o.shape if isinstance(o, Tensor) else o for o in out) if isinstance(out, (tuple, list)) else out)
        return formula(*shapes, out_shape=out_shape, **kwargs)

    return count

#: Plan: let the op decompose under the counting mode (its inner calls are counted).
DECOMPOSE = object()

# Metadata queries FlopCounterMode never decomposes or counts.
_NEVER_DECOMPOSE = {
    getattr(getattr(aten, name, None), "default", None)
    for name in (
        "sym_is_contiguous", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense",
        "size", "sym_size", "stride", "sym_stride", "storage_offset", "sym_storage_offset",
        "numel", "sym_numel", "dim",
    )
} | {aten.is_contiguous.memory_format, torch.ops.prim.layout.default, torch.ops.prim.device.default}

_plans: dict[Any, Any] = {}
_registry_size = -1


def refresh_plans() -> dict[Any, Any]:
    """The plan cache, emptied when someone registered a new formula since last time.

    Called once per counted forward or backward, not per ATen call.
    """
    global _registry_size
    _register_extra_formulas()
    size = (len(_torch.flop_registry()), _torch.HAS_SHAPE_LEVEL_FLOP_FORMULAS)
    if size != _registry_size:
        _plans.clear()
        _registry_size = size
    return _plans


def plan_for(func: Any) -> Any:
    """What to do with one ATen overload: a counter, :data:`DECOMPOSE` or ``None``.

    Like ``FlopCounterMode``, an overload that has only a CompositeImplicitAutograd
    decomposition decomposes (its inner calls are counted); otherwise the
    packet's formula counts it; an overload with neither carries no FLOPs.
    Unlike ``FlopCounterMode``, an overload with a kernel of its own (e.g.
    ``silu_backward`` on CPU) is never decomposed: running the decomposition
    would change the user's numerics, and gradients must equal a stock run's.
    A counter is called as ``counter(args, kwargs, out) -> int``.
    """
    plan = _plans.get(func, _plans)
    if plan is not _plans:
        return plan
    packet = getattr(func, "overloadpacket", None)  # ATen overloads only; HOPs carry none
    if packet is None or func in _NEVER_DECOMPOSE:
        plan = None
    elif _torch.only_decomposes(func):
        plan = DECOMPOSE
    else:
        formula = _torch.flop_registry().get(packet)
        plan = _counter(formula) if formula is not None else _extra_counter(packet)
    _plans[func] = plan
    return plan


def _counter(formula: Callable[..., int]) -> Callable[[tuple, dict | None, Any], int]:
    """A caller of one registry formula that skips its pytree walk where it can.

    The registry wraps shape-level formulas in ``shape_wrapper``, which maps
    every tensor of args, kwargs and output to its shape with a pytree walk;
    for the flat arguments ATen passes here a list comprehension gives the
    same shapes at a fraction of the cost. Nested tensor lists and raw
    formulas (``get_raw``) take the registry's own path.
    """
    shape_level = _torch.shape_level_flop_formula(formula)
    if shape_level is None:
        def raw(args: tuple, kwargs: dict | None, out: Any) -> int:
            return formula(*args, **(kwargs or {}), out_val=out)

        return raw

    def count(args: tuple, kwargs: dict | None, out: Any) -> int:
        shapes = []
        for arg in args:
            if isinstance(arg, Tensor):
                shapes.append(arg.shape)
            elif isinstance(arg, (list, tuple)) and any(isinstance(item, Tensor) for item in arg):
                return formula(*args, **(kwargs or {}), out_val=out)
            else:
                shapes.append(arg)
        if kwargs:
            kwargs = {k: v.shape if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        else:
            kwargs = {}
        if isinstance(out, Tensor):
            out_shape = out.shape
        elif isinstance(out, (tuple, list)):
            out_shape = tuple(o.shape if isinstance(o, Tensor) else o for o in out)
        else:
            out_shape = out
        return shape_level(*shapes, out_shape=out_shape, **kwargs)

    return count


def op_name(func: Any) -> str:
    """``aten.mm`` for ``aten.mm.default``: the name reports use for an ATen call."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)
