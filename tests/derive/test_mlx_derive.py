"""bl.derive on MLX: mx.value_and_grad over a module's rebound parameters."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from torch_ports import (
    TorchAttention,
    TorchMLP,
    assert_close,
    assert_equal,
    attention_input,
    attention_weights,
    captured_grads,
    drifting,
    mlp_input,
    mlp_weights,
)

import backlens as bl


class MlxMLP(mnn.Module):
    def __init__(self, w):
        super().__init__()
        self.fc1, self.fc2 = mnn.Linear(4, 6), mnn.Linear(6, 3)
        self.fc1.weight, self.fc1.bias = mx.array(w["w1"].T), mx.array(w["b1"])
        self.fc2.weight, self.fc2.bias = mx.array(w["w2"].T), mx.array(w["b2"])

    def __call__(self, x):
        return self.fc2(mx.tanh(self.fc1(x)))


class MlxAttention(mnn.Module):
    def __init__(self, w):
        super().__init__()
        d = w["wq"].shape[0]
        self.scale = 1.0 / float(np.sqrt(d))
        self.q, self.k, self.v, self.o = (mnn.Linear(d, d, bias=False) for _ in range(4))
        for name in "qkvo":
            getattr(self, name).weight = mx.array(w[f"w{name}"].T)

    def __call__(self, x):
        scores = self.q(x) @ self.k(x).T * self.scale
        return self.o(mx.softmax(scores, axis=-1) @ self.v(x)) + x


def loss_fn(model, x):
    return mx.mean(model(x) ** 2)


MODELS = {
    "mlp": (MlxMLP, TorchMLP, mlp_weights, mlp_input,
            ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]),
    "attention": (MlxAttention, TorchAttention, attention_weights, attention_input,
                  ["q.weight", "k.weight", "v.weight", "o.weight"]),
}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_leaf_grads_equal_mlxs_own_value_and_grad_and_the_torch_capture(which):
    mlx_cls, torch_cls, weights_fn, input_fn, names = MODELS[which]
    weights, x = weights_fn(), input_fn()
    model, leaf = mlx_cls(weights), mx.array(x)
    derived = bl.derive(loss_fn, model, leaf)
    assert derived.framework == "mlx" and derived.version == mx.__version__
    assert sorted(derived.leaf_grads) == sorted([*names, "args[0]"])

    own_loss, own_grads = mnn.value_and_grad(model, loss_fn)(model, leaf)
    own_input_grad = mx.grad(lambda x: loss_fn(model, x))(leaf)
    for name, grad in tree_flatten(own_grads):
        assert_equal(derived.leaf_grads[name], np.array(grad), name)
    assert_equal(derived.leaf_grads["args[0]"], np.array(own_input_grad), "args[0]")
    assert_equal(derived.output, np.array(own_loss), "output")

    loss, params, input_grad = captured_grads(torch_cls(weights), x)
    assert_close(derived.output, loss, "loss")
    for name in names:
        assert_close(derived.leaf_grads[name], params[name], name)
    assert_close(derived.leaf_grads["args[0]"], input_grad, "args[0]")


def test_the_models_parameters_are_restored_after_the_derivation():
    model = MlxMLP(mlp_weights())
    before = tree_flatten(model.parameters())
    bl.derive(loss_fn, model, mx.array(mlp_input()))
    after = tree_flatten(model.parameters())
    assert [name for name, _ in after] == [name for name, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))


def test_the_models_parameters_are_restored_when_fn_raises_during_the_derivation():
    model, calls = MlxMLP(mlp_weights()), []
    before = tree_flatten(model.parameters())

    def fails_second_time(m, x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return loss_fn(m, x)

    with pytest.raises(RuntimeError, match="boom"):
        bl.derive(fails_second_time, model, mx.array(mlp_input()))
    assert all(a is b for (_, a), (_, b) in zip(tree_flatten(model.parameters()), before))


def test_frozen_parameters_are_not_declared_leaves():
    model = MlxMLP(mlp_weights())
    model.fc1.freeze()
    derived = bl.derive(loss_fn, model, mx.array(mlp_input()), input_grads=False)
    assert sorted(derived.leaf_grads) == ["fc2.bias", "fc2.weight"]


def test_a_parameter_tree_is_differentiated_directly():
    w = mlp_weights()
    params = {"layers": [{"w": mx.array(w["w1"])}]}
    derived = bl.derive(lambda p, x: mx.sum((x @ p["layers"][0]["w"]) ** 2), params, mx.array(mlp_input()))
    x = mlp_input().astype(np.float64)
    assert_close(derived.leaf_grads["layers.0.w"], x.T @ (2 * (x @ w["w1"])), "layers.0.w")


def test_a_derived_output_that_differs_from_the_functions_own_is_refused():
    with pytest.raises(bl.DeriveError) as info:
        bl.derive(drifting(loss_fn), MlxMLP(mlp_weights()), mx.array(mlp_input()))
    assert info.value.code == "derived_output_mismatch"
