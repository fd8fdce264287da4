"""Rank fields outside torch.distributed: {rank} paths, a capture's rank, non-rank directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import backlens as bl
from backlens.records.collectives import CollectiveRecord


def small_capture(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    cap = bl.capture(model, torch.randn(2, 3), **options)
    cap.output.sum().backward()
    return cap


def test_to_disk_expands_rank_to_0_outside_torch_distributed(tmp_path):
    cap = small_capture(save_grads=True, storage=bl.to_disk(tmp_path / "run" / "rank{rank}"))
    cap.close()
    assert (tmp_path / "run" / "rank0" / "manifest.json").is_file()
    assert not list((tmp_path / "run").glob("*{rank}*"))


def test_save_expands_rank_as_to_disk_does(tmp_path):
    path = small_capture().save(str(tmp_path / "b-{rank}"))
    assert Path(path).name == "b-0"


def test_a_capture_outside_torch_distributed_has_no_rank_and_no_collectives(tmp_path):
    cap = small_capture()
    assert cap.rank is None and cap.world_size is None
    assert len(cap.passes[0].collectives) == 0 and len(cap.collectives) == 0
    assert cap.passes.to_pandas()["num_collectives"].tolist() == [0]
    manifest = json.loads((cap.save(tmp_path / "b") / "manifest.json").read_text())
    assert manifest["capture"]["rank"] is None and manifest["capture"]["world_size"] is None
    assert manifest["collectives"] == []


def test_a_directory_of_bundles_captured_outside_distributed_is_refused_as_a_rank_set(tmp_path):
    small_capture().save(tmp_path / "run" / "a")
    small_capture().save(tmp_path / "run" / "b")
    with pytest.raises(bl.BundleError) as caught:
        bl.load(tmp_path / "run")
    assert caught.value.code == "bundle_not_a_rank" and "run/a" in str(caught.value)


def test_a_single_bundle_still_loads_as_one_capture(tmp_path):
    path = small_capture().save(tmp_path / "b")
    assert not isinstance(bl.load(path), bl.RankSet)


def test_the_collectives_table_columns_are_documented():
    text = (Path(__file__).resolve().parents[2] / "docs" / "records.md").read_text()
    start = text.index("## `cap.collectives`")
    end = text.find("\n## ", start + 1)
    documented = re.findall(r"^\| `(\w+)` \|", text[start:end if end > 0 else None], re.M)
    assert documented == list(CollectiveRecord.COLUMNS)
