"""The backlens command, run as a user would: a subprocess per command."""

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
from trace_checks import parents_of, validate_trace

HERE = Path(__file__).parent
ACCEPTED = "accepted: an nn.Module, or a tuple (model, inputs, loss_fn)"


def run(*args: str, cwd: Path = HERE) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="160")
    return subprocess.run([sys.executable, "-m", "backlens.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


def assert_one_clear_line(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0]


def test_profile_prints_the_backward_profile_and_writes_html_and_a_bundle(tmp_path):
    page, bundle = tmp_path / "p.html", tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--input-shape", "4,8", "--html", str(page),
               "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert "Backward profile per module" in done.stdout and "fc1" in done.stdout
    assert "backward/forward FLOP ratio 1.33x" in done.stdout  # the input needs no grad: fc1 has one matmul
    assert page.read_text().count("<table>") == 3 and "class='gantt'" in page.read_text()
    assert (bundle / "manifest.json").is_file()


def test_profile_runs_a_cold_pass_then_repeats_warm_ones_and_shows_medians_apart(tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "3", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert "median of passes 2-4" in done.stdout and "cold" in done.stdout
    assert "cold first pass" in done.stdout
    cap = bl.load(str(bundle))
    assert [p.number for p in cap.passes] == [1, 2, 3, 4] and {p.status for p in cap.passes} == {"ok"}
    assert len({len(p.calls) for p in cap.passes}) == 1  # every pass does the same work


def test_profile_by_default_runs_ten_warm_passes(tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--save", str(bundle)).returncode == 0
    assert len(bl.load(str(bundle)).passes) == 11


def test_profile_with_no_repeats_runs_one_pass_and_shows_no_cold_column(tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "0", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert "cold" not in done.stdout and len(bl.load(str(bundle)).passes) == 1


def test_a_negative_repeat_count_is_refused():
    done = run("profile", "tiny_factories:build", "--repeats", "-1")
    assert done.returncode == 2 and "expected a whole number 0 or more" in done.stderr


def test_profile_with_bench_times_the_backward_alone():
    done = run("profile", "tiny_factories:build", "--repeats", "2", "--bench")
    assert done.returncode == 0, done.stderr
    assert "backward alone" in done.stdout and "AddmmBackward0" in done.stdout


def test_profile_writes_the_timeline_as_trace_event_json(tmp_path):
    path, bundle = tmp_path / "t.json", tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "2", "--timeline", str(path), "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    assert str(path) in done.stdout.replace("\n", "")
    events = validate_trace(json.loads(path.read_text()))
    parents_of(events)
    cap = bl.load(str(bundle))
    assert sorted(e["name"] for e in events if e["cat"] == "node") == sorted(c.label for c in cap.grad_fn_calls)
    assert [e["name"] for e in events if e["cat"] == "pass"] == ["pass 1", "pass 2", "pass 3"]


def test_the_passes_call_site_names_the_factory_in_the_user_s_file(tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build", "--repeats", "1", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    line = inspect.getsourcelines(tiny_factories.build)[1]
    assert f"tiny_factories.py:{line} (build)" in done.stdout
    for backward_pass in bl.load(str(bundle)).passes:
        site = backward_pass.call_site
        assert (Path(site.file).name, site.line, site.function) == ("tiny_factories.py", line, "build")


def test_a_factory_may_return_the_model_a_batch_and_a_loss(tmp_path):
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
def test_a_factory_may_feed_tokenized_text(tmp_path):
    bundle = tmp_path / "b"
    done = run("profile", "tiny_factories:build_tokenized", "--repeats", "1", "--save", str(bundle))
    assert done.returncode == 0, done.stderr
    cap = bl.load(str(bundle))
    assert {i.name for i in cap.inputs} >= {"input_ids", "attention_mask"}
    assert "encoder.layer.1" in done.stdout


def test_show_prints_a_saved_bundle(tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--save", str(bundle)).returncode == 0
    page = tmp_path / "show.html"
    done = run("show", str(bundle), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert "11 backward passes" in done.stdout and "Backward passes" in done.stdout
    assert page.is_file()


def test_show_writes_the_timeline_of_a_saved_bundle(tmp_path):
    bundle, path = tmp_path / "b", tmp_path / "t.json"
    assert run("profile", "tiny_factories:build", "--repeats", "1", "--save", str(bundle)).returncode == 0
    done = run("show", str(bundle), "--timeline", str(path))
    assert done.returncode == 0, done.stderr
    assert json.loads(path.read_text()) == bl.report.timeline(bl.load(str(bundle))).to_trace()


def test_show_prints_a_derived_gradients_bundle_s_leaf_gradients(tmp_path):
    import numpy as np

    derived = bl.DerivedGrads(framework="jax", version="0.0", output=np.float32(1.5),
                              leaf_grads={"w": np.array([[1.0, -2.0]], dtype=np.float32)})
    derived.save(tmp_path / "d")
    done = run("show", str(tmp_path / "d"))
    assert done.returncode == 0, done.stderr
    assert "derived gradients from jax" in done.stdout and "(1, 2)" in done.stdout
    assert f"{np.linalg.norm([1.0, -2.0]):.4g}" in done.stdout


def test_show_refuses_a_timeline_of_a_derived_gradients_bundle(tmp_path):
    import numpy as np

    bl.DerivedGrads(framework="jax", version="0.0", output=np.float32(1.5),
                    leaf_grads={"w": np.ones(2, dtype=np.float32)}).save(tmp_path / "d")
    assert_one_clear_line(run("show", str(tmp_path / "d"), "--timeline", str(tmp_path / "t.json")),
                          "derived gradients", "--timeline")


def test_doctor_runs():
    done = run("doctor")
    assert done.returncode == 0 and "HAS_CURRENT_AUTOGRAD_NODE" in done.stdout


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
def test_bad_profile_input_gets_one_clear_line_and_exit_code_2(factory, needles):
    assert_one_clear_line(run("profile", factory), *needles)


def test_an_unreadable_bundle_gets_one_clear_line(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")
    assert_one_clear_line(run("show", str(tmp_path / "junk")), "BundleError", "manifest.json")


def test_a_hostile_bundle_gets_one_line_naming_the_file(tmp_path):
    cap = bl.capture(torch.nn.Linear(3, 2), torch.randn(2, 3), save_grads=True)
    cap.output.sum().backward()
    path = cap.save(tmp_path / "b")
    shard = next(path.glob("*.safetensors"))
    shard.unlink()
    shard.symlink_to("/dev/zero")
    assert_one_clear_line(run("show", str(path)), "BundleError", str(shard), "symlink")


def test_debug_shows_the_traceback():
    done = run("--debug", "profile", "tiny_factories:build_broken")
    assert done.returncode != 0 and "Traceback" in done.stderr
