"""A KeyboardInterrupt at any moment of a captured forward or backward leaves nothing installed in torch.

interrupt_points.py raises KeyboardInterrupt at evenly spread lines of
backlens (and of torch's mode enter/exit code) during a captured forward and
two captured backwards, and at named places (a user's tensor hook, a custom
Function's backward, the FLOP census, backlens's own hooks, the user's
forward, installing and removing the checkpoint witness), in a fresh process.
After each: torch's mode stacks are empty, ``nn.Module._call_impl`` and the
checkpoint classes the witness swaps are torch's, the capture either records later passes
or refuses them with a named error (gradients stock either way), its records
read, and once it is closed a plain training step runs no backlens code and
gives stock gradients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("interrupt_points.py")
NAMED = ["a user's tensor hook", "a node's backward", "the user's forward", "the FLOP census",
         "a backlens pre-hook", "discovering nodes", "opening a pass", "closing a pass",
         "installing the checkpoint witness", "removing the checkpoint witness"]


@pytest.fixture(scope="module")
def points():
    done = subprocess.run([sys.executable, str(SCRIPT), "18"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_interrupts_land_in_the_forward_the_backward_and_every_named_place(points):
    names = [p["point"] for p in points]
    assert set(NAMED) <= set(names)
    lines = [p for p in points if p["point"].startswith("line ")]
    assert len(lines) >= 16
    assert sum(1 for p in lines if p["interrupted"] and "cap" not in p and "statuses" not in p) >= 3  # forward
    assert sum(1 for p in lines if p.get("statuses") and "failed" in p["statuses"]) >= 3  # backward
    assert all(p["interrupted"] for p in points if p["point"] in NAMED)


def test_no_mode_is_left_on_torchs_stacks(points):
    assert [p["point"] for p in points if p["mode_stacks"] != [0, 0]] == []


def test_module_call_impl_is_torchs_own_again(points):
    assert [p["point"] for p in points if not p["call_impl_stock"]] == []


def test_torchs_checkpoint_hooks_class_and_reentrant_forward_are_its_own_again(points):
    assert [p["point"] for p in points if not p["checkpoint_stock"]] == []


def test_an_interrupted_capture_records_later_passes_or_refuses_them_by_name(points):
    for point in points:
        later = point.get("later_backward")
        if later is None:
            continue  # interrupted in the forward: there is no capture
        assert later == "ok" or later.startswith("BacklensError"), point
        if later == "ok":
            assert point["later_grads_stock"], point
        assert point["records_readable"] is True, point
        assert "running" not in point["statuses"], point


def test_after_close_a_plain_step_runs_no_backlens_code_and_gives_stock_gradients(points):
    for point in points:
        assert point["engine_stock_after_close"], point
        # Importing backlens installs nothing in torch (live's Tensor.backward comes with the
        # first bl.wrap(), which this process never calls): no backlens code runs at all.
        assert point["backlens_entries_in_plain_step"] == [], point
        assert point["backlens_calls_in_plain_step"] == [], point
        assert point["plain_grads_stock"], point
