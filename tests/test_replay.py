"""cap.do(site, edit, differentiable=True): replaying recorded ops from recorded activations."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import backlens as bl
from models import MLP, Double, build, loss_of


def mlp_capture(**options):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 6)
    return model, x, bl.capture(model, x, save_activations=True, **options)


def downstream_of_relu_1(model, h):
    """The MLP after its first ReLU, run stock (net.2 -> net.3 -> net.4)."""
    return model.net[4](model.net[3](model.net[2](h)))


# -- the fork's forward ----------------------------------------------------------------

@pytest.mark.parametrize("site", ["relu_1", "net.1", "linear_2", bl.func("relu")])
def test_an_mlp_fork_s_output_equals_running_the_model_with_the_same_edit(site):
    _model, _x, cap = mlp_capture()
    fork = cap.do(site, bl.scale(2.0), differentiable=True)
    rerun = cap.do(site, bl.scale(2.0))
    assert torch.equal(fork.output, rerun.output)
    assert fork.output.grad_fn is not None


@pytest.mark.parametrize("site", ["transformer.h.0", "transformer.h.1.mlp", "layer_norm_2", "embedding_1"])
def test_a_gpt2_fork_s_logits_equal_running_the_model_with_the_same_edit(site):
    model, args, kwargs = build("gpt2")
    cap = bl.capture(model, *args, save_activations=True, **kwargs)
    fork = cap.do(site, bl.scale(1.5), differentiable=True)
    rerun = cap.do(site, bl.scale(1.5))
    assert torch.equal(fork.output.logits, rerun.output.logits)


def test_the_fork_replays_only_the_ops_downstream_of_the_site_under_their_labels_and_modules():
    _model, _x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert fork.ops.labels() == ["linear_2", "relu_2", "linear_3"]
    for op in fork.ops:
        assert op.module == cap.ops[op.label].module
    assert list(fork.frontier) == ["relu_1"]
    assert [i.name for i in fork.inputs] == ["relu_1"]
    (application,) = fork.forward_edits
    assert application.site == "relu_1" and application.op == "relu_1" and application.edit == "scale(2.0)"


class Gated(nn.Module):
    """A multi-output op whose second output a replayed op reads directly."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        a, b = self.inp(x).chunk(2, dim=-1)
        return self.out(torch.relu(a) * b)


def test_a_frontier_value_that_is_a_later_output_of_a_multi_output_op_is_a_leaf_of_its_own():
    torch.manual_seed(0)
    model = Gated()
    x = torch.randn(3, 4)
    cap = bl.capture(model, x, save_activations=True)
    fork = cap.do("relu_1", bl.scale(3.0), differentiable=True)
    assert torch.equal(fork.output, cap.do("relu_1", bl.scale(3.0)).output)
    assert set(fork.frontier) == {"relu_1", "chunk_1[1]"}
    fork.backward(fork.output.sum())
    twin = copy.deepcopy(model)
    relu = cap.ops["relu_1"].activation.detach().requires_grad_()
    b = twin.inp(x).chunk(2, dim=-1)[1].detach().requires_grad_()
    twin.out(relu * 3.0 * b).sum().backward()
    assert torch.equal(fork.frontier["relu_1"].grad, relu.grad)
    assert torch.equal(fork.frontier["chunk_1[1]"].grad, b.grad)


def test_no_model_runs_during_a_replay():
    model, _x, cap = mlp_capture()
    calls = []
    model.net[2].register_forward_pre_hook(lambda m, a: calls.append(m))
    cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert calls == []


# -- the fork's backward -------------------------------------------------------------

def test_an_mlp_fork_s_frontier_gradient_equals_a_stock_run_from_the_detached_activation():
    model, _x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(2.0), differentiable=True)
    fork.backward(fork.output.pow(2).sum())
    twin = copy.deepcopy(model)
    h = cap.ops["relu_1"].activation.detach().requires_grad_()
    downstream_of_relu_1(twin, h * 2.0).pow(2).sum().backward()
    assert torch.equal(fork.frontier["relu_1"].grad, h.grad)
    for name in ("net.2.weight", "net.2.bias", "net.4.weight"):
        assert torch.equal(dict(model.named_parameters())[name].grad, dict(twin.named_parameters())[name].grad)


def test_a_gpt2_fork_s_frontier_gradient_equals_a_stock_run_from_the_detached_activation():
    model, args, kwargs = build("gpt2")
    cap = bl.capture(model, *args, save_activations=True, **kwargs)
    fork = cap.do("transformer.h.0", bl.scale(1.5), differentiable=True)
    fork.backward(loss_of(fork.output))
    (site_label,) = [name for name in fork.frontier if name == cap.modules["transformer.h.0"].ops[-1]]

    twin = copy.deepcopy(model)
    leaves = []

    def from_detached(module, args, output):
        leaves.append(cap.ops[site_label].activation.detach().requires_grad_())
        return leaves[0] * 1.5

    twin.transformer.h[0].register_forward_hook(from_detached)
    loss_of(twin(*args, **kwargs)).backward()
    assert torch.equal(fork.frontier[site_label].grad, leaves[0].grad)
    name = "transformer.h.1.mlp.c_fc.weight"
    assert torch.equal(dict(model.named_parameters())[name].grad, dict(twin.named_parameters())[name].grad)


def test_no_gradient_reaches_the_source_run_s_tensors_or_upstream_parameters():
    model, x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(2.0), differentiable=True)
    fork.backward(fork.output.sum())
    assert model.net[0].weight.grad is None and model.net[0].bias.grad is None
    assert all(op.activation.grad is None and not op.activation.requires_grad for op in cap.ops)
    assert len(cap.passes) == 0  # the source's graph never ran
    cap.output.sum().backward()  # ...and is intact
    assert model.net[0].weight.grad is not None


def test_the_fork_records_its_backward_as_a_capture_does():
    _model, _x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(2.0), differentiable=True)
    fork.backward(fork.output.sum(), save_grads=True)
    (pass_,) = fork.passes
    assert pass_.status == "ok" and pass_.trigger == "cap.backward"
    assert fork.ops["linear_2"].grad_fn.type == "AddmmBackward0"
    assert fork.ops["linear_2"].grad.shape == fork.ops["linear_2"].shape
    status = bl.report.backward_status(fork)
    assert status.executed_flops == sum(op.flops for op in pass_.aten_ops) > 0
    assert torch.equal(fork.inputs["relu_1"].grad, fork.frontier["relu_1"].grad)


def test_do_with_a_loss_runs_the_fork_s_backward():
    _model, _x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(0.0), loss=lambda f: f.output.sum(), differentiable=True)
    assert len(fork.passes) == 1 and torch.equal(fork.frontier["relu_1"].grad,
                                                 torch.zeros_like(fork.frontier["relu_1"]))


# -- refusals ------------------------------------------------------------------------------

def test_a_gradient_edit_is_refused():
    _model, _x, cap = mlp_capture()
    with pytest.raises(bl.ReplayError) as caught:
        cap.do(bl.grad("relu_1"), bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_gradient_edit_unsupported" and caught.value.remedy


def test_a_capture_that_kept_no_activations_cannot_replay():
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6))
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_no_activation" and "relu_1" in str(caught.value)
    assert "save_activations=True" in caught.value.remedy


def test_a_module_site_on_a_capture_that_kept_no_activations_is_refused_the_same_way():
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6))
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("net.1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_no_activation" and "net.1" in str(caught.value)


def test_a_missing_activation_at_the_frontier_is_named():
    _model, _x, cap = mlp_capture()
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_activations=bl.label("linear_1"))
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_no_activation" and "'relu_1'" in str(caught.value)


class WithCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(Double.apply(torch.relu(self.a(x))))


def test_a_custom_function_downstream_of_the_site_is_refused_by_name():
    torch.manual_seed(0)
    cap = bl.capture(WithCustomFunction(), torch.randn(2, 4), save_activations=True)
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_custom_function"
    assert "'Double'" in str(caught.value) and "'mul_1'" in str(caught.value)
    fork = cap.do("mul_1", bl.scale(2.0), differentiable=True)  # after the Function: fine
    assert torch.equal(fork.output, cap.do("mul_1", bl.scale(2.0)).output)


class HidesAnOp(nn.Module):
    """Doubles its activation where no torch function mode sees it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        with torch._C.DisableTorchFunction():
            hidden = h * 2
        return self.b(hidden)


def test_an_op_reading_a_tensor_no_recorded_op_made_is_refused_by_name():
    torch.manual_seed(0)
    cap = bl.capture(HidesAnOp(), torch.randn(2, 4), save_activations=True)
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_op_unsupported" and "'linear_2'" in str(caught.value)


def test_a_capture_with_armed_edits_is_refused():
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(4, 6), save_activations=True,
                     intervene=bl.when("relu_2", bl.scale(3.0)))
    with pytest.raises(bl.ReplayError) as caught:
        cap.do("relu_1", bl.scale(2.0), differentiable=True)
    assert caught.value.code == "replay_source_has_edits"


def test_a_replay_takes_no_new_inputs():
    _model, x, cap = mlp_capture()
    with pytest.raises(bl.UnsupportedInputError):
        cap.do("relu_1", bl.scale(2.0), inputs=x, differentiable=True)


def test_a_closed_capture_cannot_replay():
    _model, _x, cap = mlp_capture()
    cap.close()
    with pytest.raises(bl.CaptureClosedError):
        cap.do("relu_1", bl.scale(2.0), differentiable=True)


@pytest.mark.parametrize("differentiable", [False, True])
def test_a_fork_cannot_rerun_or_replay_and_says_where_to_call_do(differentiable):
    _model, _x, cap = mlp_capture()
    fork = cap.do("relu_1", bl.scale(2.0), differentiable=True)
    with pytest.raises(bl.CaptureClosedError) as caught:
        fork.do("linear_2", bl.scale(0.5), differentiable=differentiable)
    assert caught.value.code == "fork_cannot_rerun"
    assert cap.frontier is None


def test_an_unknown_site_names_close_labels():
    _model, _x, cap = mlp_capture()
    with pytest.raises(bl.LabelNotFoundError) as caught:
        cap.do("relu_9", bl.scale(2.0), differentiable=True)
    assert "relu_1" in str(caught.value)


# -- keep_grad -------------------------------------------------------------------------------

def test_keep_grad_warns_once_under_replay():
    _model, _x, cap = mlp_capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fork = cap.do(bl.func("relu"), bl.keep_grad(bl.zero_ablate()), differentiable=True)
    codes = [w.message.code for w in caught if isinstance(w.message, bl.BacklensWarning)]
    assert codes == ["keep_grad_replay_frontier"]
    fork.backward(fork.output.sum())
    # The ablated value still passes the gradient straight through to the frontier leaf.
    assert fork.frontier["relu_1"].grad.abs().sum() > 0


class StraightThroughZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_keep_grad_passes_the_gradient_to_the_unedited_value():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 6)
    cap = bl.capture(model, x, intervene=bl.when("net.1", bl.keep_grad(bl.zero_ablate())))
    cap.output.sum().backward()
    twin.net[1].register_forward_hook(lambda m, a, out: StraightThroughZero.apply(out))
    twin(x).sum().backward()
    assert model.net[0].weight.grad.abs().sum() > 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


# -- bind ------------------------------------------------------------------------------------

def test_bind_trains_upstream_parameters_through_an_edit_as_a_stock_hook_does():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 6)
    bound = bl.when("net.1", bl.scale(0.5)).bind(model)
    bound(x).pow(2).sum().backward()
    twin.net[1].register_forward_hook(lambda m, a, out: out * 0.5)
    twin(x).pow(2).sum().backward()
    assert model.net[0].weight.grad.abs().sum() > 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_bind_applies_an_op_site_edit_on_every_call():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 6)
    bound = bl.when("relu_1", bl.scale(0.0)).bind(model)
    for _ in range(2):
        assert torch.equal(bound(x), model.net[4](model.net[3](model.net[2](torch.zeros(4, 16)))))


def test_bind_arms_gradient_edits_on_the_latest_call():
    torch.manual_seed(0)
    model = MLP()
    bound = bl.when(bl.grad("relu_1"), bl.scale(0.0)).bind(model)
    bound(torch.randn(4, 6)).sum().backward()
    assert torch.equal(model.net[0].weight.grad, torch.zeros_like(model.net[0].weight))
    assert model.net[2].weight.grad.abs().sum() > 0


def test_bind_on_gpt2_trains_upstream_blocks_as_a_stock_hook_does():
    model, args, kwargs = build("gpt2")
    twin = copy.deepcopy(model)
    bound = bl.when("transformer.h.1", bl.scale(0.5)).bind(model)
    loss_of(bound(*args, **kwargs)).backward()
    twin.transformer.h[1].register_forward_hook(lambda m, a, out: out * 0.5)
    loss_of(twin(*args, **kwargs)).backward()
    name = "transformer.h.0.mlp.c_fc.weight"
    assert dict(model.named_parameters())[name].grad.abs().sum() > 0
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
