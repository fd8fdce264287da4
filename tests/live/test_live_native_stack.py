"""Torch errors inside live bodies walk only sound native frames (the Python 3.13 crash).

Every torch error records a native backtrace. Run inside a coroutine whose
base lies under stale stack memory, that walk read wild addresses and
crashed the process: a freed graph or a torch error in a backward block,
after many traces. The probe runs such traces in a child process (a crash
must fail the test, not the test run) and walks the whole native stack at
every step of them.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("native_stack_probe.py")


def _has_glibc_backtrace() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "backtrace")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_glibc_backtrace(),
    reason="the probe walks the native stack with glibc's backtrace(), as torch's errors do on Linux",
)


def test_many_traces_with_torch_errors_in_bodies_and_engine_run_without_crashing_and_on_sound_stacks():
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    done = subprocess.run(
        [sys.executable, str(PROBE), "12"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, f"the probe ended with {done.returncode}:\n{done.stderr[-4000:]}"
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["sound"] > 100
    assert counts["unsound"] == 0, counts
