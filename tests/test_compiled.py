"""bl.capture on a torch.compile model: eager by default, or compiled="opaque"."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

import backlens as bl
from models import MLP

torch_dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def compiled_pair(backend: str):
    """A compiled MLP and a compiled twin with the same weights (its stock gradients are the reference)."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    return model, torch.compile(model, backend=backend), torch.compile(twin, backend=backend), twin


def run_quietly(caplog, fn):
    """Run ``fn`` and return (its result, the warnings it raised, dynamo/inductor log records at WARNING)."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        result = fn()
    logged = [r for r in caplog.records if r.name.startswith(("torch._dynamo", "torch._inductor"))
              and r.levelno >= logging.WARNING]
    return result, [w.message for w in caught], logged


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_a_compiled_model_is_captured_eagerly_with_one_warning(caplog):
    model, compiled, compiled_twin, twin = compiled_pair("aot_eager")
    x = torch.randn(4, 6)

    def run():
        cap = bl.capture(compiled, x)
        cap.output.sum().backward()
        return cap

    cap, warned, logged = run_quietly(caplog, run)
    assert [getattr(w, "code", None) for w in warned] == ["compiled_model_captured_eager"]
    assert logged == [] and graph_breaks() == 0
    assert cap.ops.labels() == ["linear_1", "relu_1", "linear_2", "relu_2", "linear_3"]
    assert cap.modules.labels()[:2] == ["", "net"]  # the original module's addresses
    assert [p.name for p in cap.params] == [n for n, _ in model.named_parameters()]
    compiled_twin(x).sum().backward()
    # The eager MLP runs the same kernels aot_eager does: bitwise equal.
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_opaque_keeps_the_compiled_graph_and_records_each_region_as_one_node(caplog):
    model, compiled, compiled_twin, twin = compiled_pair("aot_eager")
    x = torch.randn(4, 6)

    def run():
        cap = bl.capture(compiled, x, compiled="opaque")
        cap.output.sum().backward()
        return cap

    cap, warned, logged = run_quietly(caplog, run)
    assert warned == [] and logged == [] and graph_breaks() == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    (region,) = [g for g in cap.grad_fns if g.type == "CompiledFunctionBackward"]
    assert region.module == "" and region.calls[0].duration > 0
    assert region.calls[0].flops is None
    (counted,) = bl.report.backward_status(cap).passes
    assert not counted.counted and "compiled regions" in counted.reason
    assert len(cap.ops) == 0 and cap.modules.labels() == [""]
    assert [p.name for p in cap.params] == [n for n, _ in model.named_parameters()]
    assert cap.checkpoint_verdict == "unknown"
    compiled_twin(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_an_unknown_compiled_mode_is_refused():
    _model, compiled, _twin, _ = compiled_pair("aot_eager")
    with pytest.raises(bl.UnsupportedInputError) as caught:
        bl.capture(compiled, torch.randn(4, 6), compiled="inductor")
    assert caught.value.code == "bad_compiled_mode"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "opaque"])
def test_an_inductor_compiled_model_in_both_modes(caplog, mode):
    model, compiled, compiled_twin, twin = compiled_pair("inductor")
    x = torch.randn(4, 6)

    def run():
        cap = bl.capture(compiled, x, compiled=mode)
        cap.output.sum().backward()
        return cap

    _cap, warned, logged = run_quietly(caplog, run)
    assert [getattr(w, "code", None) for w in warned] == (["compiled_model_captured_eager"] if mode == "eager" else [])
    assert logged == [] and graph_breaks() == 0
    compiled_twin(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        if mode == "opaque":
            assert torch.equal(p.grad, q.grad)  # the same compiled kernels
        else:
            # Eager kernels against inductor's fused ones: float32 rounding apart.
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
