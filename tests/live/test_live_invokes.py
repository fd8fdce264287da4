"""Several invokes in one batched forward: each sees and edits only its rows."""

from __future__ import annotations

import pytest
import torch
from live_helpers import assert_clean

import backlens.live as bl
from backlens.errors import TraceError, UnsupportedInputError

SIZES = (2, 3, 1)


@pytest.fixture
def inputs():
    torch.manual_seed(2)
    return [torch.randn(n, 4) for n in SIZES]


def rows(k):
    start = sum(SIZES[:k])
    return slice(start, start + SIZES[k])


def batched_reference(mlp, inputs, k, module="fc2"):
    """Plain autograd on the same batch, loss over invoke k's rows only."""
    kept = {}
    handle = mlp.get_submodule(module).register_forward_hook(
        lambda mod, args, out: (out.retain_grad(), kept.setdefault("out", out)) and None
    )
    try:
        out = mlp(torch.cat(inputs))
        out[rows(k)].sum().backward()
    finally:
        handle.remove()
    return kept["out"].grad


def test_each_invoke_reads_only_its_own_rows_of_an_output(mlp, lens, inputs):
    full = mlp.fc1(torch.cat(inputs)).detach()
    seen = {}
    with lens.trace() as tracer:
        for k, inp in enumerate(inputs):
            with tracer.invoke(inp):
                seen[k] = lens.fc1.output.detach()
    for k in range(3):
        assert torch.equal(seen[k], full[rows(k)])
    assert_clean(mlp)


@pytest.mark.parametrize("taker", [0, 1, 2])
def test_any_one_of_three_invokes_takes_its_gradient(mlp, lens, inputs, taker):
    expected = batched_reference(mlp, inputs, taker)
    mlp.zero_grad()
    got = {}
    with lens.trace() as tracer:
        for k, inp in enumerate(inputs):
            with tracer.invoke(inp):
                h = lens.fc2.output
                if k == taker:
                    with lens.output.sum().backward():
                        got[k] = h.grad
    assert list(got) == [taker]
    assert got[taker].shape[0] == SIZES[taker]
    assert torch.equal(got[taker], expected[rows(taker)])
    assert_clean(mlp)


def test_negative_control_other_rows_get_no_gradient_and_other_losses_differ(mlp, lens, inputs):
    expected_0 = batched_reference(mlp, inputs, 0)
    expected_1 = batched_reference(mlp, inputs, 1)
    # The loss of invoke 0 sends nothing into invoke 1's rows...
    assert torch.count_nonzero(expected_0[rows(1)]) == 0
    got = {}
    with lens.trace() as tracer:
        with tracer.invoke(inputs[0]):
            h0 = lens.fc2.output
            with lens.output.sum().backward():
                got[0] = h0.grad
        with tracer.invoke(inputs[1]):
            pass
        with tracer.invoke(inputs[2]):
            pass
    # ...and the comparison can tell invokes apart: invoke 1's own gradient differs.
    assert torch.equal(got[0], expected_0[rows(0)])
    assert not torch.equal(got[0][:1], expected_1[rows(1)][:1])


def test_three_invokes_each_take_their_gradient_in_one_trace(mlp, lens, inputs):
    expected = [batched_reference(mlp, inputs, k) for k in range(3)]
    got = {}
    with lens.trace() as tracer:
        for k, inp in enumerate(inputs):
            with tracer.invoke(inp):
                h = lens.fc2.output
                with lens.output.sum().backward(retain_graph=k < 2):
                    got[k] = h.grad
    for k in range(3):
        assert torch.equal(got[k], expected[k][rows(k)])


def test_a_forward_edit_in_one_invoke_leaves_the_others_rows_alone(mlp, lens, inputs):
    stock = mlp(torch.cat(inputs)).detach()
    out = {}
    with lens.trace() as tracer:
        with tracer.invoke(inputs[0]):
            lens.fc1.output = lens.fc1.output * 0
            out[0] = lens.output.detach()
        with tracer.invoke(inputs[1]):
            out[1] = lens.output.detach()
        with tracer.invoke(inputs[2]):
            out[2] = lens.output.detach()
    zeroed = mlp.fc3(torch.tanh(mlp.fc2(mlp.act(mlp.fc1.bias * 0 + torch.zeros(2, 8))))).detach()
    assert torch.equal(out[0], zeroed)
    assert torch.equal(out[1], stock[rows(1)])
    assert torch.equal(out[2], stock[rows(2)])


def test_a_gradient_edit_in_one_invoke_leaves_the_others_rows_alone(mlp, lens, inputs):
    batch = torch.cat(inputs)
    kept = {}

    def double_invoke_0(grad):
        grad = grad.clone()
        grad[rows(0)] *= 2
        return grad

    def on_fc2(mod, args, out):
        out.register_hook(double_invoke_0)

    def on_fc1(mod, args, out):
        out.retain_grad()
        kept["fc1"] = out

    handles = [mlp.fc2.register_forward_hook(on_fc2), mlp.fc1.register_forward_hook(on_fc1)]
    mlp(batch).sum().backward()
    for handle in handles:
        handle.remove()
    expected = kept["fc1"].grad
    mlp.zero_grad()

    shared = {}
    got = {}
    with lens.trace() as tracer:
        with tracer.invoke(inputs[0]):
            shared["a0"] = lens.fc1.output
            shared["b0"] = lens.fc2.output
            shared["out0"] = lens.output
        with tracer.invoke(inputs[1]):
            shared["out1"] = lens.output
        with tracer.invoke(inputs[2]):
            a2 = lens.fc1.output
            b2 = lens.fc2.output
            out2 = lens.output  # served after invokes 0 and 1 took theirs
            loss = shared["out0"].sum() + shared["out1"].sum() + out2.sum()
            with loss.backward():
                b0 = shared["b0"]
                before = b2.grad.clone()
                b0.grad = b0.grad * 2  # only invoke 0's rows of fc2's gradient
                got["b2_after"] = b2.grad
                got["b2_before"] = before
                got["a2"] = a2.grad
                got["a0"] = shared["a0"].grad
    assert torch.equal(got["b2_after"], got["b2_before"])
    assert torch.equal(got["a2"], expected[rows(2)])
    assert torch.equal(got["a0"], expected[rows(0)])
    assert_clean(mlp)


def test_invokes_whose_inputs_cannot_be_concatenated_raise_a_clear_error(mlp, lens):
    with pytest.raises(UnsupportedInputError) as info:
        with lens.trace() as tracer:
            with tracer.invoke(torch.randn(2, 4)):
                pass
            with tracer.invoke(torch.randn(2, 5)):
                pass
    assert info.value.code == "uncombinable_inputs"
    assert "[2, 4]" in str(info.value) and "[2, 5]" in str(info.value)
    assert_clean(mlp)


def test_dicts_of_tensors_are_combined_key_by_key():
    batcher = bl.Batcher  # the protocol is exported
    from backlens.live.batching import ConcatBatcher

    combined_args, combined_kwargs = ConcatBatcher().combine(
        [((), {"ids": torch.zeros(2, 3), "flag": True}), ((), {"ids": torch.ones(1, 3), "flag": True})]
    )
    assert combined_kwargs["ids"].shape == (3, 3) and combined_kwargs["flag"] is True
    assert isinstance(ConcatBatcher(), batcher)


def test_a_custom_batcher_decides_how_invokes_combine(mlp):
    class Stack:
        def size(self, *args, **kwargs):
            return 1

        def combine(self, invokes):
            return (torch.stack([args[0] for args, _ in invokes]),), {}

    lens = bl.wrap(mlp, batcher=Stack())
    seen = {}
    with lens.trace() as tracer:
        with tracer.invoke(torch.ones(4)):
            seen[0] = lens.fc1.output.detach()
        with tracer.invoke(torch.zeros(4)):
            seen[1] = lens.fc1.output.detach()
    # (a 1-row matmul may round differently from the batched one)
    assert torch.allclose(seen[0][0], mlp.fc1(torch.ones(4)).detach())
    assert torch.allclose(seen[1][0], mlp.fc1.bias.detach())


def test_invoke_in_a_trace_that_has_inputs_is_refused(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x) as tracer:
            with tracer.invoke(x):
                pass
    assert info.value.code == "invoke_with_trace_inputs"
    assert_clean(mlp)


def test_a_trace_without_inputs_or_invokes_is_refused(mlp, lens):
    with pytest.raises(TraceError) as info:
        with lens.trace():
            y = 1  # noqa: F841
    assert info.value.code == "no_inputs"
    assert "has no inputs" in str(info.value)
    assert_clean(mlp)


def test_module_values_outside_an_invoke_are_refused(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            lens.fc1.output  # noqa: B018  (a request, for its effect)
            with tracer.invoke(x):
                pass
    assert info.value.code == "outside_invoke"
    assert "fc1.output" in str(info.value)
    assert_clean(mlp)


def test_more_invokes_than_the_coroutine_pool_keeps_each_see_their_own_rows(mlp, lens):
    torch.manual_seed(5)
    inputs = [torch.randn(1, 4) for _ in range(12)]
    full = mlp.fc2(mlp.act(mlp.fc1(torch.cat(inputs)))).detach()
    seen = {}
    with lens.trace() as tracer:
        for k, inp in enumerate(inputs):
            with tracer.invoke(inp):
                seen[k] = lens.fc2.output.detach()
    for k in range(12):
        assert torch.equal(seen[k], full[k : k + 1])
    assert_clean(mlp)
