"""cap.save(path) / load(path): a GPT-2 capture with two passes reads back the same."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from bundle_checks import assert_same_capture, same_value
from safetensors.torch import load_file

import backlens as bl
from backlens import load
from backlens.io import manifest as manifest_io
from backlens.select import func, grad_output, module
from models import MLP, BackwardExplodes, build, loss_of


@pytest.fixture(scope="module")
def gpt2_bundle(tmp_path_factory):
    model, args, kwargs = build("gpt2")
    cap = bl.capture(model, *args, save_grads=True, save_activations=func("layer_norm"), **kwargs)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.backward(loss * 2, save_grads=module("transformer.h.1") & grad_output())
    path = cap.save(tmp_path_factory.mktemp("bundles") / "gpt2")
    return cap, path, load(path)


def test_a_gpt2_capture_with_two_passes_reads_back_the_same(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    assert_same_capture(live, loaded)


def test_gradients_of_both_passes_are_bitwise_equal(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    op = next(o.label for o in live.ops if o.module and o.module.startswith("transformer.h.1") and len(o.grads) == 2)
    for k in (1, 2):
        assert torch.equal(loaded.ops[op].grad_for(pass_=k), live.ops[op].grad_for(pass_=k))
    name = "transformer.h.0.mlp.c_fc.weight"
    assert [g.pass_number for g in loaded.params[name].increments] == [1]
    assert torch.equal(loaded.params[name].grad, live.params[name].grad)


def test_passes_keep_trigger_call_site_policy_and_timing(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    assert [p.trigger for p in loaded.passes] == ["Tensor.backward", "cap.backward"]
    assert loaded.passes[0].call_site == live.passes[0].call_site
    assert loaded.passes[1].save_grads_policy == live.passes[1].save_grads_policy
    assert repr(loaded.passes[1].save_grads_policy) == (
        "save_grads=bl.module('transformer.h.1') & bl.grad_output()")
    assert loaded.passes[0].duration == live.passes[0].duration > 0
    starts = [c.start for c in loaded.grad_fn_calls]
    assert starts == [c.start for c in live.grad_fn_calls] and all(s is not None for s in starts)
    assert [c.duration for c in loaded.grad_fn_calls] == [c.duration for c in live.grad_fn_calls]
    assert [c.flops for c in loaded.grad_fn_calls] == [c.flops for c in live.grad_fn_calls]


def test_activations_read_back(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    kept = [op.label for op in live.ops if op.activation is not None]
    assert kept and kept == [op.label for op in loaded.ops if op.activation is not None]
    assert all(torch.equal(live.ops[k].activation, loaded.ops[k].activation) for k in kept)


def test_lookups_by_label_work_on_a_loaded_capture(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    node = live.grad_fns[3]
    assert loaded[node.label].type == node.type
    assert loaded[f"{node.label}:1"].pass_number == 1
    assert loaded["transformer.h.0"].address == "transformer.h.0"
    assert loaded.grad_fns[node.label].calls.for_pass(1).label == f"{node.label}:1"
    with pytest.raises(KeyError, match="Close labels"):
        loaded["layer_norm_99"]


def test_a_loaded_capture_is_read_only(gpt2_bundle):
    _live, _path, loaded = gpt2_bundle
    with pytest.raises(bl.BackwardUnavailableError) as info:
        loaded.backward()
    assert info.value.code == "read_only_bundle" and "read-only" in str(info.value)
    assert loaded.output is None


def test_a_bundle_is_a_manifest_and_safetensors_only(gpt2_bundle):
    _live, path, _loaded = gpt2_bundle
    names = {p.name for p in path.iterdir()}
    shards = names - {"manifest.json"}
    assert "manifest.json" in names and shards and all(n.endswith(".safetensors") for n in shards)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == manifest_io.FORMAT_VERSION
    assert manifest["torch_version"] == torch.__version__ and manifest["backlens_version"] == bl.__version__
    for key in ("ops", "modules", "params", "inputs", "grad_fns", "passes", "calls", "cost"):
        assert key in manifest
    index = manifest["tensors"]["index"]
    for file_name in manifest["tensors"]["files"]:
        for name, tensor in load_file(path / file_name).items():
            entry = index[name]
            assert entry["file"] == file_name and entry["shape"] == list(tensor.shape)
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert hashlib.sha256(raw).hexdigest() == entry["sha256"]


def test_equal_tensors_are_stored_once(gpt2_bundle):
    _live, path, _loaded = gpt2_bundle
    index = json.loads((path / "manifest.json").read_text())["tensors"]["index"]
    keys = [(e["sha256"], e["dtype"], tuple(e["shape"])) for e in index.values()]
    assert len(keys) == len(set(keys))


def test_a_loaded_capture_saves_to_a_new_bundle(gpt2_bundle, tmp_path):
    live, _path, loaded = gpt2_bundle
    again = load(loaded.save(tmp_path / "copy"))
    assert_same_capture(live, again)


def test_saving_over_a_bundle_needs_overwrite(tmp_path):
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss_of(cap.output).backward()
    cap.save(tmp_path / "b")
    with pytest.raises(bl.BundleError, match="already exists") as info:
        cap.save(tmp_path / "b")
    assert info.value.code == "bundle_exists"
    cap.save(tmp_path / "b", overwrite=True)
    assert len(load(tmp_path / "b").passes) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary left behind


def test_a_capture_without_backward_saves_and_loads(tmp_path):
    with torch.no_grad():
        cap = bl.capture(MLP(), torch.randn(2, 6))
    loaded = load(cap.save(tmp_path / "b"))
    assert loaded.inference_only and len(loaded.passes) == 0
    assert loaded.ops.labels() == cap.ops.labels()


def test_a_failed_pass_keeps_its_status_and_message(tmp_path):
    lin = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(lin)
    model.register_forward_hook(lambda m, i, o: BackwardExplodes.apply(o))
    cap = bl.capture(model, torch.randn(2, 3))
    with pytest.raises(RuntimeError):
        cap.output.sum().backward()
    loaded = load(cap.save(tmp_path / "b"))
    assert loaded.passes[0].status == "failed"
    live_error, loaded_error = cap.passes[0].error, loaded.passes[0].error
    assert type(loaded_error).__name__ == type(live_error).__name__ == "RuntimeError"
    assert str(loaded_error) == str(live_error) and isinstance(loaded_error, Exception)
    assert same_value(cap.passes.to_pandas()["error"][0], loaded.passes.to_pandas()["error"][0])


def test_higher_order_passes_keep_orders_and_coverage(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(5, 3, requires_grad=True)
    cap = bl.capture(model, x, save_grads=True)
    (gx,) = torch.autograd.grad(cap.output.sum(), [x], create_graph=True)
    gx.pow(2).sum().backward()
    loaded = load(cap.save(tmp_path / "b"))
    assert_same_capture(cap, loaded)
    assert [g.order for g in loaded.grad_fns] == [g.order for g in cap.grad_fns]
    assert 2 in loaded.passes[1].orders


def test_flops_and_backward_status_read_the_same(gpt2_bundle):
    live, _path, loaded = gpt2_bundle
    before, after = bl.report.backward_status(live), bl.report.backward_status(loaded)
    assert after.executed_flops == before.executed_flops and before.executed_flops
    for a, b in zip(before.flops_attributions, after.flops_attributions):
        assert a.to_pandas().equals(b.to_pandas())
        assert a.unattributed_flops == b.unattributed_flops
    assert [op.forward_flops for op in loaded.ops] == [op.forward_flops for op in live.ops]
    assert bl.report.cost_tree(live).to_pandas().equals(bl.report.cost_tree(loaded).to_pandas())


def test_older_format_versions_are_migrated(tmp_path, monkeypatch):
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss_of(cap.output).backward()
    path = cap.save(tmp_path / "b")
    migrated = []

    current = manifest_io.FORMAT_VERSION

    def from_current(manifest):
        migrated.append(manifest["format_version"])
        return {**manifest, "format_version": current + 1}

    monkeypatch.setattr(manifest_io, "FORMAT_VERSION", current + 1)
    monkeypatch.setitem(manifest_io.MIGRATIONS, current, from_current)
    loaded = load(path)
    assert migrated == [current] and loaded.format_version == current + 1
    assert loaded.ops.labels() == cap.ops.labels()


def test_a_newer_format_version_is_refused_with_a_clear_message(tmp_path):
    cap = bl.capture(MLP(), torch.randn(2, 6))
    path = cap.save(tmp_path / "b")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("checksum")
    manifest["format_version"] = 99
    manifest_io.write(path, manifest)
    with pytest.raises(bl.BundleError, match="format version 99") as info:
        load(path)
    assert info.value.code == "bundle_too_new" and "Upgrade backlens" in str(info.value)


def test_a_dropped_loaded_capture_is_freed_without_the_garbage_collector(gpt2_bundle):
    import gc
    import weakref

    live, path, _loaded = gpt2_bundle
    label = next(o.label for o in live.ops if o.grads)
    gc.disable()
    try:
        loaded = load(path)
        assert len(loaded.grad_fns.to_pandas()) and loaded.passes[0].calls and loaded.ops[label].grads
        dropped = weakref.ref(loaded)
        del loaded
        assert dropped() is None
    finally:
        gc.enable()


def test_a_record_kept_after_its_loaded_capture_is_dropped_still_reads(gpt2_bundle):
    live, path, _loaded = gpt2_bundle
    label = next(o.label for o in live.ops if len(o.grads) == 2)
    op = load(path).ops[label]
    assert torch.equal(op.grad_for(pass_=2), live.ops[label].grad_for(pass_=2))
    assert op.grad_fn.label == live.ops[label].grad_fn.label
    assert len(op.grad_fn.calls) == len(live.ops[label].grad_fn.calls)


def test_a_bundle_written_by_format_version_2_loads_with_its_records_and_gradients():
    # tests/io/data/format_v2 was written by backlens at format version 2 (before memory and
    # clock fields existed) from this model, input and loss.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4, requires_grad=True)
    model(x).square().sum().backward()
    loaded = load(Path(__file__).parent / "data" / "format_v2")
    assert loaded.format_version == manifest_io.FORMAT_VERSION
    assert loaded.ops.labels() == ["linear_1", "relu_1", "linear_2"]
    assert loaded.ops["linear_2"].parents == ["relu_1"]
    for name, param in model.named_parameters():
        assert torch.equal(loaded.params[name].grad, param.grad), name
    assert torch.equal(loaded.inputs[0].grad, x.grad)
    assert torch.equal(loaded.ops["relu_1"].activation, torch.relu(model[0](x)).detach())
    assert loaded.memory is None and loaded.ops["relu_1"].call_site is None
