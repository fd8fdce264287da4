"""Saving and loading a large bundle shows a progress bar (bytes), advanced between files, never in a backward."""

from __future__ import annotations

import contextlib

import torch

import backlens as bl
from backlens._progress import LARGE_BYTES
from backlens.io import bundle as bundle_io
from models import MLP, loss_of


def spy_on_progress(monkeypatch):
    """Record (description, total, bytes advanced) of every bundle progress bar, as if at a terminal."""
    bars: list[list] = []

    @contextlib.contextmanager
    def progress(description, total, *, unit="steps", min_total=0, sizes=True, **_options):
        bar = [description, total, 0, unit, min_total, sizes]
        bars.append(bar)

        def advance(amount=1):
            bar[2] += amount

        yield advance

    monkeypatch.setattr(bundle_io, "progress", progress)
    monkeypatch.setattr(bundle_io, "progress_shown", lambda *a: True)
    return bars


def test_saving_a_bundle_advances_a_bar_by_the_bytes_of_its_tensors(tmp_path, monkeypatch):
    bars = spy_on_progress(monkeypatch)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_grads=True)
    loss_of(cap.output).backward()
    cap.save(tmp_path / "b")
    (save,) = [bar for bar in bars if bar[0] == "Saving bundle"]
    _description, total, advanced, unit, min_total, sizes = save
    assert unit == "bytes" and min_total == LARGE_BYTES  # small bundles never show a bar
    assert not sizes  # bytes read, a repeated tensor written once: the bar shows no size it would not write
    assert advanced > 0 and advanced <= total  # equal tensors are stored once


def test_loading_a_bundle_advances_a_bar_by_the_bytes_of_its_shards(tmp_path, monkeypatch):
    cap = bl.capture(MLP(), torch.randn(4, 6), save_grads=True)
    loss_of(cap.output).backward()
    path = cap.save(tmp_path / "b")
    bars = spy_on_progress(monkeypatch)
    bl.load(path)
    (check,) = [bar for bar in bars if bar[0] == "Checking bundle"]
    shard_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert check[1] == check[2] == shard_bytes and check[3] == "bytes"
