"""The monitor's HTML page (mon.report and `backlens report DIR`): a heatmap of module x step per
statistic, a small plot per layer, the alerts marked; rendered in headless Chromium."""

from __future__ import annotations

import base64
import os
import re
import shutil
import struct
import subprocess
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from monitor_helpers import batch, loss_of, net

import backlens as bl
from backlens.cli import main as cli_main
from backlens.report import figures
from backlens.report.grads import grads_report, grid


def _chromium() -> str:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed for this test: `make test` installs it as root, or apt-get install chromium"
    return found


def _dom(page: Path, user_dir: Path) -> str:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={user_dir}", "--dump-dom", f"file://{page}"],
                          capture_output=True, text=True, timeout=120).stdout


def spiky_run(sink=None):
    """12 steps of SGD; the loss is scaled 1000x at step 9: one gradient_spike."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with bl.monitor(model, optimizer, outputs=True, window=5, sink=sink) as mon:
            for step in range(12):
                (loss_of(model(batch(step))) * (1000.0 if step == 9 else 1.0)).backward()
                optimizer.step()
                optimizer.zero_grad()
    return mon


def png_pixels(uri: str) -> np.ndarray:
    """An RGB PNG (filter 0 rows, as figures.png writes) back to an array."""
    data = base64.b64decode(uri.split(",", 1)[1])
    chunks, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind = data[at + 4:at + 8]
        chunks[kind] = chunks.get(kind, b"") + data[at + 8:at + 8 + length]
        at += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[r * (3 * width + 1) + 1:(r + 1) * (3 * width + 1)] for r in range(height)]
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(height, width, 3)


def test_the_page_draws_a_heatmap_per_statistic_a_small_plot_per_layer_and_the_alert(tmp_path):
    mon = spiky_run()
    (alert,) = mon.alerts
    page = Path(mon.report(tmp_path / "grads.html"))
    dom = _dom(page, tmp_path / "profile")
    # norm, absmax, update ratio per module, and output norms (no non-finite value: a table says so)
    assert dom.count("class=\"heatmap\"") == 4
    assert "none at any recorded step" in dom
    layers = ["(model)", "encoder", "block.0", "head"]  # the modules holding parameters themselves
    plots = re.findall(r'class="small-plot"[^>]*data-label="([^"]+)" data-points="(\d+)"', dom)
    assert [label for label, _n in plots[:4]] == layers
    assert all(int(points) == 12 for _label, points in plots)  # one point per recorded step
    assert dom.count(f'class="alert-mark" data-step="{alert.step}"') == 4  # one per heatmap
    assert alert.message.split(":")[0] in dom and "gradient_spike" in dom
    shot = tmp_path / "page.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'p2'}",
                    f"--screenshot={shot}", "--window-size=1200,1600", f"file://{page}"], capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000


def test_each_heatmap_cell_has_the_colour_of_its_modules_value_at_its_step(tmp_path):
    mon = spiky_run()
    frame = mon.to_pandas()
    html = grads_report(frame, mon.alerts, "t").to_html()
    first = re.search(r"<svg[^>]*class='heatmap'.*?href='(data:image/png;base64,[^']+)'", html, re.S)
    pixels = png_pixels(first.group(1))
    names, steps, values, recorded = grid(frame, "module", "norm")
    assert pixels.shape == (len(names), len(steps), 3)
    scale = figures.Scale.of(values[recorded], log=True)
    expected = figures.colors(values, recorded, scale)
    assert np.array_equal(pixels, expected)
    # the largest value gets viridis's top colour, the smallest its bottom one
    top, bottom = np.unravel_index(np.nanargmax(values), values.shape), np.unravel_index(np.nanargmin(values), values.shape)
    assert tuple(pixels[top]) == tuple(figures.VIRIDIS[-1].astype(np.uint8))
    assert tuple(pixels[bottom]) == tuple(figures.VIRIDIS[0].astype(np.uint8))
    assert names[0] == "" and steps.tolist() == list(range(12))


def test_backlens_report_draws_the_page_of_a_tensorboard_directory(tmp_path, capsys):
    mon = spiky_run(sink=str(tmp_path / "run"))
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    page = tmp_path / "run" / "grads.html"
    assert "HTML report" in capsys.readouterr().out
    # TensorBoard keeps float32: the same page as the monitor's rows rounded to float32
    frame = mon.to_pandas()
    frame["value"] = frame["value"].astype(np.float32).astype(np.float64)
    expected = grads_report(frame, mon.alerts, "backlens monitor: run").to_html()
    assert page.read_text() == expected


def test_backlens_report_draws_the_page_of_a_csv_file_as_mon_report_does(tmp_path):
    mon = spiky_run(sink=str(tmp_path / "grads.csv"))
    assert cli_main(["report", str(tmp_path / "grads.csv"), "--html", str(tmp_path / "cli.html")]) == 0
    mine = Path(mon.report(tmp_path / "mine.html")).read_text()
    theirs = (tmp_path / "cli.html").read_text()
    assert theirs.replace("backlens monitor: grads.csv", "T") == mine.replace("backlens monitor: Net", "T")


def test_backlens_report_on_a_path_without_monitor_rows_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no values a gradient monitor wrote" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path / "missing")]) == 2


def test_a_non_finite_gradient_is_a_red_cell_and_the_non_finite_heatmap_appears():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with bl.monitor(model, optimizer, stats=("norm", "nonfinite")) as mon:
            for step in range(4):
                loss_of(model(batch(step))).backward()
                if step == 2:
                    model.head.bias.grad[0] = float("nan")
                optimizer.step()
                optimizer.zero_grad()
    html = grads_report(mon.to_pandas(), mon.alerts, "t").to_html()
    images = re.findall(r"<svg[^>]*class='heatmap'.*?href='(data:image/png;base64,[^']+)'", html, re.S)
    assert len(images) == 2  # norm and non-finite values
    names, _steps, _values, _recorded = grid(mon.to_pandas(), "module", "norm")
    norm_pixels = png_pixels(images[0])
    red = {(names[r], c) for r, c in zip(*np.nonzero((norm_pixels == figures.NONFINITE_RGB).all(axis=-1)))}
    # step 2: the model and head hold head.bias; step 3: the NaN stepped into every weight
    assert {name for name, column in red if column == 2} == {"", "head"}
    assert {name for name, column in red if column == 3} == set(names)
    assert not {column for _name, column in red} & {0, 1}
    assert "gradient_nonfinite" in html and "head.bias" in html


def test_a_report_under_a_file_is_an_output_path_error_and_a_missing_folder_is_made(tmp_path):
    (tmp_path / "afile").write_text("mine")
    mon = spiky_run()
    bad = tmp_path / "afile" / "grads.html"
    with pytest.raises(bl.OutputPathError) as info:
        mon.report(bad)
    assert isinstance(info.value, OSError) and info.value.code == "output_not_writable"
    assert str(bad) in str(info.value)
    page = mon.report(tmp_path / "new" / "grads.html")
    assert Path(page).read_text().startswith("<!DOCTYPE html>")
