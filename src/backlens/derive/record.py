"""``DerivedGrads``: what ``bl.derive`` returns, and its intermediate records.

Every array is a read-only numpy array, whatever framework computed it, so a
record reads the same live and loaded from a bundle.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from backlens import _args
from backlens._pandas import data_frame
from backlens.derive import saving
from backlens.errors import LabelNotFoundError

# The one status an exposed intermediate record has: its gradient was computed
# twice, by two different computations, and both gave the same bits.
EXACT = "exact"


def frozen_array(value: Any) -> np.ndarray:
    """``value`` as a numpy array nobody can write to (a copy when it was writable).

    Float types numpy lacks (bfloat16, float8: ml_dtypes' kind "V") are
    widened to float32, which holds each of their values exactly.
    """
    array = np.array(value, copy=True) if not isinstance(value, np.ndarray) or value.flags.writeable else value
    if array.dtype.kind == "V" and array.dtype.names is None:
        array = array.astype(np.float32)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class IntermediateGrad:
    """The gradient of the loss with respect to one op's output.

    ``label`` is ``{op}_{k}``: the k-th op of that name in forward order
    (``dot_general_2``), with ``[i]`` appended for output ``i`` of an op that
    has several. ``status`` is always ``"exact"`` on exposed records.
    """

    label: str
    op: str
    output_index: int
    grad: np.ndarray
    status: str = EXACT

    def __post_init__(self):
        object.__setattr__(self, "grad", frozen_array(self.grad))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.grad.shape)

    @property
    def dtype(self) -> str:
        return str(self.grad.dtype)

    def __repr__(self) -> str:
        return f"IntermediateGrad({self.label!r}, shape={self.shape}, status={self.status!r})"


class IntermediateGrads(Sequence):
    """Exact intermediate records, in forward order, by position or label.

    ``withheld`` counts the records that were not exposed, by reason
    (``"mismatch"``: the check disagreed; ``"not_computed"``: past
    ``max_intermediate``; ``"replay_mismatch"``: replaying the traced ops did
    not reproduce the function's output); ``notes`` says why in words.
    """

    def __init__(self, records: Sequence[IntermediateGrad], withheld: Mapping[str, int] | None = None,
                 notes: Sequence[str] = ()):
        self._records = tuple(records)
        self._by_label = {r.label: r for r in self._records}
        self.withheld: Mapping[str, int] = MappingProxyType(dict(withheld or {}))
        self.notes: tuple[str, ...] = tuple(notes)

    @classmethod
    def unavailable(cls, framework: str) -> IntermediateGrads:
        """No records: ``framework`` gives no per-op graph to derive them from."""
        return cls([], {}, [f"{framework} exposes no per-op graph to derive intermediate gradients "
                            "from; only leaf gradients are derived."])

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[IntermediateGrad]:
        return iter(self._records)

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return self._by_label[key]
            except KeyError:
                close = difflib.get_close_matches(key, list(self._by_label), n=5, cutoff=0.5)
                raise LabelNotFoundError(
                    f"no exact intermediate record labelled {key!r}"
                    + (f"; close: {', '.join(close)}." if close else "."),
                    remedy="Use a label from [r.label for r in grads.intermediates].",
                ) from None
        return self._records[key]

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self._records]

    def to_pandas(self):
        return data_frame(
            [{"label": r.label, "op": r.op, "output_index": r.output_index, "shape": r.shape,
              "dtype": r.dtype, "grad_norm": _norm(r.grad), "status": r.status, "grad": r.grad}
             for r in self._records],
            ["label", "op", "output_index", "shape", "dtype", "grad_norm", "status", "grad"],
        )

    def __repr__(self) -> str:
        withheld = f", withheld={dict(self.withheld)}" if self.withheld else ""
        return f"IntermediateGrads({len(self)} exact{withheld})"


@dataclass(frozen=True, eq=False)
class DerivedGrads:
    """Gradients derived with another framework's own autodiff (API.md §11).

    ``leaf_grads`` maps each declared leaf's name (a pytree path such as
    ``"layers.0.w"``, a parameter name such as ``"l1.weight"``, or
    ``"args[i]"`` for a float input) to the gradient of ``output``.
    ``intermediates`` is ``None`` unless ``intermediate=True`` was asked.
    """

    framework: str
    version: str
    output: np.ndarray
    leaf_grads: Mapping[str, np.ndarray]
    intermediates: IntermediateGrads | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "output", frozen_array(self.output))
        object.__setattr__(self, "leaf_grads",
                           MappingProxyType({str(k): frozen_array(v) for k, v in self.leaf_grads.items()}))

    def to_pandas(self):
        """One row per leaf gradient, then one per exact intermediate record."""
        rows = [{"kind": "leaf", "name": name, "op": None, "shape": tuple(g.shape), "dtype": str(g.dtype),
                 "grad_norm": _norm(g), "status": EXACT, "grad": g}
                for name, g in self.leaf_grads.items()]
        for r in self.intermediates or ():
            rows.append({"kind": "intermediate", "name": r.label, "op": r.op, "shape": r.shape,
                         "dtype": r.dtype, "grad_norm": _norm(r.grad), "status": r.status, "grad": r.grad})
        return data_frame(rows, ["kind", "name", "op", "shape", "dtype", "grad_norm", "status", "grad"])

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write a bundle at ``path`` that ``bl.load(path)`` reads back as an equal record."""
        _args.path(path, "path", "DerivedGrads.save", "grads.save('runs/derived')")
        _args.flag(overwrite, "overwrite", "DerivedGrads.save")

        return saving.save(self, path, overwrite=overwrite)

    def __repr__(self) -> str:
        inter = "" if self.intermediates is None else f", intermediates={len(self.intermediates)}"
        return (f"DerivedGrads(framework={self.framework!r}, version={self.version!r}, "
                f"output={self.output.item() if self.output.size == 1 else self.output.shape}, "
                f"leaf_grads={len(self.leaf_grads)}{inter})")


def _norm(array: np.ndarray) -> float | None:
    if array.dtype.kind not in "fc" and array.dtype.name != "bfloat16":
        return None
    return float(np.linalg.norm(np.asarray(array, dtype=np.float64).ravel()))
