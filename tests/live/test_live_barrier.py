"""Barriers: a value bound in one invoke is used below the barrier in another."""

from __future__ import annotations

import traceback

import pytest
import torch
from live_helpers import assert_clean

from backlens.errors import TraceError


@pytest.fixture
def prompts():
    torch.manual_seed(4)
    return torch.randn(2, 4), torch.randn(2, 4)


def stock_patching(mlp, clean, corrupt):
    """Two plain runs: the clean one, then the corrupted one with fc1's output taken from it.

    Each run sees the same batch as the trace's single batched forward (clean
    rows, then corrupted rows), so the arithmetic is the same and the
    comparison can be exact.
    """
    batch = torch.cat([clean, corrupt])
    kept = {}

    def keep(mod, args, out):
        out.retain_grad()
        kept["clean"] = out

    handle = mlp.fc1.register_forward_hook(keep)
    mlp(batch)
    handle.remove()
    clean_h = kept["clean"][:2]
    handle = mlp.fc1.register_forward_hook(
        lambda mod, args, out: torch.slice_scatter(out, clean_h, dim=0, start=2, end=4)
    )
    out = mlp(batch)[2:]
    handle.remove()
    out.sum().backward()
    grads = {name: p.grad.clone() for name, p in mlp.named_parameters()}
    return out.detach(), kept["clean"].grad[:2], grads


def test_activation_patching_across_invokes_equals_two_stock_runs_bit_for_bit(mlp, lens, prompts):
    clean, corrupt = prompts
    expected_out, expected_grad, expected_params = stock_patching(mlp, clean, corrupt)
    mlp.zero_grad()
    with lens.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(clean):
            clean_h = lens.fc1.output
            barrier()
        with tracer.invoke(corrupt):
            barrier()
            lens.fc1.output = clean_h
            out = lens.output.save()
            with out.sum().backward():
                grad = clean_h.grad.save()
    assert torch.equal(out, expected_out)
    assert torch.equal(grad, expected_grad)
    for name, param in mlp.named_parameters():
        assert torch.equal(param.grad, expected_params[name]), name
    assert not torch.equal(out, mlp(corrupt))  # the patch changed the corrupted run
    assert_clean(mlp)


def test_a_name_the_other_invoke_bound_itself_keeps_its_own_value(lens, prompts):
    clean, corrupt = prompts
    with lens.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(clean):
            h = lens.fc1.output
            only_clean = h * 1
            barrier()
        with tracer.invoke(corrupt):
            h = lens.fc1.output
            barrier()
            mine = h.save()
            theirs = only_clean.save()
    assert torch.equal(mine, lens._lens_module.fc1(corrupt))
    assert torch.equal(theirs, lens._lens_module.fc1(clean))


def test_a_barrier_in_a_loop_meets_once_per_round(lens, prompts):
    clean, corrupt = prompts
    seen = []
    with lens.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(clean):
            for step in range(3):
                token = step * 10
                barrier()
        with tracer.invoke(corrupt):
            for _ in range(3):
                barrier()
                seen.append(token)
    assert seen == [0, 10, 20]


def test_a_barrier_that_never_fills_names_the_invokes_left_waiting(mlp, lens, prompts):
    clean, corrupt = prompts
    ran = []
    mlp.fc3.register_forward_hook(lambda mod, args, out: ran.append("fc3"))
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(clean):
                h = lens.fc2.output  # noqa: F841
                barrier()
            with tracer.invoke(corrupt):
                early = lens.fc1.output.save()  # noqa: F841  (done before fc2 runs)
    err = info.value
    assert err.code == "barrier_unfilled"
    assert "Invokes left waiting: invoke 0." in str(err)
    assert "invoke 1 finished without reaching it" in str(err)
    assert "tracer.barrier(2)" in str(err)
    frames = traceback.extract_tb(err.__traceback__)
    assert frames[-1].filename == __file__ and frames[-1].line == "barrier()"
    assert ran == []  # the model stopped at fc2, as soon as the barrier could not fill
    mlp.fc3._forward_hooks.clear()
    assert_clean(mlp)


def test_a_barrier_for_more_invokes_than_the_trace_has_is_refused_before_the_model_runs(mlp, lens, prompts):
    clean, _ = prompts
    ran = []
    mlp.fc1.register_forward_pre_hook(lambda mod, args: ran.append("fc1"))
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            barrier = tracer.barrier(3)
            with tracer.invoke(clean):
                barrier()
            with tracer.invoke(clean):
                barrier()
    assert info.value.code == "barrier_unfilled"
    assert "only 1 did (invoke 1 has not run yet)" in str(info.value)
    assert "Invokes left waiting: invoke 0." in str(info.value)
    assert ran == []
    mlp.fc1._forward_pre_hooks.clear()
    assert_clean(mlp)


def test_a_barrier_called_outside_an_invoke_is_refused(mlp, lens, prompts):
    clean, _ = prompts
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            barrier = tracer.barrier(1)
            barrier()
            with tracer.invoke(clean):
                pass
    assert info.value.code == "barrier_outside_invoke"
    assert_clean(mlp)


def test_a_barrier_needs_a_positive_count(lens):
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            tracer.barrier(0)
    assert info.value.code == "bad_barrier"
