"""The backward profile of one capture, as rows for rich tables and the HTML report.

Built only from records and reports (cost tree per pass, timeline), so a live
capture and a loaded bundle give the same profile.

Several passes over one graph (``backlens demo``, ``backlens profile
--repeats N``): the first finished pass is the cold one (first-touch
allocations, lazy initialisation in torch and backlens) and is shown apart;
times per module and per node type are medians over the others, the warm
passes. FLOPs are per pass. With a single pass there is no warm pass, and its
times are shown as they are.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from backlens.report.display import flops_text, seconds_text
from backlens.report.html import Bars, Gantt, GanttRow, Report, Table

OUTSIDE_MODULES = "(no module)"


@dataclass
class Profile:
    """Rows of the backward profile; every table is a list of dicts.

    ``cold_pass`` is the first finished pass when there are warm ones after it
    (else None); ``warm_passes`` are the passes the medians run over.
    """

    title: str
    modules: list[dict[str, Any]]
    node_types: list[dict[str, Any]]
    passes: list[dict[str, Any]]
    forward_flops: int | None
    backward_flops: int | None
    backward_state: str
    backward_reason: str | None
    cold_pass: int | None = None
    warm_passes: list[int] = field(default_factory=list)
    flops_scope: str = "per pass"
    gantt: Gantt | None = None
    extra: list[Any] = field(default_factory=list)

    @property
    def flop_ratio(self) -> float | None:
        if not self.forward_flops or self.backward_flops is None:
            return None
        return self.backward_flops / self.forward_flops

    @property
    def median_pass(self) -> float | None:
        durations = [r["duration"] for r in self.passes if r["pass"] in self.warm_passes and r["duration"] is not None]
        return statistics.median(durations) if durations else None

    @property
    def cold_pass_duration(self) -> float | None:
        return next((r["duration"] for r in self.passes if r["pass"] == self.cold_pass), None)

    @property
    def warm_label(self) -> str:
        """``"median of passes 2-11"``, or ``"pass 1"`` when there is one."""
        warm = self.warm_passes
        if len(warm) > 1:
            span = f"{warm[0]}-{warm[-1]}" if warm == list(range(warm[0], warm[-1] + 1)) else ", ".join(map(str, warm))
            return f"median of passes {span}"
        return f"pass {warm[0]}" if warm else "no pass"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def build_profile(cap: Any, title: str, depth: int = 3, top: int = 10) -> Profile:
    """Profile ``cap``: module rows down to ``depth`` levels, the ``top`` node types."""
    from backlens.report.cost_tree import cost_tree

    finished = [p.number for p in cap.passes if p.status == "ok"]
    cold, warm = (finished[0], finished[1:]) if len(finished) > 1 else (None, finished)
    trees = {n: cost_tree(cap, pass_=n) for n in finished}
    reference = trees[finished[0]] if finished else cost_tree(cap)

    modules = []
    for row in reference.rows:
        if row.kind == "module" and row.depth > depth:
            continue
        modules.append({
            "module": ("  " * row.depth + (row.address or "(model)")) if row.kind == "module" else row.address,
            "type": row.module_type or "",
            "forward_flops": row.subtree_forward_mac_flops,
            "backward_flops": row.subtree_backward_flops,
            "backward_time": _median([trees[n][row.address].subtree_backward_time for n in warm]),
            "cold_time": trees[cold][row.address].subtree_backward_time if cold is not None else None,
            "calls": row.backward_calls,
        })

    per_pass: dict[int, dict[str, dict[str, Any]]] = {}
    for number in finished:
        by_type: dict[str, dict[str, Any]] = defaultdict(lambda: {"fires": 0, "time": 0.0, "flops": 0})
        for call in cap.passes.for_pass(number).calls:
            entry = by_type[call.grad_fn.type]
            entry["fires"] += 1
            entry["time"] += call.duration or 0.0
            entry["flops"] = None if entry["flops"] is None or call.flops is None else entry["flops"] + call.flops
        per_pass[number] = by_type
    first = per_pass.get(finished[0], {}) if finished else {}
    node_types = [
        {
            "type": name,
            "fires": entry["fires"],
            "time": _median([per_pass[n][name]["time"] if name in per_pass[n] else None for n in warm]),
            "cold_time": per_pass[cold][name]["time"] if cold is not None and name in per_pass[cold] else None,
            "flops": entry["flops"],
        }
        for name, entry in first.items()
    ]
    node_types = sorted(node_types, key=lambda r: -(r["time"] or 0.0))[:top]

    passes = [
        {
            "pass": p.number,
            "kind": "cold" if p.number == cold else "warm" if p.number in warm and cold is not None else "",
            "trigger": p.trigger,
            "call_site": f"{p.call_site.file.rsplit('/', 1)[-1]}:{p.call_site.line} ({p.call_site.function})"
            if p.call_site else "-",
            "node_calls": len(p.calls),
            "duration": p.duration,
            "status": p.status,
        }
        for p in cap.passes
    ]
    executed = {trees[n].executed_flops for n in finished}
    profile = Profile(
        title=title,
        modules=modules,
        node_types=node_types,
        passes=passes,
        forward_flops=reference.forward_flops,
        backward_flops=reference.executed_flops,
        backward_state=reference.backward_state,
        backward_reason=reference.backward_reason,
        cold_pass=cold,
        warm_passes=warm,
        flops_scope="per pass" if len(executed) <= 1 else f"in pass {finished[0]}",
    )
    profile.gantt = _gantt(cap, profile, depth)
    return profile


def _gantt(cap: Any, profile: Profile, depth: int) -> Gantt | None:
    """The module calls of one warm pass (the one of median duration) on a time axis."""
    from backlens.report.timeline import timeline

    timed = sorted((r for r in profile.passes if r["pass"] in profile.warm_passes and r["duration"] is not None),
                   key=lambda r: r["duration"])
    if not timed:
        return None
    number = timed[(len(timed) - 1) // 2]["pass"]
    line = timeline(cap, pass_=number)
    whole = next((s for s in line.for_pass(number) if s.kind == "pass"), None)
    if whole is None:
        return None
    rows = []
    for _label, row_depth, pieces in line.module_bars(number, max_depth=depth):
        bars = [(s.start * 1e3, s.duration * 1e3,
                 f"{s.name}: {s.duration * 1e3:.3f} ms" + (f" (stretch {s.args['stretch']})"
                                                           if "stretch" in s.args else ""))
                for s in pieces]
        rows.append(GanttRow(pieces[0].name, row_depth, bars))
    outside = [s for s in line.for_pass(number) if s.kind == "node" and s.depth == 1]
    if outside:
        rows.append(GanttRow(OUTSIDE_MODULES, 0, [(s.start * 1e3, s.duration * 1e3,
                                                   f"{s.name} ({s.args['type']}): {s.duration * 1e3:.3f} ms")
                                                  for s in outside]))
    chosen = f"pass {number}" + (f", the median of the {len(timed)} warm passes" if len(timed) > 1 else "")
    return Gantt(
        f"Backward timeline ({chosen}): module calls to depth {depth}",
        rows, whole.duration * 1e3, unit="ms",
        note="Each bar is a stretch of the backward spent in that module call's autograd nodes. "
             "The same slices, with every node call, open in Perfetto or chrome://tracing from "
             "bl.report.timeline(cap).save('t.json') or backlens profile --timeline t.json.",
    )


def run_passes(cap: Any, loss: Any, repeats: int, leaves: list[Any]) -> None:
    """Run the backward of ``loss`` over ``cap`` ``1 + repeats`` times: a cold pass, then
    ``repeats`` warm ones over the retained graph (the last one frees it).

    ``.grad`` of ``leaves`` (parameters, inputs) is cleared before each pass so
    every pass does the same work. Only the first pass saves gradients (the
    capture's policy); the warm ones save none.
    """
    from backlens._progress import progress

    total = repeats + 1
    with progress("Backward passes", total, unit="passes") as advance:
        for i in range(total):
            for tensor in leaves:
                tensor.grad = None
            options = {"save_grads": False} if i else {}
            cap.backward(loss, retain_graph=i < total - 1, **options)
            advance(1)


def rich_tables(profile: Profile) -> list[Any]:
    """The profile as rich renderables (printed by the CLI)."""
    from rich.table import Table as RichTable

    cold = profile.cold_pass
    timing = f"time: {profile.warm_label}, pass {cold} cold apart" if cold is not None else "time: one pass"
    modules = RichTable(title=f"Backward profile per module (subtree totals; {timing}; FLOPs {profile.flops_scope})")
    columns = ["module", "type", "fwd FLOPs", "bwd FLOPs", "bwd time"] + (["cold"] if cold else [])
    for column in [*columns, "own node calls"]:
        modules.add_column(column, justify="left" if column in ("module", "type") else "right")
    for row in profile.modules:
        cells = [row["module"], row["type"], flops_text(row["forward_flops"]), flops_text(row["backward_flops"]),
                 seconds_text(row["backward_time"])]
        if cold:
            cells.append(seconds_text(row["cold_time"]))
        modules.add_row(*cells, str(row["calls"]))

    types = RichTable(title=f"The {len(profile.node_types)} costliest node types (by backward time; {timing})")
    for column in ["node type", "fires", "time"] + (["cold"] if cold else []) + ["FLOPs"]:
        types.add_column(column, justify="left" if column == "node type" else "right")
    for row in profile.node_types:
        cells = [row["type"], str(row["fires"]), seconds_text(row["time"])]
        if cold:
            cells.append(seconds_text(row["cold_time"]))
        types.add_row(*cells, flops_text(row["flops"]))

    passes = RichTable(title="Backward passes")
    for column in ("pass", "", "trigger", "call site", "node calls", "duration", "status"):
        passes.add_column(column)
    for row in profile.passes:
        passes.add_row(str(row["pass"]), row["kind"], row["trigger"], row["call_site"], str(row["node_calls"]),
                       seconds_text(row["duration"]), row["status"])
    return [modules, types, passes]


def summary_line(profile: Profile) -> str:
    ratio = profile.flop_ratio
    ratio_text = f"{ratio:.2f}x" if ratio is not None else f"unknown ({profile.backward_reason})"
    text = (f"forward {flops_text(profile.forward_flops)} FLOPs, backward {flops_text(profile.backward_flops)} "
            f"FLOPs executed {profile.flops_scope}; backward/forward FLOP ratio {ratio_text}")
    if profile.cold_pass is not None:
        text += (f"; backward pass {seconds_text(profile.median_pass)} ({profile.warm_label}), "
                 f"cold first pass {seconds_text(profile.cold_pass_duration)}")
    return text


def html_report(profile: Profile, subtitle: str = "") -> Report:
    """The profile as a self-contained HTML report (tables, bar chart, Gantt view)."""
    report = Report(profile.title, subtitle or summary_line(profile))
    report.sections.extend(profile.extra)
    timed = [r for r in profile.modules if r["backward_time"] and r["module"] != "(model)"]
    top_level = sorted(timed, key=lambda r: -(r["backward_time"] or 0))[:15]
    time_note = f", {profile.warm_label}" if profile.cold_pass is not None else ""
    report.sections.append(Bars(
        f"Backward time and FLOPs per module (subtree{time_note})",
        [(r["module"].strip(), (r["backward_time"] or 0) * 1e3, r["backward_flops"] or 0) for r in top_level],
        unit="ms", second_unit="FLOPs",
    ))
    if profile.gantt is not None:
        report.sections.append(profile.gantt)
    cold = profile.cold_pass
    report.sections.append(Table(
        "Backward profile per module",
        ["module", "type", "forward FLOPs", "backward FLOPs", f"backward ms{time_note}"]
        + ([f"pass {cold} ms (cold)"] if cold else []) + ["own node calls"],
        [[r["module"], r["type"], r["forward_flops"], r["backward_flops"], _ms(r["backward_time"])]
         + ([_ms(r["cold_time"])] if cold else []) + [r["calls"]] for r in profile.modules],
    ))
    report.sections.append(Table(
        "Costliest node types",
        ["node type", "fires", f"ms{time_note}"] + ([f"pass {cold} ms (cold)"] if cold else []) + ["FLOPs"],
        [[r["type"], r["fires"], _ms(r["time"])] + ([_ms(r["cold_time"])] if cold else []) + [r["flops"]]
         for r in profile.node_types],
    ))
    report.sections.append(Table(
        "Backward passes",
        ["pass", "", "trigger", "call site", "node calls", "ms", "status"],
        [[r["pass"], r["kind"], r["trigger"], r["call_site"], r["node_calls"], _ms(r["duration"]), r["status"]]
         for r in profile.passes],
    ))
    return report


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None
