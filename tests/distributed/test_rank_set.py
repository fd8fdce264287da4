"""Rank bundles read together: RankSet, the cross-rank table, check_grads and `backlens show`."""

from __future__ import annotations

import json
import shutil

import pytest
from rank_launch import WORLD_SIZE
from rank_worker import SLEEP

import backlens as bl
from backlens.cli import main as cli_main


def test_a_directory_of_rank_bundles_loads_as_a_rank_set_in_rank_order(world):
    ranks = bl.load(world.path / "ddp_mlp")
    assert isinstance(ranks, bl.RankSet)
    assert ranks.world_size == WORLD_SIZE == len(ranks.ranks)
    assert [cap.rank for cap in ranks.ranks] == list(range(WORLD_SIZE))
    assert [cap.path.name for cap in ranks.ranks] == [f"rank{r}" for r in range(WORLD_SIZE)]


def test_each_rank_bundles_manifest_records_its_rank_and_the_world_size(world):
    for rank in range(WORLD_SIZE):
        manifest = json.loads((world.path / "ddp_mlp" / f"rank{rank}" / "manifest.json").read_text())
        assert (manifest["capture"]["rank"], manifest["capture"]["world_size"]) == (rank, WORLD_SIZE)


def test_a_rank_set_missing_a_rank_is_refused_naming_it(world, tmp_path):
    shutil.copytree(world.path / "ddp_mlp" / "rank0", tmp_path / "run" / "rank0")
    with pytest.raises(bl.BundleError) as caught:
        bl.load(tmp_path / "run")
    assert caught.value.code == "bundle_ranks_missing" and "[1]" in str(caught.value)


def test_a_rank_set_with_a_rank_twice_is_refused(world, tmp_path):
    for name in ("rank0", "rank1", "again"):
        shutil.copytree(world.path / "ddp_mlp" / ("rank1" if name == "again" else name), tmp_path / "run" / name)
    with pytest.raises(bl.BundleError) as caught:
        bl.load(tmp_path / "run")
    assert caught.value.code == "bundle_ranks_mismatch"


@pytest.mark.parametrize(("scenario", "slow"), [("slow_ddp", "module.slow"), ("slow_fsdp", "slow")])
def test_the_cross_rank_table_names_the_module_slow_on_rank_1(world, scenario, slow):
    table = bl.load(world.path / scenario).cost_tree()
    worst = table.slowest_module
    assert worst.address == slow and worst.slowest_rank == 1
    assert worst.skew >= 0.8 * SLEEP
    assert table[slow].times[1] >= SLEEP


@pytest.mark.parametrize("scenario", ["slow_ddp", "slow_fsdp"])
def test_the_time_rank_0_waits_for_rank_1_is_its_collectives_not_a_modules(world, scenario):
    table = bl.load(world.path / scenario).cost_tree()
    waited = sum(row.times[0] for row in table if row.kind == "collective")
    assert waited >= 0.8 * SLEEP
    for row in table:
        if row.kind != "collective" and row.times[0] is not None:
            assert row.times[0] < SLEEP / 2, row


def test_the_cross_rank_table_has_a_column_per_rank_and_the_skew(world):
    frame = bl.load(world.path / "slow_ddp").cost_tree().to_pandas()
    assert list(frame.columns) == ["address", "kind", "rank0", "rank1", "slowest_rank", "skew"]
    row = frame.set_index("address").loc["module.slow"]
    assert row["skew"] == pytest.approx(abs(row["rank1"] - row["rank0"]))


@pytest.mark.parametrize("scenario", ["ddp_mlp", "ddp_gpt2", "slow_ddp"])
def test_check_grads_is_true_for_ddp_after_the_all_reduce(world, scenario):
    check = bl.load(world.path / scenario).check_grads()
    assert check and check.compared and not check.mismatched


def test_check_grads_names_the_gradient_one_rank_changed_after_the_all_reduce(world):
    check = bl.load(world.path / "desync").check_grads()
    assert not check
    assert check.mismatched == ["module.2.weight"]
    assert check.max_abs_diff["module.2.weight"] > 0
    assert "module.2.weight" in repr(check)


def test_check_grads_is_false_with_the_reason_when_no_gradient_is_replicated(world):
    check = bl.load(world.path / "fsdp_mlp").check_grads()
    assert not check and not check.compared
    assert "all-reduce" in check.reason and "shard" in check.reason


def test_backlens_show_prints_the_cross_rank_table_naming_the_slow_module(world, capsys):
    assert cli_main(["show", str(world.path / "slow_ddp")]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "skew" in out
    assert "Greatest skew: module 'module.slow' is slowest on rank 1" in out
    assert "agree on every rank" in out


def test_backlens_show_writes_one_timeline_with_a_process_per_rank(world, tmp_path, capsys):
    target = tmp_path / "t.json"
    assert cli_main(["show", str(world.path / "slow_fsdp"), "--timeline", str(target)]) == 0
    events = json.loads(target.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "rank 0", 2: "rank 1"}
    assert {e["pid"] for e in events if e.get("cat") == "collective"} == {1, 2}
    # one clock for every rank: each rank's first pass where it ran, in the file's time base
    document = json.loads(target.read_text())
    ranks = bl.load(world.path / "slow_fsdp")
    for rank, cap in enumerate(ranks):
        (first,) = [e for e in events if e["pid"] == rank + 1 and e.get("name") == "pass 1"]
        entry = cap._state.passes[0]
        expected = entry.start_ns + entry.clock_offset_ns
        assert abs(document["baseTimeNanoseconds"] + round(first["ts"] * 1000) - expected) <= 1


@pytest.mark.parametrize(("call", "code", "kind"), [
    (lambda ranks: ranks[WORLD_SIZE], "label_not_found", IndexError),
    (lambda ranks: ranks["0"], "bad_argument", TypeError),
    (lambda ranks: ranks.cost_tree(pass_=0), "bad_pass_number", ValueError),
], ids=["rank_past_the_world", "rank_a_string", "cost_tree_pass_zero"])
def test_a_rank_set_checks_its_arguments_at_the_call(world, call, code, kind):
    ranks = bl.load(world.path / "ddp_mlp")
    with pytest.raises(bl.BacklensError) as caught:
        call(ranks)
    assert caught.value.code == code and isinstance(caught.value, kind)


def test_loading_a_rank_set_checks_verify_before_reading_a_bundle(world):
    with pytest.raises(bl.UnsupportedInputError) as caught:
        bl.load(world.path / "ddp_mlp", verify="yes")
    assert caught.value.code == "bad_argument"
