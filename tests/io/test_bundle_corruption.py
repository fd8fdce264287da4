"""Damaged, missing or foreign bundles raise BundleError naming the file; no half-written bundle loads."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from bundle_checks import reseal

import backlens as bl
from backlens import load
from backlens.io import bundle as bundle_io
from backlens.io import manifest as manifest_io
from backlens.io.disk_store import to_disk
from backlens.io.shards import ShardWriter
from models import MLP, loss_of


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A bundle with several shards (streamed with tiny shards), and its capture."""
    root = tmp_path_factory.mktemp("pristine")
    with bl.capture(MLP(), torch.randn(4, 6), save_grads=True, save_activations=True,
                    storage=to_disk(root / "b", shard_bytes=512)) as cap:
        loss = loss_of(cap.output)
        loss.backward(retain_graph=True)
        loss.backward()
    assert len(list((root / "b").glob("*.safetensors"))) > 2
    load(root / "b")  # sound before we damage copies of it
    return root / "b"


def copy_of(pristine: Path, tmp_path: Path) -> Path:
    target = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
    shutil.copytree(pristine, target)
    return target


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def expect_bundle_error(path: Path, names: Path | None = None) -> bl.BundleError:
    with pytest.raises(bl.BundleError) as info:
        load(path)
    assert isinstance(info.value, ValueError) and info.value.code.startswith("bundle_")
    assert str(names or path) in str(info.value), (str(info.value), names)
    return info.value


def flip_bit(path: Path, position: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_truncated_shards_are_refused(pristine, tmp_path):
    for index in range(len(shards(pristine))):
        for keep in (0, 4, 8, 20, -1):
            path = copy_of(pristine, tmp_path)
            shard = shards(path)[index]
            data = shard.read_bytes()
            shard.write_bytes(data[:keep] if keep >= 0 else data[:keep])
            expect_bundle_error(path, shard)


def test_a_shard_with_extra_bytes_is_refused(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)
    shard = shards(path)[0]
    shard.write_bytes(shard.read_bytes() + b"\0")
    expect_bundle_error(path, shard)


def test_every_bit_flip_in_a_shard_is_caught(pristine, tmp_path):
    rng = random.Random(0)
    for _ in range(60):
        path = copy_of(pristine, tmp_path)
        shard = rng.choice(shards(path))
        flip_bit(shard, rng.randrange(shard.stat().st_size), rng.randrange(8))
        expect_bundle_error(path, shard)
        shutil.rmtree(path)


def test_every_bit_flip_in_the_manifest_is_caught(pristine, tmp_path):
    rng = random.Random(1)
    for _ in range(60):
        path = copy_of(pristine, tmp_path)
        manifest = path / "manifest.json"
        flip_bit(manifest, rng.randrange(manifest.stat().st_size), rng.randrange(8))
        expect_bundle_error(path, manifest)
        shutil.rmtree(path)


def test_each_missing_shard_is_named(pristine, tmp_path):
    for index in range(len(shards(pristine))):
        path = copy_of(pristine, tmp_path)
        missing = shards(path)[index]
        missing.unlink()
        error = expect_bundle_error(path, missing)
        assert error.code == "bundle_missing_file"


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"format": "backlens.bundle"}',
                                  b'{"format": "other"}'])
def test_a_malformed_manifest_is_refused(pristine, tmp_path, text):
    path = copy_of(pristine, tmp_path)
    (path / "manifest.json").write_bytes(text)
    expect_bundle_error(path, path / "manifest.json")


def test_a_missing_manifest_is_refused(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)
    (path / "manifest.json").unlink()
    assert expect_bundle_error(path).code == "bundle_not_a_bundle"


def test_a_tensor_sha256_that_does_not_match_is_refused(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)

    def change(manifest):
        entry = next(iter(manifest["tensors"]["index"].values()))
        entry["sha256"] = "0" * 64

    reseal(path, change)
    assert "sha256 mismatch" in str(expect_bundle_error(path))


def test_a_file_sha256_that_does_not_match_is_refused(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)

    def change(manifest):
        info = next(iter(manifest["tensors"]["files"].values()))
        info["sha256"] = "f" * 64

    reseal(path, change)
    assert "sha256 mismatch" in str(expect_bundle_error(path))


@pytest.mark.parametrize("change", [
    lambda m: m["tensors"]["files"].update({"../escape.safetensors": {"bytes": 1, "sha256": ""}}),
    lambda m: next(iter(m["tensors"]["index"].values())).update({"shape": [999]}),
    lambda m: next(iter(m["tensors"]["index"].values())).update({"dtype": "Q7"}),
    lambda m: next(iter(m["tensors"]["index"].values())).update({"file": "nowhere.safetensors"}),
    lambda m: m.update({"ops": 5}),
    lambda m: m["calls"][0].update({"node": 10_000}),
    lambda m: m["calls"][0].update({"grad_outputs": ["no/such"]}),
    lambda m: m["grad_slots"].update({"ops": [["x"]]}),
    lambda m: m.pop("grad_fns"),
    lambda m: m.update({"format_version": "1"}),
], ids=["path_escape", "shape", "dtype", "unlisted_file", "ops_type", "bad_node", "unknown_tensor",
        "bad_slots", "missing_section", "version_type"])
def test_an_inconsistent_but_sealed_manifest_is_refused(pristine, tmp_path, change):
    path = copy_of(pristine, tmp_path)
    reseal(path, change)
    expect_bundle_error(path)


@pytest.mark.parametrize("make", ["empty_dir", "foreign_dir", "file", "missing"])
def test_a_path_that_is_not_a_bundle_is_refused(tmp_path, make):
    path = tmp_path / "thing"
    if make == "empty_dir":
        path.mkdir()
    elif make == "foreign_dir":
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    elif make == "file":
        path.write_text("hello")
    expect_bundle_error(path)


def test_an_unfinished_to_disk_directory_says_how_to_finish_it(tmp_path):
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True, storage=to_disk(tmp_path / "s"))
    loss_of(cap.output).backward()
    error = expect_bundle_error(tmp_path / "s")
    assert error.code == "bundle_unfinished" and "cap.close()" in error.remedy
    cap.close()
    load(tmp_path / "s")


def small_capture():
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss_of(cap.output).backward()
    return cap


def test_saving_over_a_foreign_directory_is_refused_even_with_overwrite(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(bl.BundleError, match="not a backlens bundle") as info:
        small_capture().save(tmp_path / "mine", overwrite=True)
    assert str(tmp_path / "mine") in str(info.value)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_saving_over_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(bl.BundleError, match="not a directory"):
        small_capture().save(tmp_path / "f", overwrite=True)


def test_an_unwritable_path_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(bl.BundleError, match="cannot write") as info:
        small_capture().save(tmp_path / "file" / "bundle")
    assert str(tmp_path / "file" / "bundle") in str(info.value)


def fail(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("broken", ["shard", "manifest"])
def test_a_save_that_fails_midway_leaves_nothing_that_loads(tmp_path, monkeypatch, broken):
    cap = small_capture()
    if broken == "shard":
        monkeypatch.setattr(ShardWriter, "flush", fail)
    else:
        monkeypatch.setattr(manifest_io, "write", fail)
    with pytest.raises(bl.BundleError, match="No space left"):
        cap.save(tmp_path / "b")
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor a temporary directory
    expect_bundle_error(tmp_path / "b")


def test_a_failed_overwrite_keeps_the_old_bundle(tmp_path, monkeypatch):
    cap = small_capture()
    cap.save(tmp_path / "b")
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    monkeypatch.setattr(bundle_io.manifest_io, "write", fail)
    with pytest.raises(bl.BundleError):
        cap.save(tmp_path / "b", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    load(tmp_path / "b")
