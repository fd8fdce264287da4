"""Where a monitor's rows go besides memory: TensorBoard event files, a CSV file, a callable.

``sink=``: a directory (TensorBoard event files, written with
``torch.utils.tensorboard``'s ``FileWriter``: one event per recorded step
holding every value, tag ``stat/kind/name``), a path ending in ``.csv`` (the
rows of ``to_pandas()``; alerts beside it in ``NAME.alerts.jsonl``), a callable
``(step, rows)`` getting each recorded step's :class:`~backlens.monitoring.series.Row`
list, or a list of those. Alerts go to TensorBoard as text (tag
``alerts/CODE``). The readers here turn a directory or CSV file back into rows
and alerts for ``backlens report``.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from backlens._output import make_parent, not_writable
from backlens.errors import UnsupportedInputError
from backlens.monitoring.alerts import Alert
from backlens.monitoring.series import COLUMNS, ROOT_TAG_NAME, Series, empty_frame, tag_of

if TYPE_CHECKING:
    import pandas as pd

ALERT_TAG = "alerts"
KINDS = ("param", "module", "output", "step")
STAT_NAMES = ("norm", "absmax", "nonfinite", "update_ratio", "skipped")


class Sink:
    def describe(self) -> str:
        return type(self).__name__

    def write(self, step: int, series: Series, ids: np.ndarray, values: np.ndarray) -> None:
        raise NotImplementedError

    def alert(self, alert: Alert) -> None:
        """Record an alert where the rows go (nothing for a callable)."""

    def flush(self) -> None:
        """Push what is buffered to storage."""

    def close(self) -> None:
        self.flush()


class TensorBoardSink(Sink):
    def __init__(self, directory: str):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import text
        from torch.utils.tensorboard.writer import FileWriter

        self._summary, self._text = Summary, text
        self.directory = directory
        self.writer = FileWriter(directory)
        self._tags: list[str] = []

    def describe(self) -> str:
        return f"TensorBoard directory {self.directory!r}"

    def write(self, step: int, series: Series, ids: np.ndarray, values: np.ndarray) -> None:
        tags = self._tags
        if len(tags) < len(series):
            tags.extend(tag_of(series.kinds[i], series.names[i], series.stats[i])
                        for i in range(len(tags), len(series)))
        value = self._summary.Value
        summary = self._summary(value=[value(tag=tags[i], simple_value=v)
                                       for i, v in zip(ids.tolist(), values.tolist())])
        self.writer.add_summary(summary, step)

    def alert(self, alert: Alert) -> None:
        self.writer.add_summary(self._text(f"{ALERT_TAG}/{alert.code}", json.dumps(alert.to_dict())), alert.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvSink(Sink):
    def __init__(self, path: str):
        self.path = path
        self.alerts_path = alerts_path(path)
        self.handle = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - open until close()
        self.writer = csv.writer(self.handle)
        self.writer.writerow(COLUMNS)
        if os.path.exists(self.alerts_path):  # an earlier run's alerts are not this run's
            os.remove(self.alerts_path)

    def describe(self) -> str:
        return f"CSV file {self.path!r}"

    def write(self, step: int, series: Series, ids: np.ndarray, values: np.ndarray) -> None:
        kinds, names, stats = series.kinds, series.names, series.stats
        self.writer.writerows((step, kinds[i], names[i], stats[i], repr(v))
                              for i, v in zip(ids.tolist(), values.tolist()))
        self.handle.flush()

    def alert(self, alert: Alert) -> None:
        with open(self.alerts_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(alert.to_dict()) + "\n")

    def flush(self) -> None:
        if not self.handle.closed:
            self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class CallableSink(Sink):
    def __init__(self, fn: Callable[[int, list], Any]):
        self.fn = fn

    def write(self, step: int, series: Series, ids: np.ndarray, values: np.ndarray) -> None:
        self.fn(step, series.rows(step, ids, values))


def alerts_path(csv_path: str) -> str:
    return str(Path(csv_path).with_suffix("")) + ".alerts.jsonl"


def describe(sink: Any) -> str:
    """What a sink option is, for messages."""
    if callable(sink):
        return getattr(sink, "__name__", type(sink).__name__)
    return os.fspath(sink)


def open_sinks(sink: Any, where: str, opened: bool = True) -> list[Sink]:
    """The sinks a ``sink=`` option names, checked, then opened where ``opened`` (rank 0 of a
    distributed run writes; the other ranks check the option alike and open nothing)."""
    if sink is None:
        return []
    items = list(sink) if isinstance(sink, (list, tuple)) else [sink]
    for item in items:
        if not (callable(item) or isinstance(item, (str, os.PathLike))) or (
                not callable(item) and os.fspath(item) in ("", b"")):
            raise UnsupportedInputError(
                f"{where}: sink must be a directory (TensorBoard), a .csv path, a callable (step, rows) or a "
                f"list of those, got {item!r}.", code="bad_sink",
                remedy='Pass e.g. sink="runs/exp1", sink="grads.csv" or sink=lambda step, rows: ...')
    if not opened:
        return []
    made: list[Sink] = []
    try:
        for item in items:
            try:
                made.append(_open(item, where))
            except OSError as exc:
                raise not_writable(item, exc, f"{where}: sink") from exc
    except BaseException:
        for done in made:
            done.close()
        raise
    return made


def _open(item: Any, where: str) -> Sink:
    if callable(item):
        return CallableSink(item)
    path = os.fspath(item)
    if path.lower().endswith(".csv"):
        if os.path.isdir(path):
            raise UnsupportedInputError(f"{where}: sink {path!r} is a directory, not a CSV file.",
                                        code="bad_sink", remedy="Name a file: sink='grads.csv'.")
        make_parent(path)
        return CsvSink(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UnsupportedInputError(
            f"{where}: sink {path!r} is a file; a TensorBoard sink is a directory (or name a .csv file).",
            code="bad_sink", remedy="Pass a directory such as sink='runs/exp1'.")
    try:
        return TensorBoardSink(path)
    except ImportError as exc:
        raise UnsupportedInputError(
            f"{where}: sink {path!r} is a directory, for TensorBoard event files, and tensorboard is not "
            f"installed ({exc}).", code="tensorboard_not_installed",
            remedy="pip install 'backlens[monitor]' (or tensorboard), or pass a .csv path.") from exc


# -- reading back ------------------------------------------------------------------------

def read(path: str) -> tuple[pd.DataFrame, list[Alert]]:
    """Rows and alerts a monitor wrote to a TensorBoard directory or a CSV file."""
    if os.path.isdir(path):
        return read_tensorboard(path)
    if path.lower().endswith(".csv") and os.path.isfile(path):
        return read_csv(path)
    raise FileNotFoundError(f"{path} is neither a directory of TensorBoard event files nor a .csv file")


def read_csv(path: str) -> tuple[pd.DataFrame, list[Alert]]:
    import pandas as pd

    frame = pd.read_csv(path, keep_default_na=False, na_values={"value": ["nan"]},
                        dtype={"step": np.int64, "kind": str, "name": str, "stat": str, "value": np.float64})
    if list(frame.columns) != list(COLUMNS):
        raise ValueError(f"{path} has columns {list(frame.columns)}, not a monitor's {list(COLUMNS)}")
    alerts = []
    if os.path.exists(alerts_path(path)):
        with open(alerts_path(path), encoding="utf-8") as handle:
            alerts = [Alert.from_dict(json.loads(line)) for line in handle if line.strip()]
    return frame, alerts


def read_tensorboard(directory: str) -> tuple[pd.DataFrame, list[Alert]]:
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    series, by_step = [], {}
    for tag in tags.get("scalars", []):
        parsed = parse_tag(tag)
        if parsed is None:
            continue  # the user's own scalars
        position = len(series)
        series.append(parsed)
        for event in events.Scalars(tag):
            by_step.setdefault(event.step, []).append((position, event.value))
    rows = []
    for step in sorted(by_step):
        for position, value in sorted(by_step[step]):
            kind, name, stat = series[position]
            rows.append((step, kind, name, stat, float(value)))
    frame = pd.DataFrame(rows, columns=list(COLUMNS)) if rows else empty_frame()
    frame = frame.astype({"step": np.int64, "value": np.float64})
    alerts = []
    for tag in tags.get("tensors", []):
        if tag.startswith(ALERT_TAG + "/"):
            for event in events.Tensors(tag):
                for text in tensor_util.make_ndarray(event.tensor_proto).reshape(-1):
                    alerts.append(Alert.from_dict(json.loads(text.decode("utf-8"))))
    alerts.sort(key=lambda alert: alert.step)
    return frame, alerts


def parse_tag(tag: str) -> tuple[str, str, str] | None:
    """``(kind, name, stat)`` of a monitor's tag, None for any other."""
    stat, _, rest = tag.partition("/")
    kind, _, name = rest.partition("/")
    if stat not in STAT_NAMES or kind not in KINDS or not name:
        return None
    return kind, ("" if name == ROOT_TAG_NAME else name), stat
