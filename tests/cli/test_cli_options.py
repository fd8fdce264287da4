"""The CLI's options and output: --depth, --threads, noisy timings, output paths checked
before the first pass, --overwrite, and output to a pipe kept whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_factories

import backlens as bl
from backlens import cli
from backlens.report import profile as profile_module

HERE = Path(__file__).parent


def test_depth_5_lists_a_gpt2_attention_s_projection(run):
    code, out, err = run("profile", "tiny_factories:build_gpt2", "--input-ids", "--repeats", "1", "--depth", "5")
    assert code == 0, err
    assert "transformer.h.0.attn.c_attn " in out and "to depth 5" in out


def test_the_default_depth_stops_at_3(run):
    code, out, err = run("profile", "tiny_factories:build_gpt2", "--input-ids", "--repeats", "1")
    assert code == 0, err
    assert "transformer.h.0.attn " in out and "transformer.h.0.attn.c_attn" not in out


def test_a_backward_that_sleeps_at_random_is_reported_noisy(run):
    code, out, err = run("profile", "tiny_factories:build_with_noisy_loss", "--repeats", "8")
    assert code == 0, err
    assert "warning [timing_noisy]" in err and "interquartile range" in err
    assert "NOISY" in out


def test_more_threads_than_usable_cores_is_reported_noisy(run, monkeypatch):
    monkeypatch.setattr(profile_module, "usable_cores", lambda: 1)
    code, _out, err = run("profile", "tiny_factories:build", "--repeats", "2", "--threads", "2")
    assert code == 0 and "warning [timing_noisy]" in err and "torch runs 2 threads on the 1 core" in err


def test_threads_sets_torch_s_threads_for_the_run(run):
    tiny_factories.FORWARD_CALLS.clear()
    code, _out, err = run("profile", "tiny_factories:build_counted", "--repeats", "1", "--threads", "1")
    assert code == 0, err
    assert tiny_factories.FORWARD_CALLS and set(tiny_factories.FORWARD_CALLS) == {1}


@pytest.mark.parametrize("option", ["--timeline", "--html", "--save"])
def test_an_output_in_a_missing_folder_fails_before_the_forward_runs(run, tmp_path, option):
    tiny_factories.FORWARD_CALLS.clear()
    target = tmp_path / "missing" / "out"
    code, _out, err = run("profile", "tiny_factories:build_counted", option, str(target))
    assert code == 2 and f"{option} {target}: the folder {target.parent} does not exist" in err
    assert tiny_factories.FORWARD_CALLS == []


def test_an_output_that_is_a_folder_fails_before_the_forward_runs(run, tmp_path):
    tiny_factories.FORWARD_CALLS.clear()
    code, _out, err = run("profile", "tiny_factories:build_counted", "--timeline", str(tmp_path))
    assert code == 2 and "is a folder" in err and tiny_factories.FORWARD_CALLS == []


def test_save_refuses_an_existing_bundle_unless_overwrite_is_given(run, tmp_path):
    bundle = tmp_path / "b"
    assert run("profile", "tiny_factories:build", "--repeats", "0", "--save", str(bundle))[0] == 0
    tiny_factories.FORWARD_CALLS.clear()
    code, _out, err = run("profile", "tiny_factories:build_counted", "--repeats", "1", "--save", str(bundle))
    assert code == 2 and "--overwrite" in err and tiny_factories.FORWARD_CALLS == []
    assert len(bl.load(str(bundle)).passes) == 1  # untouched
    code, _out, err = run("profile", "tiny_factories:build", "--repeats", "1", "--save", str(bundle), "--overwrite")
    assert code == 0, err
    assert len(bl.load(str(bundle)).passes) == 2


def test_piped_output_keeps_long_module_names_whole(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is a pipe here, as under `| grep`
    assert cli.main(["profile", "tiny_factories:build_long_names", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "feature_extractor_with_a_long_descriptive_name" in out
    assert "classification_head_with_an_even_longer_descriptive_name" in out
    assert "\u2026" not in out  # nothing cut with an ellipsis


def test_the_module_table_says_what_own_node_calls_are(run):
    code, out, err = run("profile", "tiny_factories:build_gpt2", "--input-ids", "--repeats", "0")
    assert code == 0, err
    assert "own node calls: calls of autograd nodes made by the module call's own ops" in " ".join(out.split())


def test_too_few_timed_passes_are_reported_noisy(run):
    code, out, err = run("profile", "tiny_factories:build", "--repeats", "1")
    assert code == 0, err
    assert "warning [timing_noisy]" in err and "only 1 timed pass: too few" in err
    assert "NOISY" in out
