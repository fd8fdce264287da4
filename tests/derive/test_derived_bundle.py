"""Derived gradients save to a bundle and bl.load reads them back; damaged bundles are refused."""

from __future__ import annotations

import hashlib
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tinygrad import Tensor, nn
from torch_ports import mlp_input, mlp_weights

import backlens as bl
from backlens.derive import bundle as derived_bundle
from backlens.derive import saving as derived_saving
from backlens.io import files, replace


def mlp(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) ** 2)


@pytest.fixture(scope="module")
def jax_grads():
    params = {name: jnp.asarray(w) for name, w in mlp_weights().items()}
    return bl.derive(mlp, params, jnp.asarray(mlp_input()), intermediate=True, max_intermediate=6)


def assert_same_record(loaded, live):
    assert type(loaded) is bl.DerivedGrads
    assert (loaded.framework, loaded.version, loaded.notes) == (live.framework, live.version, live.notes)
    assert np.array_equal(loaded.output, live.output) and loaded.output.dtype == live.output.dtype
    assert loaded.output.shape == live.output.shape
    assert list(loaded.leaf_grads) == list(live.leaf_grads)
    for name, grad in live.leaf_grads.items():
        assert loaded.leaf_grads[name].dtype == grad.dtype and np.array_equal(loaded.leaf_grads[name], grad), name
    if live.intermediates is None:
        assert loaded.intermediates is None
        return
    assert loaded.intermediates.labels == live.intermediates.labels
    assert dict(loaded.intermediates.withheld) == dict(live.intermediates.withheld)
    assert loaded.intermediates.notes == live.intermediates.notes
    for a, b in zip(loaded.intermediates, live.intermediates):
        assert (a.op, a.output_index, a.status) == (b.op, b.output_index, b.status)
        assert a.grad.dtype == b.grad.dtype and np.array_equal(a.grad, b.grad), a.label


def test_jax_record_with_intermediates_round_trips_through_bl_load(tmp_path, jax_grads):
    path = jax_grads.save(tmp_path / "derived")
    loaded = bl.load(path)
    assert_same_record(loaded, jax_grads)
    assert dict(loaded.intermediates.withheld) == {"not_computed": 4}
    assert all(not g.flags.writeable for g in loaded.leaf_grads.values())
    assert loaded.to_pandas().drop(columns="grad").equals(jax_grads.to_pandas().drop(columns="grad"))


def test_tinygrad_record_without_intermediates_round_trips(tmp_path):
    class Model:
        def __init__(self):
            self.fc = nn.Linear(4, 2)

    model = Model()
    grads = bl.derive(lambda m, x: m.fc(x).square().mean(), model, Tensor(mlp_input()))
    assert_same_record(bl.load(grads.save(tmp_path / "t")), grads)


def test_the_manifest_says_kind_derived_and_lists_every_array(tmp_path, jax_grads):
    path = jax_grads.save(tmp_path / "derived")
    assert sorted(os.listdir(path)) == ["manifest.json", "tensors.safetensors"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["kind"], manifest["format_version"]) == ("backlens.derived", "derived", 1)
    assert [leaf["name"] for leaf in manifest["leaf_grads"]] == list(jax_grads.leaf_grads)
    data = (path / "tensors.safetensors").read_bytes()
    assert manifest["file"] == {"name": "tensors.safetensors", "bytes": len(data),
                                "sha256": hashlib.sha256(data).hexdigest()}


def test_capture_bundles_still_load_as_captures(tmp_path):
    model = torch.nn.Linear(3, 2)
    with bl.capture(model, torch.ones(1, 3)) as cap:
        cap.output.sum().backward()
        cap.save(tmp_path / "cap")
    loaded = bl.load(tmp_path / "cap")
    assert not isinstance(loaded, bl.DerivedGrads) and len(loaded.passes) == 1


def test_saving_over_an_existing_bundle_needs_overwrite(tmp_path, jax_grads):
    path = jax_grads.save(tmp_path / "derived")
    with pytest.raises(bl.BundleError) as info:
        jax_grads.save(path)
    assert info.value.code == "bundle_exists"
    jax_grads.save(path, overwrite=True)
    assert_same_record(bl.load(path), jax_grads)
    assert [p.name for p in tmp_path.iterdir()] == ["derived"]  # no temporary left beside it


def test_overwrite_never_replaces_a_directory_that_is_not_a_bundle(tmp_path, jax_grads):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(bl.BundleError) as info:
        jax_grads.save(tmp_path / "notes", overwrite=True)
    assert info.value.code == "bundle_not_a_bundle"
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_failed_save_leaves_the_old_bundle_in_place(tmp_path, jax_grads, monkeypatch):
    path = jax_grads.save(tmp_path / "derived")
    before = (path / "manifest.json").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(replace, "put_in_place", disk_full)
    with pytest.raises(bl.BundleError) as info:
        jax_grads.save(path, overwrite=True)
    assert info.value.code == "bundle_write_failed"
    assert (path / "manifest.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["derived"]


def _rewrite_manifest(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    manifest["checksum"] = derived_saving.checksum(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _flip_last_byte(path):
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(data))


def _replace_with_symlink(path):
    target = path.parent / "elsewhere.safetensors"
    os.replace(path / "tensors.safetensors", target)
    os.symlink(target, path / "tensors.safetensors")


DAMAGE = {
    "edited manifest": (lambda p: (p / "manifest.json").write_text(
        (p / "manifest.json").read_text().replace('"jax"', '"jaz"')), "checksum mismatch"),
    "flipped tensor byte": (_flip_last_byte, "sha256 mismatch"),
    "truncated tensors": (lambda p: (p / "tensors.safetensors").write_bytes(
        (p / "tensors.safetensors").read_bytes()[:-10]), "truncated"),
    "missing tensors": (lambda p: (p / "tensors.safetensors").unlink(), "missing"),
    "symlinked tensors": (_replace_with_symlink, "symlink"),
    "not json": (lambda p: (p / "manifest.json").write_text('{"format": "backlens.derived", "kind": "derived"'),
                 "malformed JSON"),
    "unknown field": (lambda p: _rewrite_manifest(p, lambda m: m.update(module="os.system")), "unexpected ['module']"),
    "other file name": (lambda p: _rewrite_manifest(p, lambda m: m["file"].update(name="../x")), "file.name"),
    "bad dtype": (lambda p: _rewrite_manifest(p, lambda m: m["output"].update(dtype="object")), "output.dtype"),
    "bad shape": (lambda p: _rewrite_manifest(p, lambda m: m["leaf_grads"][0].update(shape=[-1])), "shape"),
    "shape differs from the array": (lambda p: _rewrite_manifest(p, lambda m: m["leaf_grads"][0].update(shape=[7])),
                                     "the manifest says"),
    "repeated leaf name": (lambda p: _rewrite_manifest(
        p, lambda m: m["leaf_grads"][1].update(name=m["leaf_grads"][0]["name"])), "repeats"),
    "status not exact": (lambda p: _rewrite_manifest(
        p, lambda m: m["intermediates"]["records"][0].update(status="mismatch")), "status"),
    "negative count": (lambda p: _rewrite_manifest(
        p, lambda m: m["intermediates"]["withheld"].update(not_computed=-1)), "withheld"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_bundle_raises_bundle_error_naming_the_file(tmp_path, jax_grads, damage):
    change, words = DAMAGE[damage]
    path = jax_grads.save(tmp_path / "derived")
    change(path)
    with pytest.raises(bl.BundleError) as info:
        bl.load(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_a_newer_format_version_asks_for_an_upgrade(tmp_path, jax_grads):
    path = jax_grads.save(tmp_path / "derived")
    _rewrite_manifest(path, lambda m: m.update(format_version=2))
    with pytest.raises(bl.BundleError) as info:
        bl.load(path)
    assert info.value.code == "bundle_too_new"


def test_a_large_manifest_is_recognised_by_its_opening(tmp_path, jax_grads, monkeypatch):
    path = jax_grads.save(tmp_path / "derived")
    monkeypatch.setattr(files, "PEEK_WHOLE_BELOW", 64)
    assert derived_bundle.is_derived(path)
    assert_same_record(bl.load(path), jax_grads)


def test_a_derived_bundle_replacement_cut_between_its_renames_is_restored_by_load(tmp_path, jax_grads):
    path = jax_grads.save(tmp_path / "derived")
    os.rename(path, tmp_path / ".derived.old-0123456789ab")  # what a kill after the first rename leaves
    assert_same_record(bl.load(path), jax_grads)
    assert [p.name for p in tmp_path.iterdir()] == ["derived"]
