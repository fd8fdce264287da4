"""Checks of a Trace Event format document (the JSON Perfetto and chrome://tracing open).

Written from the format's specification: a JSON object with a ``traceEvents``
list; every event has ``name``, ``ph``, ``pid`` and ``tid``; a complete
event (``"X"``) has numeric ``ts`` and ``dur`` in microseconds; metadata
events (``"M"``) carry ``args``; complete events on one thread must nest.
"""

from __future__ import annotations

from numbers import Real

REQUIRED = {"name", "ph", "pid", "tid"}
METADATA_NAMES = {"process_name", "thread_name", "thread_sort_index", "process_sort_index", "process_labels"}


def ns(value: float) -> int:
    """Microseconds in the file to integer nanoseconds."""
    return round(value * 1000)


def validate_trace(document: dict) -> list[dict]:
    """Assert that ``document`` is a valid Trace Event format object; return its complete events."""
    assert isinstance(document, dict) and isinstance(document.get("traceEvents"), list)
    assert document.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for event in document["traceEvents"]:
        missing = REQUIRED - event.keys()
        assert not missing, (event, missing)
        assert isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        if event["ph"] == "M":
            assert event["name"] in METADATA_NAMES and isinstance(event["args"], dict), event
        elif event["ph"] in ("s", "f"):  # a flow arrow's ends: an id shared by both, a time
            assert isinstance(event["id"], int) and isinstance(event["ts"], Real), event
        elif event["ph"] == "C":  # a counter sample: numeric series in args
            assert isinstance(event["ts"], Real) and all(isinstance(v, Real) for v in event["args"].values())
        else:
            assert event["ph"] == "X", event
            for key in ("ts", "dur"):
                assert isinstance(event[key], Real) and not isinstance(event[key], bool), event
                assert event[key] >= 0, event
            assert isinstance(event.get("args", {}), dict) and isinstance(event.get("cat", ""), str)
            complete.append(event)
    return complete


def parents_of(events: list[dict]) -> dict[int, int | None]:
    """Index of each complete event -> index of the event it nests in (None at top level).

    Asserts proper nesting on every thread: an event that overlaps the one
    open above it must lie entirely inside it.
    """
    order = sorted(range(len(events)), key=lambda i: (events[i]["pid"], events[i]["tid"],
                                                      ns(events[i]["ts"]), -ns(events[i]["dur"])))
    parents: dict[int, int | None] = {}
    stack: list[int] = []
    thread = None
    for i in order:
        event = events[i]
        if (event["pid"], event["tid"]) != thread:
            thread, stack = (event["pid"], event["tid"]), []
        start, end = ns(event["ts"]), ns(event["ts"]) + ns(event["dur"])
        # The open event ends before this one starts (one starting at the same time encloses it).
        while stack and ns(events[stack[-1]]["ts"]) < start \
                and ns(events[stack[-1]]["ts"]) + ns(events[stack[-1]]["dur"]) <= start:
            stack.pop()
        if stack:
            top = events[stack[-1]]
            top_end = ns(top["ts"]) + ns(top["dur"])
            assert ns(top["ts"]) <= start and end <= top_end, ("slices overlap without nesting", top, event)
        parents[i] = stack[-1] if stack else None
        stack.append(i)
    return parents


def ancestors(i: int, events: list[dict], parents: dict[int, int | None]) -> list[str]:
    """Names of the events ``i`` nests in, outermost first."""
    names = []
    parent = parents[i]
    while parent is not None:
        names.append(events[parent]["name"])
        parent = parents[parent]
    return names[::-1]
