"""The device work of one recorded step: per-parameter statistics stacked on the device, read back once.

Kernels, measured on the 4-layer GPT-2 of bench/ (52 gradients, 13.6 MB,
one CPU thread, as the optimizer gets them after a backward): on CPU, per
tensor in turn its L2 norm, ``amax`` and ``amin`` (max |g| is the larger of
``amax`` and ``-amin``) 1.1 ms: the norm fetches the tensor from memory
(0.65 ms for all of them) and the two others find it in cache. A
multi-tensor norm costs the same as the per-tensor norms, but then every
later pass fetches every gradient from memory again; ``aminmax`` costs more
than ``amax`` and ``amin`` together once the tensor is in cache; the
multi-tensor inf-norm costs 9 ms. Other devices take one multi-tensor norm
call (one launch instead of one per tensor; not measured here). Non-finite
values are counted (5 ms for all gradients) only for the gradients whose
max |g| (or norm) is not finite, in a second pass on that step alone. The
update ratio copies each parameter and takes the copy's norm while it is in
cache, then subtracts the parameter after the step and takes that norm,
tensor by tensor on CPU (2.4 ms for GPT-2 against 2.7 ms for each of the
four as one multi-tensor pass and 6.3 ms taking both norms after the step).

Every statistic of a step goes into one vector per device and dtype (0-d
results stacked once, not one by one), read back with one ``.cpu()`` per
device; nothing syncs per tensor. Under FSDP2 the vector holds this rank's
sums of squares over its shards, and one all-reduce of a (world x
statistics) matrix, each rank writing its own row, lets every rank add up
the shards (and take the largest |g|) exactly.
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
# Dtypes numpy reads as they are (float64 on the host holds each exactly).
NUMPY_DTYPES = frozenset({torch.float32, torch.float64})
# A run of tensors read several times in a row on CPU: a quarter of a core's L2 cache on the
# machines measured (1 MB), so it stays there between the passes.
RUN_BYTES = 256 * 1024

# A statistic's values: a 1-D tensor, or 0-d tensors of one device and dtype (stacked at the read).
Values = torch.Tensor | list

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The values this process holds: a DTensor's local shard, a sparse tensor's values (called
    under ``torch.no_grad()``, so nothing here is recorded by autograd)."""
    if type(tensor) in _PLAIN and tensor.layout == torch.strided:  # the usual case, asked cheaply
        return tensor
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:
        tensor = to_local()
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    return tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norms_on_cpu(tensors: list[torch.Tensor], accumulate: torch.dtype) -> list[torch.Tensor]:
    """``torch.linalg.vector_norm(t, dtype=accumulate)`` of each tensor: one multi-tensor call for
    several (on CPU it runs that same kernel on each), the dtype named only where it is not the
    tensor's own (the same kernel, one argument less to parse)."""
    if len(tensors) > 1:
        return _torch.foreach_norm(tensors, accumulate)
    if tensors[0].dtype == accumulate:
        return [torch.linalg.vector_norm(tensors[0])]
    return [torch.linalg.vector_norm(tensors[0], dtype=accumulate)]


def cache_runs(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` in runs of neighbours taking at most ``RUN_BYTES`` together (a
    larger tensor alone): every pass over a run after the first finds it in cache, and a run of
    small tensors takes one multi-tensor call per pass instead of one call per tensor."""
    runs: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if run and size + nbytes > RUN_BYTES:
            runs.append(run)
            run, size = [], 0
        run.append(i)
        size += nbytes
    if run:
        runs.append(run)
    return runs


def _groups(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Positions in ``tensors`` grouped by device and dtype (multi-tensor kernels take one of each)."""
    groups: dict[tuple, list[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    return groups


def _device_and_dtype(values: Values) -> tuple[torch.device, torch.dtype]:
    first = values[0] if isinstance(values, list) else values
    return first.device, first.dtype


def _vector(parts: list[Values]) -> torch.Tensor:
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
    """The statistics of one step, on the device until :meth:`read`.

    ``put(key, indices, values)`` files values (a 1-D tensor, or a list of 0-d
    tensors of one device and dtype) whose i-th belongs to parameter
    ``indices[i]`` (or, with ``size``, to position ``indices[i]`` of a key of its
    own length); :meth:`read` returns, per key, a float64 array over all
    parameters (NaN where nothing was filed). ``present``: the parameters that
    had a gradient; ``copied``: those whose update is measured.
    """

    def __init__(self, layout: Layout, rank: int, world: int):
        self.layout = layout
        self.rank, self.world = rank, world
        self.slots: list[tuple[str, np.ndarray, Values]] = []
        self.sizes: dict[str, int] = {}
        self.present = np.zeros(0, dtype=np.int64)
        self.copied = np.zeros(0, dtype=np.int64)

    def put(self, key: str, indices: np.ndarray, values: Values, size: int | None = None) -> None:
        if not len(values):
            return
        self.slots.append((key, indices, values))
        self.sizes.setdefault(key, size if size is not None else len(self.layout.params))

    # -- kernels -----------------------------------------------------------------
    def norms(self, key: str, indices: np.ndarray, tensors: list[torch.Tensor]) -> None:
        """L2 norms (squared under sharding, to be summed across ranks)."""
        for (_device, dtype), positions in _groups(tensors).items():
            found = _torch.foreach_norm([tensors[p] for p in positions], _accumulation_dtype(dtype))
            self._put_norms(key, indices[positions], found)

    def _put_norms(self, key: str, indices: np.ndarray, norms: list[torch.Tensor]) -> None:
        if self.layout.mesh_group is not None:
            self.put(key, indices, torch.stack(norms).square())
        else:
            self.put(key, indices, norms)

    def grad_stats(self, indices: np.ndarray, tensors: list[torch.Tensor], norm: bool, absmax: bool) -> None:
        """The L2 norm and max |g| of each tensor (max |g| exact in the tensor's dtype, 0 when empty)."""
        for (device, dtype), positions in _groups(tensors).items():
            group = [tensors[p] for p in positions]
            accumulate = _accumulation_dtype(dtype)
            full = [t.numel() > 0 for t in group]
            if device.type == "cpu":  # a run of tensors at a time, each fetched from memory once
                norms, tops, bottoms = [], [], []
                for run in cache_runs(group):
                    if norm:
                        norms += _norms_on_cpu([group[i] for i in run], accumulate)
                    if absmax:
                        for i in run:
                            if full[i]:
                                tops.append(group[i].amax())
                                bottoms.append(group[i].amin())
            else:
                norms = _torch.foreach_norm(group, accumulate) if norm else []
                tops = [t.amax() for t, filled in zip(group, full) if filled] if absmax else []
                bottoms = [t.amin() for t, filled in zip(group, full) if filled] if absmax else []
            where = indices[positions]
            if norm:
                self._put_norms("norm", where, norms)
            if not absmax:
                continue
            if tops:
                ends = torch.stack(tops + bottoms)
                count = len(tops)
                self.put("absmax", where if all(full) else where[np.asarray(full)],
                         torch.maximum(ends[:count], ends[count:].neg()))
            if not all(full):
                empty = where[~np.asarray(full)]
                self.put("absmax", empty, torch.zeros(len(empty), dtype=dtype, device=device))

    def counts(self, indices: np.ndarray, tensors: list[torch.Tensor]) -> None:
        """How many values of each tensor are NaN or infinite."""
        for (_device, _dtype), positions in _groups(tensors).items():
            found = [torch.isfinite(tensors[p]).logical_not().sum() for p in positions]
            self.put("count", indices[positions], torch.stack(found).to(torch.float64))

    # -- read back ---------------------------------------------------------------
    def read(self) -> dict[str, np.ndarray]:
        """Every filed statistic per parameter: one ``.cpu()`` per device (one all-reduce
        before it under sharding)."""
        out = {key: np.full(size, np.nan) for key, size in self.sizes.items()}
        sharded = self.layout.mesh_group is not None
        by_device: dict[torch.device, list[tuple[str, np.ndarray, Values]]] = {}
        for slot in self.slots:
            by_device.setdefault(_device_and_dtype(slot[2])[0], []).append(slot)
        for device, slots in by_device.items():
            local_slots = [slot for slot in slots if not sharded or slot[0] in LOCAL]
            if local_slots:
                _read_local(out, device, local_slots)
            if len(local_slots) < len(slots):
                self._read_sharded(out, device, [slot for slot in slots if slot[0] not in LOCAL])
        return out

    def _read_sharded(self, out: dict[str, np.ndarray], device: torch.device,
                      slots: list[tuple[str, np.ndarray, Values]]) -> None:
        import torch.distributed as dist

        vector = torch.cat([_vector([values]).to(torch.float64) for _k, _i, values in slots])
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


def _read_local(out: dict[str, np.ndarray], device: torch.device,
                slots: list[tuple[str, np.ndarray, Values]]) -> None:
    """Values of one device into ``out``: one vector per dtype, one transfer for them all."""
    by_dtype: dict[torch.dtype, list[tuple[str, np.ndarray, Values]]] = {}
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
        for key, indices, _values in group:
            out[key][indices] = values[start:start + len(indices)]
            start += len(indices)


class ParamCopies:
    """The parameters as they were before an optimizer step, for the update ratio."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None
        self.indices: np.ndarray | None = None
        self.kinds: list[tuple] | None = None  # (shape, dtype, device) of each copied parameter
        self.runs: dict[tuple, list[list[int]]] = {}  # (device, dtype) -> cache_runs of its buffers

    def take(self, work: StepWork, indices: np.ndarray, params: list[torch.Tensor]) -> None:
        """Copy the parameters and file ‖w‖ of the copy (still in cache)."""
        current = [local(p) for p in params]
        kinds = [(c.shape, c.dtype, c.device) for c in current]
        if (self.buffers is None or self.indices is None or kinds != self.kinds
                or not np.array_equal(self.indices, indices)):
            self.buffers = _views_of_one_block(current)
            self.indices, self.kinds = indices, kinds
            self.runs = {key: cache_runs([self.buffers[p] for p in positions])
                         for key, positions in _groups(self.buffers).items()}
        _each(work, "wnorm", indices, self.buffers, current, self.runs, _torch.foreach_copy_)

    def measure(self, work: StepWork, params: list[torch.Tensor]) -> None:
        """File ‖Δw‖ of every copied parameter (after the step)."""
        assert self.buffers is not None and self.indices is not None
        _each(work, "dnorm", self.indices, self.buffers, [local(p) for p in params], self.runs,
              _torch.foreach_sub_)

    def release(self) -> None:
        self.buffers = self.indices = self.kinds = None
        self.runs = {}


def _each(work: StepWork, key: str, indices: np.ndarray, buffers: list[torch.Tensor],
          sources: list[torch.Tensor], runs: dict[tuple, list[list[int]]], many: object) -> None:
    """``many(buffers, sources)``, then file each buffer's norm under ``key``: on CPU a run of
    tensors at a time, the norm taken while the run is in cache; elsewhere all at once and one
    multi-tensor norm per dtype."""
    for (device, dtype), positions in _groups(buffers).items():
        accumulate = _accumulation_dtype(dtype)
        group = [buffers[p] for p in positions]
        sourced = [sources[p] for p in positions]
        if device.type == "cpu":
            norms = []
            for run in runs[(device, dtype)]:
                targets = [group[i] for i in run]
                many(targets, [sourced[i] for i in run])  # type: ignore[operator]
                norms += _norms_on_cpu(targets, accumulate)
        else:
            many(group, sourced)  # type: ignore[operator]
            norms = _torch.foreach_norm(group, accumulate)
        work._put_norms(key, indices[positions], norms)


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
