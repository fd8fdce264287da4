"""bl.derive on JAX: leaf gradients, per-op intermediates, refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from torch_ports import (
    TorchAttention,
    TorchMLP,
    assert_close,
    assert_equal,
    attention_input,
    attention_weights,
    captured_grads,
    mlp_input,
    mlp_weights,
)

import backlens as bl

SCALE = 1.0 / float(np.sqrt(4.0))


def mlp(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"]) ** 2)


def attention(p, x):
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    scores = q @ k.T * SCALE
    e = jnp.exp(scores - jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True)))
    probs = e / e.sum(axis=-1, keepdims=True)
    return jnp.mean(((probs @ v) @ p["wo"] + x) ** 2)


def as_jax(weights):
    return {name: jnp.asarray(w) for name, w in weights.items()}


@pytest.mark.parametrize("fn, weights, x", [
    (mlp, mlp_weights(), mlp_input()),
    (attention, attention_weights(), attention_input()),
], ids=["mlp", "attention"])
def test_leaf_grads_equal_jax_grad_exactly(fn, weights, x):
    params, x = as_jax(weights), jnp.asarray(x)
    derived = bl.derive(fn, params, x)
    loss, (param_grads, input_grad) = jax.value_and_grad(fn, argnums=(0, 1))(params, x)
    assert derived.framework == "jax" and derived.version == jax.__version__
    assert list(derived.leaf_grads) == sorted(weights) + ["args[0]"]
    for name in weights:
        assert_equal(derived.leaf_grads[name], param_grads[name], name)
    assert_equal(derived.leaf_grads["args[0]"], input_grad, "args[0]")
    assert_equal(derived.output, loss, "output")


def test_mlp_leaf_grads_match_the_torch_capture_of_the_same_weights():
    weights, x = mlp_weights(), mlp_input()
    derived = bl.derive(mlp, as_jax(weights), jnp.asarray(x))
    loss, params, input_grad = captured_grads(TorchMLP(weights), x)
    assert_close(derived.output, loss, "loss")
    assert_close(derived.leaf_grads["w1"], params["fc1.weight"].T, "w1")
    assert_close(derived.leaf_grads["b1"], params["fc1.bias"], "b1")
    assert_close(derived.leaf_grads["w2"], params["fc2.weight"].T, "w2")
    assert_close(derived.leaf_grads["b2"], params["fc2.bias"], "b2")
    assert_close(derived.leaf_grads["args[0]"], input_grad, "args[0]")


def test_attention_leaf_grads_match_the_torch_capture_of_the_same_weights():
    weights, x = attention_weights(), attention_input()
    derived = bl.derive(attention, as_jax(weights), jnp.asarray(x))
    loss, params, input_grad = captured_grads(TorchAttention(weights), x)
    assert_close(derived.output, loss, "loss")
    for name in "qkvo":
        assert_close(derived.leaf_grads[f"w{name}"], params[f"{name}.weight"].T, f"w{name}")
    assert_close(derived.leaf_grads["args[0]"], input_grad, "args[0]")


def test_nested_params_are_named_by_their_pytree_paths():
    params = {"encoder": {"layers": [{"w": jnp.ones((4, 3))}, {"w": jnp.ones((3, 2))}]}, "scale": 2.0}

    def fn(p, x):
        h = x @ p["encoder"]["layers"][0]["w"] @ p["encoder"]["layers"][1]["w"]
        return jnp.sum(h) * p["scale"]

    derived = bl.derive(fn, params, jnp.ones((2, 4)))
    assert set(derived.leaf_grads) == {"encoder.layers.0.w", "encoder.layers.1.w", "scale", "args[0]"}
    expected = jax.grad(fn)(params, jnp.ones((2, 4)))
    assert_equal(derived.leaf_grads["encoder.layers.1.w"], expected["encoder"]["layers"][1]["w"], "layer 1")


def test_integer_leaves_and_integer_inputs_are_not_declared():
    params = {"w": jnp.ones((5, 2)), "step": jnp.asarray(3)}

    def fn(p, ids):
        return jnp.sum(p["w"][ids]) * p["step"]

    derived = bl.derive(fn, params, jnp.asarray([0, 3, 3]))
    assert list(derived.leaf_grads) == ["w"]
    assert_equal(derived.leaf_grads["w"], jax.grad(fn, allow_int=True)(params, jnp.asarray([0, 3, 3]))["w"], "w")


def test_input_grads_false_declares_only_params():
    derived = bl.derive(mlp, as_jax(mlp_weights()), jnp.asarray(mlp_input()), input_grads=False)
    assert sorted(derived.leaf_grads) == ["b1", "b2", "w1", "w2"]


def test_mlp_intermediate_grads_equal_the_gradients_computed_by_hand():
    weights, x = mlp_weights(), mlp_input()
    derived = bl.derive(mlp, as_jax(weights), jnp.asarray(x), intermediate=True)
    records = derived.intermediates
    assert records.labels == ["dot_general_1", "broadcast_in_dim_1", "add_1", "tanh_1", "dot_general_2",
                              "broadcast_in_dim_2", "add_2", "integer_pow_1", "reduce_sum_1", "div_1"]
    assert all(r.status == "exact" for r in records) and not records.withheld

    w = {k: v.astype(np.float64) for k, v in weights.items()}
    a = x.astype(np.float64) @ w["w1"] + w["b1"]
    h = np.tanh(a)
    y = h @ w["w2"] + w["b2"]
    n = y.size
    dy = 2 * y / n
    dh = dy @ w["w2"].T
    da = dh * (1 - h ** 2)
    hand = {
        "div_1": np.float64(1.0),
        "reduce_sum_1": np.float64(1 / n),
        "integer_pow_1": np.full(y.shape, 1 / n),
        "add_2": dy,
        "dot_general_2": dy,
        "broadcast_in_dim_2": dy.sum(axis=0, keepdims=True),
        "tanh_1": dh,
        "add_1": da,
        "dot_general_1": da,
        "broadcast_in_dim_1": da.sum(axis=0, keepdims=True),
    }
    for label, expected in hand.items():
        assert records[label].shape == np.shape(expected), label
        assert_close(records[label].grad, expected, label)


def test_attention_intermediate_grads_equal_the_gradients_computed_by_hand():
    weights, x = attention_weights(), attention_input()
    derived = bl.derive(attention, as_jax(weights), jnp.asarray(x), intermediate=True)
    records = derived.intermediates
    assert not records.withheld

    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x64 = x.astype(np.float64)
    q, k, v = x64 @ w["wq"], x64 @ w["wk"], x64 @ w["wv"]
    scores = q @ k.T * SCALE
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    total = e.sum(axis=-1, keepdims=True)
    probs = e / total
    mixed = probs @ v
    out = mixed @ w["wo"] + x64
    d_out = 2 * out / out.size
    d_mixed = d_out @ w["wo"].T
    d_probs = d_mixed @ v.T
    d_e = (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True)) / total
    d_shifted = d_e * e
    d_qk = d_shifted * SCALE
    hand = {
        "add_1": d_out, "dot_general_6": d_out, "dot_general_5": d_mixed, "div_1": d_probs,
        "exp_1": d_e, "sub_1": d_shifted, "mul_1": d_shifted, "dot_general_4": d_qk,
        "transpose_1": q.T @ d_qk, "dot_general_1": d_qk @ k, "dot_general_2": d_qk.T @ q,
        "dot_general_3": probs.T @ d_mixed,
        # The max enters through stop_gradient: its output's cotangent is the sub's, and stops there.
        "stop_gradient_1": -d_shifted.sum(axis=-1, keepdims=True),
        "broadcast_in_dim_1": np.zeros((5, 1)),
    }
    for label, expected in hand.items():
        assert_close(records[label].grad, expected, label)


def test_a_jitted_function_gives_the_same_intermediate_records():
    params, x = as_jax(mlp_weights()), jnp.asarray(mlp_input())
    plain = bl.derive(mlp, params, x, intermediate=True).intermediates
    jitted = bl.derive(jax.jit(mlp), params, x, intermediate=True).intermediates
    assert jitted.labels == plain.labels
    for a, b in zip(plain, jitted):
        assert_equal(b.grad, a.grad, a.label)


def test_max_intermediate_bounds_the_number_of_records():
    params, x = as_jax(mlp_weights()), jnp.asarray(mlp_input())
    derived = bl.derive(mlp, params, x, intermediate=True, max_intermediate=3)
    assert derived.intermediates.labels == ["dot_general_1", "broadcast_in_dim_1", "add_1"]
    assert derived.intermediates.withheld == {"not_computed": 7}
    assert "max_intermediate=3" in derived.intermediates.notes[0]


def test_records_that_disagree_with_their_check_are_withheld(monkeypatch):
    # Make the oracle (the gradient of each op's downstream replay) disagree for two ops.
    real_grad = jax.grad

    def skewed_grad(f, *args, **kwargs):
        g = real_grad(f, *args, **kwargs)
        if getattr(f, "__name__", "") != "suffix" or f.__defaults__[0] not in (3, 6):
            return g
        return lambda *a, **k: g(*a, **k) + 1.0

    monkeypatch.setattr(jax, "grad", skewed_grad)
    derived = bl.derive(mlp, as_jax(mlp_weights()), jnp.asarray(mlp_input()), intermediate=True)
    assert "tanh_1" not in derived.intermediates.labels and "add_2" not in derived.intermediates.labels
    assert len(derived.intermediates) == 8
    assert derived.intermediates.withheld == {"mismatch": 2}
    assert all(r.status == "exact" for r in derived.intermediates)


def test_intermediates_are_withheld_when_the_traced_ops_do_not_reproduce_the_loss():
    calls = []

    def drifting(p, x):  # the same on the first two calls, different from the third (the trace) on
        calls.append(1)
        return mlp(p, x) + (0.0 if len(calls) < 3 else 1.0)

    derived = bl.derive(drifting, as_jax(mlp_weights()), jnp.asarray(mlp_input()), intermediate=True)
    assert len(derived.intermediates) == 0
    assert derived.intermediates.withheld == {"replay_mismatch": 11}
    assert "not fn's own" in derived.intermediates.notes[0]


def test_a_derived_output_that_differs_from_the_functions_own_is_refused():
    calls = []

    def impure(p, x):  # reads state that changes between calls
        calls.append(1)
        return mlp(p, x) + len(calls)

    with pytest.raises(bl.DeriveError) as info:
        bl.derive(impure, as_jax(mlp_weights()), jnp.asarray(mlp_input()))
    assert info.value.code == "derived_output_mismatch"
    assert isinstance(info.value, RuntimeError) and info.value.remedy
    assert "differs from fn's own output" in str(info.value)


def test_a_non_scalar_loss_is_refused():
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(lambda p, x: x @ p["w1"], as_jax(mlp_weights()), jnp.asarray(mlp_input()))
    assert info.value.code == "derive_loss_not_scalar"


def test_numpy_params_need_the_framework_named():
    weights, x = mlp_weights(), mlp_input()
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.derive(mlp, weights, x)
    assert info.value.code == "derive_unknown_framework" and "framework='jax'" in info.value.remedy
    derived = bl.derive(mlp, weights, x, framework="jax")
    assert_equal(derived.leaf_grads["w1"], jax.grad(mlp)(as_jax(weights), jnp.asarray(x))["w1"], "w1")


def test_to_pandas_has_one_row_per_leaf_then_per_exact_intermediate():
    derived = bl.derive(mlp, as_jax(mlp_weights()), jnp.asarray(mlp_input()), intermediate=True)
    table = derived.to_pandas()
    assert list(table["kind"]) == ["leaf"] * 5 + ["intermediate"] * 10
    assert list(table["name"][:5]) == ["b1", "b2", "w1", "w2", "args[0]"]
    assert set(table["status"]) == {"exact"}
    row = table.iloc[2]
    assert row["shape"] == (4, 6) and row["dtype"] == "float32"
    assert row["grad_norm"] == pytest.approx(float(np.linalg.norm(derived.leaf_grads["w1"])))
    assert list(derived.intermediates.to_pandas()["label"]) == derived.intermediates.labels


def test_derived_arrays_are_read_only_numpy_arrays():
    derived = bl.derive(mlp, as_jax(mlp_weights()), jnp.asarray(mlp_input()), intermediate=True)
    for array in [derived.output, *derived.leaf_grads.values(), *(r.grad for r in derived.intermediates)]:
        assert isinstance(array, np.ndarray) and not array.flags.writeable
    with pytest.raises(TypeError):
        derived.leaf_grads["w9"] = np.zeros(1)


def test_an_unknown_intermediate_label_names_close_ones():
    derived = bl.derive(mlp, as_jax(mlp_weights()), jnp.asarray(mlp_input()), intermediate=True)
    with pytest.raises(bl.LabelNotFoundError) as info:
        derived.intermediates["tanh_9"]
    assert "tanh_1" in str(info.value)


def test_a_loss_of_shape_one_and_non_array_leaves_are_accepted():
    params = {"w": jnp.ones((3, 2)), "name": "probe", "unused": None}

    def fn(p, x):
        assert p["name"] == "probe"
        return jnp.sum(x @ p["w"], keepdims=True).reshape(1)

    derived = bl.derive(fn, params, jnp.ones((2, 3)), intermediate=True)
    assert derived.output.shape == () and float(derived.output) == 12.0
    assert list(derived.leaf_grads) == ["w", "args[0]"]
    assert derived.intermediates.labels == ["dot_general_1", "reduce_sum_1", "broadcast_in_dim_1", "reshape_1"]
    assert not derived.intermediates.withheld
