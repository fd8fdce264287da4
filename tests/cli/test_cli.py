"""The backlens command, run in-process through ``cli.main(argv)`` as the console script
runs it (one test runs the real ``python -m backlens.cli`` in a subprocess)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_factories
import torch

import backlens as bl
from backlens import cli
from trace_checks import parents_of, validate_trace

HERE = Path(__file__).parent
ACCEPTED = "accepted: an nn.Module, or a tuple (model, inputs, loss_fn)"


def assert_one_clear_line(done, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0]


def test_the_console_entry_point_profiles_a_factory_and_writes_html_and_a_bundle(tmp_path):
    page, bundle = tmp_path / "p.html", tmp_path / "b"
    env = dict(os.environ, COLUMNS="160")
    done = subprocess.run([sys.executable, "-m", "backlens.cli", "profile", "tiny_factories:build", "--input-shape",
                           "4,8", "--repeats", "2", "--html", str(page), "--save", str(bundle)],
                          cwd=HERE, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Backward profile per module" in done.stdout and "fc1" in done.stdout
    assert "backward/forward FLOP ratio 1.33x" in done.stdout  # the input needs no grad: fc1 has one matmul
    html = page.read_text()
    assert html.count("<table") == 4 and "class='gantt'" in html and "class='icicle'" in html
    assert (bundle / "manifest.json").is_file()


def test_profile_runs_a_counted_cold_pass_then_timed_warm_ones_and_shows_medians_apart(run, tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "3", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert "median of passes 2-4" in done.stdout and "cold" in done.stdout
    assert "cold first pass" in done.stdout and "timed without the FLOP census" in done.stdout
    assert "interquartile range" in done.stdout and "stock backward passes" in done.stdout
    cap = bl.load(str(bundle))
    assert [p.number for p in cap.passes] == [1, 2, 3, 4] and {p.status for p in cap.passes} == {"ok"}
    assert len({len(p.calls) for p in cap.passes}) == 1  # every pass does the same work
    status = bl.report.backward_status(cap)
    assert [p.counted for p in status.passes] == [True, False, False, False]


def test_profile_by_default_runs_ten_warm_passes(run, tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--save", str(bundle)).returncode == 0
    assert len(bl.load(str(bundle)).passes) == 11


def test_profile_with_no_repeats_runs_one_pass_and_shows_no_cold_column(run, tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "0", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert "cold" not in done.stdout and len(bl.load(str(bundle)).passes) == 1
    assert "these passes also ran the FLOP census" in done.stdout  # its time is said to include it


def test_a_negative_repeat_count_is_refused(run):
    with pytest.raises(SystemExit):
        run("profile", "tiny_factories:build", "--repeats", "-1")


def test_profile_with_bench_times_the_backward_alone(run):
    done = run("profile", "tiny_factories:build", "--repeats", "2", "--bench")
    assert done.returncode == 0, done.stderr
    assert "backward alone" in done.stdout and "AddmmBackward0" in done.stdout


def test_profile_writes_the_timeline_as_trace_event_json(run, tmp_path):
    path, bundle = tmp_path / "t.json", tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "2", "--timeline", str(path), "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert str(path) in done.stdout.replace("\n", "")
    events = validate_trace(json.loads(path.read_text()))
    parents_of(events)
    cap = bl.load(str(bundle))
    assert sorted(e["name"] for e in events if e["cat"] == "node") == sorted(c.label for c in cap.grad_fn_calls)
    assert [e["name"] for e in events if e["cat"] == "pass"] == ["pass 1", "pass 2", "pass 3"]


def test_the_passes_call_site_names_the_factory_in_the_user_s_file(run, tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "1", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    line = inspect.getsourcelines(tiny_factories.build)[1]
    assert f"tiny_factories.py:{line} (build)" in done.stdout
    for backward_pass in bl.load(str(bundle)).passes:
        site = backward_pass.call_site
        assert (Path(site.file).name, site.line, site.function) == ("tiny_factories.py", line, "build")


def test_a_factory_may_return_the_model_a_batch_and_a_loss(run, tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build_with_inputs", "--repeats", "1", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    model, batch, loss_fn = tiny_factories.build_with_inputs()
    cap = bl.load(str(bundle))
    assert cap.inputs[0].shape == tuple(batch.shape) == (3, 8)
    # The factory's loss (a mean of squares), not --loss: its seed gradient reaches fc2's output.
    reference = bl.capture(model, batch)
    loss_fn(reference.output).backward()
    node_types = {c.grad_fn.type for c in cap.passes[0].calls}
    assert "MeanBackward0" in node_types and "PowBackward0" in node_types
    assert [c.grad_fn.type for c in cap.passes[0].calls] == [c.grad_fn.type for c in reference.passes[0].calls]


@pytest.mark.slow
def test_a_factory_may_feed_tokenized_text(run, tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build_tokenized", "--repeats", "1", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    cap = bl.load(str(bundle))
    assert {i.name for i in cap.inputs} >= {"input_ids", "attention_mask"}
    assert "encoder.layer.1" in done.stdout


def test_show_prints_a_saved_bundle(run, tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--repeats", "2", "--save", str(bundle)).returncode == 0
    page = tmp_path / "show.html"
    done = run("show", str(bundle), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert "3 backward passes" in done.stdout and "Backward passes" in done.stdout
    assert page.is_file()


def test_show_writes_the_timeline_of_a_saved_bundle(run, tmp_path):
    bundle, path = tmp_path / "b", tmp_path / "t.json"
    assert run("profile", "tiny_factories:build", "--repeats", "1", "--save", str(bundle)).returncode == 0
    done = run("show", str(bundle), "--timeline", str(path))
    assert done.returncode == 0, done.stderr
    assert json.loads(path.read_text()) == bl.report.timeline(bl.load(str(bundle))).to_trace()


def test_show_prints_a_derived_gradients_bundle_s_leaf_gradients(run, tmp_path):
    import numpy as np

    derived = bl.DerivedGrads(framework="jax", version="0.0", output=np.float32(1.5),
                              leaf_grads={"w": np.array([[1.0, -2.0]], dtype=np.float32)})
    derived.save(tmp_path / "d")
    done = run("show", str(tmp_path / "d"))
    assert done.returncode == 0, done.stderr
    assert "derived gradients from jax" in done.stdout and "(1, 2)" in done.stdout
    assert f"{np.linalg.norm([1.0, -2.0]):.4g}" in done.stdout


def test_show_refuses_a_timeline_of_a_derived_gradients_bundle(run, tmp_path):
    import numpy as np

    bl.DerivedGrads(framework="jax", version="0.0", output=np.float32(1.5),
                    leaf_grads={"w": np.ones(2, dtype=np.float32)}).save(tmp_path / "d")
    assert_one_clear_line(run("show", str(tmp_path / "d"), "--timeline", str(tmp_path / "t.json")),
                          "derived gradients", "--timeline")


def test_show_on_a_folder_of_ordinary_bundles_lists_them(run, tmp_path):
    for name in ("first", "second"):
        cap = bl.capture(torch.nn.Linear(3, 2), torch.randn(2, 3))
        cap.output.sum().backward()
        cap.save(tmp_path / name)
    done = run("show", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "folder of 2 bundles" in done.stdout and "first" in done.stdout and "second" in done.stdout
    assert f"backlens show {tmp_path / 'first'}" in done.stdout


def test_doctor_runs(run):
    done = run("doctor")
    assert done.returncode == 0 and "HAS_CURRENT_AUTOGRAD_NODE" in done.stdout and "HAS_PROFILER_RANGES" in done.stdout


@pytest.mark.parametrize(
    ("factory", "needles"),
    [
        ("no_such_module:build", ["cannot import module 'no_such_module'"]),
        ("tiny_factories:no_such_factory", ["has no callable 'no_such_factory'"]),
        ("tiny_factories:build_broken", ["raised RuntimeError", "weights file missing"]),
        ("tiny_factories:build_not_a_model", ["returned int;", ACCEPTED]),
        ("tiny_factories:build_pair", ["returned a tuple of 2 items;", ACCEPTED]),
        ("tiny_factories:build_with_bad_loss", ["loss_fn returned a tensor of shape (3, 4)", "scalar"]),
        ("tiny_factories", ["expected MODULE:FACTORY"]),
        ("tiny_factories:build_needs_mask", ["NeedsMask.forward(x, mask)"]),
    ],
)
def test_bad_profile_input_gets_one_clear_line_and_exit_code_2(run, factory, needles):
    assert_one_clear_line(run("profile", factory), *needles)


@pytest.mark.parametrize(
    ("factory", "options", "needles"),
    [
        ("build_cnn", [], ["random floats of shape (2, 8)", "conv2d", "--input-shape", "2,3,32,32"]),
        ("build_cnn", ["--input-ids"], ["token ids of shape (2, 8)", "--input-shape"]),
        ("build_bert", [], ["random floats of shape (2, 8)", "embedding", "--input-ids"]),
        ("build_bert", ["--input-ids", "--input-shape", "2,3,4,5"], ["token ids of shape (2, 3, 4, 5)",
                                                                     "--input-shape"]),
    ],
)
def test_an_input_the_cli_made_that_the_model_refuses_gets_a_named_error(run, factory, options, needles):
    assert_one_clear_line(run("profile", f"tiny_factories:{factory}", "--repeats", "0", *options),
                          "the model's forward failed on the input backlens made for it", *needles)


def test_token_ids_reach_a_bert_factory(run):
    done = run("profile", "tiny_factories:build_bert", "--input-ids", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    assert "encoder.layer.0" in done.stdout


def test_an_unreadable_bundle_gets_one_clear_line(run, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")
    assert_one_clear_line(run("show", str(tmp_path / "junk")), "BundleError", "manifest.json")


def test_a_hostile_bundle_gets_one_line_naming_the_file(run, tmp_path):
    cap = bl.capture(torch.nn.Linear(3, 2), torch.randn(2, 3), save_grads=True)
    cap.output.sum().backward()
    path = cap.save(tmp_path / "b")
    shard = next(path.glob("*.safetensors"))
    shard.unlink()
    shard.symlink_to("/dev/zero")
    assert_one_clear_line(run("show", str(path)), "BundleError", str(shard), "symlink")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_before_or_after_the_subcommand(run, where):
    argv = ["--debug", "profile", "tiny_factories:build_broken"] if where == "before" else \
        ["profile", "tiny_factories:build_broken", "--debug"]
    with pytest.raises(cli.UsageError, match="weights file missing"):
        run(*argv)


def test_debug_is_off_unless_asked(run):
    assert run("profile", "tiny_factories:build_broken").returncode == 2
