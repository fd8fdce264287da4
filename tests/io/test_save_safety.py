"""Saves never destroy what is not theirs: only a provable bundle is replaced, a directory is known
however it is spelled, a streaming directory has one writer, and no special file blocks a save."""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch
from bundle_checks import assert_same_capture

import backlens as bl
from backlens.io import disk_store, replace
from models import MLP, loss_of


def small_capture(seed: int = 0, storage=None, passes: int = 1):
    torch.manual_seed(seed)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_grads=True, storage=storage)
    loss = loss_of(cap.output)
    for k in range(passes):
        (loss * (k + 1)).backward(retain_graph=True)
    return cap


def listing(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# -- only a provable bundle is replaced --------------------------------------------------------

def not_a_bundle(tmp_path: Path, manifest: str, marker: str | None = None) -> Path:
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "manifest.json").write_text(manifest)
    (folder / "thesis.tex").write_text("\\documentclass{article}")
    if marker is not None:
        (folder / ".backlens-stream").write_text(marker)
    return folder


NOT_BUNDLES = {
    "a_manifest_naming_a_backlens_plugin": ('{"plugins": ["backlens.report"]}', None),
    "a_manifest_whose_format_is_elsewhere": ('{"other": {"format": "backlens.bundle"}}', None),
    "a_manifest_that_is_not_json": ('"backlens.bundle" is what we use', None),
    "a_stream_marker_of_someone_else": ("{}", "backlens-stream, but not written by backlens"),
}


@pytest.mark.parametrize("case", sorted(NOT_BUNDLES))
def test_a_save_with_overwrite_leaves_a_directory_that_only_looks_like_a_bundle(tmp_path, case):
    folder = not_a_bundle(tmp_path, *NOT_BUNDLES[case])
    before = listing(folder)
    with pytest.raises(bl.BundleError) as info:
        small_capture().save(folder, overwrite=True)
    assert info.value.code == "bundle_not_a_bundle" and str(folder) in str(info.value)
    with pytest.raises(bl.BundleError):
        bl.capture(MLP(), torch.randn(4, 6), storage=bl.to_disk(folder, overwrite=True))
    assert listing(folder) == before


def test_a_save_with_overwrite_replaces_a_bundle_of_either_kind(tmp_path):
    import numpy as np

    bl.DerivedGrads(framework="jax", version="0", output=np.float32(1.0),
                    leaf_grads={"w": np.ones(2, dtype=np.float32)}).save(tmp_path / "b")
    cap = small_capture()
    cap.save(tmp_path / "b", overwrite=True)
    assert_same_capture(cap, bl.load(tmp_path / "b"))


@pytest.mark.parametrize("how", ["save", "to_disk"])
def test_a_bundle_holding_a_user_s_files_beside_its_own_is_not_replaced(tmp_path, how):
    small_capture().save(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("what I found in this run")
    before = listing(tmp_path / "b")
    (tmp_path / "b" / "figures").mkdir()
    with pytest.raises(bl.BundleError) as info:
        if how == "save":
            small_capture(seed=1).save(tmp_path / "b", overwrite=True)
        else:
            bl.capture(MLP(), torch.randn(4, 6), storage=bl.to_disk(tmp_path / "b", overwrite=True))
    assert info.value.code == "bundle_holds_other_files"
    assert "'notes.txt'" in str(info.value) and "'figures'" in str(info.value)
    (tmp_path / "b" / "figures").rmdir()  # still there, and empty, as left
    assert listing(tmp_path / "b") == before


def test_a_leftover_named_like_a_save_s_but_holding_other_files_is_left_alone(tmp_path):
    mine = tmp_path / ".b.partial-0123456789ab"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    ours = tmp_path / ".b.partial-ba9876543210"
    ours.mkdir()
    (ours / "grads-00001.safetensors").write_bytes(b"half a shard")
    small_capture().save(tmp_path / "b")
    assert (mine / "notes.txt").read_text() == "mine"
    assert not ours.exists()


# -- a directory is one directory, however spelled ---------------------------------------------

@pytest.mark.parametrize("spelling", ["double_slash", "linked_parent", "dot_dot"])
def test_saving_a_streaming_capture_under_another_spelling_of_its_directory_finishes_it(tmp_path, spelling):
    (tmp_path / "data" / "run").mkdir(parents=True)
    real = tmp_path / "data" / "run" / "b"
    os.symlink(tmp_path / "data", tmp_path / "linked")
    other = {"double_slash": "/" + str(real), "linked_parent": str(tmp_path / "linked" / "run" / "b"),
             "dot_dot": str(tmp_path / "data" / "run" / ".." / "run" / "b")}[spelling]
    cap = small_capture(storage=bl.to_disk(real))
    assert cap.save(other) == real
    cap.close()
    assert_same_capture(cap, bl.load(real))
    assert not [p for p in (tmp_path / "data" / "run").iterdir() if p.name != "b"]


# -- one writer per streaming directory ----------------------------------------------------------

def test_a_second_writer_on_a_streaming_directory_is_refused_and_the_first_goes_on(tmp_path):
    first = small_capture(0, storage=bl.to_disk(tmp_path / "b", shard_bytes=256))
    first.save()
    with pytest.raises(bl.BundleError) as info:
        bl.capture(MLP(), torch.randn(4, 6), save_grads=True, storage=bl.to_disk(tmp_path / "b", overwrite=True))
    assert info.value.code == "bundle_locked" and "streaming" in str(info.value)
    with pytest.raises(bl.BundleError) as info:
        small_capture(1).save(tmp_path / "b", overwrite=True)
    assert info.value.code == "bundle_locked"
    (loss_of(first.output) * 5).backward()
    first.close()
    assert_same_capture(first, bl.load(tmp_path / "b"))


def test_the_streaming_lock_is_let_go_when_the_capture_closes(tmp_path):
    small_capture(0, storage=bl.to_disk(tmp_path / "b")).close()
    assert not (tmp_path / "b" / ".backlens-lock").exists()
    second = small_capture(1, storage=bl.to_disk(tmp_path / "b", overwrite=True))
    second.close()
    assert_same_capture(second, bl.load(tmp_path / "b"))


def test_the_streaming_lock_is_let_go_when_the_capture_is_dropped(tmp_path):
    cap = small_capture(0, storage=bl.to_disk(tmp_path / "b"))
    cap.save()
    del cap
    gc.collect()
    small_capture(1).save(tmp_path / "b", overwrite=True)


def test_two_captures_streaming_into_one_new_directory_are_refused_at_the_second(tmp_path):
    first = small_capture(0, storage=bl.to_disk(tmp_path / "b"))
    with pytest.raises(bl.BundleError) as info:
        small_capture(1, storage=bl.to_disk(tmp_path / "b", overwrite=True))
    assert info.value.code == "bundle_locked"
    first.close()
    assert_same_capture(first, bl.load(tmp_path / "b"))


# -- special files never block ---------------------------------------------------------------------

def finishes(call, seconds: float = 20.0) -> BaseException | None:
    """Run ``call`` in a thread; the error it raised (a hang fails the test, leaving the thread)."""
    outcome: list = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, "the call blocked"
    return outcome[0]


@pytest.mark.parametrize("how", ["save", "to_disk"])
def test_a_fifo_named_manifest_json_never_blocks_a_save(tmp_path, how):
    folder = tmp_path / "b"
    folder.mkdir()
    os.mkfifo(folder / "manifest.json")
    cap = small_capture()
    call = {"save": lambda: cap.save(folder, overwrite=True),
            "to_disk": lambda: bl.capture(MLP(), torch.randn(4, 6), storage=bl.to_disk(folder, overwrite=True))}[how]
    error = finishes(call)
    assert isinstance(error, bl.BundleError) and error.code == "bundle_not_a_bundle"


# -- what a killed stream leaves -------------------------------------------------------------------

def test_loading_removes_the_shards_a_killed_stream_left_after_its_last_save(tmp_path):
    cap = small_capture(0, storage=bl.to_disk(tmp_path / "live", shard_bytes=64))
    cap.save()
    saved = bl.load(tmp_path / "live")
    (loss_of(cap.output) * 7).backward()  # streams more shards the manifest does not name
    cap._state.store.flush()
    shutil.copytree(tmp_path / "live", tmp_path / "killed")  # what a kill at this moment leaves
    referenced = set(json.loads((tmp_path / "killed" / "manifest.json").read_text())["tensors"]["files"])
    stray = {p.name for p in (tmp_path / "killed").glob("*.safetensors")} - referenced
    assert stray and (tmp_path / "killed" / ".backlens-lock").exists()
    loaded = bl.load(tmp_path / "killed")
    assert {p.name for p in (tmp_path / "killed").iterdir()} == referenced | {"manifest.json"}
    assert len(loaded.passes) == len(saved.passes) == 1
    cap.close()


def test_loading_leaves_alone_the_shards_of_a_stream_still_running(tmp_path):
    cap = small_capture(0, storage=bl.to_disk(tmp_path / "live", shard_bytes=64))
    cap.save()
    (loss_of(cap.output) * 7).backward()
    cap._state.store.flush()
    before = {p.name for p in (tmp_path / "live").iterdir()}
    bl.load(tmp_path / "live")
    assert {p.name for p in (tmp_path / "live").iterdir()} == before
    cap.close()
    assert_same_capture(cap, bl.load(tmp_path / "live"))


def test_checking_and_replacing_a_bundle_leaves_no_directory_listing_open(tmp_path):
    small_capture(0).save(tmp_path / "b")
    (tmp_path / "empty").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        disk_store.check_target(tmp_path / "b", overwrite=True)
        replace._is_empty_directory(tmp_path / "empty")
        small_capture(1).save(tmp_path / "b", overwrite=True)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_a_bundle_too_large_to_parse_when_checked_is_recognised_by_its_opening(tmp_path, monkeypatch):
    from backlens.io import files, markers

    cap = bl.capture(torch.nn.Linear(3, 2), torch.randn(2, 3))
    path = cap.save(tmp_path / "b")
    monkeypatch.setattr(files, "PEEK_WHOLE_BELOW", 64)
    assert markers.holds_manifest(path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(" " * 100 + '{"plugins": ["backlens.report"]}')
    assert not markers.holds_manifest(tmp_path / "other")
