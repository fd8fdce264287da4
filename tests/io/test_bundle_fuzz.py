"""Property-based fuzzing of manifests and shard headers: loading raises BundleError or reads sanely.

A manifest is mutated at a random place (a value replaced by random JSON, a
key or element dropped, a key added) and sealed with a correct checksum, as an
attacker would. Whatever comes out, ``bl.load`` either raises BundleError or
returns a capture whose every table, report and saved tensor reads without an
error that is not a BacklensError. Shard headers get random bytes or random
JSON, with the manifest's file size kept consistent so the parser is reached.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backlens as bl
from backlens.io import manifest as manifest_io
from models import MLP, loss_of

FUZZ = settings(max_examples=int(os.environ.get("BACKLENS_FUZZ_EXAMPLES", "120")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([-1, 0, 1, 2, 3, 2**31, 2**63, 2**64]) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["float32", "F32", "ok", "input", "param", "relu_1", "tensors/1", "grads/1"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    """A small bundle (one shard, a memory record) and its manifest body, without the checksum."""
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True, save_activations=bl.func("relu"), memory=True)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.backward(loss * 2, save_grads=bl.func("linear") & bl.in_pass(2))
    path = cap.save(tmp_path_factory.mktemp("fuzz") / "sound")
    body = json.loads((path / "manifest.json").read_text())
    body.pop("checksum")
    return path, body


def places(value, at=()):
    """Every place in a JSON document, as a path of keys and indices."""
    yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from places(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from places(item, (*at, index))


def mutate(body, place, how, value):
    body = copy.deepcopy(body)
    if not place:
        return value if how == "replace" else body
    parent = body
    for step in place[:-1]:
        parent = parent[step]
    last = place[-1]
    if how == "replace":
        parent[last] = value
    elif how == "drop":
        del parent[last]
    elif how == "add" and isinstance(parent, dict):
        parent[f"{last}_extra"] = value
    elif how == "add":
        parent.insert(last, value)
    return body


def exercise(loaded) -> None:
    """Read everything a user can read from a loaded capture."""
    for name in ("ops", "modules", "params", "inputs", "grad_fns", "grad_fn_calls", "passes"):
        records = getattr(loaded, name)
        records.to_pandas()
        for record in records:
            repr(record)
    for op in loaded.ops:
        op.grads, op.activation, op.grad_fn  # noqa: B018
    for call in loaded.grad_fn_calls:
        call.grad_inputs, call.grad_outputs  # noqa: B018
    bl.report.backward_status(loaded)
    bl.report.cost_tree(loaded)
    bl.report.timeline(loaded)
    if loaded.memory is not None:
        loaded.memory.to_pandas()
        for backward_pass in loaded.passes:
            memory = backward_pass.memory
            memory.peak_bytes, memory.peak_at, memory.held_at_peak, list(memory.samples)  # noqa: B018
        bl.report.memory_plan(loaded)


def load_and_read(path: Path) -> None:
    try:
        loaded = bl.load(path)
    except bl.BundleError:
        return
    try:
        exercise(loaded)
    except bl.BacklensError:
        pass


@FUZZ
@given(data=st.data())
def test_a_fuzzed_manifest_loads_or_raises_bundle_error(sound, tmp_path_factory, data):
    path, body = sound
    every = list(places(body))
    place = every[data.draw(st.integers(0, len(every) - 1), label="place")]
    how = data.draw(st.sampled_from(["replace", "replace", "drop", "add"]), label="how")
    value = data.draw(json_values, label="value")
    fuzzed = mutate(body, place, how, value)
    target = tmp_path_factory.mktemp("m")
    shutil.copytree(path, target, dirs_exist_ok=True)
    if isinstance(fuzzed, dict):
        manifest_io.write(target, fuzzed)
    else:
        (target / "manifest.json").write_text(json.dumps(fuzzed))
    load_and_read(target)


def rewrite_shard(path: Path, header: bytes, claimed: int | None = None) -> None:
    """Put ``header`` in the shard (its length field ``claimed``, default its true length), keep
    the data, and make the manifest's file size match so the header is what gets checked."""
    shard = next(path.glob("*.safetensors"))
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    new = struct.pack("<Q", len(header) if claimed is None else claimed) + header + data[8 + length:]
    shard.write_bytes(new)
    body = json.loads((path / "manifest.json").read_text())
    body.pop("checksum")
    body["tensors"]["files"][shard.name]["bytes"] = len(new)
    manifest_io.write(path, body)


@FUZZ
@given(header=st.binary(max_size=400), claimed=st.none() | st.integers(0, 2**64 - 1))
def test_a_shard_with_random_header_bytes_raises_bundle_error(sound, tmp_path_factory, header, claimed):
    path, _body = sound
    target = tmp_path_factory.mktemp("h")
    shutil.copytree(path, target, dirs_exist_ok=True)
    rewrite_shard(target, header, claimed)
    with pytest.raises(bl.BundleError):
        bl.load(target)


@FUZZ
@given(data=st.data())
def test_a_shard_with_a_fuzzed_json_header_loads_or_raises_bundle_error(sound, tmp_path_factory, data):
    path, _body = sound
    target = tmp_path_factory.mktemp("j")
    shutil.copytree(path, target, dirs_exist_ok=True)
    shard = next(target.glob("*.safetensors"))
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    every = list(places(header))
    place = every[data.draw(st.integers(0, len(every) - 1), label="place")]
    fuzzed = mutate(header, place, data.draw(st.sampled_from(["replace", "drop", "add"])), data.draw(json_values))
    text = json.dumps(fuzzed, separators=(",", ":")).encode()
    rewrite_shard(target, text + b" " * (-len(text) % 8))
    load_and_read(target)
