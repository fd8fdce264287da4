"""The monitor's rows: one numbered series per (kind, name, stat), and the latest steps in memory.

A recorded step is two arrays, series ids and values, so a step costs a few
numpy operations and no Python object per row; rows become a DataFrame (or
``Row`` tuples for a callable sink) only when asked.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ("step", "kind", "name", "stat", "value")
ROOT_TAG_NAME = "(model)"  # the model's own address, "", where a name must not be empty


class Row(NamedTuple):
    """One value: ``step``, ``kind`` ("param" | "module" | "output" | "step"), ``name``
    (a parameter name or module address; ``""`` is the model), ``stat``, ``value``."""

    step: int
    kind: str
    name: str
    stat: str
    value: float

    def __getitem__(self, key):  # row["value"] as well as row.value and row[4]
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)

    @property
    def tag(self) -> str:
        """``stat/kind/name``: the TensorBoard tag (``norm/param/lin.weight``), a metric name
        for W&B or MLflow."""
        return tag_of(self.kind, self.name, self.stat)


def tag_of(kind: str, name: str, stat: str) -> str:
    return f"{stat}/{kind}/{name or ROOT_TAG_NAME}"


class Series:
    """Series ids, handed out in the order series first appear."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.names: list[str] = []
        self.stats: list[str] = []
        self._ids: dict[tuple[str, str, str], int] = {}

    def __len__(self) -> int:
        return len(self.kinds)

    def id(self, kind: str, name: str, stat: str) -> int:
        key = (kind, name, stat)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self.kinds)
            self.kinds.append(kind)
            self.names.append(name)
            self.stats.append(stat)
        return found

    def ids(self, kind: str, names: list[str], stat: str) -> np.ndarray:
        return np.array([self.id(kind, name, stat) for name in names], dtype=np.int64)

    def rows(self, step: int, ids: np.ndarray, values: np.ndarray) -> list[Row]:
        kinds, names, stats = self.kinds, self.names, self.stats
        return [Row(step, kinds[i], names[i], stats[i], v) for i, v in zip(ids.tolist(), values.tolist())]

    def frame(self, steps: list[int], ids: list[np.ndarray], values: list[np.ndarray]) -> pd.DataFrame:
        import pandas as pd

        if not steps:
            return empty_frame()
        every_id = np.concatenate(ids)
        kinds, names, stats = (np.array(column, dtype=object) for column in (self.kinds, self.names, self.stats))
        return pd.DataFrame({
            "step": np.repeat(np.array(steps, dtype=np.int64), [len(i) for i in ids]),
            "kind": kinds[every_id].astype(str) if len(every_id) else np.array([], dtype=str),
            "name": names[every_id].astype(str) if len(every_id) else np.array([], dtype=str),
            "stat": stats[every_id].astype(str) if len(every_id) else np.array([], dtype=str),
            "value": np.concatenate(values).astype(np.float64),
        }, columns=list(COLUMNS))


def empty_frame() -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame({"step": np.array([], dtype=np.int64), "kind": np.array([], dtype=str),
                         "name": np.array([], dtype=str), "stat": np.array([], dtype=str),
                         "value": np.array([], dtype=np.float64)}, columns=list(COLUMNS))


class Store:
    """The latest ``keep`` recorded steps."""

    def __init__(self, series: Series, keep: int):
        self.series = series
        self.steps: deque[tuple[int, np.ndarray, np.ndarray]] = deque(maxlen=keep)

    def add(self, step: int, ids: np.ndarray, values: np.ndarray) -> None:
        self.steps.append((step, ids, values))

    def frame(self) -> pd.DataFrame:
        steps = list(self.steps)
        return self.series.frame([s for s, _i, _v in steps], [i for _s, i, _v in steps],
                                 [v for _s, _i, v in steps])
