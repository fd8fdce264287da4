"""Every statistic the monitor records equals one computed by hand from the same run's gradients
and parameters, at exactly the recorded steps.

Exact (``==``) where the arithmetic is the same: a parameter's gradient norm (the same
``torch.linalg.vector_norm`` in float32), max |g|, non-finite counts. Tolerances where it
differs: a module's norm adds its parameters' float32 norms squared in float64, the reference
takes one float64 norm over their concatenated values (rtol 1e-6); the update ratio's norms
come from torch's multi-tensor kernel, the reference from per-tensor norms (rtol 1e-6).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monitor_helpers import keep_by_hand, module_params, net, norm64, sq_norm_sum, train, value

import backlens as bl

STEPS = 5


def monitored(optimizer_kind="sgd", every=2, micro=1, **options):
    model = net()
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer_kind == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=0.01))
    seen, handles = keep_by_hand(model, optimizer)
    with bl.monitor(model, optimizer, every=every, **options) as mon:
        train(model, optimizer, STEPS, micro=micro, seen=seen)
    for handle in handles:
        handle.remove()
    return model, mon, seen


def test_rows_exist_exactly_at_the_recorded_steps():
    _model, mon, _seen = monitored(every=2)
    assert sorted(set(mon.to_pandas().step)) == [0, 2, 4]


def test_the_columns_are_step_kind_name_stat_value():
    _model, mon, _seen = monitored()
    frame = mon.to_pandas()
    assert list(frame.columns) == ["step", "kind", "name", "stat", "value"]
    assert set(frame.kind) == {"param", "module"}
    assert set(frame.stat) == {"norm", "absmax", "nonfinite", "update_ratio"}


def test_parameter_norms_absmax_and_nonfinite_counts_equal_the_gradients_at_each_recorded_step():
    model, mon, seen = monitored(every=2)
    frame = mon.to_pandas()
    for step in (0, 2, 4):
        for name, grad in seen.grads[step].items():
            assert value(frame, step, "param", name, "norm") == float(torch.linalg.vector_norm(grad))
            assert value(frame, step, "param", name, "absmax") == float(grad.abs().max())
            assert value(frame, step, "param", name, "nonfinite") == 0.0
    assert len(frame[frame.kind == "param"].name.unique()) == len(list(model.parameters()))


def test_module_rows_roll_up_every_parameter_the_module_holds():
    model, mon, seen = monitored(every=1)
    frame = mon.to_pandas()
    for step in range(STEPS):
        for address in ("", "encoder", "block", "block.0", "head"):
            grads = [seen.grads[step][n] for n in module_params(model, address)]
            assert math.isclose(value(frame, step, "module", address, "norm"), norm64(grads), rel_tol=1e-6)
            assert value(frame, step, "module", address, "absmax") == max(float(g.abs().max()) for g in grads)
            assert value(frame, step, "module", address, "nonfinite") == 0.0
    # modules without parameters have no parameter statistics
    assert not {"act", "block.1"} & set(frame[frame.kind == "module"].name)


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
def test_update_ratios_are_the_norm_of_the_step_over_the_norm_of_the_weights_before_it(optimizer_kind):
    model, mon, seen = monitored(optimizer_kind, every=2)
    frame = mon.to_pandas()
    for step in (0, 2, 4):
        before, after = seen.before[step], seen.after[step]
        for name in before:
            expected = float(torch.linalg.vector_norm(after[name] - before[name])) / float(
                torch.linalg.vector_norm(before[name]))
            assert math.isclose(value(frame, step, "param", name, "update_ratio"), expected, rel_tol=1e-6), name
        for address in ("", "block", "head"):
            names = module_params(model, address)
            expected = norm64([after[n] - before[n] for n in names]) / norm64([before[n] for n in names])
            assert math.isclose(value(frame, step, "module", address, "update_ratio"), expected, rel_tol=1e-6)


def test_output_norms_are_the_gradients_reaching_each_module_output():
    model, mon, seen = monitored(every=2, outputs=True, stats=("norm",))
    frame = mon.to_pandas()
    outputs = frame[frame.kind == "output"]
    assert set(outputs.step) == {0, 2, 4}
    for step in (0, 2, 4):
        for address, grads in seen.outputs[step].items():
            assert math.isclose(value(frame, step, "output", address, "norm"), sq_norm_sum(grads), rel_tol=1e-7)
    assert set(outputs.name) == {a for a, _m in model.named_modules()}


def test_accumulated_micro_batches_are_recorded_once_per_optimizer_step():
    model, mon, seen = monitored(every=1, micro=3, outputs=True)
    frame = mon.to_pandas()
    assert sorted(set(frame.step)) == list(range(STEPS))
    for step in range(STEPS):
        for name, grad in seen.grads[step].items():
            assert value(frame, step, "param", name, "norm") == float(torch.linalg.vector_norm(grad))
        for address, grads in seen.outputs[step].items():
            assert len(grads) == 3  # one gradient per micro-batch, one norm over them all
            assert math.isclose(value(frame, step, "output", address, "norm"), sq_norm_sum(grads), rel_tol=1e-7)


def test_training_with_the_monitor_leaves_every_parameter_bitwise_as_without_it():
    def run(monitor: bool, **options):
        model = net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = bl.monitor(model, optimizer, **options) if monitor else None
        train(model, optimizer, 6, micro=2)
        if mon is not None:
            mon.close()
        return model

    stock = run(False)
    for options in ({}, {"outputs": True, "every": 2}):
        watched = run(True, **options)
        for (name, a), (_n, b) in zip(stock.named_parameters(), watched.named_parameters()):
            assert torch.equal(a, b), (options, name)


def test_a_parameter_without_a_gradient_has_no_rows_and_its_modules_roll_up_the_rest():
    model = net()
    model.encoder.bias.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    seen, handles = keep_by_hand(model, optimizer)
    with bl.monitor(model, optimizer) as mon:
        train(model, optimizer, 2)
    frame = mon.to_pandas()
    assert "encoder.bias" not in set(frame.name)
    assert math.isclose(value(frame, 1, "module", "encoder", "norm"),
                        float(torch.linalg.vector_norm(seen.grads[1]["encoder.weight"])), rel_tol=1e-6)


def test_without_an_optimizer_mon_step_records_the_gradients_after_the_backward():
    model = net()
    grads = []
    with bl.monitor(model, every=2) as mon:
        for _step in range(4):
            model.zero_grad(set_to_none=True)
            model(torch.randn(5, 6)).pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            mon.step()
    frame = mon.to_pandas()
    assert sorted(set(frame.step)) == [0, 2] and "update_ratio" not in set(frame.stat)
    for step in (0, 2):
        for name, grad in grads[step].items():
            assert value(frame, step, "param", name, "norm") == float(torch.linalg.vector_norm(grad))


def test_keep_bounds_the_steps_held_in_memory_to_the_latest():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with bl.monitor(model, optimizer, keep=2) as mon:
        train(model, optimizer, 5)
    assert sorted(set(mon.to_pandas().step)) == [3, 4]


def test_a_bfloat16_model_gets_float32_norms_of_its_gradients():
    model = net().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with bl.monitor(model, optimizer, stats=("norm", "absmax")) as mon:
        model(torch.randn(5, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    frame = mon.to_pandas()
    for name, grad in grads.items():
        assert value(frame, 0, "param", name, "norm") == float(torch.linalg.vector_norm(grad, dtype=torch.float32))
        assert value(frame, 0, "param", name, "absmax") == float(grad.abs().max())
    assert np.isfinite(frame.value).all()
