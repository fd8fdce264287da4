"""Declarative edits: identity oracles on an MLP with ReLU against hand-made references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import MLP


def model_and_input(seed=0):
    torch.manual_seed(seed)
    return MLP(), torch.randn(4, 6)


def loss_fn(out):
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def stock_grads_with_hook(model, x, module_index, transform):
    """Reference: a plain tensor hook on a module's output applies the same transform."""
    model = copy.deepcopy(model)

    def hook(module, inputs, out):
        out.register_hook(transform)

    handle = model.net[module_index].register_forward_hook(hook)
    loss_fn(model(x)).backward()
    handle.remove()
    return {n: p.grad for n, p in model.named_parameters()}


def captured_grads(model, x, intervene):
    model = copy.deepcopy(model)
    cap = bl.capture(model, x, intervene=intervene)
    loss_fn(cap.output).backward()
    return cap, {n: p.grad for n, p in model.named_parameters()}


def test_zero_ablating_a_gradient_zeroes_every_upstream_parameter_gradient():
    model, x = model_and_input()
    plain = copy.deepcopy(model)
    plain_out = plain(x)
    cap, grads = captured_grads(model, x, bl.when(bl.grad("relu_1"), bl.zero_ablate()))
    assert torch.equal(cap.output, plain_out)
    assert torch.count_nonzero(grads["net.0.weight"]) == 0 and torch.count_nonzero(grads["net.0.bias"]) == 0
    assert torch.count_nonzero(grads["net.4.weight"]) > 0


def test_scale_two_doubles_upstream_gradients_exactly():
    model, x = model_and_input()
    reference = stock_grads_with_hook(model, x, 1, lambda g: g * 2)
    _, grads = captured_grads(model, x, bl.when(bl.grad("relu_1"), bl.scale(2)))
    for name in ("net.0.weight", "net.0.bias"):
        assert torch.equal(grads[name], reference[name])
    plain = copy.deepcopy(model)
    loss_fn(plain(x)).backward()
    assert torch.equal(grads["net.0.weight"], plain.net[0].weight.grad * 2)


def test_clamp_zero_zero_zeroes_the_gradient():
    model, x = model_and_input()
    _, grads = captured_grads(model, x, bl.when(bl.grad("net.2"), bl.clamp(0, 0)))
    assert torch.count_nonzero(grads["net.0.weight"]) == 0


def test_clip_norm_bounds_the_gradient_norm():
    model, x = model_and_input()
    cap = bl.capture(model, x, save_grads=True, intervene=bl.when(bl.grad("linear_2"), bl.clip_norm(0.01)))
    loss_fn(cap.output).backward()
    (application,) = cap.passes[0].edits
    assert application.norm_before > 0.01
    assert application.norm_after == pytest.approx(0.01, rel=1e-4)
    assert application.site == "linear_2" and application.edit == "clip_norm(0.01)"


def test_seeded_noise_is_reproducible_and_changes_the_gradient():
    model, x = model_and_input()
    edit = bl.when(bl.grad("relu_2"), bl.add_noise(0.5, seed=7))
    _, first = captured_grads(model, x, edit)
    _, second = captured_grads(model, x, bl.when(bl.grad("relu_2"), bl.add_noise(0.5, seed=7)))
    _, plain = captured_grads(model, x, ())
    assert torch.equal(first["net.0.weight"], second["net.0.weight"])
    assert not torch.equal(first["net.0.weight"], plain["net.0.weight"])


def test_an_activation_edit_changes_the_output_as_the_same_edit_by_hand():
    model, x = model_and_input()
    by_hand = copy.deepcopy(model)
    by_hand.net[1].register_forward_hook(lambda m, i, out: out * 0.5)
    expected = by_hand(x)
    cap = bl.capture(model, x, intervene=bl.when("relu_1", bl.scale(0.5)))
    assert torch.equal(cap.output, expected)
    assert cap.forward_edits[0].op == "relu_1"
    module_cap = bl.capture(model, x, intervene=bl.when("net.1", bl.scale(0.5)))
    assert torch.equal(module_cap.output, expected)


def test_a_callable_edit_gets_a_context_naming_its_site():
    model, x = model_and_input()
    seen = []

    def record(value, *, ctx):
        seen.append(ctx)
        return value

    cap = bl.capture(model, x, intervene=bl.when(bl.grad("relu_1"), record))
    loss_fn(cap.output).backward()
    (ctx,) = seen
    assert (ctx.site, ctx.op, ctx.module, ctx.pass_number) == ("relu_1", "relu_1", "net.1", 1)


def test_do_returns_a_new_capture_and_leaves_the_first_unchanged():
    model, x = model_and_input()
    cap = bl.capture(model, x)
    before = cap.output.clone()
    edited = cap.do("relu_1", bl.zero_ablate(), loss=lambda c: loss_fn(c.output))
    assert edited is not cap
    assert torch.equal(cap.output, before) and len(cap.passes) == 0
    assert len(edited.passes) == 1
    zeroed = model.net[4](model.net[3](model.net[2](torch.zeros(4, 16))))
    assert torch.equal(edited.output, zeroed)


@pytest.mark.parametrize("fails_in", ["loss", "backward"])
def test_do_closes_its_fork_when_the_loss_or_its_backward_raises(fails_in):
    from backlens import _torch
    from backlens.graph import engine

    model, x = model_and_input()
    armed = engine._live_participants()  # captures other tests may still hold
    cap = bl.capture(model, x)

    def loss(c):
        if fails_in == "loss":
            raise ValueError("no loss today")
        out = c.output.clone()
        out.register_hook(_explode)
        return loss_fn(out)

    with pytest.raises((ValueError, RuntimeError), match="no loss today|exploded"):
        cap.do("relu_1", bl.zero_ablate(), loss=loss)
    assert engine._live_participants() == [*armed, cap._state.recorder]
    cap.close()
    assert engine._live_participants() == armed
    assert _torch.engine_wrapper_installed() == bool(armed or engine._observers)


def _explode(grad):
    raise RuntimeError("exploded in the backward")


def test_gradient_edits_apply_in_every_pass():
    model, x = model_and_input()
    cap = bl.capture(model, x, intervene=bl.when(bl.grad("relu_1"), bl.scale(2)))
    loss = loss_fn(cap.output)
    loss.backward(retain_graph=True)
    first = model.net[0].weight.grad.clone()
    loss.backward()
    assert torch.equal(model.net[0].weight.grad, first * 2)
    assert [len(p.edits) for p in cap.passes] == [1, 1]


def test_a_site_that_names_nothing_lists_close_labels():
    model, x = model_and_input()
    with pytest.raises(KeyError) as info:
        bl.capture(model, x, intervene=bl.when(bl.grad("relu_9"), bl.scale(2)))
    assert "relu_1" in str(info.value)


def test_an_edit_that_changes_shape_is_refused_naming_the_site():
    model, x = model_and_input()
    with pytest.raises(bl.BacklensError) as info:
        bl.capture(model, x, intervene=bl.when("relu_1", lambda v, ctx: v.sum()))
    assert info.value.code == "edit_changed_shape" and "relu_1" in str(info.value)
    assert all(not m._forward_hooks for m in model.modules())


def test_a_gradient_edit_needs_backward_capture():
    model, x = model_and_input()
    with pytest.raises(bl.BackwardUnavailableError):
        bl.capture(model, x, backward=False, intervene=bl.when(bl.grad("relu_1"), bl.scale(2)))


def test_sites_combine_with_or():
    model, x = model_and_input()
    site = bl.grad("relu_1") | bl.grad("relu_2")
    cap = bl.capture(model, x, intervene=bl.when(site, bl.scale(1.0)))
    loss_fn(cap.output).backward()
    assert sorted(a.site for a in cap.passes[0].edits) == ["relu_1", "relu_2"]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        return self.a(x).relu()


def test_unedited_ops_get_no_extra_autograd_nodes():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 3)
    plain = bl.capture(model, x)
    armed = bl.capture(model, x, intervene=bl.when(bl.grad("relu_1"), bl.scale(2)))
    plain.output.sum().backward()
    armed.output.sum().backward()
    assert [g.type for g in plain.grad_fns] == [g.type for g in armed.grad_fns]


def test_edit_applications_round_trip_through_a_bundle(tmp_path):
    model, x = model_and_input()
    intervene = bl.when(bl.grad("relu_1"), bl.scale(2)) | bl.when("linear_1", bl.scale(0.5))
    cap = bl.capture(model, x, intervene=intervene)
    loss_fn(cap.output).backward()
    cap.save(tmp_path / "bundle")
    loaded = bl.load(tmp_path / "bundle")
    assert loaded.passes[0].edits == cap.passes[0].edits
    assert loaded.forward_edits == cap.forward_edits and len(cap.forward_edits) == 1
