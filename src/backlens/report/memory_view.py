"""The memory of a ``memory=True`` capture in the timeline and the HTML report.

* :func:`memory_counter_events`: a counter track ("C" Trace Events) of the
  bytes held through each pass, one point after every node call, split into
  saved tensors, gradients in flight and parameter gradients (Perfetto and
  ``chrome://tracing`` stack them), on the timeline's clock.
* :func:`memory_sections`: two HTML report sections, the bytes held through
  the backward (one line per kind, one step per node call) and the saved bytes
  per module call.

Both read records only (``pass_.memory``, ``cap.memory``), so a loaded bundle
draws the same.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from backlens.report.display import bytes_text
from backlens.report.html import Bars

COUNTER_NAME = "bytes held"


def memory_counter_events(cap: Any, slices: list[Any]) -> list[tuple[int, dict[str, int]]]:
    """``(at_ns, values)`` samples of the bytes held through each pass, for the counter track
    ``COUNTER_NAME`` of the timeline made of ``slices`` (its ``"pass"`` slices say where each
    pass starts); empty without memory records."""
    origins = {s.pass_number: s.start_ns for s in slices if s.kind == "pass"}
    samples: list[tuple[int, dict[str, int]]] = []
    for backward_pass in cap.passes:
        origin = origins.get(backward_pass.number)
        memory = getattr(backward_pass, "memory", None)
        if origin is None or memory is None:
            continue
        samples.append(_counter(origin, memory.start_saved_bytes, memory.start_bytes - memory.start_saved_bytes, 0))
        by_label = {call.label: call for call in backward_pass.calls}
        for sample in memory.samples:
            call = by_label.get(sample.call)
            if call is None or call.start is None or call.duration is None:
                continue
            at = origin + round((call.start + call.duration) * 1e9)
            samples.append(_counter(at, sample.saved_bytes, sample.grad_bytes, sample.param_grad_bytes))
    return samples


def _counter(at_ns: int, saved: int, grads: int, params: int) -> tuple[int, dict[str, int]]:
    return at_ns, {"saved tensors": saved, "gradients in flight": grads, "parameter gradients": params}


@dataclass
class MemoryCurve:
    """An HTML section: bytes held after each node call of one pass, one line per kind."""

    title: str
    labels: list[str]
    series: dict[str, list[int]]
    note: str = ""

    def to_html(self) -> str:
        width, height, left, top, bottom = 900, 260, 90, 14, 30
        count = max(len(self.labels), 1)
        peak = max((max(values) for values in self.series.values() if values), default=0) or 1
        x_step = (width - left - 10) / count
        colours = {"total": "#1d2330", "saved tensors": "#4c6ef5", "gradients in flight": "#f59f00",
                   "parameter gradients": "#0ca678"}
        parts = [f"<h2>{html.escape(self.title)}</h2>"]
        if self.note:
            parts.append(f"<p class='sub'>{html.escape(self.note)}</p>")
        parts.append(f"<svg xmlns='http://www.w3.org/2000/svg' class='memory-curve' width='{width}' "
                     f"height='{height + bottom}' role='img' data-peak='{peak}'>")
        for k in range(5):  # a bytes axis
            y = top + (height - top) * k / 4
            parts.append(f"<line class='gantt-grid' x1='{left}' y1='{y:.1f}' x2='{width - 10}' y2='{y:.1f}'/>")
            parts.append(f"<text x='{left - 6}' y='{y + 4:.1f}' text-anchor='end'>"
                         f"{html.escape(bytes_text(round(peak * (4 - k) / 4)))}</text>")
        for name, values in self.series.items():
            points = []
            for i, value in enumerate(values):
                y = top + (height - top) * (1 - value / peak)
                points.append(f"{left + i * x_step:.1f},{y:.1f} {left + (i + 1) * x_step:.1f},{y:.1f}")
            colour = colours.get(name, "#7048e8")
            parts.append(f"<polyline class='memory-line' data-series='{html.escape(name)}' fill='none' "
                         f"stroke='{colour}' stroke-width='1.5' points='{' '.join(points)}'/>")
        parts.append(f"<text x='{left}' y='{height + bottom - 6}'>node calls in the order they ran "
                     f"({len(self.labels)})</text>")
        parts.append("</svg><div class='legend'>" + "".join(
            f"<span style='background:{colours.get(name, '#7048e8')}'></span>{html.escape(name)}"
            for name in self.series) + "</div>")
        return "".join(parts)


def memory_sections(cap: Any, top: int = 15) -> list[Any]:
    """The memory view of the HTML report: the bytes held through the pass with the highest
    peak, and the saved bytes of the ``top`` module calls that saved most (none without
    memory records)."""
    table = getattr(cap, "memory", None)
    if table is None:
        return []
    sections: list[Any] = []
    measured = [(p, p.memory) for p in cap.passes if p.memory is not None and p.memory.samples]
    if measured:
        backward_pass, memory = max(measured, key=lambda item: item[1].peak_bytes)
        samples = memory.samples
        sections.append(MemoryCurve(
            f"Bytes held through backward pass {backward_pass.number}: peak {bytes_text(memory.peak_bytes)} "
            f"after {memory.peak_at}",
            [s.call for s in samples],
            {"total": [s.bytes for s in samples], "saved tensors": [s.saved_bytes for s in samples],
             "gradients in flight": [s.grad_bytes for s in samples],
             "parameter gradients": [s.param_grad_bytes for s in samples]},
            note="After each node call: tensors autograd saved in the forward and has not released yet, "
                 "gradients produced and not yet consumed, parameter gradients accumulated in this pass "
                 "(docs/cost.md says what this model counts and what it cannot see).",
        ))
    rows = sorted((r for r in table.modules if r.saved_bytes), key=lambda r: -r.saved_bytes)
    children = [r for r in rows if r.label]  # the model's own call holds everything: left out
    if children:
        sections.append(Bars(
            f"Saved for the backward per module call (subtree; {bytes_text(table.saved_bytes)} in all, "
            f"parameters apart)",
            [(r.label, r.saved_bytes / 2**10, r.saved_param_bytes / 2**10) for r in children[:top]],
            unit="KiB saved", second_unit="KiB of parameters saved",
        ))
    return sections


def memory_tables(cap: Any, plan: Any, top: int = 12) -> list[Any]:
    """What ``backlens profile --memory`` prints: the peak of each pass, the module calls
    that saved most, and the checkpointing plan (rich renderables)."""
    from rich.table import Table

    table = cap.memory
    passes = Table(title=f"Backward memory (saved for the backward: {bytes_text(table.saved_bytes)} in "
                         f"{table.saved_tensors} tensors, parameters apart: {bytes_text(table.saved_param_bytes)})")
    for column in ("pass", "held at start", "peak", "peak after node call"):
        passes.add_column(column, justify="left" if column == "peak after node call" else "right")
    for backward_pass in cap.passes:
        memory = backward_pass.memory
        if memory is not None:
            passes.add_row(str(backward_pass.number), bytes_text(memory.start_bytes), bytes_text(memory.peak_bytes),
                           memory.peak_at or "-")
    modules = Table(title=f"Saved for the backward, the {top} module calls that saved most (subtree)")
    for column in ("module call", "saved", "tensors", "parameters saved", "released by"):
        modules.add_column(column, justify="left" if column in ("module call", "released by") else "right")
    for row in sorted(table.modules, key=lambda r: -r.saved_bytes)[:top]:
        freed = row.freed
        modules.add_row(row.label or "(model)", bytes_text(row.saved_bytes), str(row.saved_tensors),
                        bytes_text(row.saved_param_bytes),
                        f"pass {freed.pass_number}: {freed.call}" if freed is not None else "held")
    ranked = Table(title="Checkpointing candidates (non-reentrant), by bytes freed per recompute FLOP")
    for column in ("module call", "frees", "recompute FLOPs", "recompute time", "chosen"):
        ranked.add_column(column, justify="left" if column == "module call" else "right")
    from backlens.report.display import flops_text, seconds_text

    for row in plan.rows[:top]:
        ranked.add_row(row.module or "(model)", bytes_text(row.saved_bytes), flops_text(row.recompute_flops),
                       seconds_text(row.recompute_time), "yes" if row.chosen else "")
    return [passes, modules, ranked, str(plan)]
