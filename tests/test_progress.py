"""Progress bars: drawn only for a person at a terminal, advanced only between passes."""

from __future__ import annotations

import io
from contextlib import contextmanager

import torch

import backlens as bl
from backlens import _progress
from backlens._torch import graph_task_id_function
from backlens.report.profile import run_passes
from models import MLP


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_when_asked_and_counts_the_steps():
    screen = Terminal()
    with _progress.progress("Backward passes", 3, unit="passes", stream=screen, shown=True) as advance:
        for _ in range(3):
            advance(1)
    assert "Backward passes" in screen.getvalue() and "3/3" in screen.getvalue()


def test_nothing_is_drawn_when_the_stream_is_not_a_terminal(monkeypatch):
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    plain = io.StringIO()
    assert not _progress.progress_shown(plain)
    with _progress.progress("Backward passes", 3, stream=plain) as advance:
        advance(3)
    assert plain.getvalue() == ""


def test_a_terminal_gets_a_bar_outside_tests_unless_switched_off(monkeypatch):
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    assert _progress.progress_shown(Terminal())
    monkeypatch.setenv("BACKLENS_PROGRESS", "0")
    assert not _progress.progress_shown(Terminal())


def test_tests_never_get_a_bar_even_on_a_terminal():
    assert not _progress.progress_shown(Terminal())


def test_byte_sized_work_below_the_threshold_draws_nothing():
    screen = Terminal()
    with _progress.progress("Saving bundle", 10 * 2**20, unit="bytes", min_total=_progress.LARGE_BYTES,
                            stream=screen, shown=True) as advance:
        advance(10 * 2**20)
    assert screen.getvalue() == ""


def test_a_large_bundle_gets_a_byte_counting_bar():
    screen = Terminal()
    total = 2 * _progress.LARGE_BYTES
    with _progress.progress("Saving bundle", total, unit="bytes", min_total=_progress.LARGE_BYTES,
                            stream=screen, shown=True) as advance:
        advance(total)
    assert "Saving bundle" in screen.getvalue() and "MB" in screen.getvalue()


def recording_progress(monkeypatch, target):
    """Replace ``target.progress`` by one that records whether each advance ran inside a backward."""
    task_id = graph_task_id_function()
    seen: list[bool] = []
    real = _progress.progress

    def spy(description, total, **options):
        options["shown"] = False
        context = real(description, total, **options)

        class Wrapped:
            def __enter__(self):
                context.__enter__()
                return lambda amount=1: seen.append(task_id() != -1)

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(target, "progress", spy)
    return seen


def test_bench_backward_advances_once_per_pass_and_never_inside_the_backward(monkeypatch):
    import backlens.bench as bench

    seen = recording_progress(monkeypatch, bench)
    torch.manual_seed(0)
    bl.bench.backward(MLP(), torch.randn(4, 6), lambda out: out.sum(), repeats=3, warmup=1)
    assert seen == [False] * (1 + 2 * 3)


def test_profile_passes_advance_once_per_pass_and_never_inside_the_backward(monkeypatch):
    seen = recording_progress(monkeypatch, _progress)
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    run_passes(cap, cap.output.sum(), 2, list(model.parameters()))
    assert seen == [False, False, False] and len(cap.passes) == 3


def test_a_save_s_byte_bar_ends_at_its_total_when_tensors_repeat(monkeypatch, tmp_path):
    import backlens.io.bundle as bundle

    totals, advanced = [], []

    @contextmanager
    def spy(description, total, **options):
        totals.append(total)
        yield advanced.append

    monkeypatch.setattr(bundle, "progress", spy)
    monkeypatch.setattr(bundle, "progress_shown", lambda: True)
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_grads=True, save_activations=True)
    cap.output.sum().backward()  # a node's outgoing gradient is the next node's incoming one: kept twice
    cap.save(tmp_path / "b")
    assert totals[0] > 0 and sum(advanced) == totals[0]


def test_a_bar_of_bytes_read_rather_than_written_shows_a_percentage_not_sizes():
    screen = Terminal()
    total = 2 * _progress.LARGE_BYTES
    with _progress.progress("Saving bundle", total, unit="bytes", sizes=False, min_total=_progress.LARGE_BYTES,
                            stream=screen, shown=True) as advance:
        advance(total // 2)
        advance(total - total // 2)
    drawn = screen.getvalue()
    assert "Saving bundle" in drawn and "%" in drawn and "/536.9 MB" not in drawn and "536.9" not in drawn
