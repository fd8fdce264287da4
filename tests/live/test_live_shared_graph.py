"""One batched forward, one autograd graph: freeing it, keeping it."""

from __future__ import annotations

import gc

import pytest
import torch
from live_helpers import assert_clean

from backlens.errors import FreedGraphError

ORIGINAL = "Original error from torch.autograd: Trying to backward through the graph a second time"


@pytest.fixture
def two():
    torch.manual_seed(3)
    return torch.randn(2, 4), torch.randn(3, 4)


def test_a_second_backward_after_one_that_freed_the_graph_is_explained_in_invoke_terms(mlp, lens, two):
    with pytest.raises(FreedGraphError) as info:
        with lens.trace() as tracer:
            with tracer.invoke(two[0]):
                with lens.output.sum().backward():
                    pass
            with tracer.invoke(two[1]):
                with lens.output.sum().backward():
                    pass
    err = info.value
    message = str(err)
    assert isinstance(err, RuntimeError) and err.code == "freed_graph"
    assert message.startswith("invoke 1's .backward() at ")
    assert "the earlier invoke 0's .backward()" in message
    assert "single batched forward pass" in message and "share one autograd graph" in message
    assert "Pass retain_graph=True to every .backward() but the last, or run each invoke in its own trace" in message
    assert message.splitlines()[-1].startswith(ORIGINAL)
    assert message.rstrip().endswith("after calling backward.")
    assert_clean(lens._lens_module)


def test_the_freed_graph_error_says_the_earlier_call_did_not_retain_when_the_failing_one_did(mlp, lens, two):
    with pytest.raises(FreedGraphError) as info:
        with lens.trace() as tracer:
            with tracer.invoke(two[0]):
                with lens.output.sum().backward():
                    pass
            with tracer.invoke(two[1]):
                with lens.output.sum().backward(retain_graph=True):
                    pass
    message = str(info.value)
    assert info.value.code == "freed_graph"
    assert "invoke 1's .backward()" in message and "passed retain_graph=True" in message
    assert "invoke 0's .backward()" in message and "did not" in message
    assert message.splitlines()[-1].startswith(ORIGINAL)
    assert_clean(mlp)


def test_a_bare_second_backward_in_a_trace_is_explained_too(mlp, lens, two):
    with pytest.raises(FreedGraphError) as info, pytest.warns(UserWarning):
        with lens.trace() as tracer:
            with tracer.invoke(two[0]):
                lens.output.sum().backward()
            with tracer.invoke(two[1]):
                lens.output.sum().backward()
    assert info.value.code == "freed_graph"
    assert "invoke 1's .backward()" in str(info.value)
    assert_clean(mlp)


def test_other_autograd_errors_are_not_reworded(mlp, lens, two):
    with pytest.raises(RuntimeError) as info:
        with lens.trace(two[0]):
            out = lens.output
            with out.backward():  # not a scalar: torch's own error
                pass
    assert type(info.value) is RuntimeError
    assert str(info.value).startswith("grad can be implicitly created only for scalar outputs")
    assert_clean(mlp)


def test_a_freed_graph_outside_a_trace_keeps_torchs_error(mlp, two):
    loss = mlp(two[0]).sum()
    loss.backward()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert type(info.value) is RuntimeError
    assert str(info.value).startswith("Trying to backward through the graph a second time")


def test_keep_graph_retains_the_graph_for_every_backward_in_the_trace(mlp, lens, two):
    got = {}
    with lens.trace(keep_graph=True) as tracer:
        with tracer.invoke(two[0]):
            h0 = lens.fc2.output
            with lens.output.sum().backward():
                got[0] = h0.grad
        with tracer.invoke(two[1]):
            h1 = lens.fc2.output
            with lens.output.sum().backward():
                got[1] = h1.grad
    assert got[0].shape == (2, 8) and got[1].shape == (3, 8)
    assert_clean(mlp)


def test_keep_graph_frees_the_graph_when_the_trace_exits(mlp, lens, two):
    with lens.trace(two[0], keep_graph=True):
        out = lens.output.save()
        with out.sum().backward():
            pass
    with pytest.raises(FreedGraphError) as info:
        out.sum().backward()
    assert info.value.code == "freed_graph"
    assert "keep_graph=True" in str(info.value) and "frees it when the trace exits" in str(info.value)
    assert_clean(mlp)


def test_without_keep_graph_a_retained_graph_outlives_the_trace(mlp, lens, two):
    with lens.trace(two[0]):
        out = lens.output.save()
        with out.sum().backward(retain_graph=True):
            pass
    out.sum().backward()  # stock: the user retained it
    assert mlp.fc1.weight.grad is not None


def test_the_engine_is_watched_only_while_a_trace_runs(mlp, lens, two):
    from backlens import _torch
    from backlens.graph import engine
    from backlens.live import freed

    seen = []
    with lens.trace(two[0]):
        seen.append((engine.observing(freed._on_engine_run), _torch.engine_wrapper_installed()))
        with lens.output.sum().backward():
            pass
    assert seen == [(True, True)]
    assert not engine.observing(freed._on_engine_run)
    gc.collect()
    if not engine._live_participants():  # a capture another test still holds keeps the wrapper
        assert not _torch.engine_wrapper_installed()
    assert_clean(mlp)
