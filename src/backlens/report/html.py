"""A self-contained HTML report: inline CSS, SVG and one small inline script; no network.

The report is a list of sections (tables, bar charts, highlighted tokens, a
Gantt view, an icicle view of a tree, a drill-down table) built from plain rows,
so any command can assemble one from what it printed. Everything is drawn when
the page is written; the script only adds interaction (zooming the Gantt and
the icicle, selecting a module in both and listing its nodes), so the page
reads the same with scripts off. Text from a capture reaches the page escaped,
and the script writes it with ``textContent`` only.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backlens._output import write_text

_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #1d2330; background: #fbfbfd; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
p.sub { color: #5a6275; margin-top: 0; }
p.notice { background: #fff4e6; border-left: 4px solid #f59f00; padding: .5rem .8rem; }
table { border-collapse: collapse; width: 100%; font-size: .85rem; background: white; }
th, td { border-bottom: 1px solid #e3e6ee; padding: .3rem .55rem; text-align: left; }
td { overflow-wrap: anywhere; }
th { background: #f0f2f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
caption { caption-side: bottom; text-align: left; color: #5a6275; font-size: .8rem; padding-top: .3rem; }
svg text { font-size: 11px; fill: #1d2330; } .bar { fill: #4c6ef5; } .bar2 { fill: #f59f00; }
.tokens span { display: inline-block; padding: .15rem .3rem; margin: .12rem; border-radius: 4px;
               font-family: ui-monospace, monospace; font-size: .85rem; }
.legend span { display: inline-block; width: .8rem; height: .8rem; margin: 0 .3rem 0 1rem; }
.gantt-bar { fill: #4c6ef5; } .gantt-bar.d1 { fill: #7048e8; } .gantt-bar.d2 { fill: #1c7ed6; }
.gantt-bar.d3 { fill: #0ca678; } .gantt-bar.d4 { fill: #f59f00; } .gantt-grid { stroke: #e3e6ee; }
svg.gantt, svg.icicle { cursor: crosshair; user-select: none; }
.gantt-row.selected text, .gantt-row.selected rect { font-weight: bold; stroke: #e8590c; stroke-width: 1.5; }
.gantt-brush { fill: rgba(232, 89, 12, .15); }
.icicle-cell rect { stroke: white; stroke-width: 1; } .icicle-cell { cursor: pointer; }
.icicle-cell.selected rect { stroke: #e8590c; stroke-width: 2.5; }
.icicle-cell text { pointer-events: none; fill: white; }
code { font-family: ui-monospace, monospace; font-size: .8rem; }
"""

# Zoom the Gantt (drag a span, double-click to reset) and the icicle (click a cell to fill
# the width with it, double-click to go back to the whole), select a module in both by
# clicking it, and list the selected module's nodes in the drill-down table.
_SCRIPT = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  function tick(value, unit) {  // as report/display.py's seconds_text writes times
    if (unit !== "ms") return value.toPrecision(3) + " " + unit;
    if (value === 0) return "0";
    if (value >= 1000) return (value / 1000).toFixed(3) + " s";
    if (value >= 1) return value.toFixed(2) + " ms";
    return (value * 1000).toFixed(1) + " us";
  }
  var tree = {}, dataNode = document.getElementById("backlens-drill-data");
  var drill = dataNode ? JSON.parse(dataNode.textContent) : null;
  if (drill) drill.modules.forEach(function (m) { tree[m.id] = m.parent; });
  function within(id, root) {
    for (var at = id, guard = 0; at !== null && at !== undefined && guard < 10000; guard++) {
      if (at === root) return true;
      at = tree[at];
    }
    return false;
  }
  function cell(row, text, numeric, tip) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (numeric) td.className = "num";
    if (tip) td.title = tip;
    row.appendChild(td);
  }
  function renderDrill(id) {
    var body = document.getElementById("backlens-drill-body"), title = document.getElementById("backlens-drill-title");
    if (!drill || !body) return;
    var nodes = drill.nodes.filter(function (n) { return id === null || within(n.module, id); });
    nodes.sort(function (a, b) { return (b.time_s || 0) - (a.time_s || 0); });
    title.textContent = (id === null ? drill.root : id) + ": " + nodes.length + " autograd nodes" +
      (nodes.length > drill.limit ? " (the " + drill.limit + " slowest shown)" : "");
    while (body.firstChild) body.removeChild(body.firstChild);
    nodes.slice(0, drill.limit).forEach(function (n) {
      var tr = document.createElement("tr");
      cell(tr, n.label); cell(tr, n.type); cell(tr, n.module); cell(tr, n.op); cell(tr, n.source, false, n.path);
      cell(tr, n.time, true); cell(tr, n.flops, true);
      body.appendChild(tr);
    });
  }
  function select(id) {
    document.querySelectorAll("[data-module]").forEach(function (el) {
      el.classList.toggle("selected", id !== null && el.getAttribute("data-module") === id);
    });
    renderDrill(id);
  }
  document.querySelectorAll("svg.gantt").forEach(function (svg) {
    var left = +svg.dataset.left, width = +svg.dataset.width, span = +svg.dataset.span, unit = svg.dataset.unit;
    var view = [0, span], brush = null, from = null;
    function apply(t0, t1) {
      view = [t0, t1];
      var k = width / (t1 - t0);
      svg.querySelectorAll("rect.gantt-bar").forEach(function (r) {
        var s = +r.dataset.start, d = +r.dataset.duration;
        var a = Math.max(s, t0), b = Math.min(s + d, t1);
        r.setAttribute("x", left + (a - t0) * k);
        r.setAttribute("width", Math.max(b - a, 0) * k);
      });
      svg.querySelectorAll("text.gantt-tick").forEach(function (t, i) {
        t.textContent = tick(t0 + (t1 - t0) * i / 5, unit);
      });
    }
    function time(event) {
      var x = event.clientX - svg.getBoundingClientRect().left;
      return view[0] + Math.min(Math.max(x - left, 0), width) / width * (view[1] - view[0]);
    }
    svg.addEventListener("mousedown", function (e) {
      from = time(e);
      brush = document.createElementNS(NS, "rect");
      brush.setAttribute("class", "gantt-brush");
      brush.setAttribute("y", 0); brush.setAttribute("height", svg.getAttribute("height"));
      svg.appendChild(brush);
    });
    svg.addEventListener("mousemove", function (e) {
      if (from === null) return;
      var to = time(e), k = width / (view[1] - view[0]);
      brush.setAttribute("x", left + (Math.min(from, to) - view[0]) * k);
      brush.setAttribute("width", Math.abs(to - from) * k);
    });
    svg.addEventListener("mouseup", function (e) {
      if (from === null) return;
      var to = time(e);
      svg.removeChild(brush); brush = null;
      if (Math.abs(to - from) > (view[1] - view[0]) / 200) apply(Math.min(from, to), Math.max(from, to));
      else {
        var row = e.target.closest ? e.target.closest("[data-module]") : null;
        if (row) select(row.getAttribute("data-module"));
      }
      from = null;
    });
    svg.addEventListener("dblclick", function () { apply(0, span); });
  });
  document.querySelectorAll("svg.icicle").forEach(function (svg) {
    var width = +svg.dataset.width;
    function zoom(x0, x1) {
      svg.querySelectorAll("g.icicle-cell").forEach(function (g) {
        var a = (+g.dataset.x0 - x0) / (x1 - x0) * width, b = (+g.dataset.x1 - x0) / (x1 - x0) * width;
        var r = g.querySelector("rect"), t = g.querySelector("text");
        a = Math.max(a, 0); b = Math.min(b, width);
        r.setAttribute("x", a); r.setAttribute("width", Math.max(b - a, 0));
        if (t) {
          t.setAttribute("x", a + 3);
          var room = Math.floor((b - a - 6) / 6.5), name = g.dataset.name;
          t.textContent = b - a > 24 ? (name.length > room ? name.slice(0, Math.max(room - 1, 1)) + "\u2026" : name) : "";
        }
      });
    }
    svg.addEventListener("click", function (e) {
      var g = e.target.closest ? e.target.closest("g.icicle-cell") : null;
      if (!g) return;
      zoom(+g.dataset.x0, +g.dataset.x1);
      select(g.getAttribute("data-module"));
    });
    svg.addEventListener("dblclick", function () { zoom(0, 1); select(null); });
  });
  renderDrill(null);
})();
"""


@dataclass
class Table:
    """Rows of cells; ``numeric`` column positions are right-aligned; ``caption`` goes under it."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    numeric: Sequence[int] = ()
    caption: str = ""


@dataclass
class Bars:
    """Horizontal bars; each item is (label, value) or (label, value, second value);
    ``fmt``/``second_fmt`` write a value's label (default: three significant digits and the unit)."""

    title: str
    items: Sequence[tuple]
    unit: str = ""
    second_unit: str | None = None
    fmt: Callable[[float], str] | None = None
    second_fmt: Callable[[float], str] | None = None


@dataclass
class GanttRow:
    """One row of a Gantt chart: a label, its nesting depth, and its bars
    ``(start, duration, tooltip)`` in the chart's time unit; ``module`` links the row
    to the same module in the other views (empty: none)."""

    label: str
    depth: int
    bars: Sequence[tuple[float, float, str]]
    module: str = ""


@dataclass
class Gantt:
    """Bars laid on a shared time axis from 0 to ``span`` (in ``unit``)."""

    title: str
    rows: Sequence[GanttRow]
    span: float
    unit: str = "ms"
    note: str = ""


@dataclass
class IcicleCell:
    """One node of a tree drawn as an icicle: ``value`` (its subtree's) sets its width."""

    id: str
    name: str
    parent: str | None
    value: float
    tooltip: str = ""


@dataclass
class Icicle:
    """A tree as nested bands: each cell as wide as its value, its children beneath it."""

    title: str
    cells: Sequence[IcicleCell]
    note: str = ""


@dataclass
class DrillDown:
    """A table the page fills with the rows of the module selected in the other views
    (every row at first): ``modules`` ``(id, parent)`` say which are inside which; each
    row of ``nodes`` has label, type, module, op, source, time, flops (as text), ``path``
    (the source's full text, shown on hover) and ``time_s`` to sort by."""

    title: str
    modules: Sequence[tuple[str, str | None]]
    nodes: Sequence[dict[str, Any]]
    root: str = "the model"
    limit: int = 200
    note: str = ""


@dataclass
class Notice:
    """A sentence the reader must not miss (noisy timings)."""

    text: str


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
        interactive = any(isinstance(s, (Gantt, Icicle, DrillDown)) for s in self.sections)
        script = f"<script>{_SCRIPT}</script>" if interactive else ""
        return (
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_e(self.title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(body)
            + script
            + "</body></html>"
        )

    def write(self, path: str) -> str:
        """Write the page to ``path`` (its folder made if missing); returns ``path``."""
        return write_text(path, self.to_html(), "the HTML report")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _cell(value: Any, numeric: bool = False) -> str:
    if isinstance(value, float):
        return f"<td class='num'>{value:,.3f}</td>"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"<td class='num'>{value:,}</td>"
    return f"<td{' class=num' if numeric else ''}>{_e('' if value is None else value)}</td>"


def _render(section: Any) -> str:
    draw = getattr(section, "to_html", None)  # a section that draws itself (report/figures.py)
    if draw is not None:
        return draw()
    if isinstance(section, Table):
        head = "".join(f"<th>{_e(c)}</th>" for c in section.columns)
        numeric = set(section.numeric)
        rows = "".join("<tr>" + "".join(_cell(v, i in numeric) for i, v in enumerate(row)) + "</tr>"
                       for row in section.rows)
        caption = f"<caption>{_e(section.caption)}</caption>" if section.caption else ""
        return (f"<h2>{_e(section.title)}</h2><table>{caption}<thead><tr>{head}</tr></thead>"
                f"<tbody>{rows}</tbody></table>")
    if isinstance(section, Bars):
        return f"<h2>{_e(section.title)}</h2>" + _bars_svg(section)
    if isinstance(section, Tokens):
        return f"<h2>{_e(section.title)}</h2>" + _tokens(section)
    if isinstance(section, Gantt):
        note = f"<p class='sub'>{_e(section.note)}</p>" if section.note else ""
        return f"<h2>{_e(section.title)}</h2>{note}" + _gantt_svg(section)
    if callable(getattr(section, "to_html", None)):  # a section that draws itself (report/memory_view.py)
        return section.to_html()
    if isinstance(section, Icicle):
        note = f"<p class='sub'>{_e(section.note)}</p>" if section.note else ""
        return f"<h2>{_e(section.title)}</h2>{note}" + _icicle_svg(section)
    if isinstance(section, DrillDown):
        return _drill_down(section)
    if isinstance(section, Notice):
        return f"<p class='notice'>{_e(section.text)}</p>"
    raise TypeError(f"unknown report section {type(section).__name__}")


def _bars_svg(section: Bars) -> str:
    items = list(section.items)
    two = any(len(item) > 2 for item in items)
    label_width, bar_width, row = 260, 560, 22 if not two else 30
    height = max(row * len(items) + 10, 30)
    first_max = max((float(item[1] or 0) for item in items), default=0) or 1.0
    second_max = max((float(item[2] or 0) for item in items if len(item) > 2), default=0) or 1.0
    first_fmt = section.fmt or (lambda v: f"{v:,.3g} {section.unit}")
    second_fmt = section.second_fmt or (lambda v: f"{v:,.3g} {section.second_unit or ''}")
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{label_width + bar_width + 140}' "
             f"height='{height}' role='img'>"]
    for i, item in enumerate(items):
        y = i * row + 4
        label, value = item[0], float(item[1] or 0)
        width = max(bar_width * value / first_max, 1)
        parts.append(f"<text x='{label_width - 6}' y='{y + 12}' text-anchor='end'>{_e(label)}</text>")
        parts.append(f"<rect class='bar' x='{label_width}' y='{y}' width='{width:.1f}' height='12'/>")
        parts.append(f"<text x='{label_width + width + 4:.1f}' y='{y + 11}'>{_e(first_fmt(value))}</text>")
        if two and len(item) > 2:
            second = float(item[2] or 0)
            width2 = max(bar_width * second / second_max, 1)
            parts.append(f"<rect class='bar2' x='{label_width}' y='{y + 13}' width='{width2:.1f}' height='8'/>")
            parts.append(f"<text x='{label_width + width2 + 4:.1f}' y='{y + 21}'>{_e(second_fmt(second))}</text>")
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
             f"height='{height}' role='img' data-span='{span!r}' data-scale='{scale!r}' "
             f"data-left='{label_width}' data-width='{chart_width}' data-unit='{_e(section.unit)}'>"]
    for k in range(6):  # a time axis: 0, span/5, ... span
        x = label_width + chart_width * k / 5
        parts.append(f"<line class='gantt-grid' x1='{x:.1f}' y1='{top - 4}' x2='{x:.1f}' y2='{height}'/>")
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        parts.append(f"<text class='gantt-tick' x='{x:.1f}' y='11' text-anchor='{anchor}'>"
                     f"{_e(_tick(span * k / 5, section.unit))}</text>")
    for i, gantt_row in enumerate(rows):
        y = top + i * row
        module = f" data-module='{_e(gantt_row.module)}'" if gantt_row.module else ""
        parts.append(f"<g class='gantt-row' data-label='{_e(gantt_row.label)}'{module}>")
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


def _tick(value: float, unit: str) -> str:
    """A time-axis label: times in ms as report/display.py writes every time (``1.450 s``)."""
    if unit == "ms":
        from backlens.report.display import seconds_text

        return seconds_text(value / 1e3) if value else "0"
    return f"{value:.3g} {unit}"


_ICICLE_COLORS = ("#364fc7", "#5f3dc4", "#1864ab", "#087f5b", "#e67700", "#c92a2a", "#495057")


def icicle_layout(cells: Sequence[IcicleCell]) -> dict[str, tuple[float, float, int]]:
    """Each cell's ``(x0, x1, depth)``: roots share [0, 1] by value; children lie side by side
    from their parent's left edge, each as wide as its share of the parent's value (what the
    parent did itself is the room left at its right)."""
    children: dict[str | None, list[IcicleCell]] = {}
    known = {c.id for c in cells}
    for c in cells:
        children.setdefault(c.parent if c.parent in known else None, []).append(c)
    layout: dict[str, tuple[float, float, int]] = {}
    roots = children.get(None, [])
    total = sum(max(c.value, 0) for c in roots) or 1.0
    todo: list[tuple[IcicleCell, float, float, int]] = []
    x = 0.0
    for c in sorted(roots, key=lambda c: -c.value):
        width = max(c.value, 0) / total
        todo.append((c, x, x + width, 0))
        x += width
    while todo:
        c, x0, x1, depth = todo.pop()
        layout[c.id] = (x0, x1, depth)
        kids = children.get(c.id, [])
        scale = (x1 - x0) / c.value if c.value > 0 else 0.0
        x = x0
        for kid in sorted(kids, key=lambda k: -k.value):
            width = min(max(kid.value, 0) * scale, x1 - x)
            todo.append((kid, x, x + width, depth + 1))
            x += width
    return layout


def _icicle_svg(section: Icicle) -> str:
    width, row = 1040, 20
    layout = icicle_layout(section.cells)
    depth = max((d for _a, _b, d in layout.values()), default=0) + 1
    height = depth * row + 2
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='icicle' width='{width}' height='{height}' "
             f"role='img' data-width='{width}'>"]
    for c in section.cells:
        if c.id not in layout:
            continue
        x0, x1, d = layout[c.id]
        x, w = x0 * width, (x1 - x0) * width
        room = int((w - 6) / 6.5)
        text = c.name if len(c.name) <= room else (c.name[:max(room - 1, 1)] + "\u2026" if w > 24 else "")
        parts.append(f"<g class='icicle-cell' data-module='{_e(c.id)}' data-name='{_e(c.name)}' "
                     f"data-x0='{x0!r}' data-x1='{x1!r}' data-depth='{d}'>"
                     f"<rect x='{x:.2f}' y='{d * row}' width='{w:.2f}' height='{row - 1}' "
                     f"fill='{_ICICLE_COLORS[d % len(_ICICLE_COLORS)]}'><title>{_e(c.tooltip or c.name)}</title></rect>"
                     f"<text x='{x + 3:.2f}' y='{d * row + 14}'>{_e(text)}</text></g>")
    parts.append("</svg>")
    return "".join(parts)


def _drill_down(section: DrillDown) -> str:
    data = {"root": section.root, "limit": section.limit,
            "modules": [{"id": m, "parent": p} for m, p in section.modules],
            "nodes": list(section.nodes)}
    # JSON inside a script element: "<" escaped so no text can close the element.
    payload = json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    head = "".join(f"<th>{_e(c)}</th>" for c in ("node", "type", "module call", "forward op",
                                                     "forward source line", "time", "FLOPs"))
    note = f"<p class='sub'>{_e(section.note)}</p>" if section.note else ""
    return (f"<h2>{_e(section.title)}</h2>{note}<p class='sub' id='backlens-drill-title'></p>"
            f"<table id='backlens-drill'><thead><tr>{head}</tr></thead><tbody id='backlens-drill-body'></tbody>"
            f"</table><script type='application/json' id='backlens-drill-data'>{payload}</script>")


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
