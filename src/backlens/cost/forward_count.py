"""Forward FLOPs per recorded op, by replaying FLOP-bearing ops on meta tensors.

Why not a dispatch mode during the forward: while any ``TorchDispatchMode`` is
active, ATen treats every tensor as subclass-like and takes other paths
(``reshape`` makes a ``ViewBackward0`` where it would make a
``ReshapeAliasBackward0``), so the user's graph would change. Instead, for a
capture made with ``flops=True``, :class:`FlopForwardRecorder` (the forward
recorder plus one check per op) counts the commonest FLOP-bearing ops from
their shapes on the spot (:mod:`backlens.cost.forward_shapes`) and notes every
other op that may carry FLOPs: its function and its arguments with every
tensor reduced to shape, strides and dtype. :func:`replay`, when the forward
FLOPs are first read, runs each noted op again on meta tensors under a
counting dispatch mode: the same formulas, the same ATen decompositions, no
data, no effect on the real tensors, the graph or the random state. Ops on the
:data:`ZERO_FLOP` list (views, elementwise math, normalisation, indexing,
creation, property reads) are never noted: none of them reaches a matmul,
convolution or attention kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from backlens import _torch
from backlens.capture.forward import ForwardRecorder
from backlens.cost.counting import CountingMode
from backlens.cost.formulas import op_name
from backlens.cost.forward_shapes import SHAPE_COUNTS

# torch-level functions whose ATen work never includes a FLOP-carrying kernel.
_ZERO_FLOP_NAMES = """
abs abs_ absolute acos acosh add add_ addcdiv addcmul all amax amin aminmax angle any arange argmax argmin
argsort argwhere as_strided as_tensor asin asinh atan atan2 atanh bernoulli bernoulli_ bfloat16 bincount
bitwise_and bitwise_not bitwise_or bitwise_xor bool broadcast_tensors broadcast_to bucketize byte cat ceil
ceil_ char chunk clamp clamp_ clamp_max clamp_min clip clip_ clone concat concatenate contiguous copy_ cos
cosh count_nonzero cpu cuda cummax cummin cumprod cumsum data_ptr deg2rad detach detach_ diag diag_embed
diagonal diff dim div div_ divide double dropout dropout_ dsplit dstack element_size embedding empty
empty_like eq eq_ equal erf erfc erfinv exp exp2 exp_ expand expand_as expm1 exponential_ eye fill_ fill_diagonal_
fix flatten flip fliplr flipud float float_power floor floor_ floor_divide fmax fmin fmod frac full full_like
gather gcd ge gelu glu greater greater_equal gt half hardshrink histc histogram hardsigmoid hardswish hardtanh heaviside
hsplit hstack hypot index_add index_add_ index_copy index_copy_ index_fill index_fill_ index_put index_put_
index_select int is_complex is_contiguous is_floating_point is_nonzero isclose isfinite isin isinf isnan
isneginf isposinf isreal item kthvalue layer_norm lcm ldexp le leaky_relu lerp less less_equal lgamma
linspace log log10 log1p log2 log_softmax logaddexp logaddexp2 logcumsumexp logical_and logical_not
logical_or logical_xor logit logspace logsumexp long lt masked_fill masked_fill_ masked_scatter
masked_scatter_ masked_select max maximum mean median min minimum mish mode moveaxis movedim msort mul mul_
multiply nan_to_num nanmean nanmedian nanquantile nansum narrow narrow_copy ne neg neg_ negative new_empty
new_full new_ones new_tensor new_zeros nextafter nonzero norm normal_ not_equal numel one_hot ones ones_like
permute polar pow pow_ prod quantile rad2deg rand rand_like randint randint_like randn randn_like random_
randperm ravel real reciprocal reciprocal_ relu relu6 relu_ remainder renorm repeat repeat_interleave
requires_grad_ reshape reshape_as resize_ resize_as_ roll rot90 round rsqrt rsqrt_ scatter scatter_
scatter_add scatter_add_ scatter_reduce searchsorted select select_scatter selu sgn short sigmoid sigmoid_
sign signbit silu sin sinc sinh size slice_scatter softmax softmin softplus softshrink sort split
split_with_sizes sqrt sqrt_ square square_ squeeze squeeze_ stack std std_mean stride sub sub_ subtract sum
swapaxes swapdims t t_ take take_along_dim tan tanh tanh_ tensor tensor_split threshold
tile to tolist topk transpose transpose_ tril tril_ triu triu_ true_divide trunc type type_as unbind unflatten
uniform_ unique unique_consecutive unsqueeze unsqueeze_ values var var_mean view view_as
vsplit vstack where xlogy zero_ zeros zeros_like
batch_norm group_norm instance_norm layer_norm local_response_norm rms_norm normalize pad embedding
dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout celu elu gelu logsigmoid prelu rrelu
silu tanhshrink threshold adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
adaptive_max_pool2d adaptive_max_pool3d avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d
pixel_shuffle pixel_unshuffle cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss
binary_cross_entropy binary_cross_entropy_with_logits kl_div cosine_similarity pairwise_distance
__getitem__ __setitem__ __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
__truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__ __ifloordiv__
__mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __invert__ __and__ __rand__
__iand__ __or__ __ror__ __ior__ __xor__ __rxor__ __ixor__ __lshift__ __rshift__ __eq__ __ne__ __lt__ __le__
__gt__ __ge__ __len__ __iter__ __bool__ __float__ __int__ __index__ __contains__ __format__ __repr__
__hash__ __reversed__ __array__ __deepcopy__ __reduce_ex__
""".split()


def _zero_flop_functions() -> frozenset[Any]:
    found = set()
    for owner in (torch, torch.Tensor, F):
        for name in _ZERO_FLOP_NAMES:
            value = getattr(owner, name, None)
            if value is not None and callable(value):
                try:
                    found.add(value)
                except TypeError:  # unhashable: never seen as a function here anyway
                    pass
    return frozenset(found)


#: Functions a FLOP count never needs to replay (see the module docstring).
ZERO_FLOP = _zero_flop_functions()
_ACCESSORS = ("__get__", "__set__")  # property reads and writes: .shape, .T, .data


@dataclass(frozen=True)
class TensorSpec:
    """What a replay needs of a tensor argument: no data, no reference to it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        try:
            return TensorSpec(tuple(value.shape), value.stride(), value.dtype)
        except RuntimeError:  # sparse and other layouts without strides
            return TensorSpec(tuple(value.shape), (), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(item) for item in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {key: _spec(item) for key, item in value.items()}
    return value


# Argument types a replay may pass on as they are: none can hold a real tensor.
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, type(Ellipsis))


def _replayable(value: Any) -> bool:
    """Whether a noted argument holds only specs and plain values (so a replay
    can neither read nor write a real tensor, generator or user object)."""
    if isinstance(value, (TensorSpec, *_PLAIN)):
        return True
    if type(value) in (list, tuple):
        return all(_replayable(item) for item in value)
    if isinstance(value, dict):
        return all(_replayable(item) for item in value.values())
    return False


def _meta(value: Any) -> Any:
    if isinstance(value, TensorSpec):
        if value.stride:
            return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if type(value) in (list, tuple):
        return type(value)(_meta(item) for item in value)
    if isinstance(value, dict):
        return {key: _meta(item) for key, item in value.items()}
    return value


class FlopForwardRecorder(ForwardRecorder):
    """The forward recorder, also counting or noting each op that may carry FLOPs.

    ``counted``: op index -> FLOPs, for ops counted from their shapes on the
    spot (:data:`SHAPE_COUNTS`). ``noted``: ``(op index, func, args spec,
    kwargs spec)`` of the others, for :func:`replay`. Only calls that became a
    journal row are kept.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.counted: dict[int, int] = {}
        self.noted: list[tuple[int, Any, Any, Any]] = []

    def observe_row(self, index: int, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:  # type: ignore[override]
        """Count the row's FLOPs from its shapes, or note it for a replay."""
        # After the call: an in-place op keeps its arguments' shapes, strides and dtypes.
        try:
            if func in ZERO_FLOP or getattr(func, "__name__", None) in _ACCESSORS:
                return
            shape_count = SHAPE_COUNTS.get(func)
        except TypeError:  # an unhashable callable: note it like any other op
            shape_count = None
        if shape_count is not None:
            try:
                self.counted[index] = shape_count(args, kwargs, out)
                return
            except Exception:  # noqa: BLE001 - shapes the formula does not cover: replay instead
                pass
        self.noted.append((index, func, _spec(args), _spec(kwargs) if kwargs else None))

    def forward_cost(self) -> Callable[[], dict[str, Any]]:
        """What computes the forward cost dict when it is first read."""
        return partial(replay, self.noted, len(self.journal.raw_ops), self.counted)


class _MetaCounter(CountingMode):
    """Sums registry FLOPs of the ATen calls made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def seen(self, func: Any, counter: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        if counter is not None:
            self.flops += counter(args, kwargs, out)


def replay(noted: list[tuple[int, Any, Any, Any]], num_ops: int,
           counted: dict[int, int] | None = None) -> dict[str, Any]:
    """Plain data: FLOPs per op (``None`` where the replay failed) and the failures.

    ``counted`` holds the ops already counted from their shapes.
    """
    op_flops: list[int | None] = [0] * num_ops
    for index, flops in (counted or {}).items():
        op_flops[index] = flops
    failures: list[dict[str, Any]] = []
    with torch.no_grad():
        for index, func, args, kwargs in noted:
            counter = _MetaCounter()
            try:
                if not (_replayable(args) and _replayable(kwargs)):
                    raise TypeError("an argument other than tensors and plain values cannot be replayed safely")
                if not _torch.HAS_FLOP_REGISTRY:
                    raise RuntimeError("this torch has no FLOP formula registry (bl.doctor(): HAS_FLOP_REGISTRY)")
                with _torch.dispatch_mode(counter):
                    func(*_meta(args), **(_meta(kwargs) or {}))
            except Exception as exc:  # noqa: BLE001 - data-dependent or device-bound ops cannot replay
                op_flops[index] = None
                failures.append(_failure(index, func, exc))
                continue
            op_flops[index] = counter.flops
    return {"op_flops": op_flops, "replay_failures": failures}


def _failure(index: int, func: Any, exc: Exception) -> dict[str, Any]:
    name = op_name(func) if hasattr(func, "overloadpacket") else getattr(func, "__name__", str(func))
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return {"op_index": index, "func": name, "error": f"{type(exc).__name__}: {first_line}"}
