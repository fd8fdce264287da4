"""A recorded step's rows, made on the host from what was read back.

Parameter rows come straight from the read-back; module rows roll up the
parameters each module holds (monitoring/rollup.py); output rows add up, per
module, the squared norms of every gradient that reached its output this step
(several calls, several micro-batches: one norm over them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backlens.monitoring import rollup
from backlens.monitoring.layout import Layout
from backlens.monitoring.series import Series

SPIKE_STATS = ("norm", "absmax", "update_ratio")  # output norms are watched too


@dataclass
class SeriesIds:
    """The series id of each row a step can make."""

    param: dict[str, np.ndarray]  # stat -> id per parameter
    module: dict[str, np.ndarray]  # stat -> id per module holding parameters
    output: np.ndarray  # id per module (its output's norm)
    skipped: int
    spiking: np.ndarray  # bool per series: watched for spikes

    @classmethod
    def make(cls, series: Series, layout: Layout, stats: tuple[str, ...]) -> SeriesIds:
        param = {stat: series.ids("param", layout.names, stat) for stat in stats}
        module = {stat: series.ids("module", layout.modules, stat) for stat in stats}
        output = series.ids("output", [address for address, _m in layout.called], "norm")
        skipped = series.id("step", "", "skipped")
        watched = [param[s] for s in SPIKE_STATS if s in stats] + [module[s] for s in SPIKE_STATS if s in stats]
        spiking = np.zeros(len(series), dtype=bool)
        spiking[np.concatenate([*watched, output])] = True
        return cls(param, module, output, skipped, spiking)


@dataclass
class StepValues:
    """What one step read back, per parameter (NaN where none), and its output gradients' norms."""

    present: np.ndarray  # parameters with a gradient
    copied: np.ndarray  # parameters whose update was measured
    read: dict[str, np.ndarray]  # "norm", "absmax", "wnorm", "dnorm" per parameter
    counts: np.ndarray  # non-finite values per parameter
    fired: np.ndarray  # module position of each output gradient, in backward order
    fire_norms: np.ndarray  # its norm (unscaled)
    skipped: bool


def step_rows(layout: Layout, ids: SeriesIds, stats: tuple[str, ...],
              step: StepValues) -> tuple[np.ndarray, np.ndarray]:
    """The step's series ids and values."""
    id_parts, value_parts = [], []

    def add(found: np.ndarray, values: np.ndarray) -> None:
        id_parts.append(found)
        value_parts.append(values)

    present, read = step.present, step.read
    members = layout.members[:, present]
    held = members.any(axis=1)
    members = members[held]
    for stat in stats:
        if stat == "update_ratio":
            copied = step.copied
            if not len(copied):
                continue
            inside = layout.members[:, copied]
            holding = inside.any(axis=1)
            if step.skipped:  # the scaler skipped the step: no parameter moved
                ratio, module_ratio = np.zeros(len(copied)), np.zeros(int(holding.sum()))
            else:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = read["dnorm"][copied] / read["wnorm"][copied]
                    module_ratio = (rollup.norm_over(inside, read["dnorm"][copied])
                                    / rollup.norm_over(inside, read["wnorm"][copied]))[holding]
            add(ids.param[stat][copied], ratio)
            add(ids.module[stat][holding], module_ratio)
            continue
        if not len(present):  # no gradient at all this step
            continue
        if stat == "norm":
            values = read["norm"][present]
            module_values = rollup.norm_over(members, values)
        elif stat == "absmax":
            values = read["absmax"][present]
            module_values = rollup.max_over(members, values)
        else:
            values = step.counts[present]
            module_values = rollup.sum_over(members, values)
        add(ids.param[stat][present], values)
        add(ids.module[stat][held], module_values)
    if len(step.fired):
        positions = np.unique(step.fired)  # in the model's module order
        squares = np.zeros(len(layout.called))
        np.add.at(squares, step.fired, np.square(step.fire_norms))
        add(ids.output[positions], np.sqrt(squares[positions]))
    if step.skipped:
        add(np.array([ids.skipped]), np.ones(1))
    if not id_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    return np.concatenate(id_parts), np.concatenate(value_parts)


def first_nonfinite_output(layout: Layout, step: StepValues) -> str | None:
    """The first module output, in backward order, whose gradient was not finite."""
    bad = np.flatnonzero(~np.isfinite(step.fire_norms))
    return layout.called[step.fired[bad[0]]][0] if len(bad) else None
