"""Backward capture: passes, nodes, calls, gradients, and unchanged autograd results."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import backlens as bl
from models import MLP, build, first_tensor, loss_of

ALL_MODELS = ["mlp", "cnn", "gpt2", "gpt2_cache", "bert", "llama", "t5"]


def param_grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("save_grads", [False, True])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_parameter_gradients_with_capture_equal_stock_bitwise(name, save_grads):
    model, args, kwargs = build(name)
    twin = copy.deepcopy(model)
    loss_of(model(*args, **kwargs)).backward()
    cap = bl.capture(twin, *args, save_grads=save_grads, **kwargs)
    loss_of(cap.output).backward()
    stock, captured = param_grads(model), param_grads(twin)
    assert stock.keys() == captured.keys()
    for key in stock:
        if stock[key] is None:
            assert captured[key] is None, key
        else:
            assert torch.equal(stock[key], captured[key]), key
    assert len(cap.passes) == 1 and cap.passes[0].status == "ok"
    assert len(cap.grad_fn_calls) > 0


class HookEveryOpOutput(TorchFunctionMode):
    """Reference: a plain tensor hook on every op output that requires grad."""

    def __init__(self):
        super().__init__()
        self.grads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        primary = out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else out
        if isinstance(primary, torch.Tensor) and primary.grad_fn is not None and not (args and primary is args[0]):
            slot = len(self.grads)
            self.grads.append(None)
            primary.register_hook(lambda g, slot=slot: self.grads.__setitem__(slot, g))
        return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_op_output_gradients_equal_tensor_hook_references(name):
    model, args, kwargs = build(name)
    with HookEveryOpOutput() as reference:
        output = model(*args, **kwargs)
    loss_of(output).backward()
    model.zero_grad()

    cap = bl.capture(model, *args, save_grads=True, **kwargs)
    loss_of(cap.output).backward()
    with_node = [op for op in cap.ops if op.grad_fn is not None]
    assert len(with_node) == len(reference.grads)
    compared = 0
    for op, expected in zip(with_node, reference.grads):
        if expected is None:
            assert op.grads == [], op.label
            continue
        assert torch.equal(op.grad, expected), op.label
        compared += 1
    assert compared > len(reference.grads) // 2


def test_module_output_gradients_equal_tensor_hook_references():
    model, args, kwargs = build("gpt2")
    reference = {}

    def keep(address):
        def hook(module, inputs, output):
            first_tensor(output).register_hook(lambda g: reference.__setitem__(address, g))
        return hook

    handles = [m.register_forward_hook(keep(a)) for a, m in model.named_modules() if a]
    loss_of(model(*args, **kwargs)).backward()
    for h in handles:
        h.remove()
    cap = bl.capture(model, *args, save_grads=True, **kwargs)
    loss_of(cap.output).backward()
    for address, expected in reference.items():
        assert torch.equal(cap.modules[address].output_grad, expected), address


def test_each_trigger_opens_exactly_one_named_pass():
    model = MLP()
    x = torch.randn(2, 6, requires_grad=True)
    cap = bl.capture(model, x)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    torch.autograd.backward(loss, retain_graph=True)
    torch.autograd.grad(loss, [x], retain_graph=True)
    cap.backward(loss)
    triggers = [p.trigger for p in cap.passes]
    assert triggers == ["Tensor.backward", "torch.autograd.backward", "torch.autograd.grad", "cap.backward"]
    assert [p.number for p in cap.passes] == [1, 2, 3, 4]
    assert [p.retain_graph for p in cap.passes] == [True, True, True, False]
    site = cap.passes[0].call_site
    assert site.file == __file__ and site.function == "test_each_trigger_opens_exactly_one_named_pass"


def test_an_engine_run_that_bypasses_the_entry_points_is_an_implicit_pass():
    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6))
    loss = loss_of(cap.output)
    engine = torch.autograd.Variable._execution_engine
    engine.run_backward((loss,), (torch.ones(()),), False, False, (), True, True)
    assert len(cap.passes) == 1
    implicit = cap.passes[0]
    assert implicit.trigger == "implicit" and implicit.call_site is None
    assert implicit.status == "ok"
    assert model.net[0].weight.grad is not None
    assert {c.grad_fn.type for c in implicit.calls} >= {"AddmmBackward0", "AccumulateGrad"}


def test_an_implicit_pass_records_every_fire_with_its_timing_like_an_explicit_one():
    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6))
    loss = loss_of(cap.output)
    engine = torch.autograd.Variable._execution_engine
    engine.run_backward((loss,), (torch.ones(()),), True, False, (), True, True)
    loss.backward()
    implicit, explicit = cap.passes
    assert implicit.trigger == "implicit" and explicit.trigger == "Tensor.backward"
    implicit_labels = [c.grad_fn.label for c in implicit.calls]
    explicit_labels = [c.grad_fn.label for c in explicit.calls]
    # The loss's own nodes, made after the forward, are found only by the entry points' walk.
    loss_nodes = explicit_labels[: len(explicit_labels) - len(implicit_labels)]
    assert explicit_labels[len(loss_nodes):] == implicit_labels
    assert all(cap.grad_fns[label].module is None for label in loss_nodes)
    assert all(c.duration is not None and c.duration >= 0 for c in implicit.calls)


def test_three_passes_give_dense_call_labels_and_a_loud_op_grad():
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss = loss_of(cap.output)
    for _ in range(3):
        loss.backward(retain_graph=True)
    node = cap.ops["linear_2"].grad_fn
    assert [c.label for c in node.calls] == [f"{node.label}:{k}" for k in (1, 2, 3)]
    assert [c.pass_number for c in node.calls] == [1, 2, 3]
    assert node.calls.for_pass(2).index == 2
    assert cap.last_pass is cap.passes.for_pass(3)
    module = cap.modules["net.2"]
    assert torch.equal(module.output_grad_for(pass_=2), module.output_grads[1].tensor)
    with pytest.raises(bl.AmbiguousGradError, match="3 saved gradients"):
        _ = cap.ops["linear_2"].grad
    assert torch.equal(cap.ops["linear_2"].grad_for(pass_=2), cap.ops["linear_2"].grads[1].tensor)
    table = cap.to_pandas()
    row = table[table.label == "linear_2"].iloc[0]
    assert row["grad"] is None and row["num_saved_grads"] == 3


def test_node_labels_follow_the_grammar_and_pair_with_ops_and_modules():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss_of(cap.output).backward()
    addmm = cap.ops["linear_1"].grad_fn
    assert addmm.type == "AddmmBackward0"
    assert addmm.label.startswith("addmm_back_1_")
    assert addmm.op is cap.ops["linear_1"] and addmm.module == "net.0" and addmm.module_source == "paired"
    acc = [g for g in cap.grad_fns if g.param == "net.0.weight"][0]
    assert acc.type == "AccumulateGrad" and acc.module == "net.0"
    loss_nodes = [g for g in cap.grad_fns if g.op is None and g.type != "AccumulateGrad"]
    assert loss_nodes and all(g.module is None for g in loss_nodes)
    numbers = sorted(int(g.label.rsplit("_", 1)[1]) for g in cap.grad_fns)
    assert numbers == list(range(1, len(cap.grad_fns) + 1))


def test_grad_fn_records_count_distinct_nodes_once():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    count = len(cap.grad_fns)
    loss.backward()
    assert len(cap.grad_fns) == count
    assert all(len(g.calls) == 2 for g in cap.grad_fns)


def test_stimulus_gradients_are_kept_for_leaf_and_parameter_inputs():
    x = torch.randn(2, 6, requires_grad=True)
    cap = bl.capture(MLP(), x, save_grads=True)
    loss_of(cap.output).backward()
    assert torch.equal(cap.inputs[0].grad, x.grad)

    stimulus = nn.Parameter(torch.randn(2, 6))
    cap = bl.capture(MLP(), stimulus, save_grads=True)
    loss_of(cap.output).backward()
    assert cap.inputs[0].was_parameter
    assert torch.equal(cap.inputs[0].grad, stimulus.grad)


def test_grad_trigger_keeps_the_stimulus_gradient_it_returns():
    x = torch.randn(2, 6, requires_grad=True)
    cap = bl.capture(MLP(), x, save_grads=True)
    (gx,) = torch.autograd.grad(loss_of(cap.output), [x])
    assert x.grad is None
    assert torch.equal(cap.inputs[0].grad, gx)


def test_params_record_increments_per_pass_and_the_live_grad():
    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6), save_grads=True)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    loss.backward()
    weight = cap.params["net.0.weight"]
    assert len(weight.increments) == 2
    assert torch.equal(weight.increments[0].tensor + weight.increments[1].tensor, model.net[0].weight.grad)
    assert weight.grad is model.net[0].weight.grad


def test_save_grads_false_records_structure_and_timing_but_no_tensors():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss_of(cap.output).backward()
    calls = cap.grad_fn_calls
    assert len(calls) == len(cap.grad_fns)
    assert all(c.grad_outputs is None and c.grad_inputs is None for c in calls)
    assert all(c.duration is not None and c.duration >= 0 for c in calls)
    assert cap.ops["relu_1"].grads == []


def test_timing_false_leaves_durations_unknown():
    cap = bl.capture(MLP(), torch.randn(2, 6), timing=False)
    loss_of(cap.output).backward()
    assert all(c.duration is None for c in cap.grad_fn_calls)


@pytest.mark.parametrize("save_grads", [False, True])
def test_the_fires_of_a_pass_follow_one_another_inside_it(save_grads):
    model, args, kwargs = build("gpt2")
    cap = bl.capture(model, *args, save_grads=save_grads, **kwargs)
    loss_of(cap.output).backward()
    calls = list(cap.passes[0].calls)
    assert calls and all(c.duration >= 0 for c in calls)
    for earlier, later in zip(calls, calls[1:]):
        # one engine thread: no overlap (1 ns of slack for float rounding)
        assert later.start >= earlier.start + earlier.duration - 1e-9
    assert calls[-1].start + calls[-1].duration <= cap.passes[0].duration + 1e-9


def test_cap_backward_can_widen_the_save_policy_for_one_pass():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss = loss_of(cap.output)
    cap.backward(loss, save_grads=True, retain_graph=True)
    loss.backward()
    assert [g.pass_number for g in cap.ops["relu_1"].grads] == [1]
    assert repr(cap.passes[0].save_grads_policy) == "save_grads=True"
    assert repr(cap.passes[1].save_grads_policy) == "save_grads=False"


def test_create_graph_discovers_higher_order_nodes_with_their_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3, requires_grad=True)
    cap = bl.capture(model, x)
    (gx,) = torch.autograd.grad(cap.output.sum(), [x], create_graph=True)
    first = cap.passes[0]
    assert first.create_graph and first.orders == [1]
    assert first.order_coverage == 1.0
    second_order = [g for g in cap.grad_fns if g.order == 2]
    assert second_order, "nodes built by the create_graph pass are recorded"
    assert all(g.module is not None for g in second_order if g.type != "AccumulateGrad")
    gx.pow(2).sum().backward()
    assert 2 in cap.passes[1].orders
    expected_x = x.grad.clone()
    x.grad = None
    (gx2,) = torch.autograd.grad(model(x).sum(), [x], create_graph=True)
    gx2.pow(2).sum().backward()
    assert torch.equal(x.grad, expected_x)


class ExplodingBackward(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if ExplodingBackward.armed:
            raise RuntimeError("custom backward exploded")
        return grad * 2


class WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return ExplodingBackward.apply(self.lin(x))


def test_a_pass_that_raises_is_closed_as_failed_and_the_next_pass_works():
    model = WithCustom()
    cap = bl.capture(model, torch.randn(2, 3))
    loss = cap.output.sum()
    ExplodingBackward.armed = True
    with pytest.raises(RuntimeError, match="custom backward exploded"):
        loss.backward(retain_graph=True)
    failed = cap.passes[0]
    assert failed.status == "failed" and "exploded" in str(failed.error)
    custom = [g for g in cap.grad_fns if g.is_custom]
    assert len(custom) == 1 and custom[0].module == ""
    ExplodingBackward.armed = False
    loss.backward()
    assert cap.passes[1].status == "ok"
    assert model.lin.weight.grad is not None


def test_after_close_nothing_is_recorded_and_gradients_are_stock():
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 6)
    cap = bl.capture(model, x)
    loss = loss_of(cap.output)
    cap.close()
    loss.backward()
    loss_of(twin(x)).backward()
    assert len(cap.passes) == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_disarm_keeps_records_and_stops_recording():
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.disarm()
    loss.backward()
    assert len(cap.passes) == 1
    assert cap.ops["relu_1"].grad is not None


def test_two_live_captures_of_different_models_record_only_their_own_passes():
    a = bl.capture(MLP(), torch.randn(2, 6))
    b = bl.capture(nn.Sequential(nn.Linear(6, 2)), torch.randn(2, 6))
    loss_of(a.output).backward()
    assert (len(a.passes), len(b.passes)) == (1, 0)
    loss_of(b.output).backward()
    assert (len(a.passes), len(b.passes)) == (1, 1)
    assert {c.grad_fn.type for c in b.passes[0].calls} == {"AddmmBackward0", "TBackward0", "AccumulateGrad", "SumBackward0", "MulBackward0"}


def test_two_captures_of_one_model_do_not_share_passes_through_parameter_nodes():
    model = MLP()
    a = bl.capture(model, torch.randn(2, 6))
    b = bl.capture(model, torch.randn(3, 6))
    loss_of(a.output).backward()
    assert (len(a.passes), len(b.passes)) == (1, 0)
    loss_of(b.output).backward()
    assert (len(a.passes), len(b.passes)) == (1, 1)
    assert all(c.pass_number == 1 for c in b.grad_fn_calls)


def test_a_backward_over_an_unrelated_graph_is_not_recorded():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    w = torch.randn(3, requires_grad=True)
    (w * 2).sum().backward()
    assert len(cap.passes) == 0


def test_tables_for_passes_grad_fns_and_calls():
    cap = bl.capture(MLP(), torch.randn(2, 6))
    loss_of(cap.output).backward()
    passes = cap.passes.to_pandas()
    assert list(passes["trigger"]) == ["Tensor.backward"]
    grad_fns = cap.grad_fns.to_pandas()
    assert len(grad_fns) == len(cap.grad_fns) and "module_source" in grad_fns
    calls = cap.grad_fn_calls.to_pandas()
    assert set(calls["pass_number"]) == {1} and calls["duration"].notna().all()
    assert cap.grad_fn_calls[calls["label"][0]].label == calls["label"][0]


def test_parameter_increments_keep_each_pass_value_when_the_weight_is_tied():
    model, args, kwargs = build("gpt2")
    cap = bl.capture(model, *args, save_grads=True, **kwargs)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    first = model.transformer.wte.weight.grad.clone()
    (loss * 3).backward()
    increments = cap.params["transformer.wte.weight"].increments
    assert torch.equal(increments[0].tensor, first)
    assert torch.allclose(increments[1].tensor, first * 3, rtol=1e-4, atol=1e-5)  # 3x upstream: rounding differs


def test_a_dropped_capture_is_collected_and_stops_taking_part():
    import gc
    import weakref

    model = MLP()
    cap = bl.capture(model, torch.randn(2, 6))
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    ref = weakref.ref(cap)
    del cap
    gc.collect()
    assert ref() is None
    loss.backward()  # hooks left on the graph do nothing once their capture is gone
    assert model.net[0].weight.grad is not None


def test_a_capture_fed_by_another_captures_output_records_the_same_run():
    first = bl.capture(MLP(), torch.randn(2, 6))
    second = bl.capture(nn.Sequential(nn.Linear(3, 2)), first.output)
    loss_of(second.output).backward()
    assert (len(first.passes), len(second.passes)) == (1, 1)
    assert first.passes[0].trigger == second.passes[0].trigger == "Tensor.backward"
    assert {c.grad_fn.type for c in first.passes[0].calls} >= {"AddmmBackward0", "AccumulateGrad"}


def test_many_live_captures_each_record_only_their_own_backward():
    captures = [bl.capture(MLP(), torch.randn(2, 6)) for _ in range(5)]
    for cap in captures:
        loss_of(cap.output).backward()
    assert [len(c.passes) for c in captures] == [1] * 5


def _node_facts(cap):
    return [(g.label, g.type, g.op.label if g.op else None, g.module, g.module_source, g.order, g.param)
            for g in cap.grad_fns]


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_records_first_read_after_close_equal_records_read_while_open(name):
    model, args, kwargs = build(name)
    read_open = bl.capture(model, *args, save_grads=True, **kwargs)
    loss_of(read_open.output).backward()
    expected_nodes = _node_facts(read_open)
    expected_op_grads = {op.label: op.grad for op in read_open.ops if op.grads}
    expected_module_grads = {m.address: m.output_grad for m in read_open.modules}
    read_open.close()
    model.zero_grad()

    read_closed = bl.capture(model, *args, save_grads=True, **kwargs)
    loss_of(read_closed.output).backward()
    read_closed.close()  # nothing was read before: the records are built from what close kept
    assert _node_facts(read_closed) == expected_nodes
    op_grads = {op.label: op.grad for op in read_closed.ops if op.grads}
    assert op_grads.keys() == expected_op_grads.keys()
    for label, grad in expected_op_grads.items():
        assert torch.equal(op_grads[label], grad), label
    for address, grad in expected_module_grads.items():
        got = read_closed.modules[address].output_grad
        assert (got is None and grad is None) or torch.equal(got, grad), address


def test_a_capture_dropped_during_its_own_backward_leaves_the_pass_to_finish_stock():
    model = MLP()
    x = torch.randn(2, 6)
    reference = copy.deepcopy(model)
    loss_of(reference(x)).backward()
    holder = [bl.capture(model, x)]
    loss = loss_of(holder[0].output)
    loss.register_hook(lambda grad: holder.clear())  # the last reference goes mid-pass
    loss.backward()
    assert holder == []
    for (name, param), stock in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, stock.grad), name


def test_close_leaves_no_autograd_node_behind_in_a_capture_that_is_kept():
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    class SavesItsActivation(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.saved = None

        def forward(self, x):
            hidden = torch.relu(self.lin(x))  # ReluBackward0 saves this tensor's storage
            self.saved = StorageWeakRef(hidden.untyped_storage())
            return hidden.sum()

    model = SavesItsActivation()
    cap = bl.capture(model, torch.randn(2, 4))
    loss = cap.output
    loss.backward(retain_graph=True)
    cap.grad_fns  # noqa: B018 - records read before close, too
    gc.disable()
    try:
        cap.close()
        del loss
        cap.output = None  # the user's last handle on the graph; the capture itself stays
        assert model.saved.expired()  # no node (and so no saved tensor) is held by the capture
        assert cap.grad_fns and cap.passes[0].calls  # records stay readable
    finally:
        gc.enable()


def _relu_output_gradient_reference(model, x):
    """The gradient of the first ReLU's output, by a plain tensor hook."""
    seen = {}
    hidden = model.net[1](model.net[0](x))
    hidden.register_hook(lambda grad: seen.setdefault("relu", grad))
    loss_of(model.net[2:](hidden)).backward()
    model.zero_grad(set_to_none=True)
    return seen["relu"]


def test_a_dropped_capture_frees_its_saved_gradients_even_after_its_records_were_read():
    import gc
    import weakref

    model, x = MLP(), torch.randn(4, 6)
    gc.disable()
    try:
        cap = bl.capture(model, x, save_grads=True)
        loss_of(cap.output).backward()
        kept = weakref.ref(cap.ops["relu_1"].grad)
        assert cap.grad_fns.to_pandas() is not None and cap.passes[0].calls and cap.params[0].increments
        assert cap.ops["relu_1"].grad_fn.calls[0].grad_outputs is not None
        cap.close()
        del cap
        assert kept() is None  # reference counting alone freed the saved gradients
    finally:
        gc.enable()


def test_a_record_kept_after_its_capture_is_dropped_still_reads_gradients_and_nodes():
    model, x = MLP(), torch.randn(4, 6)
    reference = _relu_output_gradient_reference(model, x)
    cap = bl.capture(model, x, save_grads=True)
    loss_of(cap.output).backward()
    relu = cap.ops["relu_1"]
    del cap
    assert torch.equal(relu.grad, reference)
    node = relu.grad_fn
    assert node.type == "ReluBackward0" and node.op.label == "relu_1"
    assert torch.equal(node.calls[0].grad_outputs[0], reference)


def test_records_keep_a_dropped_capture_recording_later_passes():
    model, x = MLP(), torch.randn(4, 6)
    reference = _relu_output_gradient_reference(model, x)
    cap = bl.capture(model, x, save_grads=True)
    relu, output = cap.ops["relu_1"], cap.output
    del cap
    loss_of(output).backward()
    assert len(relu.grads) == 1 and torch.equal(relu.grad, reference)


def test_a_finished_pass_reads_as_the_same_record_each_time():
    model, x = MLP(), torch.randn(4, 6)
    cap = bl.capture(model, x)
    loss_of(cap.output).backward()
    assert cap.passes[0] is cap.last_pass and cap.last_pass.status == "ok"
    assert cap.last_pass.calls == cap.grad_fn_calls[:len(cap.last_pass.calls)]


class _SingularValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.linalg.svdvals(self.lin(x))  # output 1 of its node (U, S, Vh)


def test_an_op_whose_output_is_not_its_node_s_first_reads_the_gradient_of_that_output():
    torch.manual_seed(0)
    model, x = _SingularValues(), torch.randn(5, 4)
    seed = torch.randn(4)
    stock = []
    cap = bl.capture(model, x, save_grads=True)
    cap.output.register_hook(stock.append)
    cap.output.backward(seed)
    svdvals = cap.ops["linalg_svdvals_1"]
    assert svdvals.grad_fn.type == "LinalgSvdBackward0"
    assert torch.equal(svdvals.grad, stock[0])


def test_a_gradient_edit_of_such_an_op_equals_a_stock_tensor_hook_edit():
    torch.manual_seed(0)
    model, x = _SingularValues(), torch.randn(5, 4)
    twin = copy.deepcopy(model)
    out = twin(x)
    out.register_hook(lambda g: g * 0.5)
    out.sum().backward()
    cap = bl.capture(model, x, intervene=bl.when(bl.grad("linalg_svdvals_1"), bl.scale(0.5)))
    cap.output.sum().backward()
    assert torch.equal(model.lin.weight.grad, twin.lin.weight.grad)
