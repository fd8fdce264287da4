"""Alerts: the first non-finite gradient (parameter, module, step, and with outputs=True the first
module output in backward order), a spike above the rolling median; each warns once."""

from __future__ import annotations

import math
import statistics
import warnings

import torch
from monitor_helpers import net, train
from torch import nn

import backlens as bl


def codes(caught) -> list[str]:
    return [getattr(w.message, "code", None) for w in caught if isinstance(w.message, bl.BacklensWarning)]


def test_a_nan_put_into_one_gradient_at_step_k_names_the_parameter_its_module_and_k_with_one_warning():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    heard = []

    def inject(step, model):
        if step >= 3:  # from step 3 on: the first alert names step 3, later ones stay quiet
            model.block[0].weight.grad[1, 2] = float("nan")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, optimizer, on_alert=heard.append) as mon:
            train(model, optimizer, 6, inject=inject)
    assert codes(caught) == ["gradient_nonfinite"]
    (alert,) = mon.alerts
    assert (alert.code, alert.step, alert.name, alert.module) == ("gradient_nonfinite", 3, "block.0.weight", "block.0")
    assert alert.value == 1.0 and alert.output is None
    assert heard == [alert]
    assert "block.0.weight" in str(caught[0].message) and "step 3" in str(caught[0].message)
    frame = mon.to_pandas()
    row = frame[(frame.step == 3) & (frame.name == "block.0.weight") & (frame.stat == "nonfinite")]
    assert row.value.tolist() == [1.0]


class Sqrt(nn.Module):
    """sqrt at zero: an infinite gradient for its input from a finite one for its output."""

    def forward(self, x):
        return torch.sqrt(x - x.detach())


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.root = Sqrt()
        self.last = nn.Linear(4, 2)

    def forward(self, x):
        return self.last(self.root(self.act(self.first(x))))


def test_with_outputs_the_alert_names_the_first_module_output_whose_gradient_was_not_finite():
    torch.manual_seed(0)
    model = Fragile()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, optimizer, outputs=True) as mon:
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    (alert,) = mon.alerts
    # backward order: last (finite), root (finite), act (first non-finite), first
    assert alert.output == "act"
    # both of first's gradients are infinite or NaN: the one registered last is named, the other counted
    assert (alert.name, alert.module) == ("first.bias", "first") and "1 other parameters" in alert.message
    assert codes(caught) == ["gradient_nonfinite"]
    frame = mon.to_pandas()
    outputs = frame[frame.kind == "output"].set_index("name").value
    assert math.isfinite(outputs["last"]) and math.isfinite(outputs["root"])
    assert not math.isfinite(outputs["act"]) and not math.isfinite(outputs["first"])


def steady_then(spike_at: int, steps: int, factor: float):
    """A gradient of 1 + small wiggle per step, times ``factor`` at ``spike_at``."""
    model = nn.Linear(3, 1, bias=False)

    def set_grad(step):
        scale = (1.0 + 0.01 * (step % 3)) * (factor if step == spike_at else 1.0)
        model.weight.grad = torch.full((1, 3), scale)

    return model, set_grad


def test_a_spike_after_a_steady_window_raises_one_gradient_spike_against_the_rolling_median():
    model, set_grad = steady_then(spike_at=25, steps=30, factor=50.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, window=20, spike_factor=10.0, stats=("norm",)) as mon:
            for step in range(30):
                set_grad(step)
                mon.step()
    assert codes(caught) == ["gradient_spike"]
    (alert,) = mon.alerts
    assert (alert.code, alert.step, alert.stat) == ("gradient_spike", 25, "norm")
    assert alert.kind == "param" and alert.name == "weight"
    assert alert.value == mon.to_pandas().query("step == 25 and kind == 'param'").value.item()
    window = mon.to_pandas().query("5 <= step < 25 and kind == 'param'").value.tolist()
    assert alert.baseline == statistics.median(window)


def test_a_jump_within_the_factor_or_before_the_window_fills_is_no_spike():
    model, set_grad = steady_then(spike_at=10, steps=30, factor=50.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, window=20, spike_factor=10.0) as mon:
            for step in range(30):
                set_grad(step)
                mon.step()
    assert mon.alerts == [] and codes(caught) == []
    model, set_grad = steady_then(spike_at=25, steps=30, factor=5.0)
    with bl.monitor(model, window=20, spike_factor=10.0) as mon:
        for step in range(30):
            set_grad(step)
            mon.step()
    assert mon.alerts == []


def test_a_zero_in_the_window_still_lets_a_spike_above_a_median_above_zero_alert():
    model = nn.Linear(3, 1, bias=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, window=5, spike_factor=10.0, stats=("norm",)) as mon:
            for step in range(8):
                size = {0: 0.0, 2: 0.0, 6: 100.0}.get(step, 1.0)  # a zero gradient at steps 0 and 2
                model.weight.grad = torch.full((1, 3), size)
                mon.step()
    assert codes(caught) == ["gradient_spike"]
    (alert,) = mon.alerts
    assert (alert.step, alert.name) == (6, "weight")
    window = mon.to_pandas().query("1 <= step < 6 and kind == 'param'").value.tolist()
    assert min(window) == 0.0 and alert.baseline == statistics.median(window) > 0


def test_a_median_of_zero_is_no_baseline():
    model = nn.Linear(3, 1, bias=False)
    with bl.monitor(model, window=5, spike_factor=10.0, stats=("norm",)) as mon:
        for step in range(8):
            model.weight.grad = torch.full((1, 3), 100.0 if step == 6 else 0.0)
            mon.step()
    assert mon.alerts == []


def test_each_kind_warns_once_and_every_alert_reaches_on_alert():
    model = nn.Linear(3, 1, bias=False)
    heard = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bl.monitor(model, window=3, spike_factor=5.0, stats=("norm",), on_alert=heard.append) as mon:
            for step in range(12):
                big = 100.0 if step in (5, 9) else 1.0
                model.weight.grad = torch.full((1, 3), big)
                mon.step()
    assert codes(caught) == ["gradient_spike"]
    assert [a.step for a in heard] == [5, 9] and heard == mon.alerts


def test_an_error_in_on_alert_reaches_the_user():
    model = nn.Linear(3, 1, bias=False)

    def stop(alert):
        raise RuntimeError(f"stop training: {alert.code}")

    mon = bl.monitor(model, on_alert=stop)
    model.weight.grad = torch.full((1, 3), float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mon.step()
        except RuntimeError as exc:
            assert "gradient_nonfinite" in str(exc)
        else:
            raise AssertionError("on_alert's error was swallowed")
        model.weight.grad = torch.ones(1, 3)
        mon.step()  # the failed step still counted: this is step 1
    mon.close()
    assert sorted(set(mon.to_pandas().step)) == [0, 1]
