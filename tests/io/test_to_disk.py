"""storage=to_disk(path): gradients stream into shards, read back lazily, and become a bundle."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bundle_checks import assert_same_capture

import backlens as bl
from backlens import load
from backlens.io.disk_store import to_disk
from backlens.select import module
from models import MLP, build, loss_of

MB = 10**6


def two_passes(storage=None, name="mlp"):
    model, args, kwargs = build(name)
    cap = bl.capture(model, *args, save_grads=True, storage=storage, **kwargs)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.backward(loss * 3, save_grads=module("transformer.h.0") if name == "gpt2" else True)
    return cap


def test_gradients_read_back_equal_to_an_in_memory_capture(tmp_path):
    on_disk = two_passes(to_disk(tmp_path / "s"), "gpt2")
    in_memory = two_passes(None, "gpt2")
    assert on_disk.ops.labels() == in_memory.ops.labels()
    for a, b in zip(on_disk.ops, in_memory.ops):
        assert [g.pass_number for g in a.grads] == [g.pass_number for g in b.grads], a.label
        assert all(torch.equal(x.tensor, y.tensor) for x, y in zip(a.grads, b.grads)), a.label
    for a, b in zip(on_disk.grad_fn_calls, in_memory.grad_fn_calls):
        if a.grad_fn.type == "AccumulateGrad":
            continue  # compared with plain autograd below (memory keeps live, aliased tensors)
        for side_a, side_b in ((a.grad_inputs, b.grad_inputs), (a.grad_outputs, b.grad_outputs)):
            assert (side_a is None) == (side_b is None)
            for x, y in zip(side_a or (), side_b or ()):
                assert (x is None and y is None) or torch.equal(x, y), a.label


def test_parameter_increments_are_the_values_each_pass_added(tmp_path):
    model, args, kwargs = build("gpt2")
    twin = copy.deepcopy(model)
    cap = bl.capture(model, *args, save_grads=True, storage=to_disk(tmp_path / "s"), **kwargs)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    (loss * 3).backward()
    reference = loss_of(twin(*args, **kwargs))
    per_pass = []
    for scale in (1, 3):
        twin.zero_grad(set_to_none=True)
        (reference * scale).backward(retain_graph=True)
        per_pass.append({n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None})
    for name in per_pass[0]:
        increments = cap.params[name].increments
        assert [g.pass_number for g in increments] == [1, 2], name
        for k in (0, 1):
            assert torch.equal(increments[k].tensor, per_pass[k][name]), (name, k + 1)


def test_shards_are_written_while_the_backward_runs(tmp_path):
    cap = bl.capture(MLP(), torch.randn(64, 6), save_grads=True,
                     storage=to_disk(tmp_path / "s", shard_bytes=4096))
    loss_of(cap.output).backward()
    assert len(list((tmp_path / "s").glob("grads-*.safetensors"))) >= 2
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_close_writes_the_manifest_and_the_bundle_reads_the_same(tmp_path):
    with two_passes(to_disk(tmp_path / "s"), "gpt2") as cap:
        pass
    loaded = load(tmp_path / "s")
    assert_same_capture(cap, loaded)
    assert not (tmp_path / "s" / ".backlens-stream").exists()


def test_save_without_a_path_finishes_in_place_and_close_updates_it(tmp_path):
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True, save_activations=True,
                     storage=to_disk(tmp_path / "s"))
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    assert cap.save() == tmp_path / "s"
    assert len(load(tmp_path / "s").passes) == 1
    loss.backward()
    cap.close()
    loaded = load(tmp_path / "s")
    assert len(loaded.passes) == 2
    assert_same_capture(cap, loaded)
    extras = sorted(p.name for p in (tmp_path / "s").glob("extra*"))
    assert len(extras) == 1  # the first save's extras were replaced


def test_a_streamed_capture_saves_a_copy_elsewhere(tmp_path):
    cap = two_passes(to_disk(tmp_path / "s"))
    copy = load(cap.save(tmp_path / "copy"))
    assert_same_capture(cap, copy)


def test_to_disk_refuses_a_directory_in_use(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "data.csv").write_text("1,2")
    with pytest.raises(bl.BundleError, match="not empty"):
        bl.capture(MLP(), torch.randn(2, 6), storage=to_disk(tmp_path / "used"))
    with pytest.raises(bl.BundleError, match="not a backlens bundle"):
        bl.capture(MLP(), torch.randn(2, 6), storage=to_disk(tmp_path / "used", overwrite=True))
    assert (tmp_path / "used" / "data.csv").read_text() == "1,2"


def test_to_disk_overwrite_replaces_an_earlier_bundle(tmp_path):
    with two_passes(to_disk(tmp_path / "s")):
        pass
    with bl.capture(MLP(), torch.randn(2, 6), storage=to_disk(tmp_path / "s", overwrite=True)) as cap:
        loss_of(cap.output).backward()
    assert len(load(tmp_path / "s").passes) == 1


def test_bad_storage_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(bl.BacklensError, match="to_disk"):
        bl.capture(MLP(), torch.randn(2, 6), storage="disk")
    with pytest.raises(ValueError):
        to_disk("")
    with pytest.raises(ValueError):
        to_disk(tmp_path, shard_bytes=0)


def test_a_memory_capture_needs_a_path_to_save():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    with pytest.raises(bl.BundleError) as info:
        cap.save()
    assert info.value.code == "bundle_path_required"


def probe(mode: str, path: Path) -> dict:
    script = Path(__file__).with_name("rss_probe.py")
    done = subprocess.run([sys.executable, str(script), mode, str(path)], capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read RSS")
def test_saving_hundreds_of_megabytes_to_disk_keeps_memory_flat(tmp_path):
    result = probe("disk", tmp_path / "s")
    assert result["saved_bytes"] >= 200 * MB
    assert result["disk_bytes"] >= 200 * MB
    assert result["peak_growth_bytes"] < 50 * MB, result


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read RSS")
def test_the_same_capture_in_memory_grows_by_what_it_saves(tmp_path):
    """The control for the test above: the probe does see saved gradients in memory."""
    result = probe("memory", tmp_path / "s")
    assert result["peak_growth_bytes"] > 50 * MB, result  # above the bound the test above holds
