"""A torch.profiler trace, read to be merged into a backlens timeline.

torch.profiler writes the Chrome Trace Event format (``prof.export_chrome_trace``):
``ts`` in microseconds from ``baseTimeNanoseconds``, both on the Unix-epoch
clock. :func:`read_profiler_trace` takes a finished ``torch.profiler.profile``
or the path of such a file and returns its events with their absolute base, so
a timeline can lay them beside its own slices on the same clock.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from backlens.errors import UnsupportedInputError

_REMEDY = ("Pass the torch.profiler.profile object after its `with` block has ended (or the path of the "
           "trace it exported with prof.export_chrome_trace).")


@dataclass
class ProfilerTrace:
    """The profiler's events (``ts`` in microseconds from ``base_ns``) and the file's other
    top-level fields (``deviceProperties``, ``distributedInfo``, ...)."""

    events: list[dict[str, Any]]
    base_ns: int
    other: dict[str, Any] = field(default_factory=dict)

    def earliest_ns(self) -> int | None:
        """The earliest event time, on the Unix-epoch clock (ns)."""
        times = [e["ts"] for e in self.events if _is_number(e.get("ts"))]
        return self.base_ns + int(min(times) * 1000) if times else None

    def pids(self) -> set[Any]:
        return {e.get("pid") for e in self.events}


def read_profiler_trace(profiler: Any) -> ProfilerTrace:
    """The trace of ``profiler``: a finished ``torch.profiler.profile``, or a path to the
    JSON (or ``.json.gz``) it exported."""
    if isinstance(profiler, (str, os.PathLike)):
        return _from_document(_read_json(os.fspath(profiler)), os.fspath(profiler))
    export = getattr(profiler, "export_chrome_trace", None)
    if export is None:
        raise UnsupportedInputError(
            f"timeline(cap, profiler=...) takes a torch.profiler.profile or a trace file path, "
            f"not {type(profiler).__name__}.", code="not_a_profiler", remedy=_REMEDY)
    with tempfile.TemporaryDirectory(prefix="backlens-profile-") as folder:
        path = os.path.join(folder, "trace.json")
        try:
            try:
                # torch's Python exporter reads the results and may run again; its native one
                # writes a trace once (a tensorboard_trace_handler may have used it already).
                export(path, use_python_export=True)
            except TypeError:
                export(path)
        except Exception as exc:  # noqa: BLE001 - torch says little: a profile never run or still running
            raise UnsupportedInputError(
                f"The profiler has no finished trace to merge ({type(exc).__name__}: {exc}).",
                code="profiler_not_finished", remedy=_REMEDY) from exc
        return _from_document(_read_json(path), "the profiler's trace")


def _read_json(path: str) -> Any:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise UnsupportedInputError(f"Cannot read the profiler trace {path}: {type(exc).__name__}: {exc}.",
                                    code="profiler_trace_unreadable", remedy=_REMEDY) from exc


def _from_document(document: Any, where: str) -> ProfilerTrace:
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        raise UnsupportedInputError(f"{where} is not a Chrome trace (no traceEvents list).",
                                    code="profiler_trace_unreadable", remedy=_REMEDY)
    base = document.get("baseTimeNanoseconds", 0)
    other = {k: v for k, v in document.items() if k not in ("traceEvents", "baseTimeNanoseconds", "displayTimeUnit")}
    return ProfilerTrace([e for e in events if isinstance(e, dict)], int(base) if _is_number(base) else 0, other)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
