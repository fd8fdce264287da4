"""Shared weights for the derived-gradient tests, and the same models in torch.

Weights are numpy float32 arrays in (in, out) layout for dense layers (as JAX
and Paddle keep them; torch, tinygrad and MLX keep the transpose) and OIHW
for convolutions (as every framework here does). The torch side runs under
``bl.capture(..., save_grads=True)``, so the derived gradients are compared
with backlens's own torch records.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import backlens as bl

# float32 arithmetic in two frameworks: sums and transcendental functions round differently.
RTOL, ATOL = 1e-5, 1e-6


def rng(seed: int) -> np.random.RandomState:
    return np.random.RandomState(seed)


def mlp_weights(seed: int = 0) -> dict[str, np.ndarray]:
    r = rng(seed)
    return {"w1": r.randn(4, 6).astype(np.float32) * 0.5, "b1": r.randn(6).astype(np.float32) * 0.1,
            "w2": r.randn(6, 3).astype(np.float32) * 0.5, "b2": r.randn(3).astype(np.float32) * 0.1}


def mlp_input(seed: int = 1) -> np.ndarray:
    return rng(seed).randn(3, 4).astype(np.float32)


def attention_weights(seed: int = 2, d: int = 4) -> dict[str, np.ndarray]:
    r = rng(seed)
    return {name: r.randn(d, d).astype(np.float32) * 0.5 for name in ("wq", "wk", "wv", "wo")}


def attention_input(seed: int = 3) -> np.ndarray:
    return rng(seed).randn(5, 4).astype(np.float32)


def conv_weights(seed: int = 4) -> dict[str, np.ndarray]:
    r = rng(seed)
    return {"conv_w": r.randn(2, 1, 3, 3).astype(np.float32) * 0.5, "conv_b": r.randn(2).astype(np.float32) * 0.1,
            "fc_w": r.randn(18, 3).astype(np.float32) * 0.3, "fc_b": r.randn(3).astype(np.float32) * 0.1}


def conv_input(seed: int = 5) -> np.ndarray:
    return rng(seed).randn(2, 1, 5, 5).astype(np.float32)


class TorchMLP(nn.Module):
    """tanh(x @ w1 + b1) @ w2 + b2."""

    def __init__(self, w: dict[str, np.ndarray]):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)
        _set(self.fc1, w["w1"].T, w["b1"])
        _set(self.fc2, w["w2"].T, w["b2"])

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchAttention(nn.Module):
    """One attention head with a residual: softmax(q k^T / sqrt(d)) v wo + x."""

    def __init__(self, w: dict[str, np.ndarray]):
        super().__init__()
        d = w["wq"].shape[0]
        self.scale = 1.0 / float(np.sqrt(d))
        for name in ("q", "k", "v", "o"):
            layer = nn.Linear(d, d, bias=False)
            _set(layer, w[f"w{name}"].T, None)
            setattr(self, name, layer)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).T * self.scale
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x)) + x


class TorchConvNet(nn.Module):
    """conv 3x3 (1 -> 2 channels) -> relu -> flatten -> linear (18 -> 3)."""

    def __init__(self, w: dict[str, np.ndarray]):
        super().__init__()
        self.conv, self.act, self.flat, self.fc = nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 3)
        _set(self.conv, w["conv_w"], w["conv_b"])
        _set(self.fc, w["fc_w"].T, w["fc_b"])

    def forward(self, x):
        return self.fc(self.flat(self.act(self.conv(x))))


def _set(layer: nn.Module, weight: np.ndarray, bias: np.ndarray | None) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
        if bias is not None:
            layer.bias.copy_(torch.from_numpy(bias))


def captured_grads(model: nn.Module, x: np.ndarray) -> tuple[float, dict[str, np.ndarray], np.ndarray]:
    """(loss, parameter grads by torch name, input grad) of mean(model(x)**2), read from bl.capture."""
    leaf = torch.tensor(x, requires_grad=True)
    with bl.capture(model, leaf, save_grads=True) as cap:
        loss = (cap.output ** 2).mean()
        loss.backward()
        params = {record.name: cap.params[record.name].grad.numpy().copy() for record in cap.params}
        return loss.item(), params, cap.inputs[0].grad.numpy().copy()


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=RTOL, atol=ATOL, err_msg=what)


def assert_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Bitwise equal (same arithmetic, same framework)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert np.array_equal(actual, expected), f"{what}: max diff {np.abs(actual - expected).max()}"


def drifting(loss_fn):
    """``loss_fn`` scaled by how many times it was called: a function whose output changes
    between the derive's own call and the framework's (bl.derive must refuse it)."""
    calls = []

    def impure(model, x):
        calls.append(1)
        return loss_fn(model, x) * len(calls)

    return impure
