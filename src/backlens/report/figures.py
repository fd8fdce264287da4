"""Figures of values over steps for the HTML report: a heatmap (rows x steps) and small plots.

No plotting library and no script: a heatmap is a PNG (written here with
zlib, one pixel per cell, drawn pixelated) inside an inline SVG that carries
the labels, the step axis, the colour bar and the alert marks (hover one for
its message); a small plot is an SVG polyline. The page stays one offline
file a browser renders as it is, like the rest of the report.

Colours: viridis (dark, low; yellow, high), on a log scale for norms;
non-finite values red, no value light grey, zero on a log scale dark grey.
More steps than ``MAX_COLUMNS`` are binned, each bin showing its largest
value (a spike stays visible).
"""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

MAX_COLUMNS = 600  # heatmap cells per row
MAX_POINTS = 400  # points per small plot
VIRIDIS = np.array([(68, 1, 84), (72, 40, 120), (62, 74, 137), (49, 104, 142), (38, 130, 142),
                    (31, 158, 137), (53, 183, 121), (109, 205, 89), (180, 222, 44), (253, 231, 37)],
                   dtype=np.float64)
NONFINITE_RGB = (224, 49, 49)
MISSING_RGB = (238, 240, 244)
ZERO_RGB = (60, 60, 70)
ALERT_COLOR = "#e03131"


def _e(value: object) -> str:
    return html.escape(str(value))


def png(pixels: np.ndarray) -> bytes:
    """A PNG of an (height, width, 3) uint8 array."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def _data_uri(pixels: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png(pixels)).decode("ascii")


@dataclass(frozen=True)
class Scale:
    """Where a value falls between ``low`` and ``high`` (log10 when ``log``)."""

    low: float
    high: float
    log: bool

    @classmethod
    def of(cls, values: np.ndarray, log: bool) -> Scale:
        finite = values[np.isfinite(values)]
        if log:
            finite = finite[finite > 0]
        if not len(finite):
            return cls(1.0, 1.0, log) if log else cls(0.0, 0.0, log)
        return cls(float(finite.min()), float(finite.max()), log)

    def fraction(self, values: np.ndarray) -> np.ndarray:
        """0..1 for finite values inside the scale (NaN where a value has no place on it)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.log:
                low, high = math.log10(self.low), math.log10(self.high)
                placed = np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)
            else:
                low, high, placed = self.low, self.high, values.astype(np.float64)
            span = high - low
            out = (placed - low) / span if span > 0 else np.where(np.isfinite(placed), 0.5, np.nan)
        return np.where(np.isfinite(values), np.clip(out, 0.0, 1.0), np.nan)


def colors(values: np.ndarray, recorded: np.ndarray, scale: Scale) -> np.ndarray:
    """RGB of each cell: viridis by position on ``scale``; non-finite red, missing grey."""
    fraction = scale.fraction(values)
    position = np.nan_to_num(fraction, nan=0.0) * (len(VIRIDIS) - 1)
    lower = np.floor(position).astype(int).clip(0, len(VIRIDIS) - 2)
    weight = (position - lower)[..., None]
    rgb = VIRIDIS[lower] * (1 - weight) + VIRIDIS[lower + 1] * weight
    rgb = np.rint(rgb)
    rgb[recorded & np.isfinite(values) & np.isnan(fraction)] = ZERO_RGB
    rgb[recorded & ~np.isfinite(values)] = NONFINITE_RGB
    rgb[~recorded] = MISSING_RGB
    return rgb.astype(np.uint8)


def binned(steps: np.ndarray, values: np.ndarray, recorded: np.ndarray,
           limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most ``limit`` columns: each bin's first step, largest finite value (non-finite when
    any value in it is), recorded when any is."""
    count = values.shape[-1]
    if count <= limit:
        return steps, values, recorded
    edges = np.linspace(0, count, limit + 1).astype(int)
    out_values = np.full(values.shape[:-1] + (limit,), np.nan)
    out_recorded = np.zeros(values.shape[:-1] + (limit,), dtype=bool)
    for column, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        block, seen = values[..., start:end], recorded[..., start:end]
        finite = np.where(seen & np.isfinite(block), block, -np.inf).max(axis=-1)
        bad = (seen & ~np.isfinite(block)).any(axis=-1)
        out_values[..., column] = np.where(bad, np.nan, np.where(np.isfinite(finite), finite, np.nan))
        out_recorded[..., column] = seen.any(axis=-1)
    return steps[edges[:-1]], out_values, out_recorded


def _number(value: float) -> str:
    return f"{value:.3g}"


@dataclass
class Heatmap:
    """Rows (labels) x steps; ``recorded`` tells a recorded NaN from no value; ``marks``:
    (step, message) drawn as red ticks; ``skipped``: steps drawn as grey ticks."""

    title: str
    labels: list[str]
    steps: np.ndarray
    values: np.ndarray
    recorded: np.ndarray
    log: bool = True
    note: str = ""
    marks: list[tuple[int, str]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def to_html(self) -> str:
        steps, values, recorded = binned(np.asarray(self.steps), self.values, self.recorded, MAX_COLUMNS)
        scale = Scale.of(values[recorded], self.log)
        rows, columns = values.shape
        row_height = max(3, min(16, 640 // max(rows, 1)))
        label_width, plot_width, bar_width, top = 260, 720, 90, 22
        height = top + rows * row_height + 28
        cell = plot_width / max(columns, 1)
        parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='heatmap' width='{label_width + plot_width + bar_width}' "
                 f"height='{height}' role='img' data-rows='{rows}' data-columns='{columns}' "
                 f"data-low='{scale.low!r}' data-high='{scale.high!r}' data-log='{str(self.log).lower()}'>"]
        if rows and columns:
            parts.append(f"<image x='{label_width}' y='{top}' width='{plot_width}' height='{rows * row_height}' "
                         f"preserveAspectRatio='none' style='image-rendering:pixelated' "
                         f"href='{_data_uri(colors(values, recorded, scale))}'/>")
        every_label = max(1, math.ceil(9 / row_height))
        for row, label in enumerate(self.labels):
            if row % every_label == 0:
                y = top + row * row_height + row_height / 2 + 4
                parts.append(f"<text class='row-label' x='{label_width - 6}' y='{y:.1f}' text-anchor='end'>"
                             f"{_e(label)}</text>")
        axis_y = top + rows * row_height
        for k in range(min(5, columns)):
            column = round(k * (columns - 1) / 4) if columns > 1 else 0
            x = label_width + (column + 0.5) * cell
            parts.append(f"<line x1='{x:.1f}' y1='{axis_y}' x2='{x:.1f}' y2='{axis_y + 4}' stroke='#5a6275'/>")
            parts.append(f"<text x='{x:.1f}' y='{axis_y + 16}' text-anchor='middle'>step {int(steps[column])}</text>")
        for step, message in self.marks:
            column = int(np.searchsorted(steps, step, side="right")) - 1
            if 0 <= column < columns:
                x = label_width + (column + 0.5) * cell
                parts.append(f"<g class='alert-mark' data-step='{step}'><path d='M{x - 5:.1f},2 L{x + 5:.1f},2 "
                             f"L{x:.1f},{top - 4} Z' fill='{ALERT_COLOR}'/><line x1='{x:.1f}' y1='{top}' x2='{x:.1f}' "
                             f"y2='{axis_y}' stroke='{ALERT_COLOR}' stroke-opacity='0.6'/>"
                             f"<title>{_e(message)}</title></g>")
        for step in self.skipped:
            column = int(np.searchsorted(steps, step, side="right")) - 1
            if 0 <= column < columns:
                x = label_width + (column + 0.5) * cell
                parts.append(f"<line class='skipped-mark' x1='{x:.1f}' y1='{axis_y}' x2='{x:.1f}' y2='{axis_y + 8}' "
                             f"stroke='#868e96' stroke-width='2'><title>step {step}: skipped by the GradScaler"
                             f"</title></line>")
        parts.append(self._color_bar(scale, label_width + plot_width + 14, top, max(rows * row_height, 40)))
        parts.append("</svg>")
        note = f"<p class='sub'>{_e(self.note)}</p>" if self.note else ""
        return f"<h2>{_e(self.title)}</h2>{note}" + "".join(parts)

    def _color_bar(self, scale: Scale, x: float, y: float, height: float) -> str:
        ramp = colors(np.linspace(scale.high, scale.low, 64) if not scale.log
                      else np.logspace(math.log10(scale.high), math.log10(scale.low), 64),
                      np.ones(64, dtype=bool), scale)
        image = _data_uri(ramp.reshape(64, 1, 3))
        return (f"<image x='{x}' y='{y}' width='12' height='{height}' preserveAspectRatio='none' href='{image}'/>"
                f"<text x='{x + 16}' y='{y + 9}'>{_number(scale.high)}</text>"
                f"<text x='{x + 16}' y='{y + height}'>{_number(scale.low)}</text>"
                f"<text x='{x + 16}' y='{y + height / 2 + 4}'>{'log' if scale.log else 'linear'}</text>")


@dataclass
class SmallPlot:
    label: str
    steps: np.ndarray
    values: np.ndarray
    recorded: np.ndarray  # False: no value at that step


@dataclass
class SmallPlots:
    """One small line plot per row (a layer), on one step axis; ``marks``: alert steps (red)."""

    title: str
    plots: list[SmallPlot]
    log: bool = True
    note: str = ""
    marks: list[int] = field(default_factory=list)

    def to_html(self) -> str:
        if not self.plots:
            return ""
        first = min(int(p.steps[0]) for p in self.plots if len(p.steps))
        last = max(int(p.steps[-1]) for p in self.plots if len(p.steps))
        note = f"<p class='sub'>{_e(self.note)}</p>" if self.note else ""
        body = "".join(self._plot(plot, first, last) for plot in self.plots)
        return (f"<h2>{_e(self.title)}</h2>{note}"
                f"<div class='small-plots' style='display:flex;flex-wrap:wrap;gap:6px'>{body}</div>")

    def _plot(self, plot: SmallPlot, first: int, last: int) -> str:
        width, height, pad, top = 200, 86, 4, 16
        steps, values, recorded = binned(np.asarray(plot.steps), np.asarray(plot.values, dtype=np.float64),
                                         np.asarray(plot.recorded, dtype=bool), MAX_POINTS)
        scale = Scale.of(values[recorded], self.log)
        fraction = scale.fraction(values)
        span = max(last - first, 1)

        def x_of(step: float) -> float:
            return pad + (step - first) / span * (width - 2 * pad)

        inner = height - top - 16
        points = [f"{x_of(s):.1f},{top + (1 - f) * inner:.1f}"
                  for s, f, r in zip(steps.tolist(), fraction.tolist(), recorded.tolist()) if r and f == f]
        bad = steps[recorded & ~np.isfinite(values)].tolist()
        parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='small-plot' width='{width}' height='{height}' "
                 f"role='img' data-label='{_e(plot.label)}' data-points='{len(points)}' "
                 f"style='background:white;border:1px solid #e3e6ee'>",
                 f"<text x='{pad}' y='11'>{_e(plot.label)}</text>"]
        for step in self.marks:
            if first <= step <= last:
                parts.append(f"<line class='alert-mark' x1='{x_of(step):.1f}' y1='{top}' x2='{x_of(step):.1f}' "
                             f"y2='{top + inner}' stroke='{ALERT_COLOR}' stroke-opacity='0.7'/>")
        if points:
            parts.append(f"<polyline fill='none' stroke='#4c6ef5' stroke-width='1.3' points='{' '.join(points)}'/>")
        for step in bad:
            parts.append(f"<circle class='nonfinite-mark' cx='{x_of(step):.1f}' cy='{top + 2}' r='2.5' "
                         f"fill='{ALERT_COLOR}'><title>step {step}: non-finite</title></circle>")
        parts.append(f"<text x='{pad}' y='{height - 4}' fill='#5a6275'>{_number(scale.low)} – "
                     f"{_number(scale.high)}{' (log)' if self.log else ''}</text>")
        parts.append(f"<title>{_e(plot.label)}</title></svg>")
        return "".join(parts)
