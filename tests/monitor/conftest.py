"""Every monitor test fails on a monitor_failed warning: an internal failure the monitor survives
(and warns about) is still a bug, and must not pass unseen in a test that reads only some rows."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(autouse=True)
def no_monitor_failure():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    failed = [str(w.message) for w in caught if getattr(w.message, "code", None) == "monitor_failed"]
    assert not failed, failed
