"""``backlens show`` prints a bundle's text as text: rich markup is not read, control characters are
escaped, so a hostile bundle can neither stop the command nor drive the terminal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import backlens as bl
from backlens import cli
from backlens.io import manifest as manifest_io
from models import MLP, loss_of

ESC = "\x1b"
HOSTILE = {
    "markup_closing_nothing": "[/]",
    "markup_styling": "[bold red]loud[/]",
    "window_title_escape": f"{ESC}]0;owned\x07",
    "screen_clearing_escape": f"{ESC}[2J",
    "c1_control": "\x9b31m",
    "right_to_left_override": "\u202etxt.exe",
}


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_grads=True)
    loss_of(cap.output).backward()
    return cap.save(tmp_path_factory.mktemp("show") / "sound")


def show(capsys, monkeypatch, path) -> str:
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["show", str(path)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def resealed(sound, tmp_path, change):
    path = tmp_path / "b"
    body = json.loads((sound / "manifest.json").read_text())
    body.pop("checksum")
    change(body)
    path.mkdir()
    for shard in sound.glob("*.safetensors"):
        (path / shard.name).write_bytes(shard.read_bytes())
    manifest_io.write(path, body)
    return path


def set_module_type(body, text):
    body["module_types"]["net.0"] = text


def set_trigger(body, text):
    body["passes"][0]["trigger"] = text


def set_address(body, text):
    body["module_types"][f"net.{text}"] = "Linear"
    body["modules"][2]["address"] = f"net.{text}"


@pytest.mark.parametrize("where", [set_module_type, set_trigger, set_address],
                         ids=["module_type", "trigger", "module_address"])
@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_show_prints_a_capture_bundle_s_text_as_text(sound, tmp_path, capsys, monkeypatch, where, text):
    out = show(capsys, monkeypatch, resealed(sound, tmp_path, lambda body: where(body, text)))
    assert not any(c in out for c in (ESC, "\x07", "\x9b", "\u202e"))
    if text.startswith("["):
        assert text in out  # the markup, printed as it is
    else:
        assert "\\x1b" in out or "\\x9b" in out or "\\u202e" in out


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_show_prints_a_derived_bundle_s_text_as_text(tmp_path, capsys, monkeypatch, text):
    bl.DerivedGrads(framework=f"jax{text}", version="0", output=np.float32(1.0),
                    leaf_grads={f"w{text}": np.ones(2, dtype=np.float32)}).save(tmp_path / "d")
    out = show(capsys, monkeypatch, tmp_path / "d")
    assert not any(c in out for c in (ESC, "\x07", "\x9b", "\u202e"))
    assert out.count("jax") == 1 and "w" in out


def test_show_names_the_bundle_in_bold_still(sound, capsys, monkeypatch):
    from backlens._console import printable

    out = show(capsys, monkeypatch, sound)
    assert out.startswith(f"{sound}: ") and "backward passes" in out
    assert printable("a\x1b[2Jb\nc") == "a\\x1b[2Jb\\x0ac"


@pytest.mark.parametrize("text", ["[/]", f"{ESC}[2J"], ids=["markup_closing_nothing", "screen_clearing_escape"])
def test_report_prints_a_monitor_run_s_names_as_text(tmp_path, capsys, monkeypatch, text):
    model = torch.nn.Sequential()
    model.add_module(f"odd{text}", torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(bl.BacklensWarning, match="non-finite"):
        with bl.monitor(model, optimizer=optimizer, sink=str(tmp_path / "run.csv")):
            x = torch.full((2, 3), float("nan"))
            model(x).sum().backward()
            optimizer.step()
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["report", str(tmp_path / "run.csv")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "1 alerts" in out and ESC not in out
    assert ("odd[/]" in out) if text == "[/]" else ("odd\\x1b[2J" in out)
