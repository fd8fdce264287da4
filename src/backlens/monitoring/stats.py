"""The device work of one recorded step: per-parameter statistics stacked on the device, read back once.

Kernels, measured on the 4-layer GPT-2 of bench/ (52 gradients, 3.4M values,
one CPU thread, caches cold as after a backward): on CPU, per tensor in turn
its L2 norm, ``amax`` and ``amin`` (max |g| is the larger of ``amax`` and
``-amin``) 1.1 ms, against 1.6 ms for a multi-tensor norm over all gradients
followed by ``amax``/``amin`` over all of them (each pass fetches every
gradient from memory again) and 1.3 ms with ``aminmax``; the multi-tensor
inf-norm costs 9 ms. Other devices take one multi-tensor norm call (one
launch instead of one per tensor; not measured here). Non-finite values are
counted (5 ms for all gradients) only for the gradients whose max |g| (or
norm) is not finite, in a second pass on that step alone. The update ratio
copies the parameters with one multi-tensor copy and takes the copy's norm
while it is in cache (2.1 ms for copy, norm, subtract, norm, against 6.3 ms
taking both norms after the step).

Every statistic of a step goes into one float64 vector per device, read back
with one ``.cpu()``; nothing syncs per tensor. Under FSDP2 the vector holds
this rank's sums of squares over its shards, and one all-reduce of a
(world x statistics) matrix, each rank writing its own row, lets every rank
add up the shards (and take the largest |g|) exactly.
"""

from __future__ import annotations

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


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The values this process holds: a DTensor's local shard, a sparse tensor's values (called
    under ``torch.no_grad()``, so nothing here is recorded by autograd)."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:
        tensor = to_local()
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    return tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Positions in ``tensors`` grouped by device and dtype (multi-tensor kernels take one of each)."""
    groups: dict[tuple, list[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    return groups


class StepWork:
    """The statistics of one step, on the device until :meth:`read`.

    ``put(key, indices, values)`` files a float64 vector whose i-th value
    belongs to parameter ``indices[i]`` (or, with ``size``, to position
    ``indices[i]`` of a key of its own length); :meth:`read` returns, per key,
    an array over all parameters (NaN where nothing was filed). ``present``:
    the parameters that had a gradient; ``copied``: those whose update is measured.
    """

    def __init__(self, layout: Layout, rank: int, world: int):
        self.layout = layout
        self.rank, self.world = rank, world
        self.parts: dict[torch.device, list[torch.Tensor]] = {}
        self.slots: dict[torch.device, list[tuple[str, np.ndarray]]] = {}
        self.sizes: dict[str, int] = {}
        self.present = np.zeros(0, dtype=np.int64)
        self.copied = np.zeros(0, dtype=np.int64)

    def put(self, key: str, indices: np.ndarray, values: torch.Tensor, size: int | None = None) -> None:
        device = values.device
        self.parts.setdefault(device, []).append(values)
        self.slots.setdefault(device, []).append((key, indices))
        self.sizes[key] = size if size is not None else len(self.layout.params)

    # -- kernels -----------------------------------------------------------------
    def norms(self, key: str, indices: np.ndarray, tensors: list[torch.Tensor]) -> None:
        """L2 norms (squared under sharding, to be summed across ranks)."""
        for (_device, dtype), positions in _groups(tensors).items():
            found = _torch.foreach_norm([tensors[p] for p in positions], _accumulation_dtype(dtype))
            self._put_norms(key, indices[positions], torch.stack(found))

    def _put_norms(self, key: str, indices: np.ndarray, norms: torch.Tensor) -> None:
        values = norms.to(torch.float64)
        self.put(key, indices, values.square() if self.layout.mesh_group is not None else values)

    def grad_stats(self, indices: np.ndarray, tensors: list[torch.Tensor], norm: bool, absmax: bool) -> None:
        """The L2 norm and max |g| of each tensor (max |g| exact in the tensor's dtype, 0 when empty)."""
        for (device, dtype), positions in _groups(tensors).items():
            if device.type == "cpu":  # one tensor at a time: each is fetched from memory once
                norms, tops, bottoms = [], [], []
                accumulate = _accumulation_dtype(dtype)
                for p in positions:
                    tensor = tensors[p]
                    if norm:
                        norms.append(torch.linalg.vector_norm(tensor, dtype=accumulate))
                    if absmax and tensor.numel():
                        tops.append(tensor.amax())
                        bottoms.append(tensor.amin())
                if norm:
                    self._put_norms("norm", indices[positions], torch.stack(norms))
            else:
                if norm:
                    found = _torch.foreach_norm([tensors[p] for p in positions], _accumulation_dtype(dtype))
                    self._put_norms("norm", indices[positions], torch.stack(found))
                tops = [tensors[p].amax() for p in positions if tensors[p].numel()] if absmax else []
                bottoms = [tensors[p].amin() for p in positions if tensors[p].numel()] if absmax else []
            if not absmax:
                continue
            full = [p for p in positions if tensors[p].numel()]
            if full:
                values = torch.maximum(torch.stack(tops), torch.stack(bottoms).neg())
                self.put("absmax", indices[full], values.to(torch.float64))
            empty = [p for p in positions if not tensors[p].numel()]
            if empty:
                self.put("absmax", indices[empty], torch.zeros(len(empty), dtype=torch.float64, device=device))

    def counts(self, indices: np.ndarray, tensors: list[torch.Tensor]) -> None:
        """How many values of each tensor are NaN or infinite."""
        for (_device, _dtype), positions in _groups(tensors).items():
            found = torch.stack([torch.isfinite(tensors[p]).logical_not().sum() for p in positions])
            self.put("count", indices[positions], found.to(torch.float64))

    # -- read back ---------------------------------------------------------------
    def read(self) -> dict[str, np.ndarray]:
        """Every filed statistic per parameter: one ``.cpu()`` per device (one all-reduce
        before it under sharding)."""
        out = {key: np.full(size, np.nan) for key, size in self.sizes.items()}
        sharded = self.layout.mesh_group is not None
        for device in self.parts:
            slots = [(key, indices, values) for (key, indices), values in zip(self.slots[device], self.parts[device])]
            local = [slot for slot in slots if not sharded or slot[0] in LOCAL]
            if local:
                self._read_local(out, local)
            if len(local) < len(slots):
                self._read_sharded(out, device, [slot for slot in slots if slot[0] not in LOCAL])
        return out

    @staticmethod
    def _read_local(out: dict[str, np.ndarray], slots: list[tuple[str, np.ndarray, torch.Tensor]]) -> None:
        values = torch.cat([v for _k, _i, v in slots]).cpu().numpy() if len(slots) > 1 else slots[0][2].cpu().numpy()
        start = 0
        for key, indices, _values in slots:
            out[key][indices] = values[start:start + len(indices)]
            start += len(indices)

    def _read_sharded(self, out: dict[str, np.ndarray], device: torch.device,
                      slots: list[tuple[str, np.ndarray, torch.Tensor]]) -> None:
        import torch.distributed as dist

        vector = torch.cat([v for _k, _i, v in slots])
        matrix = torch.zeros(self.world, vector.numel(), dtype=torch.float64, device=device)
        matrix[self.rank] = vector
        dist.all_reduce(matrix, group=self.layout.mesh_group)
        rows = matrix.cpu().numpy()
        sharded = self.layout.sharded
        start = 0
        for key, indices, _values in slots:
            block = rows[:, start:start + len(indices)]
            start += len(indices)
            # A shard's sums add up across ranks (max |g| is the largest); a replicated
            # parameter's values are the same everywhere, and rank 0's are taken.
            across = block.sum(axis=0) if key in SUMMED else block.max(axis=0)
            value = np.where(sharded[indices], across, block[0])
            out[key][indices] = np.sqrt(value) if key in SQUARED else value


class ParamCopies:
    """The parameters as they were before an optimizer step, for the update ratio."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None
        self.indices: np.ndarray | None = None

    def take(self, work: StepWork, indices: np.ndarray, params: list[torch.Tensor]) -> None:
        """Copy the parameters and file ‖w‖ of the copy (still in cache)."""
        current = [local(p) for p in params]
        if (self.buffers is None or self.indices is None or not np.array_equal(self.indices, indices)
                or any(b.shape != c.shape or b.dtype != c.dtype or b.device != c.device
                       for b, c in zip(self.buffers, current))):
            self.buffers = _views_of_one_block(current)
            self.indices = indices
        _torch.foreach_copy_(self.buffers, current)
        work.norms("wnorm", indices, self.buffers)

    def measure(self, work: StepWork, params: list[torch.Tensor]) -> None:
        """File ‖Δw‖ of every copied parameter (after the step)."""
        assert self.buffers is not None and self.indices is not None
        _torch.foreach_sub_(self.buffers, [local(p) for p in params])
        work.norms("dnorm", self.indices, self.buffers)

    def release(self) -> None:
        self.buffers = self.indices = None


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
