"""Memory records in bundles, the timeline's counter track, the HTML memory view and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from memory_refs import HandNet

import backlens as bl
from backlens import cli
from backlens.io import manifest as manifest_io
from backlens.report.html import Report
from backlens.report.memory_view import COUNTER_NAME, memory_sections


def hand_capture(passes=1):
    torch.manual_seed(0)
    cap = bl.capture(HandNet(), torch.randn(3, 4), memory=True)
    loss = cap.output.sum()
    for k in range(passes):
        loss.backward(retain_graph=k < passes - 1)
    return cap


def test_memory_records_read_back_the_same_from_a_bundle(tmp_path):
    cap = hand_capture(passes=2)
    loaded = bl.load(cap.save(tmp_path / "b"))
    assert loaded.memory.to_pandas().equals(cap.memory.to_pandas())
    assert [row.freed for row in loaded.memory] == [row.freed for row in cap.memory]
    for live, read in zip(cap.passes, loaded.passes):
        assert read.memory == live.memory
    assert bl.report.memory_plan(loaded).rows == bl.report.memory_plan(cap).rows


def test_a_capture_without_memory_reads_back_without_memory(tmp_path):
    torch.manual_seed(0)
    cap = bl.capture(HandNet(), torch.randn(3, 4))
    assert bl.load(cap.save(tmp_path / "b")).memory is None


def resealed(path, tmp_path, change):
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop("checksum")
    change(manifest["memory"])
    manifest_io.write(copy, manifest)
    return copy


@pytest.mark.parametrize("change, names", [
    (lambda m: m["saves"][0].__setitem__(0, 10**6), "saves naming storages"),
    (lambda m: m["releases"].append(list(m["releases"][0])), "each save released at most once"),
    (lambda m: m["releases"][0].__setitem__(0, 10**6), "releases naming saves"),
    (lambda m: m["storages"][0].__setitem__(1, "heap"), "one of saved, param, buffer, grad"),
    (lambda m: m["fires"][0].__setitem__(0, 10**6), "fires"),
    (lambda m: m["saves"][0].__setitem__(1, -1), "saves"),
    (lambda m: m["releases"][0].__setitem__(2, 3), "memory: releases: [0]"),
], ids=["storage_out_of_range", "released_twice", "release_of_no_save", "unknown_storage_kind",
        "fire_call_out_of_range", "negative_op", "release_call_of_another_pass"])
def test_a_memory_section_out_of_range_is_refused_naming_it(tmp_path, change, names):
    cap = hand_capture(passes=2)
    copy = resealed(cap.save(tmp_path / "b"), tmp_path, change)
    with pytest.raises(bl.BundleError) as info:
        bl.load(copy)
    assert info.value.code == "bundle_corrupt" and names in str(info.value), str(info.value)


def test_the_timeline_has_a_counter_track_of_the_bytes_held_after_each_node_call():
    cap = hand_capture()
    trace = bl.report.timeline(cap).to_trace()
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    memory = cap.passes[0].memory
    assert {e["name"] for e in counters} == {COUNTER_NAME}
    assert [sum(e["args"].values()) for e in counters] == [memory.start_bytes] + [s.bytes for s in memory.samples]
    ends = sorted(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "node")
    assert [e["ts"] for e in counters[1:]] == pytest.approx(ends)
    (pass_slice,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "pass 1"]
    assert counters[0]["ts"] == pass_slice["ts"]  # what the pass starts holding, at its start


def test_a_capture_without_memory_has_no_counter_track():
    torch.manual_seed(0)
    cap = bl.capture(HandNet(), torch.randn(3, 4))
    cap.output.sum().backward()
    assert not [e for e in bl.report.timeline(cap).to_trace()["traceEvents"] if e["ph"] == "C"]


def test_the_html_memory_view_draws_the_bytes_held_and_the_saved_bytes_per_module():
    cap = hand_capture()
    report = Report("memory")
    report.sections += memory_sections(cap)
    page = report.to_html()
    assert page.count("class='memory-line'") == 4 and "peak 308 B after mm_back_2_5:1" in page
    assert "Saved for the backward per module call" in page
    for module in ("lin1", "act", "lin2"):
        assert f">{module}</text>" in page


def test_backlens_profile_memory_prints_the_peak_and_the_plan(tmp_path, capsys, monkeypatch):
    page = tmp_path / "p.html"
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["profile", "memory_refs:build_hand", "--memory", "--repeats", "1", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "Backward memory" in out and "Checkpointing plan" in out and "308 B" in out
    assert "class='memory-curve'" in page.read_text()


def test_a_memory_budget_alone_turns_memory_on_and_plans_for_that_budget(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["profile", "memory_refs:build_hand", "--memory-budget", "100", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "Backward memory" in out and "Checkpointing plan" in out and "100 B" in out
