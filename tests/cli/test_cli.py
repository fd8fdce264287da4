"""The backlens command, run as a user would: a subprocess per command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


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
    assert page.read_text().count("<table>") == 3
    assert (bundle / "manifest.json").is_file()


def test_profile_with_repeats_times_the_backward_alone():
    done = run("profile", "tiny_factories:build", "--repeats", "3")
    assert done.returncode == 0, done.stderr
    assert "AddmmBackward0" in done.stdout


def test_show_prints_a_saved_bundle(tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--save", str(bundle)).returncode == 0
    page = tmp_path / "show.html"
    done = run("show", str(bundle), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert "1 backward passes" in done.stdout and "Backward passes" in done.stdout
    assert page.is_file()


def test_doctor_runs():
    done = run("doctor")
    assert done.returncode == 0 and "HAS_CURRENT_AUTOGRAD_NODE" in done.stdout


@pytest.mark.parametrize(
    ("factory", "needles"),
    [
        ("no_such_module:build", ["cannot import module 'no_such_module'"]),
        ("tiny_factories:no_such_factory", ["has no callable 'no_such_factory'"]),
        ("tiny_factories:build_broken", ["raised RuntimeError", "weights file missing"]),
        ("tiny_factories:build_not_a_model", ["returned int, not a torch.nn.Module"]),
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


def test_debug_shows_the_traceback():
    done = run("--debug", "profile", "tiny_factories:build_broken")
    assert done.returncode != 0 and "Traceback" in done.stderr
