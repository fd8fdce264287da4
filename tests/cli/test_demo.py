"""The demo's pieces on a tiny BERT, its HTML report in headless Chromium, and the real run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import backlens as bl
from backlens.demo import DemoResult, mean_pool, run_similarity, token_section
from backlens.graph.labels import NO_FORWARD_OP
from backlens.report.profile import build_profile, html_report

# The tiny BERT's passes take milliseconds on a shared machine: their spread is the machine's, and
# what the timing_noisy warning says is tested in tests/report/test_profile.py.
pytestmark = pytest.mark.filterwarnings("ignore:Backward times are noisy")


def tiny_bert():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50, max_position_embeddings=16)
    model = transformers.BertModel(config).eval()
    batch = {
        "input_ids": torch.tensor([[2, 7, 9, 11, 3, 0], [2, 5, 6, 3, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
    }
    tokens = [["[CLS]", "a", "b", "c", "[SEP]"], ["[CLS]", "d", "e", "[SEP]"]]
    return model, batch, tokens


def test_token_scores_are_gradient_times_input_of_the_word_embeddings():
    model, batch, tokens = tiny_bert()
    result = run_similarity(model, batch, tokens)

    kept = {}
    handle = model.embeddings.word_embeddings.register_forward_hook(
        lambda m, i, out: kept.setdefault("out", out) if out.retain_grad() is None else None
    )
    hidden = model(**batch).last_hidden_state
    handle.remove()
    pooled = mean_pool(hidden, batch["attention_mask"])
    torch.nn.functional.cosine_similarity(pooled[0:1], pooled[1:2]).sum().backward()
    reference = (kept["out"].grad * kept["out"]).sum(-1)
    assert result.token_scores[0] == reference[0, :5].tolist()
    assert result.token_scores[1] == reference[1, :4].tolist()
    assert len(result.capture.passes) == 1


def _chromium() -> str:
    # `make test` passes the browser it found or installed as CHROMIUM.
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed for this test: `make test` installs it as root, or apt-get install chromium"
    return found


def _chromium_args(user_dir: Path) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={user_dir}"]


def _seen_in_chromium(tmp_path: Path, page_html: str, script: str, element_id: str):
    """Render ``page_html`` with ``script`` appended in headless Chromium; the JSON the script
    wrote into the element ``element_id``, and the rendered page."""
    page = tmp_path / "report.html"
    page.write_text(page_html.replace("</body>", script + "</body>"))
    dom = subprocess.run([_chromium(), *_chromium_args(tmp_path / "profile"), "--dump-dom", f"file://{page}"],
                         capture_output=True, text=True, timeout=120).stdout
    found = re.search(rf'<pre id="{element_id}">(.*?)</pre>', dom, re.S)
    return json.loads(found.group(1).replace("&quot;", '"')), dom


def test_the_html_report_renders_tables_and_bars_in_headless_chromium(tmp_path):
    model, batch, tokens = tiny_bert()
    result: DemoResult = run_similarity(model, batch, tokens)
    profile = build_profile(result.capture, "tiny demo")
    profile.extra.append(token_section(result))
    page = html_report(profile).write(str(tmp_path / "report.html"))

    chromium = _chromium()
    dom = subprocess.run([chromium, *_chromium_args(tmp_path / "profile"), "--dump-dom", f"file://{page}"],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<table>") == 3
    assert dom.count("<tr>") > 10
    assert dom.count("<rect") >= 2 and "<svg" in dom
    assert "[CLS]" in dom and "background:rgba(" in dom.replace(" ", "")
    shot = tmp_path / "report.png"
    subprocess.run([chromium, *_chromium_args(tmp_path / "profile2"), f"--screenshot={shot}",
                    "--window-size=1200,1600", f"file://{page}"], capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000


# Appended to a copy of the report: measures every Gantt bar as Chromium laid it out.
MEASURE = """<script>
const bars = [...document.querySelectorAll("svg.gantt g.gantt-row")].map(row => ({
  label: row.dataset.label,
  bars: [...row.querySelectorAll("rect.gantt-bar")].map(r => {
    const box = r.getBoundingClientRect();
    return {x: box.left, width: box.width};
  }),
}));
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify(bars);
document.body.appendChild(pre);
</script>"""


def test_the_gantt_view_has_a_bar_per_module_call_with_widths_proportional_to_time(tmp_path):
    model, batch, tokens = tiny_bert()
    cap = run_similarity(model, batch, tokens, repeats=4).capture
    profile = build_profile(cap, "tiny demo", depth=3)
    measured, dom = _seen_in_chromium(tmp_path, html_report(profile).to_html(), MEASURE, "measured")
    rows = {row["label"]: row["bars"] for row in measured}

    # The Gantt shows one of the timed passes (2-5), and says which.
    shown = int(re.search(r"Backward timeline of pass (\d+)", dom).group(1))
    assert shown in (2, 3, 4, 5) and f"The pass shown: pass {shown}, of the 4 timed passes" in dom
    # A row per module call down to depth 3 whose subtree ran nodes in that pass.
    tree = bl.report.cost_tree(cap, pass_=shown)
    expected = {row.address or "(model)" for row in tree.rows
                if row.kind == "module" and row.depth <= 3 and row.subtree_backward_time}
    assert set(rows) - {NO_FORWARD_OP} == expected
    assert all(rows[label] for label in expected)

    # Widths: one px-per-second scale for every bar, the chart's 760 px over the whole pass
    # (rendered, within half a pixel).
    line = bl.report.timeline(cap, pass_=shown)
    whole = next(piece for piece in line.for_pass(shown) if piece.kind == "pass")
    scale = 760 / whole.duration
    slices = {}
    for piece in line.for_pass(shown):
        if piece.kind == "module":
            slices.setdefault(piece.name, []).append(piece)
    for label in expected:
        assert len(rows[label]) == len(slices[label])
        for bar, piece in zip(rows[label], slices[label]):
            assert abs(bar["width"] - piece.duration * scale) < 0.5, (label, bar, piece.duration)
            assert abs(bar["x"] - rows["(model)"][0]["x"] - (piece.start - slices["(model)"][0].start) * scale) < 0.5


@pytest.mark.slow
def test_the_real_demo_runs_on_minilm_and_writes_a_bundle_and_a_report(tmp_path, capsys, monkeypatch):
    from backlens import cli

    monkeypatch.setenv("COLUMNS", "160")
    threads = torch.get_num_threads()
    try:
        code = cli.main(["demo", "--out", str(tmp_path)])  # in-process, as the console script runs it
    finally:
        torch.set_num_threads(threads)
    done = capsys.readouterr()
    assert code == 0, done.err
    for title in ("Which tokens move the similarity", "Backward profile per module",
                  "costliest node types", "Backward passes", "backward/forward FLOP ratio"):
        assert title in done.out
    assert "median of passes 2-11" in done.out and "cold first pass" in done.out
    assert "timed without the FLOP census" in done.out and "10 stock backward passes" in done.out
    assert (tmp_path / "demo.bundle" / "manifest.json").is_file()
    page = (tmp_path / "demo.html").read_text()
    assert page.count("<table>") == 3 and page.count("class='gantt-row'") > 10 and "class='icicle'" in page
    assert cli.main(["show", str(tmp_path / "demo.bundle")]) == 0 and "355" in capsys.readouterr().out


# Appended to a copy of the report: clicks the icicle's "encoder" band, then drags across the
# first half of the Gantt chart, and writes what the page shows then.
INTERACT = """<script>
const band = document.querySelector("svg.icicle g.icicle-cell[data-module='encoder']");
band.querySelector("rect").dispatchEvent(new MouseEvent("click", {bubbles: true}));
const gantt = document.querySelector("svg.gantt");
const box = gantt.getBoundingClientRect(), left = box.left + (+gantt.dataset.left), width = +gantt.dataset.width;
// a bar inside the first half of the pass: the zoom to that half doubles its width
const early = [...gantt.querySelectorAll("rect.gantt-bar")].find(r =>
  +r.dataset.duration > 0 && +r.dataset.start + +r.dataset.duration < +gantt.dataset.span / 2);
const model = () => early.getBoundingClientRect().width;
const before = model();
for (const [type, x] of [["mousedown", left], ["mousemove", left + width / 2], ["mouseup", left + width / 2]])
  gantt.dispatchEvent(new MouseEvent(type, {bubbles: true, clientX: x, clientY: box.top + 30}));
const pre = document.createElement("pre");
pre.id = "seen";
pre.textContent = JSON.stringify({
  title: document.getElementById("backlens-drill-title").textContent,
  rows: [...document.querySelectorAll("#backlens-drill-body tr")].map(tr => [...tr.children].map(td => td.textContent)),
  selected: [...document.querySelectorAll(".selected")].map(el => el.getAttribute("data-module")),
  zoom: model() / before,
});
document.body.appendChild(pre);
</script>"""


def test_the_page_links_the_icicle_the_gantt_and_the_node_list_in_headless_chromium(tmp_path):
    model, batch, tokens = tiny_bert()
    cap = run_similarity(model, batch, tokens, repeats=2).capture
    profile = build_profile(cap, "tiny demo", depth=3)
    seen, _dom = _seen_in_chromium(tmp_path, html_report(profile).to_html(), INTERACT, "seen")
    inside = [n for n in profile.nodes if n["module"] == "encoder" or n["module"].startswith("encoder.")]
    assert seen["title"] == f"encoder: {len(inside)} autograd nodes"
    assert sorted(row[0] for row in seen["rows"]) == sorted(n["label"] for n in inside)
    sources = {row[0]: row[4] for row in seen["rows"]}
    for node in inside:  # each node's forward source line, file name and line
        op = cap.grad_fns[node["label"]].op
        expected = f"{Path(op.call_site.file).name}:{op.call_site.line}" if op is not None else ""
        assert sources[node["label"]].startswith(expected)
    assert set(seen["selected"]) == {"encoder"} and len(seen["selected"]) >= 2  # its band and its Gantt row
    assert 1.9 < seen["zoom"] < 2.1  # half the span dragged: a bar in it twice as wide
