"""Memory bombs: files small on disk that would take gigabytes to read are refused first, under a memory limit.

Each case loads in this process under ``tracemalloc`` (which sees Python's and numpy's allocations)
and must stay under a bound set here: a small multiple of the file's own size, far below what
reading the bomb would take (a manifest of empty objects costs about 24 bytes of memory per byte
of JSON once parsed; a rank set claiming a million ranks would build lists and a message per rank).
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
from bundle_checks import reseal

import backlens as bl
from backlens.io import manifest as manifest_io
from models import MLP, loss_of

MiB = 1 << 20


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss_of(cap.output).backward()
    return cap.save(tmp_path_factory.mktemp("bombs") / "sound")


def load_under_limit(path: Path, limit: int) -> bl.BundleError:
    """Load ``path`` expecting a BundleError, with peak traced memory under ``limit`` bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(bl.BundleError) as info:
            bl.load(path)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak / MiB:.1f} MiB, limit {limit / MiB:.1f} MiB"
    assert len(str(info.value)) < 1000
    return info.value


def write_empty_objects(path: Path, size: int, opening: bytes = b"[", closing: bytes = b"]") -> None:
    """``opening`` then ``{},`` until the file is ``size`` bytes, then ``closing``: valid JSON."""
    count = (size - len(opening) - len(closing)) // 3
    with open(path, "wb") as handle:
        handle.write(opening)
        chunk = b"{}," * (1 << 18)
        for _ in range(count // (1 << 18)):
            handle.write(chunk)
        handle.write(b"{}," * (count % (1 << 18)) + b"{}" + closing)


def test_a_manifest_of_empty_objects_is_refused_before_parsing(tmp_path, sound):
    """8 MiB of ``{},`` would parse into ~200 MB of objects: 25 times its size."""
    bomb = tmp_path / "bomb"
    bomb.mkdir()
    write_empty_objects(bomb / "manifest.json", 8 * MiB)
    error = load_under_limit(bomb, limit=3 * 8 * MiB)
    assert error.code == "bundle_too_large" and "MiB of memory" in str(error)


def test_json_too_costly_for_the_absolute_bound_is_refused_whatever_its_ratio(tmp_path):
    from backlens.io.files import parse_json

    raw = json.dumps([{"a": 1}] * 1000).encode()
    assert parse_json(raw, tmp_path, "test") == [{"a": 1}] * 1000
    with pytest.raises(bl.BundleError, match="would take about") as info:
        parse_json(raw, tmp_path, "test", max_memory=64 * 1024)
    assert info.value.code == "bundle_too_large"


def test_a_manifest_backlens_writes_reads_within_both_memory_bounds(sound):
    from backlens.io.files import MAX_JSON_RATIO, JsonShape

    raw = (sound / "manifest.json").read_bytes()
    ratio = JsonShape(raw).memory / len(raw)
    assert ratio < MAX_JSON_RATIO / 2  # a manifest of any size passes the ratio
    # 256 MiB (the size bound) of such a manifest still reads within the absolute bound.
    assert ratio * manifest_io.MAX_MANIFEST_BYTES < manifest_io.MAX_MANIFEST_MEMORY


def test_a_derived_manifest_of_empty_objects_is_refused_before_parsing(tmp_path):
    bomb = tmp_path / "derived"
    bomb.mkdir()
    write_empty_objects(bomb / "manifest.json", 6 * MiB,
                        opening=b'{"format": "backlens.derived", "kind": "derived", "x": [', closing=b"]}")
    error = load_under_limit(bomb, limit=3 * 6 * MiB)
    assert error.code == "bundle_too_large"


def test_a_string_of_escapes_that_never_ends_is_read_in_bounded_time_and_memory(tmp_path):
    bomb = tmp_path / "unending"
    bomb.mkdir()
    (bomb / "manifest.json").write_bytes(b'{"format": "' + b'\\"' * (4 * MiB))
    error = load_under_limit(bomb, limit=3 * 8 * MiB)
    assert error.code == "bundle_corrupt" and "Unterminated string" in str(error)


def test_a_world_size_of_2_to_the_62_is_refused_before_anything_is_built_per_rank(tmp_path, sound):
    runs = tmp_path / "run"
    shutil.copytree(sound, runs / "rank0")
    reseal(runs / "rank0", lambda m: m["capture"].update(rank=0, world_size=2**62))
    error = load_under_limit(runs, limit=16 * MiB)
    assert "world_size" in str(error)


def test_a_rank_set_claiming_a_million_ranks_is_refused_with_a_short_message(tmp_path, sound):
    runs = tmp_path / "run"
    shutil.copytree(sound, runs / "rank0")
    reseal(runs / "rank0", lambda m: m["capture"].update(rank=0, world_size=10**6))
    error = load_under_limit(runs, limit=16 * MiB)
    assert error.code == "bundle_ranks_missing" and "1000000 ranks" in str(error) and "and more" in str(error)
