"""The backward profile of one capture, as rows for rich tables and the HTML report.

Built only from records and reports (cost tree, backward status), so a live
capture and a loaded bundle give the same profile.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from backlens.report.display import flops_text, seconds_text
from backlens.report.html import Bars, Report, Table


@dataclass
class Profile:
    """Rows of the backward profile; every table is a list of dicts."""

    title: str
    modules: list[dict[str, Any]]
    node_types: list[dict[str, Any]]
    passes: list[dict[str, Any]]
    forward_flops: int | None
    backward_flops: int | None
    backward_state: str
    backward_reason: str | None
    extra: list[Any] = field(default_factory=list)

    @property
    def flop_ratio(self) -> float | None:
        if not self.forward_flops or self.backward_flops is None:
            return None
        return self.backward_flops / self.forward_flops


def build_profile(cap: Any, title: str, depth: int = 3, top: int = 10) -> Profile:
    """Profile ``cap``: module rows down to ``depth`` path parts, the ``top`` node types."""
    from backlens.report.cost_tree import cost_tree

    tree = cost_tree(cap)
    modules = []
    for row in tree.rows:
        if row.kind == "module" and row.depth > depth:
            continue
        modules.append({
            "module": ("  " * row.depth + (row.address or "(model)")) if row.kind == "module" else row.address,
            "type": row.module_type or "",
            "forward_flops": row.subtree_forward_mac_flops,
            "backward_flops": row.subtree_backward_flops,
            "backward_time": row.subtree_backward_time,
            "calls": row.backward_calls,
        })
    by_type: dict[str, dict[str, Any]] = defaultdict(lambda: {"fires": 0, "time": 0.0, "flops": 0})
    for call in cap.grad_fn_calls:
        entry = by_type[call.grad_fn.type]
        entry["fires"] += 1
        entry["time"] += call.duration or 0.0
        entry["flops"] = None if entry["flops"] is None or call.flops is None else entry["flops"] + call.flops
    node_types = sorted(({"type": k, **v} for k, v in by_type.items()), key=lambda r: -r["time"])[:top]
    passes = [
        {
            "pass": p.number,
            "trigger": p.trigger,
            "call_site": f"{p.call_site.file.rsplit('/', 1)[-1]}:{p.call_site.line} ({p.call_site.function})"
            if p.call_site else "-",
            "node_calls": len(p.calls),
            "duration": p.duration,
            "status": p.status,
        }
        for p in cap.passes
    ]
    return Profile(
        title=title,
        modules=modules,
        node_types=node_types,
        passes=passes,
        forward_flops=tree.forward_flops,
        backward_flops=tree.executed_flops,
        backward_state=tree.backward_state,
        backward_reason=tree.backward_reason,
    )


def rich_tables(profile: Profile) -> list[Any]:
    """The profile as rich renderables (printed by the CLI)."""
    from rich.table import Table as RichTable

    modules = RichTable(title="Backward profile per module (subtree totals)")
    for column in ("module", "type", "fwd FLOPs", "bwd FLOPs", "bwd time", "own node calls"):
        modules.add_column(column, justify="left" if column in ("module", "type") else "right")
    for row in profile.modules:
        modules.add_row(row["module"], row["type"], flops_text(row["forward_flops"]),
                        flops_text(row["backward_flops"]), seconds_text(row["backward_time"]), str(row["calls"]))

    types = RichTable(title=f"The {len(profile.node_types)} costliest node types (by backward time)")
    for column in ("node type", "fires", "time", "FLOPs"):
        types.add_column(column, justify="left" if column == "node type" else "right")
    for row in profile.node_types:
        types.add_row(row["type"], str(row["fires"]), seconds_text(row["time"]), flops_text(row["flops"]))

    passes = RichTable(title="Backward passes")
    for column in ("pass", "trigger", "call site", "node calls", "duration", "status"):
        passes.add_column(column)
    for row in profile.passes:
        passes.add_row(str(row["pass"]), row["trigger"], row["call_site"], str(row["node_calls"]),
                       seconds_text(row["duration"]), row["status"])
    return [modules, types, passes]


def summary_line(profile: Profile) -> str:
    ratio = profile.flop_ratio
    ratio_text = f"{ratio:.2f}x" if ratio is not None else f"unknown ({profile.backward_reason})"
    return (f"forward {flops_text(profile.forward_flops)} FLOPs, backward {flops_text(profile.backward_flops)} "
            f"FLOPs executed; backward/forward FLOP ratio {ratio_text}")


def html_report(profile: Profile, subtitle: str = "") -> Report:
    """The profile as a self-contained HTML report (tables and a bar chart)."""
    report = Report(profile.title, subtitle or summary_line(profile))
    report.sections.extend(profile.extra)
    timed = [r for r in profile.modules if r["backward_time"] and r["module"] != "(model)"]
    top_level = sorted(timed, key=lambda r: -(r["backward_time"] or 0))[:15]
    report.sections.append(Bars(
        "Backward time and FLOPs per module (subtree)",
        [(r["module"].strip(), (r["backward_time"] or 0) * 1e3, r["backward_flops"] or 0) for r in top_level],
        unit="ms", second_unit="FLOPs",
    ))
    report.sections.append(Table(
        "Backward profile per module",
        ["module", "type", "forward FLOPs", "backward FLOPs", "backward ms", "own node calls"],
        [[r["module"], r["type"], r["forward_flops"], r["backward_flops"],
          (r["backward_time"] or 0) * 1e3, r["calls"]] for r in profile.modules],
    ))
    report.sections.append(Table(
        "Costliest node types",
        ["node type", "fires", "ms", "FLOPs"],
        [[r["type"], r["fires"], r["time"] * 1e3, r["flops"]] for r in profile.node_types],
    ))
    report.sections.append(Table(
        "Backward passes",
        ["pass", "trigger", "call site", "node calls", "ms", "status"],
        [[r["pass"], r["trigger"], r["call_site"], r["node_calls"], (r["duration"] or 0) * 1e3, r["status"]]
         for r in profile.passes],
    ))
    return report
