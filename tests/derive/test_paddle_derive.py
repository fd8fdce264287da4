"""bl.derive on Paddle: paddle.grad over a layer's parameters and the float inputs."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
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


class PaddleMLP(paddle.nn.Layer):
    def __init__(self, w):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(4, 6), paddle.nn.Linear(6, 3)
        for layer, weight, bias in ((self.fc1, w["w1"], w["b1"]), (self.fc2, w["w2"], w["b2"])):
            layer.weight.set_value(weight)  # paddle keeps dense weights (in, out)
            layer.bias.set_value(bias)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


class PaddleConvNet(paddle.nn.Layer):
    def __init__(self, w):
        super().__init__()
        self.conv, self.fc = paddle.nn.Conv2D(1, 2, 3), paddle.nn.Linear(18, 3)
        self.conv.weight.set_value(w["conv_w"])
        self.conv.bias.set_value(w["conv_b"])
        self.fc.weight.set_value(w["fc_w"])
        self.fc.bias.set_value(w["fc_b"])

    def forward(self, x):
        return self.fc(paddle.flatten(paddle.nn.functional.relu(self.conv(x)), 1))


def loss_fn(model, x):
    return (model(x) ** 2).mean()


# paddle name -> (torch name, whether paddle keeps it transposed)
MODELS = {
    "mlp": (PaddleMLP, TorchMLP, mlp_weights, mlp_input,
            {"fc1.weight": ("fc1.weight", True), "fc1.bias": ("fc1.bias", False),
             "fc2.weight": ("fc2.weight", True), "fc2.bias": ("fc2.bias", False)}),
    "convnet": (PaddleConvNet, TorchConvNet, conv_weights, conv_input,
                {"conv.weight": ("conv.weight", False), "conv.bias": ("conv.bias", False),
                 "fc.weight": ("fc.weight", True), "fc.bias": ("fc.bias", False)}),
}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_leaf_grads_equal_paddles_own_backward_and_the_torch_capture(which):
    paddle_cls, torch_cls, weights_fn, input_fn, names = MODELS[which]
    weights, x = weights_fn(), input_fn()
    model, leaf = paddle_cls(weights), paddle.to_tensor(x)
    derived = bl.derive(loss_fn, model, leaf)
    assert derived.framework == "paddle" and derived.version == paddle.__version__
    assert list(derived.leaf_grads) == [*names, "args[0]"]

    own_leaf = paddle.to_tensor(x, stop_gradient=False)
    own_loss = loss_fn(model, own_leaf)
    own_loss.backward()
    own = dict(model.named_parameters())
    for name in names:
        assert_equal(derived.leaf_grads[name], own[name].grad.numpy(), name)
    assert_equal(derived.leaf_grads["args[0]"], own_leaf.grad.numpy(), "args[0]")
    assert_equal(derived.output, own_loss.numpy(), "output")

    loss, params, input_grad = captured_grads(torch_cls(weights), x)
    assert_close(derived.output, loss, "loss")
    for paddle_name, (torch_name, transposed) in names.items():
        expected = params[torch_name].T if transposed else params[torch_name]
        assert_close(derived.leaf_grads[paddle_name], expected, paddle_name)
    assert_close(derived.leaf_grads["args[0]"], input_grad, "args[0]")


def test_derivation_accumulates_no_grad_and_leaves_the_inputs_as_they_were():
    model, x = PaddleMLP(mlp_weights()), paddle.to_tensor(mlp_input())
    bl.derive(loss_fn, model, x)
    assert all(p.grad is None for p in model.parameters())
    assert x.stop_gradient and x.grad is None


def test_a_parameter_dict_keeps_its_stop_gradient_flags():
    w = mlp_weights()
    params = {"w1": paddle.to_tensor(w["w1"])}  # stop_gradient=True, paddle's default
    derived = bl.derive(lambda p, x: (paddle.matmul(x, p["w1"]) ** 2).sum(), params,
                        paddle.to_tensor(mlp_input()), input_grads=False)
    x = mlp_input().astype(np.float64)
    assert_close(derived.leaf_grads["w1"], x.T @ (2 * (x @ w["w1"])), "w1")
    assert params["w1"].stop_gradient


def test_frozen_parameters_are_not_declared_leaves():
    model = PaddleMLP(mlp_weights())
    model.fc1.weight.stop_gradient = True
    derived = bl.derive(loss_fn, model, paddle.to_tensor(mlp_input()), input_grads=False)
    assert list(derived.leaf_grads) == ["fc1.bias", "fc2.weight", "fc2.bias"]


def test_a_derived_output_that_differs_from_the_functions_own_is_refused():
    with pytest.raises(bl.DeriveError) as info:
        bl.derive(drifting(loss_fn), PaddleMLP(mlp_weights()), paddle.to_tensor(mlp_input()))
    assert info.value.code == "derived_output_mismatch"
