"""Forward capture: ops, modules, params, inputs, labels, and an unchanged graph."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import MLP, SmallCNN, build, first_tensor, loss_of


def node_types_reachable(output) -> Counter:
    seen, stack, types = set(), [first_tensor(output).grad_fn], Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        types[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return types


def test_mlp_ops_are_labelled_by_function_and_call_count():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    assert cap.ops.labels() == ["linear_1", "relu_1", "linear_2", "relu_2", "linear_3"]
    assert cap["linear_2"] is cap.ops["linear_2"] is cap.ops[2]


def test_ops_record_function_module_parents_shape_and_dtype():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    op = cap.ops["linear_2"]
    assert op.func == "linear"
    assert op.module == "net.2"
    assert op.parents == ["relu_1"]
    assert op.param_parents == ["net.2.weight", "net.2.bias"]
    assert op.shape == (2, 16)
    assert op.dtype == torch.float32
    assert op.activation is None


def test_saved_activations_equal_the_real_intermediate():
    model = MLP()
    x = torch.randn(2, 6)
    cap = bl.capture(model, x, save_activations=True)
    expected = model.net[1](model.net[0](x))
    assert torch.equal(cap.ops["relu_1"].activation, expected)


def test_module_calls_nest_and_repeat_with_a_call_suffix():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)

        def forward(self, x):
            return self.block(torch.tanh(self.block(x)))

    cap = bl.capture(Twice(), torch.randn(1, 4))
    assert [m.address for m in cap.modules] == ["", "block", "block"]
    assert [m.label for m in cap.modules] == ["", "block:1", "block:2"]
    assert cap.modules["block:2"].call == 2
    assert cap.modules[""].children == ["block:1", "block:2"]
    assert cap.modules["block:2"].ops == ["linear_2"]
    assert cap.ops["tanh_1"].module == ""


class ReusesADeadTensorsId(nn.Module):
    """Drops an op's output, then makes a tensor outside torch's functions until one takes its id."""

    def forward(self, x):
        a = x * 2
        s = a.sum()
        dead = id(a)
        del a
        held = []
        for _ in range(10_000):
            c = torch.from_numpy(np.ones(3, dtype=np.float32))
            if id(c) == dead:
                break
            held.append(c)
        self.reused = id(c) == dead
        return c + s


def test_parents_do_not_follow_a_dead_tensors_id_reused_by_an_unrecorded_tensor():
    model = ReusesADeadTensorsId()
    cap = bl.capture(model, torch.randn(3, requires_grad=True))
    assert model.reused  # the situation under test did arise
    assert cap.ops["add_1"].parents == ["sum_1"]


@pytest.mark.parametrize("site", ["relu_1", "net.1"])
def test_an_activation_edit_keeps_the_edited_output_in_its_place_among_the_ops(site):
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6), intervene=bl.when(site, bl.scale(0.5)))
    assert cap.ops["linear_2"].parents == ["relu_1"]
    assert cap.ops["relu_1"].parents == ["linear_1"]


def test_cnn_records_conv_batchnorm_and_head():
    cap = bl.capture(SmallCNN().eval(), torch.randn(2, 3, 8, 8))
    funcs = [op.func for op in cap.ops]
    assert funcs[:3] == ["conv2d", "batch_norm", "relu"]
    assert cap.ops["conv2d_2"].module == "conv2"
    assert cap.modules["head"].output_shape == (2, 5)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformer_modules_and_ops_are_recorded(name):
    model, args, kwargs = build(name)
    cap = bl.capture(model, *args, **kwargs)
    addresses = {m.address for m in cap.modules}
    layer = "transformer.h.1" if name == "gpt2" else "encoder.layer.1"
    assert layer in addresses
    assert any(op.module and op.module.startswith(layer) for op in cap.ops)
    assert len(cap.ops) > 20


def test_labels_are_deterministic_across_two_captures():
    model, args, kwargs = build("gpt2")
    first = bl.capture(model, *args, **kwargs)
    second = bl.capture(model, *args, **kwargs)
    assert first.ops.labels() == second.ops.labels()
    loss_of(first.output).backward()
    loss_of(second.output).backward()
    assert first.grad_fns.labels() == second.grad_fns.labels()


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert"])
def test_autograd_node_types_are_identical_with_and_without_capture(name):
    model, args, kwargs = build(name)
    stock = node_types_reachable(model(*args, **kwargs))
    cap = bl.capture(model, *args, **kwargs)
    assert node_types_reachable(cap.output) == stock
    assert "BackwardHookFunctionBackward" not in stock


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert"])
def test_parameter_gradients_equal_a_stock_run_bitwise(name):
    model, args, kwargs = build(name)
    twin = copy.deepcopy(model)
    loss_of(model(*args, **kwargs)).backward()
    cap = bl.capture(twin, *args, **kwargs)
    loss_of(cap.output).backward()
    for (pname, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), pname


def test_inputs_are_not_copied_and_nested_inputs_are_found():
    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, batch):
            return self.lin(batch["x"]) + batch["pair"][1]

    x = torch.randn(2, 3, requires_grad=True)
    y = torch.randn(2, 3)
    cap = bl.capture(DictModel(), {"x": x, "pair": (None, y)}, save_grads=True)
    assert [i.name for i in cap.inputs] == ["args[0]['x']", "args[0]['pair'][1]"]
    assert cap.inputs[0].requires_grad and not cap.inputs[1].requires_grad
    cap.output.sum().backward()
    assert x.grad is not None
    assert torch.equal(cap.inputs[0].grad, x.grad)
    assert cap.ops["add_1"].parents == ["linear_1"]


def test_parameter_inputs_are_flagged():
    stimulus = nn.Parameter(torch.randn(2, 6))
    cap = bl.capture(MLP(), stimulus)
    assert cap.inputs[0].was_parameter


def test_a_non_module_model_is_refused_by_name():
    with pytest.raises(bl.BacklensError) as info:
        bl.capture(lambda x: x * 2, torch.randn(2))
    assert isinstance(info.value, ValueError)
    assert info.value.code == "not_a_module"
    assert "function" in str(info.value)


def _hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_forward_that_raises_propagates_unchanged_and_leaves_nothing_behind():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.lin(x)
            raise ValueError("boom in forward")

    model = Broken()
    original_call = torch.nn.Module._call_impl
    with pytest.raises(ValueError, match="boom in forward"):
        bl.capture(model, torch.randn(1, 2))
    assert _hook_counts(model) == 0
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert torch.nn.Module._call_impl is original_call


def test_close_removes_every_hook_and_mode():
    model = MLP()
    original_call = torch.nn.Module._call_impl
    with bl.capture(model, torch.randn(2, 6)) as cap:
        assert torch.nn.Module._call_impl is original_call  # patched during the forward only
        loss_of(cap.output).backward(retain_graph=True)
        node = cap.grad_fns[0]
        assert node.calls
    assert cap.closed
    assert _hook_counts(model) == 0
    assert not torch.overrides._is_torch_function_mode_enabled()
    loss_of(cap.output).backward()
    assert len(cap.passes) == 1


def test_two_open_captures_work_independently():
    a = bl.capture(MLP(), torch.randn(2, 6))
    b = bl.capture(MLP(), torch.randn(3, 6))
    loss_of(b.output).backward()
    assert len(a.passes) == 0 and len(b.passes) == 1
    loss_of(a.output).backward()
    assert len(a.passes) == 1 and len(b.passes) == 1
    assert a.ops.labels() == b.ops.labels()


def test_unknown_label_raises_key_error_listing_close_labels():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    with pytest.raises(KeyError) as info:
        cap["linear_9"]
    assert "linear_1" in str(info.value)
    assert info.value.code == "label_not_found"


def test_inference_only_capture_says_why_backward_is_unavailable():
    with torch.no_grad():
        cap = bl.capture(MLP(), torch.randn(2, 6))
    assert cap.inference_only
    with pytest.raises(bl.BackwardUnavailableError) as info:
        cap.backward(cap.output.sum())
    assert "no_grad" in str(info.value)


def test_inference_mode_is_named_as_the_cause():
    with torch.inference_mode():
        cap = bl.capture(MLP(), torch.randn(2, 6))
    with pytest.raises(bl.BackwardUnavailableError, match="inference_mode"):
        cap.backward(cap.output.sum())


def test_a_frozen_model_is_inference_only():
    model = MLP().requires_grad_(False)
    cap = bl.capture(model, torch.randn(2, 6))
    with pytest.raises(bl.BackwardUnavailableError, match="frozen"):
        cap.backward(cap.output.sum())


def test_grad_reenabled_inside_the_forward_keeps_its_graph():
    class Reenables(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            with torch.enable_grad():
                return self.lin(x)

    with torch.no_grad():
        cap = bl.capture(Reenables(), torch.randn(1, 2))
    assert not cap.inference_only
    cap.backward(cap.output.sum())
    assert len(cap.passes) == 1


def test_backward_false_records_the_forward_only():
    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6), backward=False)
    assert len(cap.ops) == 5
    with pytest.raises(bl.BackwardUnavailableError) as info:
        cap.backward(cap.output.sum())
    assert info.value.code == "backward_not_requested"
    loss_of(cap.output).backward()
    assert len(cap.passes) == 0
    assert model.net[0].weight.grad is not None


def test_ops_table_has_one_row_per_op():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    table = cap.ops.to_pandas()
    assert list(table["label"]) == cap.ops.labels()
    assert {"func", "module", "shape", "grad", "num_saved_grads"} <= set(table.columns)
    assert len(cap.modules.to_pandas()) == len(cap.modules)
    assert list(cap.params.to_pandas()["name"]) == [n for n, _ in MLP().named_parameters()]


def test_the_model_walk_names_modules_params_and_buffers_as_torch_does():
    from backlens.capture.walk import walk_model

    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.BatchNorm1d(3), nn.Sequential(shared, nn.ReLU()), nn.Linear(3, 3))
    model[3].weight = shared.weight  # a tied parameter under a second name
    addresses, types, params, buffers = walk_model(model)
    assert [(a, i) for i, a in addresses.items()] == [(a, id(m)) for a, m in model.named_modules()]
    assert types == {a: type(m).__name__ for a, m in model.named_modules()}
    assert [(n, id(p)) for n, p in params.items()] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in buffers.items()] == [(n, id(b)) for n, b in model.named_buffers()]


@pytest.mark.parametrize("options", [{}, {"flops": False, "save_grads": True}, {"backward": False}])
def test_a_dropped_capture_frees_its_graph_without_the_garbage_collector(options):
    import gc
    import weakref

    model = build("gpt2")[0]
    ids = torch.randint(0, 64, (2, 8))
    gc.disable()
    try:
        cap = bl.capture(model, ids, **options)
        loss = loss_of(cap.output)
        if options.get("backward", True):
            loss.backward(retain_graph=True)
        output = weakref.ref(first_tensor(cap.output))  # it holds the graph
        del loss
        cap.close()
        dropped = weakref.ref(cap)
        del cap
        assert dropped() is None and output() is None  # reference counting alone freed both
    finally:
        gc.enable()


def test_a_capture_dropped_without_close_leaves_the_engine_router_and_gradients_stock():
    import gc

    from backlens.graph import engine

    model = MLP()
    x = torch.randn(2, 6)
    reference = copy.deepcopy(model)
    loss_of(reference(x)).backward()
    cap = bl.capture(model, x)
    loss = loss_of(cap.output)
    recorder = cap._state.recorder
    assert recorder in engine._live_participants()
    gc.disable()
    try:
        del cap
        assert recorder not in engine._live_participants() and not recorder.armed
    finally:
        gc.enable()
    loss.backward()
    for (name, param), stock in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, stock.grad), name


_NO_CYCLES_SCRIPT = """
import gc, json, sys
import torch
import backlens as bl
from models import build, loss_of

model = build("gpt2")[0]
ids = torch.randint(0, 64, (2, 8))


def read_every_record(cap):
    cap.to_pandas()
    for op in cap.ops:
        op.grads, op.grad_fn
    for call in cap.modules:
        call.output_grads
    for param in cap.params:
        param.increments, param.grad
    for given in cap.inputs:
        given.grads
    cap.grad_fns.to_pandas()
    for node in cap.grad_fns:
        node.calls
    cap.grad_fn_calls.to_pandas()
    for backward_pass in cap.passes:
        backward_pass.calls


found = {}
for options in ({}, {"flops": False, "save_grads": True}, {"backward": False}, {"detect_nonfinite": True}):
    for read in (False, True):
        def step():
            cap = bl.capture(model, ids, **options)
            loss_of(cap.output).backward()
            if read:
                read_every_record(cap)
            cap.close()
        step()  # first-use work (imports, caches) out of the way
        gc.collect()
        gc.freeze()  # all that exists now predates the measured step: collections skip it (3x faster)
        gc.set_debug(gc.DEBUG_SAVEALL)
        step()
        gc.collect()
        gc.set_debug(0)
        found[json.dumps([options, read])] = sorted({type(o).__name__ for o in gc.garbage})
        gc.garbage.clear()
print(json.dumps(found))
"""


def test_a_capture_and_its_backward_leave_no_cyclic_garbage_even_when_every_record_was_read():
    # A fresh process: other tests may leave cyclic garbage of their own (runs left open).
    import json
    import pathlib
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parent
    result = subprocess.run([sys.executable, "-c", _NO_CYCLES_SCRIPT], cwd=tests, capture_output=True,
                            text=True, timeout=300, check=True)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {options: [] for options in found} and len(found) == 8
