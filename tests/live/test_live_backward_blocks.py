"""Reading and replacing gradients inside `with loss.backward():`."""

from __future__ import annotations

import pytest
import torch
from live_helpers import assert_clean, reference

import backlens.live as bl
from backlens.errors import NoGradForwardError, NoGradientPathError, OutOfOrderError, TraceError


def served_grad(lens, x, module_of):
    """The gradient a backward block serves for one module's output (``module_of(lens)``),
    the loss being the model output's sum."""
    with lens.trace(x):
        h = module_of(lens).output
        with lens.output.sum().backward():
            g = h.grad.save()
    return g


def test_grad_read_in_a_backward_block_equals_plain_autograd(mlp, lens, x):
    ref = reference(mlp, x, ["fc2"])
    g = served_grad(lens, x, lambda lens: lens.fc2)
    assert torch.equal(g, ref["fc2"][1])
    assert_clean(mlp)


def test_grad_edit_is_read_back_and_reaches_the_weights(mlp, lens, x):
    reference(mlp, x, [])
    stock_weight_grad = mlp.fc1.weight.grad.clone()
    mlp.zero_grad()
    with lens.trace(x):
        h = lens.fc1.output
        with lens.output.sum().backward():
            original = h.grad.save()
            h.grad = h.grad * 2
            doubled = h.grad.save()
    assert torch.equal(doubled, original * 2)
    assert torch.equal(mlp.fc1.weight.grad, stock_weight_grad * 2)
    assert_clean(mlp)


def test_gradients_read_in_reverse_forward_order_all_match(mlp, lens, x):
    ref = reference(mlp, x, ["fc1", "fc2", "fc3"])
    with lens.trace(x):
        a, b, c = lens.fc1.output, lens.fc2.output, lens.fc3.output
        with lens.output.sum().backward():
            gc = c.grad.save()
            gb = b.grad.save()
            ga = a.grad.save()
    assert torch.equal(gc, ref["fc3"][1])
    assert torch.equal(gb, ref["fc2"][1])
    assert torch.equal(ga, ref["fc1"][1])


def test_requesting_gradients_in_forward_order_raises_naming_both_sites(mlp, lens, x):
    with pytest.raises(OutOfOrderError) as info:
        with lens.trace(x):
            a, b = lens.fc1.output, lens.fc2.output
            with lens.output.sum().backward():
                a.grad  # noqa: B018  (a request, for its effect)
                b.grad  # noqa: B018  (a request, for its effect)
    err = info.value
    assert err.code == "out_of_order"
    assert "fc2.output.grad (invoke 0) was requested after fc1.output.grad (invoke 0)" in str(err)
    assert "0x" not in str(err) and "id(" not in str(err)
    assert_clean(mlp)


def test_a_tensor_the_loss_does_not_depend_on_raises_at_once(mlp, lens, x):
    with pytest.raises(NoGradientPathError) as info:
        with lens.trace(x):
            h = lens.fc1.output
            side = h * 3
            with lens.fc1.output.sum().backward():
                side.grad  # noqa: B018  (a request, for its effect)
    assert info.value.code == "no_gradient_path"
    assert "`side`" in str(info.value)
    assert_clean(mlp)


def test_an_unreachable_first_request_stops_the_backward_before_any_gradient_is_computed(mlp, lens, x):
    mlp.zero_grad(set_to_none=True)
    with pytest.raises(NoGradientPathError):
        with lens.trace(x):
            side = lens.fc1.output * 3
            with lens.fc2.output.sum().backward():
                side.grad  # noqa: B018  (a request, for its effect)
    assert all(p.grad is None for p in mlp.parameters())
    assert_clean(mlp)


def test_an_unreachable_request_while_gradients_flow_raises_at_once(mlp, lens, x):
    with pytest.raises(NoGradientPathError) as info:
        with lens.trace(x):
            h = lens.fc1.output
            side = h * 3
            c = lens.fc3.output
            with lens.output.sum().backward():
                c.grad.save()
                side.grad  # noqa: B018  (a request, for its effect)
    assert info.value.code == "no_gradient_path"
    assert "`side`" in str(info.value)
    assert_clean(mlp)


def test_an_unreachable_request_after_the_loss_s_own_gradient_names_the_missing_path(mlp, lens, x):
    with pytest.raises(NoGradientPathError) as info:
        with lens.trace(x):
            side = lens.fc1.output * 3
            loss = lens.output.sum()
            with loss.backward():
                loss.grad.save()
                side.grad  # noqa: B018  (a request, for its effect)
    assert info.value.code == "no_gradient_path"
    assert "`side`" in str(info.value)
    assert_clean(mlp)


def test_a_body_that_catches_an_unreachable_request_goes_on_reading_gradients(mlp, lens, x):
    ref = reference(mlp, x, ["fc1"])
    seen = {}
    with lens.trace(x):
        side = lens.fc1.output * 3
        a = lens.fc1.output
        with lens.output.sum().backward():
            try:
                side.grad  # noqa: B018  (a request, for its effect)
            except NoGradientPathError as error:
                seen["code"] = error.code
            ga = a.grad.save()
    assert seen == {"code": "no_gradient_path"}
    assert torch.equal(ga, ref["fc1"][1])
    assert_clean(mlp)


def test_a_tensor_that_needs_no_grad_is_named_in_the_error(mlp, lens, x):
    with pytest.raises(NoGradientPathError) as info:
        with lens.trace(x):
            loss = lens.output.sum()
            with loss.backward():
                x.grad  # noqa: B018  (a request, for its effect)
    assert info.value.code == "no_gradient_path"
    assert "`x`" in str(info.value) and "does not require grad" in str(info.value)
    assert_clean(mlp)


def test_a_backward_block_over_a_no_grad_forward_raises_no_grad_forward_error(mlp, lens, x):
    with pytest.raises(NoGradForwardError) as info:
        with torch.no_grad():
            with lens.trace(x):
                loss = lens.output.sum()
                with loss.backward():
                    pass
    assert isinstance(info.value, NotImplementedError)
    assert info.value.code == "no_grad_forward"
    assert "`loss`" in str(info.value) and "no autograd graph" in str(info.value)
    assert_clean(mlp)


def test_reading_output_inside_a_backward_block_says_to_capture_it_before(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            with lens.output.sum().backward():
                lens.fc2.output  # noqa: B018  (a request, for its effect)
    assert info.value.code == "forward_value_in_backward"
    assert "fc2.output" in str(info.value) and "before" in str(info.value)
    assert_clean(mlp)


def test_a_gradient_requested_after_it_passed_on_an_independent_branch_is_reported(mlp, lens):
    left = torch.nn.Linear(2, 2)
    right = torch.nn.Linear(2, 2)
    inp = torch.randn(3, 2)
    a, b = left(inp), right(inp)
    loss = (a * 2).sum() + (b * 3).sum()
    with pytest.raises(OutOfOrderError) as info:
        with loss.backward():
            ga = a.grad  # noqa: F841
            gb = b.grad  # noqa: F841
    message = str(info.value)
    assert info.value.code == "out_of_order"
    assert "never arrived" in message or "was requested after" in message
    assert "`b`" in message
    assert_clean(mlp)


def test_the_parameters_gradient_in_a_block_is_the_incoming_one(mlp, lens, x):
    reference(mlp, x, [])
    stock = mlp.fc3.weight.grad.clone()
    mlp.zero_grad()
    with lens.trace(x):
        with lens.output.sum().backward():
            w = mlp.fc3.weight.grad.save()
    assert torch.equal(w, stock)


def test_a_backward_block_works_outside_any_trace(mlp, x):
    h = mlp.fc1(x)
    h.retain_grad()
    mlp.fc3(torch.tanh(mlp.fc2(mlp.act(h)))).sum().backward()
    expected = h.grad.clone()
    h2 = mlp.fc1(x)
    out = mlp.fc3(torch.tanh(mlp.fc2(mlp.act(h2))))
    with out.sum().backward():
        g = h2.grad.save()
    assert torch.equal(g, expected)


def test_a_grad_replacement_after_the_gradient_passed_is_refused(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            a, b = lens.fc1.output, lens.fc2.output
            with lens.output.sum().backward():
                gb = b.grad
                ga = a.grad
                b.grad = gb * 0 + ga.sum()
    assert info.value.code == "grad_already_passed"
    assert "fc2.output.grad" in str(info.value)
    assert_clean(mlp)


def test_unsaved_values_of_a_backward_block_stay_inside_it(mlp, lens, x):
    kept = None
    with lens.trace(x):
        h = lens.fc2.output
        with lens.output.sum().backward():
            kept = h.grad.save()
            dropped = h.grad * 2  # noqa: F841
    assert kept is not None
    assert "dropped" not in locals()


def test_the_bare_backward_in_a_trace_warns_once_and_shows_the_with_form(mlp, lens, x):
    with pytest.warns(bl_warning()) as record:
        with lens.trace(x):
            out = lens.output
            out.sum().backward(retain_graph=True)
            out.sum().backward()
    ours = [w for w in record if getattr(w.message, "code", None) == "bare_backward_in_trace"]
    assert len(ours) == 1
    assert "with loss.backward():" in str(ours[0].message)
    assert ours[0].filename == __file__
    assert_clean(mlp)


def bl_warning():
    from backlens.errors import BacklensWarning

    return BacklensWarning


def test_save_is_a_method_of_every_tensor_inside_a_block(mlp, lens, x):
    with lens.trace(x):
        out = bl.save(lens.output)
    assert out.shape == (5, 3)


def test_gradients_read_one_at_a_time_in_reverse_order_match_too(mlp, lens, x):
    ref = reference(mlp, x, ["fc1", "fc2", "fc3"])
    with lens.trace(x):
        a, b, c = lens.fc1.output, lens.fc2.output, lens.fc3.output
        with lens.output.sum().backward():
            step = 0  # a statement first: the body wakes for every gradient
            gc = c.grad.save()
            step += 1
            gb = b.grad.save()
            step += 1
            ga = a.grad.save()
    assert torch.equal(gc, ref["fc3"][1]) and torch.equal(gb, ref["fc2"][1]) and torch.equal(ga, ref["fc1"][1])


def test_gradients_assigned_in_forward_order_raise_at_once_and_stop_the_backward(mlp, lens, x):
    with pytest.raises(OutOfOrderError) as info:
        with lens.trace(x):
            a, b = lens.fc1.output, lens.fc2.output
            with lens.output.sum().backward():
                ga = a.grad  # noqa: F841
                gb = b.grad  # noqa: F841
    assert "fc2.output.grad (invoke 0) was requested after fc1.output.grad (invoke 0)" in str(info.value)
    assert mlp.fc1.weight.grad is None  # the backward stopped before reaching fc1's weight
    assert_clean(mlp)


def test_a_gradient_edit_after_planned_reads_still_applies(mlp, lens, x):
    reference(mlp, x, [])
    stock = mlp.fc1.weight.grad.clone()
    mlp.zero_grad()
    with lens.trace(x):
        a, c = lens.fc1.output, lens.fc3.output
        with lens.output.sum().backward():
            gc = c.grad.save()
            ga = a.grad
            a.grad = ga * 3
    assert gc.shape == (5, 3)
    assert torch.allclose(mlp.fc1.weight.grad, stock * 3)


def test_grad_spelled_in_comprehensions_augmented_and_chained_assignments_is_served(mlp, lens, x):
    reference(mlp, x, [])
    stock = mlp.fc1.weight.grad.clone()
    mlp.zero_grad()
    with lens.trace(x):
        a, c = lens.fc1.output, lens.fc3.output
        with lens.output.sum().backward():
            shapes = bl.save([tuple(t.grad.shape) for t in (c,)])
            first = a.grad.clone().save()
            a.grad *= 2
            doubled = a.grad.save()
            kept = a.grad = a.grad * 1.5
            kept = bl.save(kept)
    assert shapes == [(5, 3)]
    assert torch.equal(doubled, first * 2)
    assert torch.equal(kept, first * 3)
    assert torch.allclose(mlp.fc1.weight.grad, stock * 3)
    assert "grad" not in torch.Tensor.__dict__  # served without patching the Tensor class


def _engine_threads_during_backward(lens, x):
    seen = {}
    with lens.trace(x):
        h = lens.fc1.output
        with lens.output.sum().backward():
            h.grad.save()
            seen["multithreading"] = torch._C._is_multithreading_enabled()
    return seen["multithreading"]


def test_a_cpu_only_backward_keeps_the_engine_as_stock(lens, x):
    assert _engine_threads_during_backward(lens, x) is True
    assert torch._C._is_multithreading_enabled()


@pytest.mark.parametrize("in_use", [True, False], ids=["in use", "present, not in use"])
def test_the_engine_runs_its_device_work_in_the_calling_thread_once_an_accelerator_is_in_use(
    lens, x, monkeypatch, in_use
):
    from backlens.live import torchstate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: in_use)
    torchstate._accelerator_modules.cache_clear()  # which modules have a device is read once
    try:
        assert _engine_threads_during_backward(lens, x) is (not in_use)
    finally:
        torchstate._accelerator_modules.cache_clear()
    assert torch._C._is_multithreading_enabled()


def test_a_backward_block_in_a_trace_runs_in_the_modes_its_with_statement_sets(mlp, lens, x):
    ref = reference(mlp, x, ["fc1"])
    with lens.trace(x):
        h = lens.fc1.output
        loss = lens.output.sum()
        with torch.no_grad(), loss.backward():
            g = h.grad.save()
            grad_mode = bl.save(torch.is_grad_enabled())
    assert grad_mode is False
    assert torch.equal(g, ref["fc1"][1])
    assert torch.is_grad_enabled()


def test_a_later_with_item_that_fails_skips_the_backward_block_and_leaves_nothing_armed(mlp, lens, x):
    class Boom:
        def __enter__(self):
            raise KeyError("boom")

        def __exit__(self, *exc):
            return False

    with pytest.raises(KeyError, match="boom"):
        with lens.trace(x):
            h = lens.fc1.output
            loss = lens.output.sum()
            with loss.backward(), Boom():
                g = h.grad.save()
    ref = reference(mlp, x, ["fc1"])
    g = served_grad(lens, x, lambda lens: lens.fc1)
    assert torch.equal(g, ref["fc1"][1])
    assert_clean(mlp)


def test_a_first_request_far_below_the_loss_is_served_and_equals_plain_autograd():
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(12)))
    x = torch.randn(2, 4)
    ref = reference(deep, x, ["0"])
    g = served_grad(bl.wrap(deep), x, lambda lens: lens[0])
    assert torch.equal(g, ref["0"][1])
    assert_clean(deep)


def test_a_first_request_off_the_path_far_below_the_loss_raises_before_the_backward_runs():
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(12)))
    lens = bl.wrap(deep)
    with pytest.raises(NoGradientPathError):
        with lens.trace(torch.randn(2, 4)):
            off = torch.randn(3, requires_grad=True) * 2
            with lens.output.sum().backward():
                off.grad  # noqa: B018  (a request, for its effect)
    assert all(p.grad is None for p in deep.parameters())
    assert_clean(deep)
