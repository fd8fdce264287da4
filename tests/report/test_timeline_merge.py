"""The timeline on torch.profiler's clock: the forward, ATen children, flow arrows, and one
file holding a torch.profiler trace beside backlens's slices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import backlens as bl
from backlens.report.timeline import CounterSample, Timeline
from models import MLP
from trace_checks import ns, parents_of, validate_trace

HERE = Path(__file__).resolve()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        return torch.tanh(h) + x  # the ops of this line are the model's own


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def net_capture(passes: int = 1, **options):
    torch.manual_seed(0)
    cap = bl.capture(Net(), torch.randn(4, 6), **options)
    loss = cap.output.pow(2).sum()
    for i in range(passes):
        loss.backward(retain_graph=i < passes - 1)
    return cap


def test_the_forward_has_one_slice_per_module_call_and_per_op_nested_in_them():
    cap = net_capture()
    trace = bl.report.timeline(cap).to_trace()
    events = validate_trace(trace)
    parents = parents_of(events)
    modules = [e for e in events if e["cat"] == "forward_module"]
    ops = [e for e in events if e["cat"] == "forward_op"]
    assert sorted(e["name"] for e in modules) == sorted(m.label or "(model)" for m in cap.modules)
    assert [e["name"] for e in sorted(ops, key=lambda e: e["ts"])] == [op.label for op in cap.ops]
    for i, event in enumerate(events):
        if event["cat"] == "forward_op":
            op = cap.ops[event["name"]]
            assert events[parents[i]]["name"] == (op.module or "(model)")  # inside its module call


def test_a_forward_op_names_the_model_s_line_that_ran_it():
    cap = net_capture()
    tanh = cap.ops["tanh_1"]
    assert Path(tanh.call_site.file).resolve() == HERE and tanh.call_site.function == "forward"
    line = HERE.read_text().splitlines()[tanh.call_site.line - 1]
    assert "torch.tanh(h) + x" in line
    # the linear inside nn.Linear: the line that called the module
    linear = cap.ops["linear_1"]
    assert "self.fc(x)" in HERE.read_text().splitlines()[linear.call_site.line - 1]


def test_each_aten_call_of_a_counted_pass_is_a_child_of_its_node_call():
    cap = net_capture()
    events = validate_trace(bl.report.timeline(cap).to_trace())
    parents = parents_of(events)
    aten = [(i, e) for i, e in enumerate(events) if e["cat"] == "aten"]
    assert [e["name"] for _i, e in aten] == [op.name for op in cap.passes[0].aten_ops]
    for i, event in aten:
        if event["args"]["call"] is not None:
            assert events[parents[i]]["name"] == event["args"]["call"]
        else:
            assert events[parents[i]]["cat"] in ("pass", "module")


def test_a_flow_arrow_leads_from_each_forward_op_to_its_node_s_call():
    cap = net_capture()
    line = bl.report.timeline(cap)
    trace = line.to_trace()
    events = validate_trace(trace)
    parents = parents_of(events)
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    paired = [c for c in cap.passes[0].calls if c.grad_fn.op is not None]
    assert starts.keys() == finishes.keys() and len(starts) == len(paired) > 0

    def innermost(point: dict) -> dict:
        """The deepest complete event on the point's track containing its time (what a viewer binds to)."""
        at = ns(point["ts"])
        holding = [i for i, e in enumerate(events) if e["tid"] == point["tid"] and e["pid"] == point["pid"]
                   and ns(e["ts"]) <= at < ns(e["ts"]) + max(ns(e["dur"]), 1)]
        depth = {i: 0 for i in holding}
        for i in holding:
            parent = parents[i]
            while parent is not None:
                depth[i] += 1
                parent = parents[parent]
        return events[max(holding, key=depth.get)]

    arrows = {(innermost(starts[k])["name"], innermost(finishes[k])["name"]) for k in starts}
    assert arrows == {(c.grad_fn.op.label, c.label) for c in paired}
    assert all(finishes[k]["bp"] == "e" for k in finishes)


def test_the_profiler_s_trace_and_backlens_s_slices_share_one_file_aligned(tmp_path):
    torch.manual_seed(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cap = bl.capture(MLP(), torch.randn(4, 6))
        cap.output.pow(2).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "profiler.json"))
    theirs = json.loads((tmp_path / "profiler.json").read_text())
    path = bl.report.timeline(cap, profiler=prof).save(str(tmp_path / "merged.json"))
    merged = json.loads(Path(path).read_text())
    base = merged["baseTimeNanoseconds"]
    ours = validate_trace({"traceEvents": [e for e in merged["traceEvents"] if e.get("cat") in (
        "pass", "module", "node", "aten", "forward", "forward_module", "forward_op")]})
    our_pid = ours[0]["pid"]
    assert {e["pid"] for e in ours} == {our_pid}
    assert our_pid not in {e.get("pid") for e in theirs["traceEvents"]}

    # Every profiler event is there, at the same absolute time.
    def absolute(event, base_ns):
        return base_ns + round(event["ts"] * 1000)

    def ops(events):  # (torch exports its own "PyTorch Profiler" span a little differently each time)
        return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]

    theirs_timed = ops(theirs["traceEvents"])
    merged_theirs = ops(e for e in merged["traceEvents"] if e.get("pid") != our_pid)
    assert len(merged_theirs) == len(theirs_timed)
    for mine, original in zip(merged_theirs, theirs_timed):
        assert mine["name"] == original["name"]
        assert abs(absolute(mine, base) - absolute(original, theirs["baseTimeNanoseconds"])) <= 1

    # Aligned: the profiler's range of each node call (its module's) lies in backlens's slice of it.
    ranges = sorted((e for e in merged_theirs if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    nodes = sorted((e for e in ours if e["cat"] == "node"), key=lambda e: e["ts"])
    assert len(ranges) == len(nodes) == len(cap.passes[0].calls)
    slack_ns = 20_000  # the two clocks agree to a few microseconds
    for annotation, node in zip(ranges, nodes):
        middle = ns(annotation["ts"]) + ns(annotation["dur"]) // 2
        assert ns(node["ts"]) - slack_ns <= middle <= ns(node["ts"]) + ns(node["dur"]) + slack_ns, node["name"]


def test_a_saved_profiler_trace_file_merges_as_the_profile_does(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cap = bl.capture(MLP(), torch.randn(4, 6))
        cap.output.sum().backward()
    prof.export_chrome_trace(str(tmp_path / "p.json"))  # torch's own export, which runs once
    from_file = bl.report.timeline(cap, profiler=str(tmp_path / "p.json")).to_trace()
    from_profile = bl.report.timeline(cap, profiler=prof).to_trace()  # after it: still merges

    def split(trace):
        """backlens's slices at absolute times, and the profiler's op names."""
        base = trace["baseTimeNanoseconds"]
        mine = [(e["name"], base + round(e["ts"] * 1000), round(e["dur"] * 1000))
                for e in trace["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"]
        theirs = sorted(e["name"] for e in trace["traceEvents"] if e.get("pid") != 1 and e.get("cat") == "cpu_op")
        return mine, theirs

    assert split(from_file) == split(from_profile) and split(from_file)[1]


def test_a_profiler_that_never_ran_is_a_named_error():
    cap = net_capture()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.report.timeline(cap, profiler=prof)
    assert info.value.code == "profiler_not_finished"


def test_counter_samples_are_written_as_counter_events():
    line = Timeline([], [], origin_ns=5_000_000_000,
                    counters=[CounterSample("memory", 1500, {"held_bytes": 4096.0})])
    trace = line.to_trace()
    (sample,) = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert (sample["name"], sample["ts"], sample["args"]) == ("memory", 1.5, {"held_bytes": 4096.0})
    assert trace["baseTimeNanoseconds"] == 5_000_000_000


def as_version_2(path: Path) -> None:
    """Rewrite a saved bundle as format version 2 wrote it (no times, no clock)."""
    from backlens.io import manifest as manifest_io

    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("checksum")
    for op in manifest["ops"]:
        for name in ("start_ns", "end_ns", "call_site"):
            del op[name]
    for call in manifest["modules"]:
        del call["start_ns"], call["end_ns"]
    for entry in manifest["passes"]:
        del entry["clock_offset_ns"]
    del manifest["capture"]["forward_clock_offset_ns"]
    for pass_cost in manifest["cost"]["passes"]:
        del pass_cost["aten_ops"]["start_ns"], pass_cost["aten_ops"]["end_ns"]
    manifest["format_version"] = 2
    manifest_io.write(path, manifest)


def test_a_version_2_bundle_loads_with_its_passes_end_to_end_and_cannot_be_merged(tmp_path):
    cap = net_capture(passes=2)
    path = cap.save(tmp_path / "b")
    as_version_2(path)
    old = bl.load(path)
    assert old.ops["tanh_1"].call_site is None and old.passes[0].aten_ops[0].start is None
    line = bl.report.timeline(old)
    assert line.origin_ns is None and {s.kind for s in line} == {"pass", "module", "node"}
    passes = [s for s in line if s.kind == "pass"]
    assert passes[0].start_ns == 0 and passes[1].start_ns == passes[0].end_ns
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.report.timeline(old, profiler=str(tmp_path / "none.json"))
    assert info.value.code == "timeline_without_clock"


def test_a_loaded_bundle_keeps_the_forward_and_the_clock(tmp_path):
    cap = net_capture()
    loaded = bl.load(cap.save(tmp_path / "b"))
    assert loaded.ops["tanh_1"].call_site == cap.ops["tanh_1"].call_site
    assert bl.report.timeline(loaded).to_trace() == bl.report.timeline(cap).to_trace()
