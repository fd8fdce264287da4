"""Under torch.profiler, a captured backward marks each node call with a range named by
its module address; with no profiler, nothing is emitted and gradients stay as stock."""

from __future__ import annotations

import json

import pytest
import torch

import backlens as bl
from backlens import _torch
from backlens.graph.labels import NO_FORWARD_OP, ROOT_NAME
from models import MLP, SmallCNN

pytestmark = pytest.mark.skipif(not _torch.HAS_PROFILER_RANGES, reason="this torch has no profiler ranges")


def _address(grad_fn) -> str:
    """The module address a node's range is named by."""
    module = grad_fn.module
    if module is None:
        return NO_FORWARD_OP
    return module.rpartition(":")[0] if ":" in module else (module or ROOT_NAME)


def _profiled_backward(tmp_path, model, x):
    torch.manual_seed(0)
    cap = bl.capture(model, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cap.output.pow(2).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    return cap, events


def _inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_each_node_call_is_one_range_named_by_its_module_address_in_firing_order(tmp_path):
    cap, events = _profiled_backward(tmp_path, MLP(), torch.randn(4, 6))
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    calls = cap.passes[0].calls
    assert [r["name"] for r in ranges] == [_address(c.grad_fn) for c in calls]
    assert {"net.0", "net.2", "net.4", NO_FORWARD_OP} <= {r["name"] for r in ranges}


def test_every_backward_aten_op_falls_inside_the_range_of_its_module(tmp_path):
    cap, events = _profiled_backward(tmp_path, SmallCNN(), torch.randn(2, 3, 8, 8))
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    nodes = [e for e in events if e["name"].startswith("autograd::engine::evaluate_function: ")]
    aten = [e for e in events if e["name"].startswith("aten::") and any(_inside(e, n) for n in nodes)]
    assert aten and len(nodes) == len(cap.passes[0].calls)
    for op in aten:
        (node,) = [n for n in nodes if _inside(op, n)]
        enclosing = [r for r in ranges if _inside(op, r)]
        assert len(enclosing) == 1 and _inside(enclosing[0], node), op["name"]
    conv = [n for n in nodes if n["name"].endswith("ConvolutionBackward0")]
    named = {r["name"] for n in conv for r in ranges if _inside(r, n)}
    assert named == {"conv1", "conv2"}


def test_without_a_profiler_no_range_is_opened_and_gradients_equal_stock(monkeypatch):
    opened = []
    monkeypatch.setattr(_torch, "open_profiler_range", lambda name: opened.append(name))
    torch.manual_seed(0)
    model, x = SmallCNN(), torch.randn(2, 3, 8, 8)
    stock = SmallCNN()
    stock.load_state_dict(model.state_dict())
    stock(x).pow(2).sum().backward()
    cap = bl.capture(model, x)
    cap.output.pow(2).sum().backward()
    assert opened == [] and len(cap.passes[0].calls) > 0
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_gradients_under_the_profiler_equal_stock():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 6)
    stock = MLP()
    stock.load_state_dict(model.state_dict())
    stock(x).pow(2).sum().backward()
    cap = bl.capture(model, x, save_grads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        cap.output.pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_pass_after_the_profiler_stopped_opens_no_range(monkeypatch):
    cap = bl.capture(MLP(), torch.randn(4, 6))
    loss = cap.output.sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        loss.backward(retain_graph=True)
    opened = []
    monkeypatch.setattr(_torch, "open_profiler_range", lambda name: opened.append(name))
    loss.backward()
    assert opened == [] and [p.status for p in cap.passes] == ["ok", "ok"]


def test_a_node_that_raises_under_the_profiler_leaves_no_range_open(tmp_path):
    from models import BackwardExplodes

    class Explodes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return BackwardExplodes.apply(self.fc(x))

    cap = bl.capture(Explodes(), torch.randn(2, 3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="backward exploded"):
            cap.output.sum().backward()
        torch.ones(2).add_(1)  # the profiler goes on recording
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    state = cap._state
    assert cap.passes[0].status == "failed"
    assert state.passes[0].ranges is None and state.recorder._range_handles is None  # all closed, hooks gone
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "user_annotation"]
    assert names and set(names) <= {"fc", ROOT_NAME, NO_FORWARD_OP}
