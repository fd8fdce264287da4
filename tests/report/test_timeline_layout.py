"""Timeline layout on hand-written records: interleaved module calls and overlapping fires.

The engine on CPU runs one node at a time and rarely leaves a module call to
come back, so these cases are built from plain objects with the public record
fields the timeline reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import backlens as bl
from trace_checks import parents_of, validate_trace


class Passes(list):
    def for_pass(self, number):
        return next(p for p in self if p.number == number)


def fake_capture(fires):
    """``fires``: (call label, module call label or None, start s, duration s), all in pass 1."""
    modules = [
        SimpleNamespace(address="", label="", module_type="Net", children=["a", "b"]),
        SimpleNamespace(address="a", label="a", module_type="Linear", children=[]),
        SimpleNamespace(address="b", label="b", module_type="Linear", children=[]),
    ]
    calls = []
    for label, module, start, duration in fires:
        node = SimpleNamespace(label=label.split(":")[0], type="MmBackward0", op=None, module=module)
        calls.append(SimpleNamespace(label=label, grad_fn=node, start=start, duration=duration, flops=8,
                                     recompute_flops=0, grad_inputs=None, grad_outputs=None, pass_number=1))
    end = max(start + duration for _l, _m, start, duration in fires)
    backward_pass = SimpleNamespace(number=1, trigger="backward", call_site=None, status="ok", duration=end,
                                    calls=calls)
    return SimpleNamespace(passes=Passes([backward_pass]), modules=modules, grad_fn_calls=calls)


def test_a_module_call_left_and_reentered_gets_one_slice_per_stretch():
    cap = fake_capture([("x:1", "a", 0.0, 1e-3), ("y:1", "b", 1e-3, 1e-3), ("z:1", "a", 2e-3, 1e-3)])
    line = bl.report.timeline(cap)
    stretches = [s for s in line if s.kind == "module" and s.name == "a"]
    assert [s.args["stretch"] for s in stretches] == ["1/2", "2/2"]
    assert [(s.start_ns, s.duration_ns) for s in stretches] == [(0, 1_000_000), (2_000_000, 1_000_000)]
    (model,) = [s for s in line if s.name == "(model)"]
    assert (model.start_ns, model.duration_ns) == (0, 3_000_000) and "stretch" not in model.args
    events = validate_trace(line.to_trace())
    parents_of(events)


def test_overlapping_fires_go_on_separate_tracks():
    cap = fake_capture([("x:1", "a", 0.0, 2e-3), ("y:1", "b", 1e-3, 2e-3), ("z:1", "a", 3e-3, 1e-3)])
    line = bl.report.timeline(cap)
    tracks = {s.name: s.track for s in line if s.kind == "node"}
    assert tracks == {"x:1": 1, "y:1": 2, "z:1": 1}
    trace = line.to_trace()
    events = validate_trace(trace)
    parents_of(events)  # nesting holds on each track
    names = {(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {tid for tid, _name in names} == {1, 2}


def test_nodes_outside_every_module_sit_directly_in_the_pass():
    cap = fake_capture([("loss:1", None, 0.0, 1e-3), ("x:1", "a", 1e-3, 1e-3)])
    line = bl.report.timeline(cap)
    (loss,) = [s for s in line if s.name == "loss:1"]
    assert loss.depth == 1
    assert [s.name for s in line if s.kind == "module"] == ["(model)", "a"]


def test_a_module_never_called_itself_sits_under_its_nearest_called_ancestor():
    cap = fake_capture([("w:1", "a.out_proj", 0.0, 1e-3)])
    line = bl.report.timeline(cap)
    assert [(s.name, s.depth) for s in line] == [("pass 1", 0), ("(model)", 1), ("a", 2), ("a.out_proj", 3),
                                                 ("w:1", 4)]
