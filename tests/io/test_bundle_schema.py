"""Bundle format version 2: every record type reads back identically; the file names nothing to import."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bundle_checks import assert_same_capture, same_value

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


def reseal(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("checksum")
    change(manifest)
    manifest_io.write(path, manifest)


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
    assert "format version 1" in message and "reads format version 2" in message and "0.0.9" in message
