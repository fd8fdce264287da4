"""Bundle format version 2: every record type reads back identically; the file names nothing to import."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bundle_checks import assert_same_capture, reseal, same_value

import backlens as bl
from backlens.io import manifest as manifest_io
from models import MLP, loss_of


@pytest.fixture(scope="module")
def eventful(tmp_path_factory):
    """A capture with every kind of record: edits, a pass per trigger, a failed pass, kept activations."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 6, requires_grad=True)
    edits = [bl.when("relu_1", bl.scale(0.5)), bl.when(bl.grad("linear_2"), bl.clamp(-1.0, 1.0))]
    cap = bl.capture(model, x, save_grads=True, save_activations=bl.func("relu"), intervene=edits)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    torch.autograd.grad(loss, [x], retain_graph=False)
    with pytest.raises(bl.FreedGraphError):
        loss.backward()  # the graph was freed: a failed pass, explained
    path = cap.save(tmp_path_factory.mktemp("schema") / "b")
    return cap, path


def test_every_record_type_reads_back_identically(eventful):
    live, path = eventful
    loaded = bl.load(path)
    assert [p.status for p in live.passes] == ["ok", "ok", "failed"]
    assert_same_capture(live, loaded)
    assert same_value(live.forward_edits, loaded.forward_edits) and live.forward_edits
    assert same_value(live.passes[0].edits, loaded.passes[0].edits) and live.passes[0].edits
    assert live.inputs[0].grads and same_value([g.tensor for g in live.inputs[0].grads],
                                                [g.tensor for g in loaded.inputs[0].grads])


def test_a_failed_pass_keeps_its_error_type_name_and_message(eventful):
    live, path = eventful
    error = bl.load(path).passes[2].error
    assert type(error).__name__ == type(live.passes[2].error).__name__ == "FreedGraphError"
    assert str(error) == str(live.passes[2].error) and isinstance(error, Exception)


def test_a_saved_loaded_capture_saves_the_same_manifest_sections(eventful, tmp_path):
    _live, path = eventful
    again = bl.load(path).save(tmp_path / "again")
    first, second = (json.loads((p / "manifest.json").read_text()) for p in (path, again))
    skip = {"created", "tensors", "checksum"}
    assert {k: v for k, v in first.items() if k not in skip} == {k: v for k, v in second.items() if k not in skip}


def copy_of(path, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


@pytest.mark.parametrize("change", [
    lambda m: m["forward_edits"].__setitem__(0, {"$dataclass": "backlens_not_a_module:Edit", "fields": {}}),
    lambda m: m["forward_edits"][0].update({"$dataclass": "backlens_not_a_module:Edit"}),
    lambda m: m["passes"][2].update({"error": ["backlens_not_a_module:Error", "boom"]}),
    lambda m: m["ops"][0].update({"dtype": "backlens_not_a_module.dtype"}),
    lambda m: m["passes"][0].update({"policy": [{"kind": "backlens_not_a_module:Selector"}, "x"]}),
], ids=["dataclass_entry", "dataclass_field", "error_type", "dtype", "selector"])
def test_a_manifest_naming_a_class_or_module_is_refused(eventful, tmp_path, change):
    _live, path = eventful
    copy = copy_of(path, tmp_path)
    reseal(copy, change)
    with pytest.raises(bl.BundleError) as info:
        bl.load(copy)
    assert info.value.code == "bundle_corrupt" and str(copy / "manifest.json") in str(info.value)
    assert "backlens_not_a_module" not in sys.modules


def test_a_version_1_bundle_is_refused_with_the_version_it_needs(eventful, tmp_path):
    _live, path = eventful
    copy = copy_of(path, tmp_path)
    reseal(copy, lambda m: m.update({"format_version": 1, "backlens_version": "0.0.9"}))
    with pytest.raises(bl.BundleError) as info:
        bl.load(copy)
    message = str(info.value)
    assert info.value.code == "bundle_too_old"
    assert "format version 1" in message and f"reads format version {manifest_io.FORMAT_VERSION}" in message and "0.0.9" in message


def a_collective(**changes):
    return {"pass_number": 1, "kind": "all_reduce", "bytes": 64, "start_ns": 10, "end_ns": 20,
            "params": ["fc1.weight"], "modules": ["fc1"], **changes}


def a_checkpoint(**changes):
    recomputed = {"pass_number": 1, "call": 0, "recompute_flops": None, "duration_ns": 5}
    return {"module_call": None, "op_start": 0, "op_end": 1, "packed": 0, "reentrant": False,
            "recomputed": [recomputed], **changes}


def first_call_of_pass(m, number):
    return next(i for i, call in enumerate(m["calls"]) if call["pass_number"] == number)


def aten_ops(m):
    return m["cost"]["passes"][0]["aten_ops"]


def test_collectives_checkpoints_and_rank_within_their_ranges_read_back(eventful, tmp_path):
    _live, path = eventful
    copy = copy_of(path, tmp_path)

    def add(m):
        m["capture"].update(rank=1, world_size=2)
        m["collectives"].append(a_collective())
        m["checkpoints"]["entries"].append(a_checkpoint())

    reseal(copy, add)
    loaded = bl.load(copy)
    assert (loaded.rank, loaded.world_size) == (1, 2)
    assert [(c.kind, c.bytes, c.params) for c in loaded.passes[0].collectives] == [("all_reduce", 64, ("fc1.weight",))]
    assert [(c.packed, c.reentrant) for c in loaded.checkpoints] == [(0, False)]


@pytest.mark.parametrize("change, names", [
    (lambda m: m["calls"][0].update(wait_ns=-1), "wait_ns"),
    (lambda m: m["passes"][0].update(other_capture_nodes=-1), "other_capture_nodes"),
    (lambda m: m["passes"][0].update(order_coverage=None), "order_coverage"),
    (lambda m: m["modules"][0].update(call=0), "modules: [0] call:"),
    (lambda m: m["modules"][0].update(output_tracked=1), "output_tracked"),
    (lambda m: m["capture"].update(rank=0), "rank and world_size"),
    (lambda m: m["capture"].update(rank=2, world_size=2), "a rank below world_size"),
    (lambda m: m["capture"].update(rank=-1, world_size=2), "capture: rank:"),
    (lambda m: m["capture"].update(rank=None, world_size=0), "world_size"),
    (lambda m: m["collectives"].append(a_collective(kind="broadcast")), "kind"),
    (lambda m: m["collectives"].append(a_collective(bytes=-1)), "bytes"),
    (lambda m: m["collectives"].append(a_collective(end_ns=5)), "end_ns >= start_ns"),
    (lambda m: m["collectives"].append(a_collective(pass_number=99)), "pass_number"),
    (lambda m: m["collectives"].append(a_collective(params=[1])), "params"),
    (lambda m: aten_ops(m)["op"].__setitem__(0, len(aten_ops(m)["names"])), "op indices into names"),
    (lambda m: aten_ops(m)["flops"].append(1), "one length"),
    (lambda m: aten_ops(m)["flops"].__setitem__(0, -1), "flops"),
    (lambda m: aten_ops(m)["call"].__setitem__(0, 10**6), "aten_ops: call: expected an index into calls"),
    (lambda m: aten_ops(m)["call"].__setitem__(0, first_call_of_pass(m, 2)), "not of pass 1"),
    (lambda m: m["cost"]["passes"][0].update(aten_calls=m["cost"]["passes"][0]["aten_calls"] + 1), "aten_calls"),
    (lambda m: m["checkpoints"]["entries"].append(a_checkpoint(op_start=3, op_end=1)), "op_end"),
    (lambda m: m["checkpoints"]["entries"].append(a_checkpoint(reentrant=True)), "packed"),
    (lambda m: m["checkpoints"]["entries"].append(a_checkpoint(recomputed=[
        {"pass_number": 1, "call": 10**6, "recompute_flops": None, "duration_ns": None}])),
     "recomputed: [0] call: expected an index into calls"),
    (lambda m: m["checkpoints"]["entries"].append(a_checkpoint(recomputed=[
        {"pass_number": 1, "call": first_call_of_pass(m, 2), "recompute_flops": None, "duration_ns": None}])),
     "not of pass 1"),
    (lambda m: m.update(checkpoints=[1]), "checkpoints"),
    (lambda m: m["checkpoints"]["reasons"].append(3), "reasons"),
], ids=["negative_wait", "negative_other_capture_nodes", "no_order_coverage", "module_call_zero",
        "output_tracked_not_a_bool", "rank_without_world_size", "rank_not_below_world_size", "negative_rank",
        "world_size_zero", "unknown_collective_kind", "negative_collective_bytes", "collective_ends_before_start",
        "collective_of_a_pass_that_never_ran", "collective_params_not_strings", "aten_op_past_its_names",
        "aten_columns_of_unequal_lengths", "negative_aten_flops", "aten_call_out_of_range",
        "aten_call_of_another_pass", "aten_calls_miscounted", "checkpoint_range_backwards",
        "packed_for_a_reentrant_checkpoint", "recompute_call_out_of_range", "recompute_call_of_another_pass",
        "checkpoints_not_an_object", "checkpoint_reason_not_a_string"])
def test_a_field_of_the_distributed_checkpoint_or_aten_records_out_of_range_is_refused_naming_it(
        eventful, tmp_path, change, names):
    _live, path = eventful
    copy = copy_of(path, tmp_path)
    reseal(copy, change)
    with pytest.raises(bl.BundleError) as info:
        bl.load(copy)
    assert info.value.code == "bundle_corrupt" and names in str(info.value), str(info.value)
