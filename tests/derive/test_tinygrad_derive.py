"""bl.derive on tinygrad: leaf gradients from Tensor.gradient, checked against backward() and torch."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, nn
from torch_ports import (
    TorchConvNet,
    TorchMLP,
    assert_close,
    assert_equal,
    captured_grads,
    conv_input,
    conv_weights,
    drifting,
    mlp_input,
    mlp_weights,
)

import backlens as bl


def tensor(array: np.ndarray) -> Tensor:
    return Tensor(np.ascontiguousarray(array))


class TinyMLP:
    def __init__(self, w):
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.fc1.weight, self.fc1.bias = tensor(w["w1"].T), tensor(w["b1"])
        self.fc2.weight, self.fc2.bias = tensor(w["w2"].T), tensor(w["b2"])

    def __call__(self, x):
        return self.fc2(self.fc1(x).tanh())


class TinyConvNet:
    def __init__(self, w):
        self.conv, self.fc = nn.Conv2d(1, 2, 3), nn.Linear(18, 3)
        self.conv.weight, self.conv.bias = tensor(w["conv_w"]), tensor(w["conv_b"])
        self.fc.weight, self.fc.bias = tensor(w["fc_w"].T), tensor(w["fc_b"])

    def __call__(self, x):
        return self.fc(self.conv(x).relu().flatten(1))


def loss_fn(model, x):
    return model(x).square().mean()


MODELS = {
    "mlp": (TinyMLP, TorchMLP, mlp_weights, mlp_input,
            {"fc1.weight": "fc1.weight", "fc1.bias": "fc1.bias", "fc2.weight": "fc2.weight", "fc2.bias": "fc2.bias"}),
    "convnet": (TinyConvNet, TorchConvNet, conv_weights, conv_input,
                {"conv.weight": "conv.weight", "conv.bias": "conv.bias", "fc.weight": "fc.weight", "fc.bias": "fc.bias"}),
}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_leaf_grads_equal_tinygrads_own_backward_and_the_torch_capture(which):
    tiny_cls, torch_cls, weights_fn, input_fn, names = MODELS[which]
    weights, x = weights_fn(), input_fn()
    model, leaf = tiny_cls(weights), tensor(x)
    derived = bl.derive(loss_fn, model, leaf)
    assert derived.framework == "tinygrad" and derived.version
    assert list(derived.leaf_grads) == [*names, "args[0]"]

    # tinygrad's own autodiff, the stock way: backward() fills .grad
    own_model, own_leaf = tiny_cls(weights), tensor(x)
    own_loss = loss_fn(own_model, own_leaf)
    own_loss.backward()
    own_params = nn.state.get_state_dict(own_model)
    for name in names:
        assert_equal(derived.leaf_grads[name], own_params[name].grad.numpy(), name)
    assert_equal(derived.leaf_grads["args[0]"], own_leaf.grad.numpy(), "args[0]")
    assert_equal(derived.output, own_loss.numpy(), "output")

    loss, params, input_grad = captured_grads(torch_cls(weights), x)
    assert_close(derived.output, loss, "loss")
    for tiny_name, torch_name in names.items():
        assert_close(derived.leaf_grads[tiny_name], params[torch_name], tiny_name)
    assert_close(derived.leaf_grads["args[0]"], input_grad, "args[0]")


def test_derivation_leaves_the_models_grad_fields_untouched():
    model, x = TinyMLP(mlp_weights()), tensor(mlp_input())
    bl.derive(loss_fn, model, x)
    assert all(t.grad is None for t in nn.state.get_state_dict(model).values())
    assert x.grad is None


def test_a_parameter_dict_and_an_unused_leaf():
    w = mlp_weights()
    params = {"w1": tensor(w["w1"]), "unused": tensor(np.ones(3, np.float32))}
    derived = bl.derive(lambda p, x: (x @ p["w1"]).square().sum(), params, tensor(mlp_input()), input_grads=False)
    assert list(derived.leaf_grads) == ["w1", "unused"]
    x = mlp_input().astype(np.float64)
    assert_close(derived.leaf_grads["w1"], x.T @ (2 * (x @ w["w1"])), "w1")
    assert_equal(derived.leaf_grads["unused"], np.zeros(3, np.float32), "unused")


def test_intermediate_records_are_declared_unavailable():
    derived = bl.derive(loss_fn, TinyMLP(mlp_weights()), tensor(mlp_input()), intermediate=True)
    assert len(derived.intermediates) == 0
    assert "tinygrad exposes no per-op graph" in derived.intermediates.notes[0]


def test_a_derived_output_that_differs_from_the_functions_own_is_refused():
    with pytest.raises(bl.DeriveError) as info:
        bl.derive(drifting(loss_fn), TinyMLP(mlp_weights()), tensor(mlp_input()))
    assert info.value.code == "derived_output_mismatch"
