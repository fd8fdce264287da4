"""A self-contained HTML report: inline CSS and SVG, no scripts, no network.

The report is a list of sections (tables, bar charts, highlighted tokens)
built from plain rows, so any command can assemble one from what it printed.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #1d2330; background: #fbfbfd; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
p.sub { color: #5a6275; margin-top: 0; }
table { border-collapse: collapse; width: 100%; font-size: .85rem; background: white; }
th, td { border-bottom: 1px solid #e3e6ee; padding: .3rem .55rem; text-align: left; }
th { background: #f0f2f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
svg text { font-size: 11px; fill: #1d2330; } .bar { fill: #4c6ef5; } .bar2 { fill: #f59f00; }
.tokens span { display: inline-block; padding: .15rem .3rem; margin: .12rem; border-radius: 4px;
               font-family: ui-monospace, monospace; font-size: .85rem; }
.legend span { display: inline-block; width: .8rem; height: .8rem; margin: 0 .3rem 0 1rem; }
.gantt-bar { fill: #4c6ef5; } .gantt-bar.d1 { fill: #7048e8; } .gantt-bar.d2 { fill: #1c7ed6; }
.gantt-bar.d3 { fill: #0ca678; } .gantt-bar.d4 { fill: #f59f00; } .gantt-grid { stroke: #e3e6ee; }
"""


@dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]


@dataclass
class Bars:
    """Horizontal bars; each item is (label, value) or (label, value, second value)."""

    title: str
    items: Sequence[tuple]
    unit: str = ""
    second_unit: str | None = None


@dataclass
class GanttRow:
    """One row of a Gantt chart: a label, its nesting depth, and its bars
    ``(start, duration, tooltip)`` in the chart's time unit."""

    label: str
    depth: int
    bars: Sequence[tuple[float, float, str]]


@dataclass
class Gantt:
    """Bars laid on a shared time axis from 0 to ``span`` (in ``unit``)."""

    title: str
    rows: Sequence[GanttRow]
    span: float
    unit: str = "ms"
    note: str = ""


@dataclass
class Tokens:
    title: str
    sentences: Sequence[Sequence[tuple[str, float]]]


@dataclass
class Report:
    title: str
    subtitle: str = ""
    sections: list[Any] = field(default_factory=list)

    def to_html(self) -> str:
        body = [f"<h1>{_e(self.title)}</h1>", f"<p class='sub'>{_e(self.subtitle)}</p>"]
        for section in self.sections:
            body.append(_render(section))
        return (
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_e(self.title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(body)
            + "</body></html>"
        )

    def write(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_html())
        return path


def _e(value: Any) -> str:
    return html.escape(str(value))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"<td class='num'>{value:,.3f}</td>"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"<td class='num'>{value:,}</td>"
    return f"<td>{_e('' if value is None else value)}</td>"


def _render(section: Any) -> str:
    draw = getattr(section, "to_html", None)  # a section that draws itself (report/figures.py)
    if draw is not None:
        return draw()
    if isinstance(section, Table):
        head = "".join(f"<th>{_e(c)}</th>" for c in section.columns)
        rows = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in section.rows)
        return f"<h2>{_e(section.title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    if isinstance(section, Bars):
        return f"<h2>{_e(section.title)}</h2>" + _bars_svg(section)
    if isinstance(section, Tokens):
        return f"<h2>{_e(section.title)}</h2>" + _tokens(section)
    if isinstance(section, Gantt):
        note = f"<p class='sub'>{_e(section.note)}</p>" if section.note else ""
        return f"<h2>{_e(section.title)}</h2>{note}" + _gantt_svg(section)
    if callable(getattr(section, "to_html", None)):  # a section that draws itself (report/memory_view.py)
        return section.to_html()
    raise TypeError(f"unknown report section {type(section).__name__}")


def _bars_svg(section: Bars) -> str:
    items = list(section.items)
    two = any(len(item) > 2 for item in items)
    label_width, bar_width, row = 260, 560, 22 if not two else 30
    height = max(row * len(items) + 10, 30)
    first_max = max((float(item[1] or 0) for item in items), default=0) or 1.0
    second_max = max((float(item[2] or 0) for item in items if len(item) > 2), default=0) or 1.0
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{label_width + bar_width + 140}' "
             f"height='{height}' role='img'>"]
    for i, item in enumerate(items):
        y = i * row + 4
        label, value = item[0], float(item[1] or 0)
        width = max(bar_width * value / first_max, 1)
        parts.append(f"<text x='{label_width - 6}' y='{y + 12}' text-anchor='end'>{_e(label)}</text>")
        parts.append(f"<rect class='bar' x='{label_width}' y='{y}' width='{width:.1f}' height='12'/>")
        parts.append(f"<text x='{label_width + width + 4:.1f}' y='{y + 11}'>{value:,.3g} {_e(section.unit)}</text>")
        if two and len(item) > 2:
            second = float(item[2] or 0)
            width2 = max(bar_width * second / second_max, 1)
            parts.append(f"<rect class='bar2' x='{label_width}' y='{y + 13}' width='{width2:.1f}' height='8'/>")
            parts.append(f"<text x='{label_width + width2 + 4:.1f}' y='{y + 21}'>{second:,.3g} "
                         f"{_e(section.second_unit or '')}</text>")
    parts.append("</svg>")
    legend = ""
    if two:
        legend = (f"<div class='legend'><span class='bar' style='background:#4c6ef5'></span>{_e(section.unit)}"
                  f"<span style='background:#f59f00'></span>{_e(section.second_unit or '')}</div>")
    return "".join(parts) + legend


def _gantt_svg(section: Gantt) -> str:
    label_width, chart_width, row, indent = 280, 760, 18, 12
    rows = list(section.rows)
    top = 18
    height = top + row * len(rows) + 6
    span = section.span if section.span > 0 else 1.0
    scale = chart_width / span
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='gantt' width='{label_width + chart_width + 10}' "
             f"height='{height}' role='img' data-span='{span!r}' data-scale='{scale!r}'>"]
    for k in range(6):  # a time axis: 0, span/5, ... span
        x = label_width + chart_width * k / 5
        parts.append(f"<line class='gantt-grid' x1='{x:.1f}' y1='{top - 4}' x2='{x:.1f}' y2='{height}'/>")
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        parts.append(f"<text x='{x:.1f}' y='11' text-anchor='{anchor}'>{span * k / 5:,.3g} {_e(section.unit)}</text>")
    for i, gantt_row in enumerate(rows):
        y = top + i * row
        parts.append(f"<g class='gantt-row' data-label='{_e(gantt_row.label)}'>")
        parts.append(f"<text x='{4 + indent * gantt_row.depth}' y='{y + 12}'>{_e(gantt_row.label)}</text>")
        for start, duration, tip in gantt_row.bars:
            x = label_width + start * scale
            width = duration * scale
            parts.append(f"<rect class='gantt-bar d{min(gantt_row.depth, 4)}' x='{x:.3f}' y='{y + 2}' "
                         f"width='{width:.3f}' height='{row - 4}' data-start='{start!r}' "
                         f"data-duration='{duration!r}'><title>{_e(tip)}</title></rect>")
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _tokens(section: Tokens) -> str:
    peak = max((abs(s) for sentence in section.sentences for _t, s in sentence), default=0) or 1.0
    lines = []
    for sentence in section.sentences:
        spans = []
        for token, score in sentence:
            alpha = min(abs(score) / peak, 1.0)
            color = f"rgba(47, 158, 68, {alpha:.2f})" if score >= 0 else f"rgba(224, 49, 49, {alpha:.2f})"
            spans.append(f"<span style='background:{color}' title='{score:+.4f}'>{_e(token)}</span>")
        lines.append("<div class='tokens'>" + "".join(spans) + "</div>")
    return "".join(lines)
