"""Each capability flag of ``backlens._torch`` turned off takes its documented degraded path.

A flag is the one switch: set to False, the next capture (or call) behaves as on a
torch without that private entry point, and says so where the result is unknown.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import backlens as bl
from backlens import _torch
from backlens.cost import formulas
from backlens.cost.once_only import saved_of
from backlens.graph import engine
from models import MLP, Double

aten = torch.ops.aten


def without(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(_torch, name, False)


def model_and_input(seed=0):
    torch.manual_seed(seed)
    return MLP(), torch.randn(4, 6)


def stock_grads(model, x, loss_fn=lambda out: out.sum()):
    twin = copy.deepcopy(model)
    loss_fn(twin(x)).backward()
    return {name: p.grad for name, p in twin.named_parameters()}


def assert_grads_equal(model, expected):
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name


@pytest.fixture
def no_engine_wrapper(monkeypatch):
    """HAS_ENGINE_RUN_BACKWARD off, with torch's own engine entry point in place for the test."""
    was_installed = _torch.engine_wrapper_installed()
    _torch.uninstall_engine_wrapper()
    without(monkeypatch, "HAS_ENGINE_RUN_BACKWARD")
    yield
    monkeypatch.undo()
    if was_installed or engine._live_participants() or engine._observers:
        _torch.install_engine_wrapper(engine._make_wrapper)


def test_without_sequence_numbers_a_node_is_paired_with_the_op_whose_output_it_made(monkeypatch):
    without(monkeypatch, "HAS_SEQUENCE_NR")
    model, x = model_and_input()
    expected = stock_grads(model, x)
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    assert_grads_equal(model, expected)
    relu = cap.ops["relu_1"]
    assert relu.grad_fn.type == "ReluBackward0" and relu.grad_fn.module == "net.1"
    assert cap.ops["linear_1"].grad_fn.type == "AddmmBackward0"
    inner = [g for g in cap.grad_fns if g.type == "TBackward0"]
    assert inner and all(g.op is None and g.module is None for g in inner)
    reference = copy.deepcopy(model)
    kept = []
    reference.net[1].register_forward_hook(lambda m, i, out: [out.register_hook(kept.append)] and None)
    reference(x).sum().backward()
    assert torch.equal(relu.grad, kept[0])


def test_without_the_engine_entry_point_every_pass_is_implicit_with_no_call_site(monkeypatch, no_engine_wrapper):
    model, x = model_and_input()
    expected = stock_grads(model, x)
    cap = bl.capture(model, x)
    assert not _torch.engine_wrapper_installed()
    cap.output.sum().backward()
    assert_grads_equal(model, expected)
    (pass_,) = cap.passes
    assert pass_.trigger == "implicit" and pass_.call_site is None
    assert {c.grad_fn.type for c in pass_.calls} >= {"AddmmBackward0", "ReluBackward0", "AccumulateGrad"}


def test_without_graph_task_ids_each_pass_still_gets_its_own_fires(monkeypatch):
    without(monkeypatch, "HAS_CURRENT_GRAPH_TASK_ID")
    model, x = model_and_input()
    cap = bl.capture(model, x)
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    first, second = cap.passes
    assert len(first.calls) == len(second.calls) > 0
    assert {c.pass_number for c in first.calls} == {1} and {c.pass_number for c in second.calls} == {2}


def test_without_engine_callbacks_an_implicit_pass_closes_at_the_next_read(monkeypatch, no_engine_wrapper):
    without(monkeypatch, "HAS_ENGINE_QUEUE_CALLBACK")
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    (pass_,) = cap.passes
    assert pass_.trigger == "implicit" and pass_.status == "ok"


def test_without_the_keep_graph_query_an_implicit_pass_reports_retain_graph_none(monkeypatch, no_engine_wrapper):
    without(monkeypatch, "HAS_GRAPH_TASK_KEEP_GRAPH")
    model, x = model_and_input()
    cap = bl.capture(model, x)
    cap.output.sum().backward(retain_graph=True)
    assert cap.passes[0].retain_graph is None


def test_without_the_executing_node_every_backward_flop_is_unattributed(monkeypatch):
    model, x = model_and_input()
    counted = bl.capture(copy.deepcopy(model), x)
    counted.output.sum().backward()
    without(monkeypatch, "HAS_CURRENT_AUTOGRAD_NODE")
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    (pass_,) = status.passes
    assert status.executed_flops == bl.report.backward_status(counted).executed_flops > 0
    assert pass_.unattributed_flops == status.executed_flops
    assert status.flops_attributions == ()  # no row can be charged
    assert all(call.flops is None for call in cap.grad_fn_calls)


def test_without_node_prehooks_a_capture_records_the_forward_and_says_why(monkeypatch):
    without(monkeypatch, "HAS_NODE_PREHOOK")
    model, x = model_and_input()
    expected = stock_grads(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap = bl.capture(model, x)
    assert [w.message.code for w in caught] == ["backward_capture_unavailable"]
    cap.output.sum().backward()
    assert_grads_equal(model, expected)
    assert len(cap.passes) == 0
    with pytest.raises(bl.BackwardUnavailableError) as refused:
        cap.backward(cap.output.sum())
    assert refused.value.code == "no_node_prehooks"
    with pytest.raises(bl.BackwardUnavailableError):
        bl.capture(model, x, intervene=bl.when(bl.grad("relu_1"), bl.scale(2.0)))


def stock_grad_of_net2(model, x):
    """The gradient reaching ``model.net[2]``'s output in a stock backward of ``model(x).sum()``."""
    kept = []
    reference = copy.deepcopy(model)
    reference.net[2].register_forward_hook(lambda m, i, out: [out.register_hook(kept.append)] and None)
    reference(x).sum().backward()
    return kept[0]


def live_grad_of_net2(lens, x):
    """The same gradient, read in a live backward block."""
    with lens.trace(x):
        h = lens.net[2].output
        with lens.output.sum().backward():
            g = h.grad.save()
    return g


def test_without_the_engine_node_query_a_live_block_walks_the_graph_to_check_requests(monkeypatch):
    without(monkeypatch, "HAS_ENGINE_NODE_QUERY")
    model, x = model_and_input()
    lens = bl.wrap(model)
    assert torch.equal(live_grad_of_net2(lens, x), stock_grad_of_net2(model, x))
    with pytest.raises(bl.NoGradientPathError):
        with lens.trace(x):
            side = lens.net[0].output * 3
            with lens.net[2].output.sum().backward():
                side.grad  # noqa: B018  (a request, for its effect)


def test_without_the_hook_dictionary_a_live_read_hooks_its_tensor_through_register_hook(monkeypatch):
    without(monkeypatch, "HAS_TENSOR_HOOK_DICT")
    model, x = model_and_input()
    lens = bl.wrap(model)
    stock = stock_grad_of_net2(model, x)
    registered = []
    stock_register_hook = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook", lambda self, hook: registered.append(hook) or stock_register_hook(self, hook))
    assert torch.equal(live_grad_of_net2(lens, x), stock)
    assert len(registered) == 1


def test_without_the_kernel_query_a_composite_op_is_counted_as_one_op(monkeypatch):
    composite = aten.einsum.default
    monkeypatch.setattr(formulas, "_plans", {})
    assert formulas.plan_for(composite) is formulas.DECOMPOSE
    monkeypatch.setattr(formulas, "_plans", {})
    without(monkeypatch, "HAS_DISPATCH_KERNEL_QUERY")
    assert formulas.plan_for(composite) is not formulas.DECOMPOSE


def test_without_raw_mode_switches_the_public_context_managers_switch_the_modes(monkeypatch):
    without(monkeypatch, "HAS_RAW_MODE_SWITCHES")
    set_grad = _torch.set_grad_enabled_function()
    assert set_grad is not torch._C._set_grad_enabled
    with torch.enable_grad():
        set_grad(False)
        assert not torch.is_grad_enabled()
        set_grad(True)
    guard = _torch.inference_mode_guard(True)
    with guard:
        assert torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()
    assert _torch.any_autocast_enabled_function() is None


class _Group:
    _all_gather_comm = "all-gather"
    _reduce_scatter_comm = "reduce-scatter"


class _Unit:
    """What an FSDP2 unit shows backlens: its state, holding one param group."""

    def _get_fsdp_state(self):
        state = type("State", (), {})()
        state._fsdp_param_groups = [_Group()]
        return state


def test_without_fsdp_comm_objects_no_param_group_is_swapped(monkeypatch):
    assert len(_torch.fsdp_param_groups(_Unit())) == 1
    monkeypatch.setattr(_torch.FSDP_COMM_OBJECTS, "_present", False)
    assert _torch.fsdp_param_groups(_Unit()) == []


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True).sum()


def test_without_the_reentrant_checkpoint_function_the_verdict_is_unknown(monkeypatch):
    without(monkeypatch, "HAS_REENTRANT_CHECKPOINT_FUNCTION")
    torch.manual_seed(0)
    cap = bl.capture(Reentrant(), torch.randn(4, 8, requires_grad=True))
    cap.output.backward()
    assert cap.checkpoint_verdict == "unknown"
    assert len(cap.checkpoints) == 0  # none seen: not "none observed"
    assert any("CheckpointFunction" in reason for reason in cap.checkpoint_reasons)


def counted_flops(model, x):
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    return status.executed_flops, [op.forward_flops for op in cap.ops]


def stock_flops(model, x):
    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        out = twin(x)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    return forward, counter.get_total_flops()


@pytest.mark.parametrize("flag", ["HAS_MODE_STACKS", "HAS_DISPATCH_MODE_FLAGS", "HAS_SHAPE_LEVEL_FLOP_FORMULAS"])
def test_flops_are_counted_the_same_without(flag, monkeypatch):
    model, x = model_and_input()
    forward, backward = stock_flops(model, x)
    without(monkeypatch, flag)
    monkeypatch.setattr(formulas, "_plans", {})
    executed, per_op = counted_flops(model, x)
    assert executed == backward and sum(per_op) == forward
    assert _torch.mode_stack_depths() == (0, 0)
    assert not torch.utils._python_dispatch._is_in_torch_dispatch_mode


class WithEinsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.einsum("ij,jk->ik", self.lin(x), x.t() @ x)


@pytest.mark.parametrize("flag", ["HAS_TORCH_DISPATCH_MODE", "HAS_FLOP_REGISTRY"])
def test_without_a_way_to_count_flops_are_none_and_say_why(flag, monkeypatch):
    without(monkeypatch, flag)
    torch.manual_seed(0)
    model, x = WithEinsum(), torch.randn(6, 6)
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    status = bl.report.backward_status(cap)
    assert status.executed_flops is None
    assert flag in " ".join(p.reason or "" for p in status.passes)
    assert cap.ops["einsum_1"].forward_flops is None


def test_without_torch_s_registration_the_cpu_attention_formulas_come_from_backlens(monkeypatch):
    for packet in formulas.EXTRA_FORMULAS:
        if packet in _torch.flop_registry() and getattr(
                _torch.flop_registry()[packet], "__wrapped__", None) is formulas.EXTRA_FORMULAS[packet]:
            monkeypatch.delitem(_torch.flop_registry(), packet)
    without(monkeypatch, "HAS_FLOP_FORMULA_REGISTRATION")
    monkeypatch.setattr(formulas, "_extra_registered", False)
    monkeypatch.setattr(formulas, "_plans", {})
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    cap = bl.capture(attention, x, x, x, need_weights=False)
    cap.output[0].sum().backward()
    assert aten._scaled_dot_product_flash_attention_for_cpu not in _torch.flop_registry()
    twin = copy.deepcopy(attention)
    out = twin(x, x, x, need_weights=False)[0]
    with FlopCounterMode(display=False, custom_mapping=formulas.EXTRA_FORMULAS) as counter:
        out.sum().backward()
    assert bl.report.backward_status(cap).executed_flops == counter.get_total_flops()


def test_with_torch_s_registration_flop_counter_mode_alone_counts_cpu_attention_as_backlens_does():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    cap = bl.capture(attention, x, x, x, need_weights=False)
    cap.output[0].sum().backward()
    twin = copy.deepcopy(attention)
    out = twin(x, x, x, need_weights=False)[0]
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert bl.report.backward_status(cap).executed_flops == counter.get_total_flops() > 0


def test_without_saved_tensor_attributes_only_custom_functions_are_fingerprinted(monkeypatch):
    x = torch.ones(3, requires_grad=True)
    builtin = (x * x).grad_fn
    custom = Double.apply(x).grad_fn
    assert saved_of(builtin)
    without(monkeypatch, "HAS_SAVED_TENSOR_ATTRIBUTES")
    assert saved_of(builtin) == {}
    assert saved_of(custom) == saved_of(custom)  # still read from the Function's own ctx


def test_without_the_recomputation_hook_class_a_create_graph_pass_reads_recompute_none(monkeypatch):
    without(monkeypatch, "HAS_RECOMPUTATION_HOOK_CLASS")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed()
    cap = bl.capture(wrapped, x)
    torch.autograd.grad(cap.output.sum(), list(wrapped.parameters()), create_graph=True)
    status = bl.report.backward_status(cap)
    assert status.passes[0].counted and status.passes[0].recompute_flops is None


def test_without_disable_torch_function_the_recorder_s_own_reads_are_not_ops(monkeypatch):
    model, x = model_and_input()
    plain = bl.capture(copy.deepcopy(model), x)
    without(monkeypatch, "HAS_DISABLE_TORCH_FUNCTION")
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    assert cap.ops.labels() == plain.ops.labels()
    assert cap.modules["net.1"].output_grad is not None


def test_every_flag_is_listed_by_doctor_and_turned_off_by_some_test():
    listed = {capability.name for capability in _torch.CAPABILITIES}
    assert listed >= {name for name in vars(_torch) if name.startswith("HAS_")}
    tests = Path(__file__).parent
    sources = "\n".join(path.read_text() for path in tests.rglob("test_*.py"))
    for name in listed:
        # a flag is turned off by name ("HAS_X" in a monkeypatch); the FSDP one is an object
        turned_off = f'"{name}"' in sources or (
            name == "HAS_FSDP_COMM_OBJECTS" and 'setattr(_torch.FSDP_COMM_OBJECTS, "_present", False)' in sources)
        assert turned_off, f"{name} has no test with it turned off"


def test_import_and_a_capture_work_on_a_torch_missing_its_private_entry_points():
    script = textwrap.dedent("""
        import sys
        import torch, torch.autograd.graph, torch.utils.flop_counter as fc
        for owner, name in [(torch._C, "_current_graph_task_id"), (torch._C, "_current_autograd_node"),
                            (torch._C, "DisableTorchFunction"), (torch._C, "_will_engine_execute_node"),
                            (torch._C._autograd, "_get_sequence_nr"), (torch.autograd.graph, "_engine_run_backward"),
                            (fc, "register_flop_formula"), (fc, "flop_registry")]:
            delattr(owner, name)
        sys.modules["torch.utils._python_dispatch"] = None
        import backlens as bl
        flags = bl.doctor()
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        cap = bl.capture(model, torch.randn(2, 3))
        cap.output.sum().backward()
        assert len(cap.passes) == 1 and cap.passes[0].trigger == "implicit"
        assert bl.report.backward_status(cap).executed_flops is None
        print("OFF", sorted(k for k, v in flags.items() if not v))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    off = done.stdout.split("OFF", 1)[1]
    for flag in ("HAS_CURRENT_GRAPH_TASK_ID", "HAS_CURRENT_AUTOGRAD_NODE", "HAS_DISABLE_TORCH_FUNCTION",
                 "HAS_SEQUENCE_NR", "HAS_ENGINE_RUN_BACKWARD", "HAS_TORCH_DISPATCH_MODE", "HAS_FLOP_REGISTRY"):
        assert flag in off


def test_without_module_dicts_the_walk_names_the_same_modules_parameters_and_buffers(monkeypatch):
    from backlens.capture.walk import walk_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    model[2].tied = model[0]  # a module reached twice keeps its first name
    fast = walk_model(model)
    without(monkeypatch, "HAS_MODULE_DICTS")
    slow = walk_model(model)
    assert slow[0] == fast[0] and slow[1] == fast[1]
    assert list(slow[2]) == list(fast[2]) and list(slow[3]) == list(fast[3])


def test_without_the_checkpoint_s_recomputed_view_memory_says_recomputed_saves_are_not_counted(monkeypatch):
    without(monkeypatch, "HAS_CHECKPOINT_RECOMPUTED")
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed()
    stock_twin = copy.deepcopy(wrapped)
    stock_twin(x).sum().backward()
    cap = bl.capture(wrapped, x, memory=True)
    cap.output.sum().backward()
    assert cap.passes[0].memory.recomputed == {}
    assert any("recomputed saves are not counted" in reason for reason in cap.memory.reasons)
    for (name, param), twin in zip(wrapped.named_parameters(), stock_twin.parameters()):
        assert torch.equal(param.grad, twin.grad), name


def _monitored_frame(steps=3):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with bl.monitor(model, optimizer) as mon:
        for _ in range(steps):
            model(torch.randn(4, 6)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return mon.to_pandas().sort_values(["step", "kind", "name", "stat"]).reset_index(drop=True), model


def test_without_foreach_kernels_the_monitor_records_the_same_stats_tensor_by_tensor(monkeypatch):
    fused, fused_model = _monitored_frame()
    without(monkeypatch, "HAS_FOREACH_KERNELS")
    looped, looped_model = _monitored_frame()
    assert fused[["step", "kind", "name", "stat"]].equals(looped[["step", "kind", "name", "stat"]])
    assert (fused.stat == "update_ratio").any()
    # The multi-tensor norm and the per-tensor norm may differ in their last float32 bits.
    assert np.allclose(fused.value, looped.value, rtol=1e-6, atol=0)
    for fused_param, looped_param in zip(fused_model.parameters(), looped_model.parameters()):
        assert torch.equal(fused_param, looped_param)


def test_without_profiler_ranges_a_profiled_backward_has_no_module_ranges_and_stock_gradients(monkeypatch, tmp_path):
    without(monkeypatch, "HAS_PROFILER_RANGES")
    model, x = model_and_input()
    twin = copy.deepcopy(model)
    twin(x).pow(2).sum().backward()
    cap = bl.capture(model, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cap.output.pow(2).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("autograd::engine::evaluate_function") for e in events)
    assert not [e for e in events if e.get("cat") == "user_annotation"]
    assert len(cap.passes[0].calls) > 0
    for (name, param), stock in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param.grad, stock.grad), name


def test_without_the_module_call_impl_entry_module_calls_are_watched_through_call(monkeypatch):
    model, x = model_and_input()
    twin = copy.deepcopy(model)
    plain = bl.capture(twin, x)
    plain.output.sum().backward()
    without(monkeypatch, "HAS_MODULE_CALL_IMPL")
    cap = bl.capture(model, x)
    cap.output.sum().backward()
    assert [m.label for m in cap.modules] == [m.label for m in plain.modules]
    assert cap.ops.labels() == plain.ops.labels()
    for (name, param), stock in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param.grad, stock.grad), name
    assert torch.nn.Module.__dict__["__call__"] is torch.nn.Module.__dict__["_wrapped_call_impl"]


def test_without_tensor_versions_a_served_gradient_changed_in_place_is_still_named(monkeypatch):
    from backlens.errors import TraceError

    without(monkeypatch, "HAS_TENSOR_VERSION")
    model, x = model_and_input()
    lens = bl.wrap(model)
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            hidden = lens.net[2].output
            with lens.output.sum().backward():
                hidden.grad.mul_(2)
    assert info.value.code == "grad_changed_in_place"


def test_without_tensor_versions_a_gradient_only_read_gives_stock_gradients(monkeypatch):
    without(monkeypatch, "HAS_TENSOR_VERSION")
    model, x = model_and_input()
    expected = stock_grads(model, x)
    twin = copy.deepcopy(model)
    lens = bl.wrap(model)
    with lens.trace(x):
        hidden = lens.net[2].output
        with lens.output.sum().backward():
            grad = hidden.grad.save()
    assert_grads_equal(model, expected)
    stock_hidden = twin.net[:3](x)
    stock_hidden.retain_grad()
    twin.net[3:](stock_hidden).sum().backward()
    assert torch.equal(grad, stock_hidden.grad)


def test_a_live_lens_names_children_the_same_without_module_dicts(monkeypatch):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    lens = bl.wrap(model)
    fast = ([child._lens_address for child in lens], len(lens), lens[2][0]._lens_address, dir(lens))
    without(monkeypatch, "HAS_MODULE_DICTS")
    assert ([child._lens_address for child in lens], len(lens), lens[2][0]._lens_address, dir(lens)) == fast


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.parts = nn.ModuleDict({"layers": nn.ModuleList([nn.ReLU(), nn.Linear(4, 2)])})

    def forward(self, x):
        hidden = self.proj(x)
        for layer in self.parts["layers"]:
            hidden = layer(hidden)
        return hidden


def test_without_module_dicts_a_lens_files_no_fast_path_and_a_trace_serves_the_same(monkeypatch):
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(2, 3)
    relu_out = torch.relu(model.proj(x))
    without(monkeypatch, "HAS_MODULE_DICTS")
    lens = bl.wrap(model)
    with lens.trace(x):
        hidden = lens.parts.layers[0].output.save()
        out = lens.output.save()
    assert torch.equal(hidden, relu_out)
    assert torch.equal(out, model(x))
    assert lens.parts._lens_children and all(type(key) is tuple for key in lens.parts._lens_children)
    assert lens.parts.layers._lens_children
    assert all(type(key) is tuple for key in lens.parts.layers._lens_children)
