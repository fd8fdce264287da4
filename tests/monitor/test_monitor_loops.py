"""Training loops as they are: a GradScaler (unscaled statistics, skipped steps marked), close()
leaving no hook, bad options refused with the right name."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from monitor_helpers import batch, loss_of, net, train, value

import backlens as bl
from backlens import _module_calls


def scaled_run(fused: bool, scaler_option: bool, steps=4, skip_at=2, outputs=True):
    """AdamW under a GradScaler; an infinite gradient at ``skip_at`` makes the scaler skip that step."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    options = {"scaler": scaler} if scaler_option else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, optimizer, outputs=outputs, **options) as mon:
            for step in range(steps):
                scaler.scale(loss_of(model(batch(step)))).backward()
                if step == skip_at:
                    model.head.weight.grad[0, 0] = float("inf")
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
    return model, mon, scaler, caught


def unscaled_run(steps=4, skip_at=2):
    """The same training without a scaler, the skipped step left out."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with bl.monitor(model, optimizer, outputs=True) as mon:
        for step in range(steps):
            if step != skip_at:
                loss_of(model(batch(step))).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return mon


@pytest.mark.parametrize("fused", [False, True])
def test_under_a_grad_scaler_the_statistics_are_of_the_unscaled_gradients(fused):
    _model, scaled, _scaler, _caught = scaled_run(fused, scaler_option=True)
    reference = unscaled_run().to_pandas()
    frame = scaled.to_pandas()
    # The reference counts only the optimizer steps it ran: its step 2 is the scaled run's step 3.
    for step, same in ((0, 0), (1, 1), (3, 2)):  # the scale is a power of two: (un)scaling is exact
        for kind, stat in (("param", "norm"), ("module", "norm"), ("param", "absmax"), ("output", "norm")):
            for name in set(reference[(reference.kind == kind) & (reference.stat == stat)].name):
                mine, theirs = value(frame, step, kind, name, stat), value(reference, same, kind, name, stat)
                assert math.isclose(mine, theirs, rel_tol=1e-6), (step, kind, name, stat)


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_the_scaler_skipped_is_recorded_and_marked_without_an_alert(fused):
    model, mon, scaler, caught = scaled_run(fused, scaler_option=True)
    frame = mon.to_pandas()
    assert frame[frame.kind == "step"][["step", "name", "stat", "value"]].values.tolist() == [[2, "", "skipped", 1.0]]
    assert value(frame, 2, "param", "head.weight", "nonfinite") == 1.0
    assert value(frame, 2, "param", "head.weight", "update_ratio") == 0.0  # the scaler did not move it
    assert sorted(set(frame.step)) == [0, 1, 2, 3]
    assert mon.alerts == [] and not [w for w in caught if isinstance(w.message, bl.BacklensWarning)]
    assert "step" not in scaler.__dict__  # close() gave the scaler its own step back


def test_without_scaler_option_a_skipped_step_is_not_seen_and_the_steps_count_the_optimizer_steps():
    _model, mon, _scaler, _caught = scaled_run(False, scaler_option=False)
    frame = mon.to_pandas()
    assert sorted(set(frame.step)) == [0, 1, 2] and "step" not in set(frame.kind)


def test_close_leaves_no_hook_on_the_optimizer_the_modules_or_the_scaler():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mon = bl.monitor(model, optimizer, outputs=True, scaler=scaler)
    assert _module_calls.watching()
    model(batch(0)).sum()  # a forward whose backward never runs: its tensor hooks must go too
    mon.close()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not _module_calls.watching()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "step" not in scaler.__dict__
    assert mon.closed
    mon.close()  # again: nothing to do


def test_close_in_the_middle_of_a_step_leaves_no_tensor_hook_behind():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = bl.monitor(model, optimizer, outputs=True)
    out = model(batch(0))
    assert out._backward_hooks  # the forward gave its output a tensor hook
    mon.close()
    assert not out._backward_hooks
    loss_of(out).backward()  # runs as stock: no monitor hook fires
    assert mon._outputs.fires == []


def test_the_with_form_closes_the_monitor_also_when_the_loop_raises():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyError):
        with bl.monitor(model, optimizer) as mon:
            train(model, optimizer, 1)
            raise KeyError("the loop failed")
    assert mon.closed and not optimizer._optimizer_step_pre_hooks


def test_a_closed_monitor_keeps_its_rows_and_refuses_to_step():
    model = net()
    mon = bl.monitor(model)
    loss_of(model(batch(0))).backward()
    mon.step()
    mon.close()
    assert len(mon.to_pandas()) > 0
    with pytest.raises(bl.CaptureClosedError) as info:
        mon.step()
    assert info.value.code == "monitor_closed"


def test_mon_step_with_an_optimizer_is_refused():
    model = net()
    with bl.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1)) as mon:
        with pytest.raises(bl.UnsupportedInputError) as info:
            mon.step()
    assert info.value.code == "monitor_step_with_optimizer"


@pytest.mark.parametrize("options, code, named", [
    ({"evry": 10}, "mistyped_option", "every="),
    ({"stats": ("norm", "nrom")}, "unknown_stat", "'norm'"),
    ({"stats": "update_ratio"}, "update_ratio_needs_optimizer", "optimizer"),
    ({"every": 0}, "bad_argument", "every"),
    ({"outputs": "yes"}, "bad_argument", "outputs"),
    ({"spike_factor": 1.0}, "bad_argument", "spike_factor"),
    ({"on_alert": "print"}, "bad_argument", "on_alert"),
])
def test_a_bad_option_is_refused_naming_it(options, code, named):
    model = net()
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.monitor(model, **options)
    assert info.value.code == code and named in str(info.value)
    assert not any(m._forward_hooks for m in model.modules())


def test_an_optimizer_wrapper_is_refused_with_the_way_to_its_torch_optimizer():
    model = net()
    with pytest.raises(bl.UnsupportedInputError, match="optimizer") as info:
        bl.monitor(model, object())
    assert info.value.code == "not_an_optimizer" and isinstance(info.value, TypeError)


def test_every_skips_steps_without_touching_them():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = bl.monitor(model, optimizer, every=3, outputs=True)
    armed = []
    for step in range(7):
        armed.append(_module_calls.watching())
        loss_of(model(batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert armed == [True, False, False, True, False, False, True]  # module calls watched only for recorded steps
    assert sorted(set(mon.to_pandas().step)) == [0, 3, 6]


def test_a_step_without_any_gradient_records_no_rows():
    model = torch.nn.Sequential(torch.nn.ReLU())
    with bl.monitor(model) as mon:
        mon.step()
    assert mon.to_pandas().empty
