"""A recorded step's rows, made on the host from what was read back.

Parameter rows come straight from the read-back; module rows roll up the
parameters each module holds (monitoring/rollup.py); output rows add up, per
module, the squared norms of every gradient that reached its output this step
(several calls, several micro-batches: one norm over them all).

What a step's rows are depends only on which parameters had a gradient and
which were stepped, the same from one step to the next in a training loop:
:class:`RowPlans` works that out once (the series ids of every row, each
module's parameters as a matrix over them) and a step costs a few numpy
operations on its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from backlens.monitoring import rollup
from backlens.monitoring.layout import Layout
from backlens.monitoring.series import Series

SPIKE_STATS = ("norm", "absmax", "update_ratio")  # output norms are watched too
PLANS_KEPT = 8  # different sets of parameters with a gradient (a loop has one or a few)


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
    counts: np.ndarray | None  # non-finite values per parameter (None: every gradient was finite)
    fired: np.ndarray  # module position of each output gradient, in backward order
    fire_norms: np.ndarray  # its norm (unscaled)
    skipped: bool
    finite: bool = False  # every norm and max |g| known finite, and so the norms' squares


class StepRows(NamedTuple):
    """A step's rows (series ids and values), and those of them watched for spikes."""

    ids: np.ndarray
    values: np.ndarray
    watched_ids: np.ndarray
    watched_values: np.ndarray


class Rollup:
    """Module values from the values of some parameters: each module holding any of them, and a
    (modules x parameters) matrix of which it holds."""

    def __init__(self, members: np.ndarray, params: np.ndarray):
        inside = members[:, params]
        self.held = np.flatnonzero(inside.any(axis=1))
        self.members = inside[self.held]
        self.ones = self.members.astype(np.float64)

    def norm(self, norms: np.ndarray, finite: bool = False) -> np.ndarray:
        """``finite``: every norm's square known finite (one matrix product does)."""
        squares = np.square(norms)
        if finite or np.isfinite(squares).all():
            return np.sqrt(self.ones @ squares)
        return rollup.norm_over(self.members, norms)

    def largest(self, values: np.ndarray) -> np.ndarray:
        return rollup.max_over(self.members, values)

    def total(self, values: np.ndarray) -> np.ndarray:
        return rollup.sum_over(self.members, values)


class RowPlan:
    """The rows of a step with gradients for ``present`` and updates measured for ``copied``,
    before their values: ``ids`` (read-only, shared by every step of this plan)."""

    def __init__(self, layout: Layout, series_ids: SeriesIds, stats: tuple[str, ...], present: np.ndarray,
                 copied: np.ndarray):
        self.present, self.copied, self.stats = present, copied, stats
        every = np.arange(len(layout.params))
        self.complete, self.all_copied = np.array_equal(present, every), np.array_equal(copied, every)
        self.grads = Rollup(layout.members, present)
        self.updates = Rollup(layout.members, copied)
        parts = []
        for stat in stats:
            if stat == "update_ratio":
                if len(copied):
                    parts += [series_ids.param[stat][copied], series_ids.module[stat][self.updates.held]]
            elif len(present):
                parts += [series_ids.param[stat][present], series_ids.module[stat][self.grads.held]]
        self.ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.ids.flags.writeable = False
        self.watched = np.flatnonzero(series_ids.spiking[self.ids])
        self.watched_ids = self.ids[self.watched]
        self.watched_ids.flags.writeable = False
        # The non-finite counts of a step whose gradients were all finite: parameters, then modules.
        self.no_counts = np.zeros(len(present) + len(self.grads.held))
        self.no_counts.flags.writeable = False

    def values(self, step: StepValues) -> np.ndarray:
        """The values of ``ids`` for this step."""
        present, copied, read = self.present, self.copied, step.read
        # Every parameter had a gradient (was updated): the arrays as they are.
        if self.complete:
            present = slice(None)  # type: ignore[assignment]
        if self.all_copied:
            copied = slice(None)  # type: ignore[assignment]
        parts = []
        for stat in self.stats:
            if stat == "update_ratio":
                if not len(self.copied):
                    continue
                if step.skipped:  # the scaler skipped the step: no parameter moved
                    parts += [np.zeros(len(self.copied)), np.zeros(len(self.updates.held))]
                    continue
                moved, weights = read["dnorm"][copied], read["wnorm"][copied]
                with np.errstate(divide="ignore", invalid="ignore"):
                    parts += [moved / weights, self.updates.norm(moved) / self.updates.norm(weights)]
                continue
            if not len(self.present):  # no gradient at all this step
                continue
            if stat == "norm":
                values = read["norm"][present]
                parts += [values, self.grads.norm(values, step.finite)]
            elif stat == "absmax":
                values = read["absmax"][present]
                parts += [values, self.grads.largest(values)]
            elif step.counts is None:
                parts.append(self.no_counts)
            else:
                values = step.counts[present]
                parts += [values, self.grads.total(values)]
        return np.concatenate(parts) if parts else np.zeros(0)


class RowPlans:
    """The plan of each set of parameters with a gradient (and updated) seen lately."""

    def __init__(self, layout: Layout, series_ids: SeriesIds, stats: tuple[str, ...]):
        self.layout, self.series_ids, self.stats = layout, series_ids, stats
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...]], RowPlan] = {}

    def plan(self, present: list[int], copied: list[int]) -> RowPlan:
        """The plan of a step whose parameters ``present`` had a gradient and ``copied`` were
        measured (both in order)."""
        key = (tuple(present), tuple(copied))
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            found = self._plans[key] = RowPlan(self.layout, self.series_ids, self.stats,
                                               np.array(present, dtype=np.int64), np.array(copied, dtype=np.int64))
        return found

    def step_rows(self, plan: RowPlan, step: StepValues) -> StepRows:
        """The step's series ids and values."""
        values = plan.values(step)
        if not len(step.fired) and not step.skipped:
            return StepRows(plan.ids, values, plan.watched_ids, values[plan.watched])
        id_parts, value_parts = [plan.ids], [values]
        watched_ids, watched_values = plan.watched_ids, values[plan.watched]
        if len(step.fired):
            called = len(self.layout.called)
            squares = np.bincount(step.fired, weights=np.square(step.fire_norms), minlength=called)
            positions = np.flatnonzero(np.bincount(step.fired, minlength=called))  # in the model's module order
            output_ids, output_values = self.series_ids.output[positions], np.sqrt(squares[positions])
            id_parts.append(output_ids)
            value_parts.append(output_values)
            watched_ids = np.concatenate([watched_ids, output_ids])  # output norms are all watched
            watched_values = np.concatenate([watched_values, output_values])
        if step.skipped:
            id_parts.append(np.array([self.series_ids.skipped]))
            value_parts.append(np.ones(1))
        return StepRows(np.concatenate(id_parts), np.concatenate(value_parts), watched_ids, watched_values)


def first_nonfinite_output(layout: Layout, step: StepValues) -> str | None:
    """The first module output, in backward order, whose gradient was not finite."""
    bad = np.flatnonzero(~np.isfinite(step.fire_norms))
    return layout.called[step.fired[bad[0]]][0] if len(bad) else None
