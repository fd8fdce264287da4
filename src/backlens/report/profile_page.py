"""The backward profile as a page to explore (``backlens profile --html``, the demo's report).

Top to bottom: the summary (and a notice when the times are noisy), an icicle of
the module tree by backward time (click a module to zoom into it), the Gantt
view of one representative pass (drag to zoom; its rows select their module),
the nodes of the selected module with the forward source line of each node's
op, and the tables the CLI prints. One numbers style throughout: FLOPs as
``1.79M``, times as ``12.3 ms`` (report/display.py).
"""

from __future__ import annotations

from typing import Any

from backlens.graph.labels import ROOT_NAME
from backlens.report.display import flops_text, seconds_text
from backlens.report.html import Bars, DrillDown, Icicle, IcicleCell, Notice, Report, Table


def profile_page(profile: Any, subtitle: str = "") -> Report:
    from backlens.report.profile import OWN_CALLS_CAPTION, summary_line

    report = Report(profile.title, subtitle or summary_line(profile))
    timing = profile.timing
    if timing.noisy:
        report.sections.append(Notice("These times are noisy: " + "; ".join(timing.noisy) + "."))
    report.sections.extend(profile.extra)
    time_note = f", {profile.warm_label}"
    if profile.tree:
        report.sections.append(Icicle(
            f"Modules by backward time (subtree{time_note})",
            [IcicleCell(r["id"], r["name"], r["parent"], r["backward_time"] or 0.0,
                        f"{r['name']} ({r['type']}): {seconds_text(r['backward_time'])} backward, "
                        f"{flops_text(r['backward_flops'])} FLOPs; own work {seconds_text(r['self_time'])}")
             for r in profile.tree],
            note="Each band is a module call, as wide as its backward time; its submodules lie beneath it "
                 "(the room left at a band's right is its own work). Click a band to zoom into it and list "
                 "its nodes below; double-click to go back.",
        ))
    if profile.gantt is not None:
        report.sections.append(profile.gantt)
    if profile.nodes:
        report.sections.append(DrillDown(
            "Nodes of the selected module (time: median over the timed passes)",
            [(r["id"], r["parent"]) for r in profile.tree],
            [{"label": n["label"], "type": n["type"], "module": n["module"] or "", "op": n["op"] or "",
              "source": _short_source(n["source"]), "path": n["source"] or "", "time": seconds_text(n["time"]),
              "flops": flops_text(n["flops"]), "time_s": n["time"]} for n in profile.nodes],
            root=ROOT_NAME,
            note="The forward source line is the model's line that ran the node's forward op. Select a "
                 "module in the icicle or the Gantt view.",
        ))
    timed = [r for r in profile.modules if r["backward_time"] and r["module"] != ROOT_NAME]
    top_level = sorted(timed, key=lambda r: -(r["backward_time"] or 0))[:15]
    report.sections.append(Bars(
        f"Backward time and FLOPs per module (subtree{time_note})",
        [(r["module"].strip(), r["backward_time"] or 0, r["backward_flops"] or 0) for r in top_level],
        unit="time", second_unit="FLOPs", fmt=seconds_text, second_fmt=lambda v: flops_text(int(v)),
    ))
    cold = profile.cold_pass
    report.sections.append(Table(
        f"Backward profile per module to depth {profile.depth}",
        ["module", "type", "forward FLOPs", "backward FLOPs", f"backward time{time_note}"]
        + ([f"pass {cold} (cold)"] if cold else []) + ["own node calls"],
        [[r["module"], r["type"], flops_text(r["forward_flops"]), flops_text(r["backward_flops"]),
          seconds_text(r["backward_time"])] + ([seconds_text(r["cold_time"])] if cold else []) + [r["calls"]]
         for r in profile.modules],
        numeric=range(2, 7), caption=OWN_CALLS_CAPTION,
    ))
    report.sections.append(Table(
        "Costliest node types",
        ["node type", "fires", f"time{time_note}"] + ([f"pass {cold} (cold)"] if cold else []) + ["FLOPs"],
        [[r["type"], r["fires"], seconds_text(r["time"])] + ([seconds_text(r["cold_time"])] if cold else [])
         + [flops_text(r["flops"])] for r in profile.node_types],
        numeric=range(1, 5),
    ))
    report.sections.append(Table(
        "Backward passes",
        ["pass", "", "trigger", "call site", "node calls", "duration", "status"],
        [[r["pass"], r["kind"], r["trigger"], r["call_site"], r["node_calls"], seconds_text(r["duration"]),
          r["status"]] for r in profile.passes],
        numeric=(4, 5),
    ))
    return report


def _short_source(source: str | None) -> str:
    """``modeling_gpt2.py:123 (forward)`` for a full ``/path/.../modeling_gpt2.py:123 (forward)``."""
    if not source:
        return ""
    return source.replace("\\", "/").rsplit("/", 1)[-1]
