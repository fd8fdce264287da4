"""Sinks: TensorBoard event files read back with tensorboard's own reader, a CSV file equal to
to_pandas(), a callable's rows; a failing file sink is dropped, memory keeps everything."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from monitor_helpers import net, train
from torch import nn

import backlens as bl


def run(sink, steps=4, **options):
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with bl.monitor(model, optimizer, sink=sink, **options) as mon:
        train(model, optimizer, steps)
    return mon


def test_tensorboard_event_files_hold_every_value_under_stat_kind_name_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = run(str(tmp_path / "tb"), every=2, outputs=True)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    frame = mon.to_pandas()
    tags = {f"{r.stat}/{r.kind}/{r.name or '(model)'}" for r in frame.itertuples()}
    assert set(events.Tags()["scalars"]) == tags
    for row in frame.itertuples():
        (event,) = [e for e in events.Scalars(f"{row.stat}/{row.kind}/{row.name or '(model)'}") if e.step == row.step]
        assert event.value == np.float32(row.value)  # TensorBoard keeps float32
    assert sorted({e.step for e in events.Scalars("norm/module/(model)")}) == [0, 2]


def test_alerts_reach_tensorboard_as_text_and_read_back(tmp_path):
    from backlens.monitoring.sinks import read_tensorboard

    model = nn.Linear(3, 1, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with bl.monitor(model, sink=str(tmp_path / "tb")) as mon:
            for step in range(3):
                model.weight.grad = torch.full((1, 3), float("nan") if step == 1 else 1.0)
                mon.step()
    frame, alerts = read_tensorboard(str(tmp_path / "tb"))
    assert alerts == mon.alerts and alerts[0].step == 1
    assert frame[["step", "kind", "name", "stat"]].equals(mon.to_pandas()[["step", "kind", "name", "stat"]])


def test_the_csv_file_equals_to_pandas(tmp_path):
    path = tmp_path / "grads.csv"
    mon = run(str(path), outputs=True)
    written = pd.read_csv(path, keep_default_na=False, na_values={"value": ["nan"]})
    expected = mon.to_pandas()
    pd.testing.assert_frame_equal(written, expected, check_dtype=False)
    assert written["value"].tolist() == expected["value"].tolist()


def test_a_callable_gets_each_recorded_steps_rows(tmp_path):
    calls = []
    mon = run(lambda step, rows: calls.append((step, rows)), every=2)
    frame = mon.to_pandas()
    assert [step for step, _rows in calls] == [0, 2]
    for step, rows in calls:
        expected = frame[frame.step == step]
        assert [tuple(r) for r in rows] == list(expected.itertuples(index=False, name=None))
        assert rows[0].tag == f"{rows[0].stat}/{rows[0].kind}/{rows[0].name}"
        assert rows[0]["value"] == rows[0].value == rows[0][4]
        assert pd.DataFrame(rows).equals(expected.reset_index(drop=True))


def test_several_sinks_get_the_same_rows(tmp_path):
    calls = []
    mon = run([str(tmp_path / "a.csv"), lambda step, rows: calls.extend(rows)])
    assert len(calls) == len(mon.to_pandas()) == len(pd.read_csv(tmp_path / "a.csv"))


def test_an_error_in_a_callable_sink_reaches_the_user():
    def broken(step, rows):
        raise ValueError("my logger is down")

    model = nn.Linear(3, 1)
    mon = bl.monitor(model, sink=broken)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(ValueError, match="my logger is down"):
        mon.step()
    mon.close()


def test_a_file_sink_that_fails_is_dropped_with_one_warning_and_memory_keeps_the_rows(tmp_path):
    model = nn.Linear(3, 1)
    mon = bl.monitor(model, sink=str(tmp_path / "g.csv"))
    mon._sinks[0].handle.close()  # the file is gone from under it (a full disk, a lost mount)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            mon.step()
    assert [w.message.code for w in caught] == ["monitor_sink_failed"]
    assert sorted(set(mon.to_pandas().step)) == [0, 1, 2]
    mon.close()


@pytest.mark.parametrize("sink", [3, "", ["ok.csv", 7]])
def test_a_sink_that_is_no_path_or_callable_is_refused_before_anything_is_installed(sink, tmp_path):
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(bl.UnsupportedInputError, match="sink") as info:
        bl.monitor(model, optimizer, sink=sink)
    assert info.value.code == "bad_sink"
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("name", ["tb", "grads.csv"])
def test_a_sink_under_a_file_is_refused_as_an_output_path_error_naming_it(name, tmp_path):
    (tmp_path / "afile").write_text("mine")
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = str(tmp_path / "afile" / name)
    with pytest.raises(OSError) as info:
        bl.monitor(model, optimizer, sink=sink)
    assert isinstance(info.value, bl.OutputPathError)
    assert info.value.code == "output_not_writable"
    assert sink in str(info.value) and info.value.remedy
    assert (tmp_path / "afile").read_text() == "mine"
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
