"""The device work of one recorded step: per-parameter statistics computed where the tensors are,
read back once.

Kernels, measured on the 4-layer GPT-2 of bench/ (52 gradients, 13.6 MB,
one CPU thread, as the optimizer gets them after a backward): on CPU, per
tensor in turn its L2 norm, ``amax`` and ``amin`` (max |g| is the larger of
``amax`` and ``-amin``) 1.0 ms: the norm fetches the tensor from memory and
the two others find it in cache. A multi-tensor norm runs the same
per-tensor kernel on CPU with more overhead, and every later pass then
fetches every gradient from memory again; ``aminmax`` costs more than
``amax`` and ``amin`` together once the tensor is in cache; the multi-tensor
inf-norm costs 9 ms. Other devices take one multi-tensor norm call (one
launch instead of one per tensor; not measured here). Non-finite values are
counted (5 ms for all gradients) only for the gradients whose max |g| (or
norm) is not finite, in a second pass on that step alone. The update ratio
copies each parameter and takes the copy's norm while it is in cache, then
subtracts the parameter after the step and takes that norm, tensor by tensor
on CPU (2.4 ms for GPT-2, against 2.7 ms as multi-tensor calls and 6.3 ms
taking both norms after the step).

A CPU tensor's results are read as Python floats as they are made: the
memory is the host's, there is nothing to transfer or wait for, and it costs
less than stacking them into one tensor (0.06 ms against 0.2 ms for GPT-2's
156). Other devices' results are stacked into one vector per dtype and read
back with one ``.cpu()`` per device; nothing syncs per tensor. Under FSDP2
the vector holds this rank's sums of squares over its shards, and one
all-reduce of a (world x statistics) matrix, each rank writing its own row,
lets every rank add up the shards (and take the largest |g|) exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from backlens import _torch
from backlens.monitoring.layout import Layout

# What a sharded statistic becomes across ranks: summed (a sum of squares, a count) or the largest.
SUMMED = frozenset({"norm", "wnorm", "dnorm", "count"})
SQUARED = frozenset({"norm", "wnorm", "dnorm"})
# This rank's own values, never combined across ranks (and never in the all-reduce, whose
# columns must line up on every rank): output gradients, a GradScaler's scale and verdict.
LOCAL = frozenset({"fires", "scale", "found_inf"})
# Dtypes numpy reads as they are (float64 on the host holds each exactly).
NUMPY_DTYPES = frozenset({torch.float32, torch.float64})
# Dtypes whose norms accumulate in their own precision (others in float32).
OWN_ACCUMULATION = NUMPY_DTYPES
# Below this a norm's square is finite in float64 (module roll-ups add squares).
SQUARE_SAFE = 1e150

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Host(list):
    """Values already on the host: Python floats read from CPU tensors as they were made."""


# A statistic's values: on the host, or on a device as a 1-D tensor or 0-d tensors of one dtype
# (stacked at the read-back).
Values = Host | torch.Tensor | list
# Where a statistic's values go: positions among the parameters (or among a key's own ``size``);
# None: every parameter, in order.
Indices = list[int] | np.ndarray | None


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The values this process holds: a DTensor's local shard, a sparse tensor's values (called
    under ``torch.no_grad()``, so nothing here is recorded by autograd)."""
    if type(tensor) in _PLAIN and not tensor.is_sparse:  # the usual case, asked cheaply
        return tensor
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:
        tensor = to_local()
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    return tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _larger(top: float, bottom: float) -> float:
    """The larger of two floats; NaN when either is NaN (both comparisons are false)."""
    return top if top >= bottom else bottom if bottom > top else math.nan


def _groups(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Positions in ``tensors`` grouped by device and dtype (multi-tensor kernels take one of each)."""
    groups: dict[tuple, list[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    return groups


def _pick(indices: Indices, positions: list[int]) -> list[int]:
    """``indices`` at ``positions`` (None: every parameter, so the positions themselves)."""
    if indices is None:
        return positions
    return [int(indices[p]) for p in positions]


def _device_and_dtype(values: torch.Tensor | list) -> tuple[torch.device, torch.dtype]:
    first = values[0] if isinstance(values, list) else values
    return first.device, first.dtype


def _vector(parts: list[torch.Tensor | list]) -> torch.Tensor:
    """One 1-D tensor of ``parts`` in order (one dtype and device): runs of 0-d tensors stacked
    together."""
    pieces, scalars = [], []
    for part in parts:
        if isinstance(part, list):
            scalars.extend(part)
            continue
        if scalars:
            pieces.append(torch.stack(scalars))
            scalars = []
        pieces.append(part)
    if scalars:
        pieces.append(torch.stack(scalars))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class StepWork:
    """The statistics of one step, until :meth:`read`.

    ``put(key, indices, values)`` files values whose i-th belongs to parameter
    ``indices[i]`` (or, with ``size``, to position ``indices[i]`` of a key of its
    own length; ``indices`` None: every parameter in order): :class:`Host`
    floats, or a device's 1-D tensor or list of 0-d tensors of one dtype.
    :meth:`read` returns, per key, a float64 array over all parameters (NaN
    where nothing was filed). ``present``: the parameters that had a gradient;
    ``copied``: those whose update is measured.
    """

    def __init__(self, layout: Layout, rank: int, world: int):
        self.layout = layout
        self.rank, self.world = rank, world
        self.slots: list[tuple[str, Indices, Values]] = []
        self.sizes: dict[str, int] = {}
        self.present: list[int] = []
        self.copied: list[int] = []
        # Every gradient's norm and max |g| seen finite (their squares too) as they were read on
        # the host; False where not known so (another device's values are looked at after).
        self.finite = True

    def put(self, key: str, indices: Indices, values: Values, size: int | None = None) -> None:
        if not len(values):
            return
        self.slots.append((key, indices, values))
        self.sizes.setdefault(key, size if size is not None else len(self.layout.params))

    def _put_norms(self, key: str, indices: Indices, norms: Host | list[torch.Tensor]) -> None:
        """File norms, as their squares (in float64) under sharding, to be summed across ranks."""
        if self.layout.mesh_group is None:
            self.put(key, indices, norms)
        elif isinstance(norms, Host):
            self.put(key, indices, Host(norm * norm for norm in norms))
        else:
            self.put(key, indices, torch.stack(norms).to(torch.float64).square())

    # -- kernels -----------------------------------------------------------------
    def grad_stats(self, indices: Indices, grads: list[torch.Tensor], norm: bool, absmax: bool) -> None:
        """The L2 norm and max |g| of each gradient (max |g| exact in its dtype, 0 when empty): of
        the values this process holds (:func:`local`)."""
        tensors = [local(g) for g in grads]
        on_cpu = [t.is_cpu for t in tensors]
        if all(on_cpu):
            self._grad_stats_on_cpu(indices, tensors, norm, absmax)
            return
        cpu = [i for i, here in enumerate(on_cpu) if here]
        if cpu:
            self._grad_stats_on_cpu(_pick(indices, cpu), [tensors[i] for i in cpu], norm, absmax)
        self.finite = False
        elsewhere = [i for i, here in enumerate(on_cpu) if not here]
        indices, tensors = _pick(indices, elsewhere), [tensors[i] for i in elsewhere]
        for (_device, dtype), positions in _groups(tensors).items():
            group = [tensors[p] for p in positions]
            where = _pick(indices, positions)
            if norm:
                self._put_norms("norm", where, _torch.foreach_norm(group, _accumulation_dtype(dtype)))
            if not absmax:
                continue
            filled = [i for i, t in enumerate(group) if t.numel()]
            if filled:
                ends = torch.stack([group[i].amax() for i in filled] + [group[i].amin() for i in filled])
                count = len(filled)
                self.put("absmax", _pick(where, filled), torch.maximum(ends[:count], ends[count:].neg()))
            if len(filled) < len(group):
                empty = [i for i, t in enumerate(group) if not t.numel()]
                self.put("absmax", _pick(where, empty), Host([0.0] * len(empty)))

    def _grad_stats_on_cpu(self, indices: Indices, tensors: list[torch.Tensor], norm: bool, absmax: bool) -> None:
        """One tensor at a time, each fetched from memory once (its norm) and found in cache by
        ``amax`` and ``amin``; each result read as a Python float, its finiteness noted on the
        way (:attr:`finite`). Small tensors too: taking them together (one multi-tensor norm,
        ``amax``/``amin`` over the rows of a stack) calls fewer kernels but more different ones,
        and right after a backward each kernel's code comes from memory the first time, so it
        measured slower (1.23 ms against 1.10 ms for GPT-2)."""
        norms, largest = Host(), Host()
        finite = True
        vector_norm = torch.linalg.vector_norm
        for tensor in tensors:
            if norm:
                if tensor.dtype in OWN_ACCUMULATION:
                    value = float(vector_norm(tensor))
                else:
                    value = float(vector_norm(tensor, dtype=torch.float32))
                norms.append(value)
                finite = finite and value < SQUARE_SAFE  # False for NaN too
            if absmax:
                value = _larger(float(tensor.amax()), -float(tensor.amin())) if tensor.numel() else 0.0
                largest.append(value)
                finite = finite and value < math.inf
        if norm:
            self._put_norms("norm", indices, norms)
        if absmax:
            self.put("absmax", indices, largest)
        self.finite = self.finite and finite

    def counts(self, indices: Indices, tensors: list[torch.Tensor]) -> None:
        """How many values of each tensor are NaN or infinite."""
        for (_device, _dtype), positions in _groups(tensors).items():
            found = [torch.isfinite(tensors[p]).logical_not().sum() for p in positions]
            self.put("count", _pick(indices, positions), torch.stack(found).to(torch.float64))

    # -- read back ---------------------------------------------------------------
    def read(self) -> dict[str, np.ndarray]:
        """Every filed statistic per parameter: one ``.cpu()`` per device (one all-reduce
        before it under sharding)."""
        out: dict[str, np.ndarray] = {}
        sharded = self.layout.mesh_group is not None
        by_device: dict[torch.device, list[tuple[str, Indices, Values]]] = {}
        for slot in self.slots:
            key, indices, values = slot
            if isinstance(values, Host):
                if sharded and key not in LOCAL:
                    by_device.setdefault(torch.device("cpu"), []).append(slot)
                elif indices is None and key not in out:  # the usual case: one array as it is
                    out[key] = np.array(values)
                else:
                    _array(out, key, self.sizes[key])[_where(indices)] = values
                continue
            by_device.setdefault(_device_and_dtype(values)[0], []).append(slot)
        for device, slots in by_device.items():
            local_slots = [slot for slot in slots if not sharded or slot[0] in LOCAL]
            if local_slots:
                self._read_local(out, device, local_slots)  # type: ignore[arg-type]
            if len(local_slots) < len(slots):
                self._read_sharded(out, device, [slot for slot in slots if slot[0] not in LOCAL])
        return out

    def _read_local(self, out: dict[str, np.ndarray], device: torch.device,
                    slots: list[tuple[str, Indices, torch.Tensor | list]]) -> None:
        """Values on one device into ``out``: one vector per dtype, one transfer for them all."""
        by_dtype: dict[torch.dtype, list[tuple[str, Indices, torch.Tensor | list]]] = {}
        for slot in slots:
            by_dtype.setdefault(_device_and_dtype(slot[2])[1], []).append(slot)
        vectors = [_vector([values for _k, _i, values in group]) for group in by_dtype.values()]
        if device.type == "cpu":  # nothing to transfer: numpy reads float32 and float64 as they are
            arrays = [(v if v.dtype in NUMPY_DTYPES else v.to(torch.float64)).numpy() for v in vectors]
        else:
            together = torch.cat([v.to(torch.float64) for v in vectors]) if len(vectors) > 1 else vectors[0]
            host = together.to(torch.float64).cpu().numpy()
            arrays = np.split(host, np.cumsum([len(v) for v in vectors])[:-1])
        for group, values in zip(by_dtype.values(), arrays):
            start = 0
            for key, indices, part in group:
                count = len(part)
                _array(out, key, self.sizes[key])[_where(indices)] = values[start:start + count]
                start += count

    def _read_sharded(self, out: dict[str, np.ndarray], device: torch.device,
                      slots: list[tuple[str, Indices, Values]]) -> None:
        import torch.distributed as dist

        vector = torch.cat([_device_vector(values, device) for _k, _i, values in slots])
        matrix = torch.zeros(self.world, vector.numel(), dtype=torch.float64, device=device)
        matrix[self.rank] = vector
        dist.all_reduce(matrix, group=self.layout.mesh_group)
        rows = matrix.cpu().numpy()
        sharded = self.layout.sharded
        start = 0
        for key, indices, values in slots:
            where = _where(indices) if indices is not None else np.arange(len(values))
            block = rows[:, start:start + len(values)]
            start += len(values)
            # A shard's sums add up across ranks (max |g| is the largest); a replicated
            # parameter's values are the same everywhere, and rank 0's are taken.
            across = block.sum(axis=0) if key in SUMMED else block.max(axis=0)
            value = np.where(sharded[where], across, block[0])
            _array(out, key, self.sizes[key])[where] = np.sqrt(value) if key in SQUARED else value


def _array(out: dict[str, np.ndarray], key: str, size: int) -> np.ndarray:
    """``out[key]``, made (all NaN) when missing."""
    found = out.get(key)
    if found is None:
        found = out[key] = np.full(size, np.nan)
    return found


def _where(indices: Indices) -> Any:
    return slice(None) if indices is None else np.asarray(indices, dtype=np.int64)


def _device_vector(values: Values, device: torch.device) -> torch.Tensor:
    """``values`` as one float64 tensor on ``device``."""
    if isinstance(values, Host):
        return torch.tensor(values, dtype=torch.float64, device=device)
    return _vector([values]).to(torch.float64)


class ParamCopies:
    """The parameters as they were before an optimizer step, for the update ratio."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None
        self.indices: list[int] | None = None
        self.kinds: list[tuple] | None = None  # (shape, dtype, device) of each copied parameter

    def take(self, work: StepWork, indices: list[int], params: list[torch.Tensor]) -> None:
        """Copy the parameters and file ‖w‖ of the copy (still in cache)."""
        current = [local(p) for p in params]
        kinds = [(c.shape, c.dtype, c.device) for c in current]
        if self.buffers is None or indices != self.indices or kinds != self.kinds:
            self.buffers = _views_of_one_block(current)
            self.indices, self.kinds = list(indices), kinds
        _each(work, "wnorm", indices, self.buffers, current, torch.Tensor.copy_, _torch.foreach_copy_)

    def measure(self, work: StepWork, params: list[torch.Tensor]) -> None:
        """File ‖Δw‖ of every copied parameter (after the step)."""
        assert self.buffers is not None and self.indices is not None
        _each(work, "dnorm", self.indices, self.buffers, [local(p) for p in params], torch.Tensor.sub_,
              _torch.foreach_sub_)

    def release(self) -> None:
        self.buffers = self.indices = self.kinds = None


def _each(work: StepWork, key: str, indices: list[int], buffers: list[torch.Tensor],
          sources: list[torch.Tensor], one: Any, many: Any) -> None:
    """``one(buffer, source)`` for each pair, then file each buffer's norm under ``key``: on CPU
    tensor by tensor, the norm taken while the buffer is in cache (the multi-tensor kernels
    run the same per-tensor loop there, with more overhead, and a second pass finds the
    first tensors evicted); elsewhere ``many`` and one multi-tensor norm per dtype."""
    for (device, dtype), positions in _groups(buffers).items():
        accumulate = _accumulation_dtype(dtype)
        if device.type == "cpu":
            vector_norm = torch.linalg.vector_norm
            found = Host(float(vector_norm(one(buffers[p], sources[p]), dtype=accumulate)) for p in positions)
            work._put_norms(key, _pick(indices, positions), found)
        else:
            group = [buffers[p] for p in positions]
            many(group, [sources[p] for p in positions])
            work._put_norms(key, _pick(indices, positions), _torch.foreach_norm(group, accumulate))


def _views_of_one_block(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty tensors shaped like ``tensors``, views of one block per device and dtype.

    One large allocation (which the C allocator maps on its own) instead of one
    per parameter: dozens of long-lived buffers in the middle of the heap made
    glibc hand the training step's freed memory back to the OS and fault it in
    again, 3000 page faults (10% of a GPT-2 step on CPU) per step.
    """
    views: list[torch.Tensor | None] = [None] * len(tensors)
    for (device, dtype), positions in _groups(tensors).items():
        block = torch.empty(sum(tensors[p].numel() for p in positions), dtype=dtype, device=device)
        start = 0
        for p in positions:
            count = tensors[p].numel()
            views[p] = block[start:start + count].view(tensors[p].shape)
            start += count
    return views  # type: ignore[return-value]
