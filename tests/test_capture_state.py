"""Records are views over one capture state: one object per record, live fields, no hooks after close."""

from __future__ import annotations

import torch

import backlens as bl
from backlens.graph import engine
from models import MLP, loss_of


def captured(save_grads=True):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 6)
    cap = bl.capture(model, x, save_grads=save_grads)
    return cap, loss_of(cap.output)


def test_a_record_read_twice_is_the_same_object_before_and_after_its_capture_is_dropped():
    cap, loss = captured()
    loss.backward()
    relu = cap.ops["relu_1"]
    node = relu.grad_fn
    call = node.calls[0]
    first_pass = cap.passes[0]
    module = cap.modules["net.0"]
    assert cap["relu_1"] is relu and cap.ops[relu.index] is relu and node.op is relu
    assert cap.grad_fns[node.label] is node and call.grad_fn is node and cap[call.label] is call
    assert cap.last_pass is first_pass and any(c is call for c in first_pass.calls)
    assert cap.modules[module.index] is module
    del cap
    assert relu.grad_fn is node and node.op is relu
    assert node.calls[0] is call and call.grad_fn is node
    assert any(c is call for c in first_pass.calls)


def test_a_held_record_does_not_keep_hooks_armed_after_close():
    cap, loss = captured()
    recorder = cap._state.recorder
    loss.backward(retain_graph=True)
    node = cap.ops["relu_1"].grad_fn
    cap.close()
    del cap
    assert recorder not in engine._live_participants() and not recorder.armed and not recorder._handles
    loss.backward()  # over the retained graph: nothing records it
    assert len(node.calls) == 1 and node.calls[0].pass_number == 1


def test_fields_that_change_while_a_pass_runs_read_the_state_as_it_is_now():
    cap, loss = captured(save_grads=False)
    seen = []
    cap.output.register_hook(lambda g: seen.append((cap.last_pass, cap.last_pass.status, cap.last_pass.duration)))
    loss.backward()
    (running, status, duration), = seen
    assert (status, duration) == ("running", None)
    assert running is cap.last_pass and running.status == "ok" and running.duration > 0
    assert all(call.flops is not None for call in running.calls)  # settled when the pass closed
