"""``bl.monitor``: gradient health across a training run.

The monitor is not a capture: no op is recorded and no torch mode entered. It
reads ``.grad`` at the optimizer's own step hooks (public API: the gradients
the optimizer steps with, after any clipping or unscaling) and, with
``outputs=True``, the gradients reaching module outputs (monitor/outputs.py).
Steps are numbered from 0 (the number of optimizer steps before this one);
step ``k`` is recorded when ``k % every == 0``, which is known before its
forward runs, so an unrecorded step costs two Python calls at the optimizer
and nothing else. A recorded step's statistics are computed on the device and
read back once (monitor/stats.py); nothing writes to a gradient or a parameter.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from backlens._distributed import rank_and_world_size
from backlens._fence import complete
from backlens._warn import warn
from backlens.errors import CaptureClosedError, UnsupportedInputError
from backlens.monitoring.alerts import Alert, SpikeWatch, nonfinite_alert, spike_alert
from backlens.monitoring.layout import Layout, layout_of, unwrapped
from backlens.monitoring.options import Options
from backlens.monitoring.outputs import OutputWatch, watch_module_outputs
from backlens.monitoring.rows import (
    RowPlans,
    SeriesIds,
    StepRows,
    StepValues,
    first_nonfinite_output,
)
from backlens.monitoring.series import Series, Store
from backlens.monitoring.sinks import CallableSink, Sink
from backlens.monitoring.stats import ParamCopies, StepWork, local

if TYPE_CHECKING:
    import pandas as pd

# A step without output gradients: made once (every numpy call costs after a backward).
NO_POSITIONS = np.zeros(0, dtype=np.int64)
NO_VALUES = np.zeros(0)
NO_POSITIONS.flags.writeable = NO_VALUES.flags.writeable = False


class Monitor:
    """Gradient statistics of a model across training steps (made by :func:`backlens.monitor`).

    ``to_pandas()`` gives the rows kept in memory (step, kind, name, stat,
    value), ``alerts`` the alerts so far, ``report(path)`` an HTML page;
    ``step()`` records in a loop without an optimizer; ``close()`` (or leaving a
    ``with`` block) removes every hook and closes the sinks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: Options,
                 sinks: list[Sink], start_step: int = 0):
        self._model = unwrapped(model)
        self._optimizer = optimizer
        self._options = options
        self._layout: Layout = layout_of(self._model, optimizer)
        self._stats = options.stats
        self._sinks = sinks
        self._step = start_step
        self._closed = False
        self._alerts: list[Alert] = []
        self._warned: set[str] = set()
        self._work: StepWork | None = None
        self._copies = ParamCopies()
        self._posts = 0  # optimizer steps that ran
        self._loss_scale: float | None = None
        self._nonfinite_alerted = False
        self._series = Series()
        self._store = Store(self._series, options.keep)
        self._rank, self._world = self._place()
        self._ids = SeriesIds.make(self._series, self._layout, self._stats)
        self._spikes = SpikeWatch(options.spike_factor, options.window, len(self._series))
        self._plans = RowPlans(self._layout, self._ids, self._stats)
        self._stepped: list[bool] = self._layout.stepped.tolist()
        self._handles: list[Any] = []
        self._scaler_step: Any = None
        self._outputs: OutputWatch | None = None
        if options.outputs:
            self._outputs = watch_module_outputs(self._layout.called, self._failed)
        self._finalizer = weakref.finalize(self, _close_sinks, sinks)
        done = False
        try:
            if optimizer is not None:
                self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
                self._handles.append(optimizer.register_step_post_hook(self._post_step))
            if options.scaler is not None:
                self._wrap_scaler(options.scaler)
            self._arm()
            done = True
        finally:
            if not done:
                complete(self._remove_hooks)

    # -- public ------------------------------------------------------------------------
    @property
    def every(self) -> int:
        return self._options.every

    @property
    def stats(self) -> tuple[str, ...]:
        return self._stats

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alerts(self) -> list[Alert]:
        """The alerts so far: the first non-finite gradient, and each step's spikes."""
        return list(self._alerts)

    def step(self) -> None:
        """Record the gradients now (in a loop without an optimizer: after the backward)."""
        if self._closed:
            raise CaptureClosedError("monitor.step(): this monitor is closed.", code="monitor_closed",
                                     remedy="Make a new monitor with bl.monitor(...).")
        if self._optimizer is not None:
            raise UnsupportedInputError(
                "monitor.step(): this monitor records at its optimizer's step already.",
                code="monitor_step_with_optimizer",
                remedy="Call optimizer.step() alone, or make the monitor without the optimizer.")
        try:
            if self._recording():
                self._safely(self._begin)
                self._finish(skipped=False)
        finally:  # also when on_alert raises: the step happened
            self._advance()

    def to_pandas(self) -> pd.DataFrame:
        """One row per value of the recorded steps kept in memory (the latest ``keep``):
        ``step``, ``kind`` ("param", "module", "output"; "step" for a step the GradScaler
        skipped), ``name``, ``stat``, ``value``."""
        return self._store.frame()

    def report(self, path: str | os.PathLike) -> str:
        """Write an HTML page of the rows in memory and the alerts to ``path``; return it."""
        from backlens.report.grads import grads_report

        title = f"backlens monitor: {type(self._model).__name__}"
        return grads_report(self.to_pandas(), self.alerts, title).write(os.fspath(path))

    def close(self) -> None:
        """Remove every hook, put the GradScaler's ``step`` back and close the sinks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        complete(self._remove_hooks)
        self._copies.release()
        self._finalizer()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<Monitor {type(self._model).__name__}: every={self.every}, stats={self._stats}, "
                f"outputs={self._outputs is not None}, {len(self._store.steps)} recorded steps in memory, "
                f"{len(self._alerts)} alerts, {state}>")

    # -- setup -------------------------------------------------------------------------
    def _place(self) -> tuple[int, int]:
        group = self._layout.mesh_group
        if group is None:
            return 0, 1
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group)

    def _wrap_scaler(self, scaler: Any) -> None:
        """Note the steps the GradScaler skips: its ``step`` on this instance runs through the
        monitor until close (the class is untouched)."""
        original = scaler.step
        monitor = weakref.ref(self)

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            watching = monitor()
            if watching is None or watching._closed:
                return original(optimizer, *args, **kwargs)
            return watching._scaled_step(original, optimizer, args, kwargs)

        step.__wrapped__ = original  # type: ignore[attr-defined]
        scaler.step = step
        self._scaler_step = (scaler, step)

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self._outputs is not None:
            self._outputs.disarm()
        if self._scaler_step is not None:
            scaler, step = self._scaler_step
            if scaler.__dict__.get("step") is step:
                del scaler.step
            self._scaler_step = None

    # -- the step ----------------------------------------------------------------------
    def _recording(self) -> bool:
        return self._step % self._options.every == 0

    def _arm(self) -> None:
        """Get ready for the step to come: output hooks on if it is recorded."""
        if self._outputs is not None:
            if self._recording():
                self._outputs.arm()
            else:
                self._outputs.disarm()

    def _advance(self) -> None:
        self._step += 1
        if not self._recording():
            self._copies.release()
        self._safely(self._arm)

    def _pre_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._step % self._options.every == 0:
            self._safely(self._begin)

    def _post_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._posts += 1
        try:
            if self._step % self._options.every == 0:
                self._finish(skipped=False)
        finally:  # also when on_alert raises: the step happened
            self._advance()

    def _scaled_step(self, original: Any, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        posts = self._posts
        if self._recording() and self._outputs is not None:
            self._loss_scale = float(self._options.scaler.get_scale())  # the scale its backward ran at
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            stepped = self._posts != posts
        if not stepped and optimizer is self._optimizer:  # the scaler found inf/NaN and skipped it
            self._skipped_elsewhere()
        self._loss_scale = None
        return result

    def _skipped_elsewhere(self) -> None:
        """An optimizer step a mixed-precision scaler skipped: its (unscaled) gradients are
        recorded and the step marked, and it counts as a step."""
        try:
            if self._recording():
                self._safely(self._begin, False)
                self._finish(skipped=True)
        finally:
            self._advance()

    def _begin(self, copy: bool = True) -> None:
        """Statistics of the gradients as the optimizer gets them, on the device; with ``copy``,
        the parameters the optimizer is about to update, for the update ratio."""
        layout, stats = self._layout, self._stats
        every_grad = [p.grad for p in layout.params]
        having = [i for i, grad in enumerate(every_grad) if grad is not None]
        work = StepWork(layout, self._rank, self._world)
        self._work = work
        work.present = having
        with torch.no_grad():
            if having:
                grads = [every_grad[i] for i in having]
                work.grad_stats(having if len(having) < len(every_grad) else None, grads,
                                norm="norm" in stats or "absmax" not in stats, absmax="absmax" in stats)
            optimizer = self._optimizer
            scale = getattr(optimizer, "grad_scale", None)  # a fused optimizer stepped by a GradScaler
            found_inf = getattr(optimizer, "found_inf", None)
            if isinstance(scale, torch.Tensor):
                work.put("scale", [0], scale.detach().reshape(1).to(torch.float64), 1)
            if isinstance(found_inf, torch.Tensor):
                work.put("found_inf", [0], found_inf.detach().reshape(1).to(torch.float64), 1)
            if "update_ratio" in stats:
                stepped = [i for i in having if self._stepped[i]]
                if stepped and copy:
                    self._copies.take(work, stepped, [layout.params[i] for i in stepped])
                work.copied = stepped

    def _finish(self, skipped: bool) -> None:
        """Read the step's statistics back, make its rows, write them, raise its alerts."""
        alerts: list[Alert] = []
        rows = self._safely(self._rows, skipped, alerts)
        self._work = None
        if rows is None:
            return
        step = self._step
        ids, values = rows
        self._store.add(step, ids, values)
        for alert in alerts:
            self._remember(alert)
        for sink in list(self._sinks):
            self._to_sink(sink, sink.write, step, self._series, ids, values)
        for alert in alerts:
            self._raise(alert)

    def _rows(self, skipped: bool, alerts: list[Alert]) -> tuple[np.ndarray, np.ndarray]:
        work, layout = self._work, self._layout
        if work is None:
            raise RuntimeError("the step's statistics were not started")
        with torch.no_grad():
            if "update_ratio" in self._stats and work.copied and not skipped:
                self._copies.measure(work, [layout.params[i] for i in work.copied])
            fired = self._outputs.take() if self._outputs is not None else None
            fired_at = fired.positions if fired is not None else NO_POSITIONS
            for slots, norms in fired.chunks if fired is not None else ():
                work.put("fires", slots, norms, fired.size)
            read = work.read()
        scale = read["scale"][0] if "scale" in read else None  # a fused optimizer unscales itself
        if scale is not None:
            work.finite = False  # divided by the scale: looked at again
            for key in ("norm", "absmax"):
                if key in read:
                    read[key] = read[key] / scale
        if "found_inf" in read and read["found_inf"][0] > 0:
            skipped = True
        fire_norms = read["fires"][fired.slots] if len(fired_at) else NO_VALUES
        loss_scale = self._loss_scale or scale
        if loss_scale:  # output gradients come from the backward of the scaled loss
            fire_norms = fire_norms / loss_scale
        plan = self._plans.plan(work.present, work.copied)
        counts = None if work.finite else self._count_nonfinite(plan.present, read)
        step = StepValues(plan.present, plan.copied, read, counts, fired_at, fire_norms, skipped, work.finite)
        rows = self._plans.step_rows(plan, step)
        if not skipped:  # a step the scaler skipped: its infinities were handled, and it set no baseline
            self._alerts_of(step, rows, alerts)
        return rows.ids, rows.values

    def _count_nonfinite(self, present: np.ndarray, read: dict[str, np.ndarray]) -> np.ndarray:
        """Non-finite values per parameter, counted (a second pass, a second read-back) only for
        gradients whose max |g| (or norm) is not finite (not called on a step whose gradients were
        all seen finite as they were read)."""
        layout = self._layout
        counts = np.zeros(len(layout.params))
        trigger = read.get("absmax", read.get("norm"))
        if trigger is None or not len(present):
            return counts
        bad = present[~np.isfinite(trigger[present])]
        if len(bad):
            counting = StepWork(layout, self._rank, self._world)
            with torch.no_grad():
                counting.counts(bad, [local(layout.params[i].grad) for i in bad])
            counts[bad] = counting.read()["count"][bad]
        return counts

    def _alerts_of(self, step: StepValues, rows: StepRows, alerts: list[Alert]) -> None:
        layout = self._layout
        if not self._nonfinite_alerted and step.counts is not None and step.counts.any():
            nonfinite = np.flatnonzero(step.counts)  # counts are 0 where no gradient
            self._nonfinite_alerted = True
            named = [(layout.names[i], layout.owners[i], step.counts[i]) for i in nonfinite[::-1]]
            alerts.append(nonfinite_alert(self._step, named, first_nonfinite_output(layout, step)))
        spike_ids, spike_values = rows.watched_ids, rows.watched_values
        found, baselines = self._spikes.check(spike_ids, spike_values)
        if len(found):
            worst = int(np.argmax(spike_values[found] / baselines))
            series = int(spike_ids[found[worst]])
            alerts.append(spike_alert(self._step, self._series.kinds[series], self._series.names[series],
                                      self._series.stats[series], float(spike_values[found[worst]]),
                                      float(baselines[worst]), len(found) - 1, self._options.window))
        self._spikes.add(spike_ids, spike_values)

    # -- alerts and failures -----------------------------------------------------------
    def _remember(self, alert: Alert) -> None:
        if len(self._alerts) < self._options.keep:
            self._alerts.append(alert)
        for sink in list(self._sinks):
            self._to_sink(sink, sink.alert, alert)

    def _to_sink(self, sink: Sink, fn: Any, *args: Any) -> None:
        """Hand something to a sink. A callable is the user's code, and its errors reach the user;
        a file sink that fails (a full disk) is dropped with a warning, memory keeps everything."""
        if isinstance(sink, CallableSink):
            fn(*args)
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the training step goes on
            self._sinks.remove(sink)
            _close_sinks([sink])
            warn(f"bl.monitor: the sink {sink.describe()} failed ({type(exc).__name__}: {exc}) and is "
                 f"dropped; the rows stay in memory (mon.to_pandas()).", "monitor_sink_failed", in_hook=True)

    def _raise(self, alert: Alert) -> None:
        """Warn once per kind; every alert goes to ``on_alert`` (the user's code: its errors are its own)."""
        if alert.code not in self._warned:
            self._warned.add(alert.code)
            warn(alert.message, alert.code)
        if self._options.on_alert is not None:
            self._options.on_alert(alert)

    def _safely(self, fn: Any, *args: Any) -> Any:
        """Run the monitor's own work so that a failure never stops the user's training: warn
        once and go on."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the training step goes on
            self._failed(exc)
            return None

    def _failed(self, exc: BaseException) -> None:
        if "monitor_failed" not in self._warned:
            self._warned.add("monitor_failed")
            warn(f"bl.monitor: recording failed at step {self._step} ({type(exc).__name__}: {exc}); "
                 f"training goes on unchanged, and the monitor records what it can.", "monitor_failed",
                 in_hook=True)


def _close_sinks(sinks: list[Sink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception:  # noqa: BLE001, S110 - closing at exit or after a failure: nothing left to tell
            pass


def rank_writes() -> bool:
    """Whether this process writes to the sinks: rank 0 of a distributed run, or the one process."""
    rank, _world = rank_and_world_size()
    return rank in (None, 0)
