"""The gradient monitor's HTML page: per statistic a heatmap of module x step, a small plot per
layer, and the alerts, in the profile report's page style (report/html.py).

Built from rows (step, kind, name, stat, value) and alerts alone, so
``mon.report(path)`` and ``backlens report DIR`` (rows read back from
TensorBoard event files or a CSV file) draw the same page. A layer is a
module that holds parameters itself (``Linear``, ``LayerNorm``, an
embedding), with the whole model first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from backlens.graph.labels import owning_module
from backlens.report.figures import Heatmap, SmallPlot, SmallPlots
from backlens.report.html import Report, Table

ROOT_LABEL = "(model)"
MAX_SMALL_PLOTS = 256
# (kind, stat): heading, whether a log scale suits it
FIGURES = (
    (("module", "norm"), "Gradient L2 norm per module", True),
    (("module", "absmax"), "Largest |gradient| per module", True),
    (("module", "nonfinite"), "Non-finite gradient values per module", False),
    (("module", "update_ratio"), "Update ratio ‖Δw‖/‖w‖ per module", True),
    (("output", "norm"), "Gradient norm reaching each module's output", True),
)


def _label(name: str) -> str:
    return name or ROOT_LABEL


def grid(frame: pd.DataFrame, kind: str, stat: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(names in first-seen order, steps, values [names, steps], recorded [names, steps])."""
    part = frame[(frame["kind"] == kind) & (frame["stat"] == stat)]
    names = list(dict.fromkeys(part["name"].tolist()))
    steps = np.array(sorted(set(part["step"].tolist())), dtype=np.int64)
    values = np.full((len(names), len(steps)), np.nan)
    recorded = np.zeros((len(names), len(steps)), dtype=bool)
    if len(part):
        row = pd.Index(names).get_indexer(part["name"])
        column = np.searchsorted(steps, part["step"].to_numpy())
        values[row, column] = part["value"].to_numpy(dtype=np.float64)
        recorded[row, column] = True
    return names, steps, values, recorded


def layers(frame: pd.DataFrame) -> set[str]:
    """The model and every module that holds a parameter itself."""
    params = frame.loc[frame["kind"] == "param", "name"].unique().tolist()
    return {""} | {owning_module(name) for name in params}


def grads_report(frame: pd.DataFrame, alerts: list[Any], title: str) -> Report:
    steps = sorted(set(frame["step"].tolist()))
    skipped = sorted(set(frame.loc[(frame["kind"] == "step") & (frame["stat"] == "skipped"), "step"].tolist()))
    params = frame.loc[frame["kind"] == "param", "name"].nunique()
    modules = frame.loc[frame["kind"] == "module", "name"].nunique()
    span = f"steps {steps[0]}–{steps[-1]}" if steps else "no step recorded"
    report = Report(title, f"{len(steps)} recorded steps ({span}), {params} parameters, {modules} modules "
                           f"holding parameters, {len(alerts)} alerts")
    summary = [("recorded steps", len(steps)), ("first step", steps[0] if steps else ""),
               ("last step", steps[-1] if steps else ""), ("parameters", int(params)),
               ("modules holding parameters", int(modules)), ("steps skipped by the GradScaler", len(skipped)),
               ("alerts", len(alerts))]
    report.sections.append(Table("Run", ["", "value"], summary))
    if alerts:
        report.sections.append(Table("Alerts", ["step", "alert", "kind", "name", "stat", "value", "baseline", "message"],
                                     [(a.step, a.code, a.kind, _label(a.name), a.stat, a.value,
                                       a.baseline, a.message) for a in alerts]))
    else:
        report.sections.append(Table("Alerts", ["alerts"], [("none: no non-finite gradient, no spike",)]))
    marks = [(a.step, a.message) for a in alerts]
    marked_steps = sorted({a.step for a in alerts})
    shown_layers = layers(frame)
    for (kind, stat), heading, log in FIGURES:
        names, grid_steps, values, recorded = grid(frame, kind, stat)
        if not names:
            continue
        if stat == "nonfinite" and not np.nan_to_num(values[recorded], nan=1.0).any():
            report.sections.append(Table(heading, ["non-finite values"],
                                         [("none at any recorded step",)]))
            continue
        scale_note = "log scale" if log else "linear scale"
        report.sections.append(Heatmap(heading, [_label(n) for n in names], grid_steps, values, recorded, log=log,
                                       note=f"rows: modules, columns: recorded steps ({scale_note}); red cells "
                                            f"are non-finite, red marks alerts",
                                       marks=marks, skipped=skipped))
        if stat == "nonfinite":
            continue
        plots = [SmallPlot(_label(name), grid_steps, values[i], recorded[i])
                 for i, name in enumerate(names) if name in shown_layers]
        note = "one plot per layer (a module holding parameters itself), the model first"
        if len(plots) > MAX_SMALL_PLOTS:
            note += f"; the first {MAX_SMALL_PLOTS} of {len(plots)} shown"
            plots = plots[:MAX_SMALL_PLOTS]
        report.sections.append(SmallPlots(f"{heading}: per layer", plots, log=log, note=note, marks=marked_steps))
    return report
