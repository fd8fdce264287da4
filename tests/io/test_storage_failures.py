"""A storage failure while streaming (bl.to_disk, disk full) never aborts the user's backward.

Gradients still reach .grad (bitwise as plain PyTorch), the capture warns once
(storage_failed), drops what it cannot write (nothing piles up in memory), and
close()/save() raise BundleError with the cause.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import backlens as bl
from backlens.io.shards import ShardWriter
from models import MLP, loss_of

SCRIPT = Path(__file__).with_name("full_disk.py")


def assert_what_the_user_sees(result: dict) -> None:
    assert result["grads_equal"], result
    assert result["warnings"].count("storage_failed") == 1, result
    assert result["pending_bytes"] == 0
    assert set(result["statuses"]) == {"ok"}
    assert result["close"] == "storage_failed" and ("EFBIG" in result["cause"] or "too large" in result["cause"]
                                                      or "No space" in result["cause"]), result


def run(*args) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_file_size_limit_reached_while_streaming_leaves_the_backward_whole(tmp_path):
    assert_what_the_user_sees(run(tmp_path / "b", 12_000))  # a 64x64 gradient is 16 kB


@pytest.fixture
def small_file_system(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test covers the same path)")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_while_streaming_leaves_the_backward_whole(small_file_system):
    result = run(small_file_system / "b")
    assert_what_the_user_sees(result)
    assert os.listdir(small_file_system) == []  # what could not become a bundle is removed


@pytest.fixture
def disk_full_after_one_shard(monkeypatch):
    real = ShardWriter.flush
    written = []

    def flush(self):
        if self._pending and self.prefix == "grads" and written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(self.prefix)
        real(self)

    monkeypatch.setattr(ShardWriter, "flush", flush)


def streamed_capture(path):
    torch.manual_seed(0)
    model = MLP((6, 32, 32, 3))
    cap = bl.capture(model, torch.randn(8, 6), save_grads=True, storage=bl.to_disk(path, shard_bytes=2048))
    return model, cap, loss_of(cap.output)


def test_after_a_storage_failure_nothing_more_is_copied_or_kept(tmp_path, disk_full_after_one_shard):
    _model, cap, loss = streamed_capture(tmp_path / "b")
    with pytest.warns(bl.BacklensWarning) as record:
        for k in range(1, 4):
            (loss * k).backward(retain_graph=True)
    assert [w.message.code for w in record] == ["storage_failed"]
    store = cap._state.store
    assert store.writer._pending == [] and store.keep((torch.ones(3),), "grad_outputs") is None
    assert len(cap.passes) == 3 and all(p.status == "ok" for p in cap.passes)


def test_save_after_a_storage_failure_raises_bundle_error_with_the_cause(tmp_path, disk_full_after_one_shard):
    _model, cap, loss = streamed_capture(tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss.backward(retain_graph=True)
        (loss * 2).backward(retain_graph=True)
    for save in (lambda: cap.save(), lambda: cap.save(tmp_path / "elsewhere")):
        with pytest.raises(bl.BundleError) as info:
            save()
        assert info.value.code == "storage_failed" and "No space left" in str(info.value.__cause__)
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(bl.BundleError):
        cap.close()
    assert cap.closed


def test_gradients_read_back_before_a_failure_stay_readable(tmp_path, disk_full_after_one_shard):
    _model, cap, loss = streamed_capture(tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss.backward(retain_graph=True)
    kept = [g for op in cap.ops for g in op.grads]
    assert kept  # the first shard was written, and reads back
    assert all(isinstance(g.tensor, torch.Tensor) for g in kept)
