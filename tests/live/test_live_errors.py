"""Errors point at the user's line, name what the user wrote, and say who freed a graph."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import transformers
from live_helpers import assert_clean

import backlens.live as bl
from backlens.errors import FreedGraphError, NoGradForwardError, OutOfOrderError, TraceError

PACKAGE = str(Path(bl.__file__).resolve().parents[1])


def frames_of(error: BaseException) -> list[traceback.FrameSummary]:
    return traceback.extract_tb(error.__traceback__)


def assert_only_user_frames(error: BaseException) -> None:
    frames = frames_of(error)
    assert frames, "no traceback"
    assert all(frame.filename == __file__ for frame in frames), [f"{f.filename}:{f.lineno}" for f in frames]


def test_a_gradient_replaced_with_the_wrong_shape_in_a_single_input_trace_fails_at_that_line(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            h = lens.fc1.output
            with lens.output.sum().backward():
                h.grad = torch.zeros(3, 3)
    err = info.value
    assert err.code == "replacement_mismatch"
    assert "fc1.output.grad" in str(err) and "[3, 3]" in str(err) and "[5, 8]" in str(err)
    assert frames_of(err)[-1].line == "h.grad = torch.zeros(3, 3)"
    assert_clean(mlp)


def test_a_graph_freed_by_torch_autograd_grad_in_an_earlier_invoke_names_that_call(mlp, lens):
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(FreedGraphError) as info:
        with lens.trace() as tracer:
            with tracer.invoke(a):
                grads = torch.autograd.grad(lens.output.sum(), [mlp.fc1.weight])  # noqa: F841
            with tracer.invoke(b):
                with lens.output.sum().backward():
                    pass
    message = str(info.value)
    source = Path(__file__).read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(source) if "grads = torch.autograd.grad(lens.output" in text)
    assert message.startswith("invoke 1's .backward() at ")
    assert f"the earlier invoke 0's torch.autograd.grad() at {Path(__file__).name}:{line}" in message.replace(
        str(Path(__file__).parent) + "/", ""
    ).replace("tests/live/", "")
    assert "not one made in this trace" not in message
    assert message.splitlines()[-1].startswith("Original error from torch.autograd: Trying to backward")
    assert_clean(mlp)


def test_a_single_input_trace_with_two_backward_blocks_gets_the_freed_graph_text_without_invokes(mlp, lens, x):
    with pytest.raises(FreedGraphError) as info:
        with lens.trace(x):
            out = lens.output
            with out.sum().backward():
                pass
            with out.sum().backward():
                pass
    message = str(info.value)
    assert message.startswith("The .backward() at ")
    assert "the earlier .backward() at " in message and "already freed" in message
    assert "invoke" not in message.split("Original error")[0]
    assert "Pass retain_graph=True to every backward but the last" in message
    assert_clean(mlp)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()


def test_sites_are_spelled_as_the_user_wrote_them(gpt2):
    lens = bl.wrap(gpt2)
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(TraceError) as info:
        with lens.trace(ids):
            late = lens.transformer.h[1].output  # noqa: F841
            early = lens.transformer.h[0].output  # noqa: F841
    assert "transformer.h[0].output (invoke 0) was requested after transformer.h[0] had already run" in str(info.value)
    with pytest.raises(OutOfOrderError) as info:
        with lens.trace(ids):
            first, second = lens.transformer.h[0].output, lens.transformer.h[1].output
            with lens.output.logits.sum().backward():
                g0 = first.grad  # noqa: F841
                g1 = second.grad  # noqa: F841
    assert "transformer.h[1].output.grad (invoke 0) was requested after transformer.h[0].output.grad" in str(info.value)
    assert "h.1" not in str(info.value)


def test_a_body_that_cannot_run_is_refused_at_its_with_line_with_no_frame_of_ours(mlp, lens, x):
    def returns():
        with lens.trace(x):
            return 1

    with pytest.raises(TraceError) as info:
        returns()
    assert info.value.code == "unsupported_statement"
    assert_only_user_frames(info.value)
    assert frames_of(info.value)[-1].line == "with lens.trace(x):"
    assert_clean(mlp)


def test_a_body_that_does_not_compile_is_refused_with_no_frame_of_ours(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        for _ in range(1):
            with lens.trace(x):
                h = lens.fc1.output  # noqa: F841
                break
    assert info.value.code == "unsupported_statement"
    assert_only_user_frames(info.value)
    assert_clean(mlp)


def test_entering_blocks_that_cannot_run_shows_no_frame_of_ours(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.fc1.trace(x):
            pass
    assert info.value.code == "trace_on_submodule"
    assert_only_user_frames(info.value)
    with pytest.raises(TraceError) as info:
        with lens.trace(x) as tracer:
            with tracer.invoke(x):
                pass
    assert info.value.code == "invoke_with_trace_inputs"
    assert all(frame.filename == __file__ for frame in frames_of(info.value)[-1:])
    with torch.no_grad():
        frozen = mlp(x).sum()
    with pytest.raises(NoGradForwardError) as info:
        with frozen.backward():
            pass
    assert_only_user_frames(info.value)
    assert_clean(mlp)
