"""bl.report.timeline: one slice per node call, nested in module calls and passes, as Trace Event JSON."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import bert
from trace_checks import ancestors, ns, parents_of, validate_trace


class Twice(nn.Module):
    """Calls one submodule twice (module calls ``inner:1`` and ``inner:2``)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(self.inner(x)))


def bert_capture(passes: int = 1, **options):
    torch.manual_seed(0)
    model = bert()
    ids = torch.tensor([[2, 7, 9, 11, 3, 5], [2, 5, 6, 3, 1, 1]])
    cap = bl.capture(model, ids, **options)
    loss = cap.output.last_hidden_state.pow(2).sum()
    for i in range(passes):
        loss.backward(retain_graph=i < passes - 1)
    return cap


def saved_trace(cap, tmp_path, **kwargs) -> dict:
    path = tmp_path / "trace.json"
    assert bl.report.timeline(cap, **kwargs).save(str(path)) == str(path)
    return json.loads(path.read_text())


def test_the_saved_file_is_valid_trace_event_json(tmp_path):
    events = validate_trace(saved_trace(bert_capture(), tmp_path))
    assert {e["cat"] for e in events} == {"pass", "module", "node", "aten", "forward", "forward_module",
                                          "forward_op"}


def test_slices_on_each_track_nest_properly_in_time(tmp_path):
    events = validate_trace(saved_trace(bert_capture(passes=2), tmp_path))
    parents = parents_of(events)  # asserts containment
    for i, event in enumerate(events):
        if event["cat"] not in ("pass", "forward"):
            assert parents[i] is not None, event  # nothing floats outside its pass or the forward


def test_there_is_one_slice_per_node_call_named_by_its_call_label(tmp_path):
    cap = bert_capture(passes=2)
    events = validate_trace(saved_trace(cap, tmp_path))
    nodes = [e["name"] for e in events if e["cat"] == "node"]
    assert Counter(nodes) == Counter(call.label for call in cap.grad_fn_calls)


def test_node_slices_add_up_to_each_pass_s_fire_durations(tmp_path):
    cap = bert_capture(passes=3)
    events = validate_trace(saved_trace(cap, tmp_path))
    for backward_pass in cap.passes:
        fired = [c for c in backward_pass.calls]
        slices = {e["name"]: e for e in events if e["cat"] == "node" and e["args"]["pass"] == backward_pass.number}
        assert len(slices) == len(fired)
        assert sum(ns(s["dur"]) for s in slices.values()) == sum(round(c.duration * 1e9) for c in fired)
        for call in fired:
            assert ns(slices[call.label]["dur"]) == round(call.duration * 1e9)


def test_a_node_slice_sits_inside_its_module_calls_and_its_pass(tmp_path):
    cap = bert_capture()
    events = validate_trace(saved_trace(cap, tmp_path))
    parents = parents_of(events)
    for i, event in enumerate(events):
        if event["cat"] != "node":
            continue
        call = cap.grad_fn_calls[event["name"]]
        module = call.grad_fn.module
        expected = ["pass 1"]
        if module is not None:
            parts = module.split(".")
            called = {m.address for m in cap.modules}
            expected += ["(model)"] + [p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1))
                                       if p in called]
        assert ancestors(i, events, parents) == expected, event["name"]


def test_each_module_slice_spans_exactly_its_nodes(tmp_path):
    cap = bert_capture()
    events = validate_trace(saved_trace(cap, tmp_path))
    parents = parents_of(events)
    children: dict[int, list[dict]] = {}
    for i, parent in parents.items():
        if parent is not None:
            children.setdefault(parent, []).append(events[i])
    modules = [i for i, e in enumerate(events) if e["cat"] == "module"]
    assert modules
    for i in modules:
        inside = children[i]
        assert ns(events[i]["ts"]) == min(ns(c["ts"]) for c in inside)
        assert ns(events[i]["ts"]) + ns(events[i]["dur"]) == max(ns(c["ts"]) + ns(c["dur"]) for c in inside)


def test_node_args_carry_label_type_op_module_flops_and_saved_gradient_bytes(tmp_path):
    cap = bert_capture(save_grads=True)
    events = validate_trace(saved_trace(cap, tmp_path))
    for event in (e for e in events if e["cat"] == "node"):
        call = cap.grad_fn_calls[event["name"]]
        saved = [t for side in (call.grad_inputs, call.grad_outputs) for t in side or () if t is not None]
        assert event["args"]["node"] == call.grad_fn.label
        assert event["args"]["type"] == call.grad_fn.type
        assert event["args"]["op"] == (call.grad_fn.op.label if call.grad_fn.op is not None else None)
        assert event["args"]["module"] == call.grad_fn.module
        assert event["args"]["flops"] == call.flops
        assert event["args"]["saved_grad_bytes"] == sum(t.numel() * t.element_size() for t in saved)
    assert any(e["args"]["saved_grad_bytes"] > 0 for e in events if e["cat"] == "node")
    assert sum(e["args"]["flops"] for e in events if e["cat"] == "node") == \
        bl.report.backward_status(cap).executed_flops


def test_without_saved_gradients_the_saved_bytes_are_zero(tmp_path):
    events = validate_trace(saved_trace(bert_capture(), tmp_path))
    assert {e["args"]["saved_grad_bytes"] for e in events if e["cat"] == "node"} == {0}


def test_passes_lie_where_they_ran_after_the_forward(tmp_path):
    cap = bert_capture(passes=3)
    events = validate_trace(saved_trace(cap, tmp_path))
    passes = sorted((e for e in events if e["cat"] == "pass"), key=lambda e: e["ts"])
    (forward,) = [e for e in events if e["cat"] == "forward"]
    assert [e["name"] for e in passes] == ["pass 1", "pass 2", "pass 3"]
    assert ns(forward["ts"]) + ns(forward["dur"]) <= ns(passes[0]["ts"])
    state = cap._state
    for before, after in zip(passes, passes[1:]):
        assert ns(before["ts"]) + ns(before["dur"]) <= ns(after["ts"])
    for event, entry in zip(passes[1:], state.passes[1:]):
        # the gap between two passes is what separated them (each pass's clock offset apart)
        first = state.passes[0]
        expected = (entry.start_ns + entry.clock_offset_ns) - (first.start_ns + first.clock_offset_ns)
        assert ns(event["ts"]) - ns(passes[0]["ts"]) == expected
    for event, backward_pass in zip(passes, cap.passes):
        assert ns(event["dur"]) == round(backward_pass.duration * 1e9)


def test_one_pass_alone_starts_at_zero(tmp_path):
    cap = bert_capture(passes=2)
    line = bl.report.timeline(cap, pass_=2)
    assert line.passes == [2] and {s.pass_number for s in line} == {2}
    assert min(s.start_ns for s in line) == 0
    assert len([s for s in line if s.kind == "node"]) == len(cap.passes.for_pass(2).calls)


def test_repeated_module_calls_get_their_own_slices():
    torch.manual_seed(0)
    cap = bl.capture(Twice(), torch.randn(3, 4))
    cap.output.sum().backward()
    line = bl.report.timeline(cap)
    modules = {s.name for s in line if s.kind == "module"}
    assert {"inner:1", "inner:2", "inner.0:1", "inner.0:2", "head"} <= modules
    second = [s for s in line if s.kind == "node" and s.args["module"] == "inner.0:2"]
    (outer,) = [s for s in line if s.name == "inner:2" and s.kind == "module"]
    assert second and all(outer.start_ns <= s.start_ns and s.end_ns <= outer.end_ns for s in second)


def test_a_loaded_bundle_gives_the_same_timeline(tmp_path):
    cap = bert_capture(passes=2, save_grads=True)
    cap.save(str(tmp_path / "b"))
    loaded = bl.load(str(tmp_path / "b"))
    assert bl.report.timeline(loaded).to_trace() == bl.report.timeline(cap).to_trace()


def test_to_pandas_has_one_row_per_slice():
    cap = bert_capture()
    line = bl.report.timeline(cap)
    frame = line.to_pandas()
    assert len(frame) == len(line) and list(frame["name"]) == [s.name for s in line]


def test_a_capture_without_timing_gives_an_empty_timeline_that_says_why(tmp_path):
    cap = bert_capture(timing=False)
    line = bl.report.timeline(cap)
    assert [s.kind for s in line if s.kind not in ("pass", "forward", "forward_module", "forward_op")] == []
    assert line.untimed_calls == len(cap.grad_fn_calls) > 0
    validate_trace(saved_trace(cap, tmp_path))


def test_a_capture_without_a_backward_gives_an_empty_timeline():
    cap = bl.capture(Twice(), torch.randn(3, 4))
    line = bl.report.timeline(cap)
    assert {s.kind for s in line} == {"forward", "forward_module", "forward_op"} and line.passes == []
    assert "no backward pass" in line.reason


def test_an_unknown_pass_number_is_an_error():
    cap = bert_capture()
    with pytest.raises(bl.LabelNotFoundError):
        bl.report.timeline(cap, pass_=5)


def test_saving_a_timeline_under_a_file_is_an_output_path_error_naming_it(tmp_path):
    (tmp_path / "afile").write_text("mine")
    cap = bert_capture()
    target = tmp_path / "afile" / "t.json"
    with pytest.raises(bl.OutputPathError) as info:
        bl.report.timeline(cap).save(str(target))
    assert isinstance(info.value, OSError) and info.value.code == "output_not_writable"
    assert str(target) in str(info.value)
    assert (tmp_path / "afile").read_text() == "mine"


def test_saving_a_timeline_makes_its_missing_folder_as_a_bundle_save_does(tmp_path):
    cap = bert_capture()
    target = tmp_path / "runs" / "one" / "t.json"
    bl.report.timeline(cap).save(str(target))
    assert json.loads(target.read_text())["traceEvents"]
