"""Saves are crash-safe: a save killed at any step leaves the old or the new bundle, and the next save
cleans up; failed deletions and interrupted replacements are BundleErrors or recovered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import backlens as bl
from backlens.io import replace
from models import MLP, loss_of

SCRIPT = Path(__file__).with_name("kill_saves.py")


MODES = ("save", "save_fallback", "to_disk")


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory) -> dict[str, list[dict]]:
    """Each mode's kill points, from one process (it imports torch once for all three)."""
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path_factory.mktemp("killed")), *MODES],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    points = [json.loads(line) for line in done.stdout.splitlines()]
    return {mode: [point for point in points if point["mode"] == mode] for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_bundle(killed_saves, mode):
    points = killed_saves[mode]
    assert len(points) >= 16
    for point in points:
        assert point["found"] in ("old", "new"), point
        if not point["killed"]:
            assert point["found"] == "new", point
    found = [point["found"] for point in points if point["killed"]]
    # Killed before the switch, the old one is there; after it, the new one: the points span both.
    assert found[0] == "old" and found[-1] == "new" and found == sorted(found, key=("old", "new").index)
    assert any(point["leftovers"] for point in points)  # so the clean-up below is tested
    for point in points:
        assert point["leftovers_after_next_save"] == [] and point["after_next_save"] == "old", point


def small_capture(seed: int = 0):
    torch.manual_seed(seed)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss_of(cap.output).backward()
    return cap


def test_overwriting_a_bundle_exchanges_it_in_one_step_where_the_os_can(tmp_path, monkeypatch):
    if replace._EXCHANGE is None:
        pytest.skip("this OS has no atomic directory exchange")  # the fallback is killed-tested above
    swaps = []
    real = replace.exchange
    monkeypatch.setattr(replace, "exchange", lambda a, b: swaps.append((a, b)) or real(a, b))
    small_capture(0).save(tmp_path / "b")
    small_capture(1).save(tmp_path / "b", overwrite=True)
    assert len(swaps) == 1 and swaps[0][1] == tmp_path / "b"
    assert os.listdir(tmp_path) == ["b"]


def test_a_replacement_interrupted_between_its_renames_is_restored_by_load(tmp_path):
    old = small_capture(0)
    old.save(tmp_path / "b")
    os.rename(tmp_path / "b", tmp_path / ".b.old-0123456789ab")  # what a kill after the first rename leaves
    loaded = bl.load(tmp_path / "b")
    assert torch.equal(loaded.params[0].grad, old.params[0].grad)
    assert os.listdir(tmp_path) == ["b"]


def test_the_next_save_removes_leftovers_of_interrupted_saves(tmp_path):
    small_capture(0).save(tmp_path / "b")
    for name in (".b.partial-aaaaaaaaaaaa", ".b.old-bbbbbbbbbbbb"):
        shutil.copytree(tmp_path / "b", tmp_path / name)
    small_capture(1).save(tmp_path / "b", overwrite=True)
    assert os.listdir(tmp_path) == ["b"]


def test_the_next_save_leaves_alone_a_save_still_running_elsewhere(tmp_path):
    small_capture(0).save(tmp_path / "b")
    running = replace.Staging(tmp_path / "b")  # locked, as a live save's directory is
    try:
        small_capture(1).save(tmp_path / "b", overwrite=True)
        assert running.path.is_dir()
    finally:
        running.discard()


def test_a_deletion_that_fails_raises_bundle_error_naming_what_was_left(tmp_path, monkeypatch):
    small_capture(0).save(tmp_path / "b")

    def refuse(path, onerror=None, **kwargs):
        failure = PermissionError(13, "Permission denied")
        onerror(os.unlink, str(Path(path) / "manifest.json"), (PermissionError, failure, None))

    monkeypatch.setattr(replace.shutil, "rmtree", refuse)
    new = small_capture(1)
    with pytest.raises(bl.BundleError) as info:
        new.save(tmp_path / "b", overwrite=True)
    assert info.value.code == "bundle_cleanup_failed" and "Permission denied" in str(info.value)
    monkeypatch.undo()
    loaded = bl.load(tmp_path / "b")  # the new bundle is in place all the same
    assert torch.equal(loaded.params[0].grad, new.params[0].grad)


def test_to_disk_with_overwrite_keeps_the_old_bundle_until_the_new_one_is_finished(tmp_path):
    old = small_capture(0)
    old.save(tmp_path / "b")
    torch.manual_seed(1)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True, storage=bl.to_disk(tmp_path / "b", overwrite=True))
    loss_of(cap.output).backward()
    during = bl.load(tmp_path / "b")
    assert torch.equal(during.params[0].grad, old.params[0].grad)
    cap.close()
    after = bl.load(tmp_path / "b")
    assert torch.equal(after.params[0].grad, cap.params[0].grad) and len(after.passes) == 1
    assert os.listdir(tmp_path) == ["b"]


def test_to_disk_keeps_streaming_into_the_bundle_after_a_first_save(tmp_path):
    small_capture(0).save(tmp_path / "b")
    torch.manual_seed(1)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True, storage=bl.to_disk(tmp_path / "b", overwrite=True))
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.save()
    assert len(bl.load(tmp_path / "b").passes) == 1
    (loss * 2).backward()
    cap.close()
    loaded = bl.load(tmp_path / "b")
    assert len(loaded.passes) == 2
    assert torch.equal(loaded.ops[0].grads[1].tensor, cap.ops[0].grads[1].tensor)
