"""The clocks of a capture's times.

Hooks read ``now()`` (``time.perf_counter_ns``: monotonic, cheap). torch.profiler
stamps its events on the Unix-epoch clock (nanoseconds, as ``time.time_ns``), so
a pass, and the forward, also keep the offset between the two measured as they
start: a time ``t`` is ``t + offset`` on torch.profiler's clock. The offset is
measured anew for each pass because the wall clock may be slewed meanwhile.
"""

from __future__ import annotations

import time

now = time.perf_counter_ns


def profiler_clock_offset() -> int:
    """torch.profiler's clock minus ``now()``, in nanoseconds (best of three readings)."""
    best_width, offset = None, 0
    for _ in range(3):
        before = now()
        wall = time.time_ns()
        after = now()
        if best_width is None or after - before < best_width:
            best_width, offset = after - before, wall - (before + after) // 2
    return offset
