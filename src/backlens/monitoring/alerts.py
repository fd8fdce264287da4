"""Alerts: the first non-finite gradient, and spikes against a rolling median.

A spike is a value above ``factor`` times the median of the same series
(kind, name, stat) over the last ``window`` recorded steps, with all of those
steps holding a finite value for it and a median above zero. A step's
spikes make one alert, naming the series with the largest value/median
ratio; the others are counted in its message.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

NONFINITE = "gradient_nonfinite"
SPIKE = "gradient_spike"
KIND_WORDS = {"param": "parameter", "module": "module", "output": "output of module"}


@dataclass(frozen=True)
class Alert:
    """One alert. ``code``: ``"gradient_nonfinite"`` or ``"gradient_spike"``; ``step``; the
    series (``kind``, ``name``, ``stat``) and its ``value``; ``baseline``: the rolling median
    a spike rose above (None for a non-finite gradient). A non-finite alert names the
    parameter's ``module`` and, when output gradients are monitored, the first module
    ``output`` in backward order whose gradient was non-finite."""

    code: str
    step: int
    kind: str
    name: str
    stat: str
    value: float
    baseline: float | None = None
    module: str | None = None
    output: str | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Alert:
        fields = cls.__dataclass_fields__
        return cls(**{key: value for key, value in data.items() if key in fields})


def _shown(name: str) -> str:
    return repr(name) if name else "the model ('')"


def nonfinite_alert(step: int, params: list[tuple[str, str, float]], output: str | None) -> Alert:
    """``params``: (name, module, non-finite count) of each parameter whose gradient was not
    finite, the one named first."""
    name, module, count = params[0]
    others = f"; {len(params) - 1} other parameters too" if len(params) > 1 else ""
    where = (f" It first appeared, in backward order, in the gradient reaching the output of module "
             f"{_shown(output)}." if output is not None else "")
    message = (f"step {step}: the gradient of parameter {name!r} (module {_shown(module)}) holds "
               f"{_count(count)} non-finite value(s){others}.{where}")
    return Alert(NONFINITE, step, "param", name, "nonfinite", float(count), None, module, output, message)


def _count(count: float) -> str:
    return str(int(count)) if math.isfinite(count) else "some"


class SpikeWatch:
    """The last ``window`` recorded values of each of ``size`` series, and the spikes of a new step."""

    def __init__(self, factor: float, window: int, size: int):
        self.factor, self.window = factor, window
        self.history = np.full((window, size), np.nan)
        self.seen = 0  # steps added

    def check(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions (into ``ids``) of spiking values and their medians, before the step is added."""
        if self.seen < self.window or not len(ids):
            return np.array([], dtype=np.int64), np.array([])
        past = self.history[:, ids]
        lowest = past.min(axis=0)  # NaN where a past step lacks a finite value
        # The median is at least the lowest value: only values above factor x lowest can spike
        # (a comparison with NaN is false).
        maybe = np.flatnonzero(values > self.factor * lowest)
        if not len(maybe):
            return maybe, np.array([])
        medians = np.median(past[:, maybe], axis=0)
        found = values[maybe]
        spiking = np.isfinite(found) & (medians > 0) & (found > self.factor * medians)
        return maybe[spiking], medians[spiking]

    def add(self, ids: np.ndarray, values: np.ndarray) -> None:
        row = self.history[self.seen % self.window]
        row.fill(np.nan)
        row[ids] = np.where(np.isfinite(values), values, np.nan)
        self.seen += 1


def spike_alert(step: int, kind: str, name: str, stat: str, value: float, baseline: float,
                others: int, window: int) -> Alert:
    more = f"; {others} other series spiked at this step" if others else ""
    message = (f"step {step}: gradient spike: {stat} of {KIND_WORDS.get(kind, kind)} {_shown(name)} is "
               f"{value:.4g}, {value / baseline:.1f}x its median {baseline:.4g} over the last {window} "
               f"recorded steps{more}.")
    return Alert(SPIKE, step, kind, name, stat, float(value), float(baseline), message=message)
