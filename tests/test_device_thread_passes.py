"""A pass is one pass whichever thread runs its nodes.

The autograd engine runs a CUDA device's nodes on that device's own thread, so
node hooks fire there while the wrapper that opened the pass ran in the
caller's thread. Here, on the CPU, every backlens node hook runs on one helper
thread (a stand-in for the device thread) while the engine's thread waits, with
the engine's task id answered there as the device thread would see it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import backlens as bl
from backlens import _torch
from backlens.capture.backward import BackwardRecorder
from models import MLP


class HooksOnADeviceThread:
    def __init__(self, monkeypatch):
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        self.task = threading.local()
        self.threads: set[int] = set()
        engine_task_id = _torch.graph_task_id_function()
        monkeypatch.setattr(_torch, "graph_task_id_function", lambda: lambda: self._task_id(engine_task_id))
        for name in ("_on_pre", "_on_sentinel_pre", "_on_post"):
            monkeypatch.setattr(BackwardRecorder, name, self._moved(getattr(BackwardRecorder, name), engine_task_id))

    def _task_id(self, engine_task_id):
        moved = getattr(self.task, "id", None)
        return moved if moved is not None else engine_task_id()

    def _moved(self, hook, engine_task_id):
        def on_device_thread(recorder, *args):
            if threading.get_ident() in self.threads:
                return hook(recorder, *args)  # a hook calling another (the sentinel calls _on_pre)
            task = engine_task_id()

            def body():
                self.task.id = task
                self.threads.add(threading.get_ident())
                try:
                    return hook(recorder, *args)
                finally:
                    self.task.id = None

            return self.worker.submit(body).result()

        return on_device_thread

    def close(self):
        self.worker.shutdown()


@pytest.fixture
def device_thread(monkeypatch):
    hooks = HooksOnADeviceThread(monkeypatch)
    yield hooks
    hooks.close()


def model_and_input():
    torch.manual_seed(0)
    return MLP(), torch.randn(4, 6)


def stock_node_fires(model, x) -> int:
    """How many nodes a plain backward of the same model runs (every node of its graph)."""
    out = model(x).sum()
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


def test_a_backward_whose_hooks_fire_on_another_thread_is_one_pass_with_every_call(device_thread):
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    assert device_thread.threads and threading.get_ident() not in device_thread.threads
    (pass_,) = cap.passes
    assert pass_.trigger == "Tensor.backward" and pass_.call_site is not None
    assert pass_.status == "ok"
    assert len(pass_.calls) == stock_node_fires(model, x)


def test_the_flops_of_such_a_pass_are_charged_to_its_own_calls(device_thread):
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    (pass_,) = cap.passes
    status = bl.report.backward_status(cap)
    (attribution,) = status.flops_attributions
    assert status.executed_flops > 0 and attribution.unattributed_flops == 0
    assert sum(c.flops or 0 for c in pass_.calls) == status.executed_flops


def test_two_passes_whose_hooks_fire_on_another_thread_stay_two_passes(device_thread):
    model, x = model_and_input()
    cap = bl.capture(model, x, save_grads=True)
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    cap.backward(loss * 2)
    assert [p.number for p in cap.passes] == [1, 2]
    assert [p.trigger for p in cap.passes] == ["Tensor.backward", "cap.backward"]
    assert len(cap.passes[1].calls) == len(cap.passes[0].calls) + 1  # the loss's MulBackward0
    relu = cap.ops["relu_1"]
    assert torch.equal(relu.grad_for(pass_=2), relu.grad_for(pass_=1) * 2)


def test_gradients_are_unchanged_when_hooks_fire_on_another_thread(device_thread):
    model, x = model_and_input()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    cap = bl.capture(model, x, intervene=bl.when(bl.grad("relu_1"), bl.scale(1.0)))
    cap.output.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len(cap.passes[0].edits) == 1


def test_a_fire_in_another_thread_joins_a_waiting_run_only_when_it_is_one_of_that_runs_roots():
    from backlens.graph import engine

    x = torch.ones(2, requires_grad=True)
    root, other = (x * 2).sum().grad_fn, (x * 3).sum().grad_fn
    run = engine.Run(trigger="Tensor.backward", call_site=None, retain_graph=False, create_graph=False,
                     explicit=True, roots=(root,))
    engine._unbound.append(run)
    found = {}
    try:
        def fire(name, node, task):
            with engine._lock:
                found[name] = engine._bind_pending(task, node)

        for name, node, task in (("other", other, 1_000_001), ("root", root, 1_000_002)):
            worker = threading.Thread(target=fire, args=(name, node, task))
            worker.start()
            worker.join()
    finally:
        engine._forget(run, [])
        engine._runs_by_task.pop(1_000_002, None)
    assert found == {"other": None, "root": run}
    assert run.task_id == 1_000_002
