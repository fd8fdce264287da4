"""cap.checkpoints: each torch.utils.checkpoint invocation, what it packed, and who recomputed it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
from cost_refs import Block, CheckpointedNet
from torch.utils.checkpoint import checkpoint

import backlens as bl
from backlens import _torch

TORCH_HOOKS_CLASS = torch.utils.checkpoint._checkpoint_hook
TORCH_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward


def packed_by_stock_hooks(fn, *args) -> int:
    """How many tensors torch saves for backward running ``fn`` (what its saved-tensor hooks see)."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        fn(*args)
    return len(seen)


def recompute_rows(cap, pass_number=1):
    attr = bl.report.backward_status(cap).flops_attributions[pass_number - 1]
    return {row.call_label: row.recompute_flops for row in attr.rows if row.recompute_flops}


class TwoCheckpoints(nn.Module):
    """A checkpointed block, then a checkpointed plain function."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False)
        h = checkpoint(lambda t: torch.tanh(t) * 2, h, use_reentrant=False)
        return self.head(h)


def test_one_record_per_invocation_with_its_module_and_ops():
    torch.manual_seed(0)
    cap = bl.capture(TwoCheckpoints(), torch.randn(4, 8))
    assert cap.checkpoint_verdict == "observed" and cap.checkpoint_reasons == []
    block, plain = cap.checkpoints
    assert block.module == "block" and block.ops == cap.modules["block"].ops
    assert plain.module is None and plain.ops == ["tanh_1", "mul_1"]
    assert not block.reentrant and not plain.reentrant


def test_packed_counts_equal_what_torch_s_saved_tensor_hooks_see():
    torch.manual_seed(0)
    model = TwoCheckpoints()
    x = torch.randn(4, 8)
    cap = bl.capture(model, x)
    block, plain = cap.checkpoints
    assert block.packed == packed_by_stock_hooks(model.block, x) > 0
    assert plain.packed == packed_by_stock_hooks(lambda t: torch.tanh(t) * 2, model.block(x)) > 0


def test_each_pass_names_the_node_call_that_recomputed_it_with_today_s_flops():
    torch.manual_seed(0)
    cap = bl.capture(CheckpointedNet(), torch.randn(4, 8))
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    (record,) = cap.checkpoints
    assert [r.pass_number for r in record.recomputed] == [1, 2]
    for recompute in record.recomputed:
        call = cap.grad_fn_calls[recompute.call]
        assert call.pass_number == recompute.pass_number and call.grad_fn.module.startswith("block")
        assert recompute.recompute_flops == call.recompute_flops == 2 * 4 * 8 * 16
        assert 0 < recompute.duration <= call.duration
    assert recompute_rows(cap) == {record.recomputed[0].call: 2 * 4 * 8 * 16}


def test_capture_keeps_a_checkpointed_model_s_gradients_bitwise():
    torch.manual_seed(0)
    model = TwoCheckpoints()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    cap = bl.capture(model, x)
    cap.output.pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_model_without_checkpointing_is_none_observed():
    torch.manual_seed(0)
    cap = bl.capture(CheckpointedNet(checkpointed=False), torch.randn(4, 8))
    assert cap.checkpoint_verdict == "none_observed"
    assert cap.checkpoint_reasons == [] and len(cap.checkpoints) == 0


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True).sum()


def test_a_reentrant_checkpoint_is_recorded_with_an_unknown_verdict_and_its_reason():
    torch.manual_seed(0)
    cap = bl.capture(Reentrant(), torch.randn(4, 8, requires_grad=True))
    cap.output.backward()
    assert cap.checkpoint_verdict == "unknown"
    assert any("reentrant" in reason for reason in cap.checkpoint_reasons)
    (record,) = cap.checkpoints
    assert record.reentrant and record.packed is None and record.module == "block"
    (recompute,) = record.recomputed
    assert cap.grad_fn_calls[recompute.call].grad_fn.type == "CheckpointFunctionBackward"
    assert recompute.recompute_flops == cap.grad_fn_calls[recompute.call].recompute_flops


def test_a_torch_without_the_hook_class_never_says_none_observed(monkeypatch):
    monkeypatch.setattr(_torch, "HAS_CHECKPOINT_HOOK_CLASS", False)
    torch.manual_seed(0)
    cap = bl.capture(CheckpointedNet(checkpointed=False), torch.randn(4, 8))
    assert cap.checkpoint_verdict == "unknown"
    assert any("_checkpoint_hook" in reason for reason in cap.checkpoint_reasons)


class CheckpointsInAThread(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        worker = threading.Thread(target=lambda: checkpoint(torch.sin, x.detach().requires_grad_(),
                                                            use_reentrant=False))
        worker.start()
        worker.join()
        return self.block(x)


def test_an_invocation_on_another_thread_makes_the_verdict_unknown():
    torch.manual_seed(0)
    cap = bl.capture(CheckpointsInAThread(), torch.randn(4, 8))
    assert cap.checkpoint_verdict == "unknown" and len(cap.checkpoints) == 0
    assert any("another thread" in reason for reason in cap.checkpoint_reasons)


def test_torch_s_checkpoint_is_restored_after_the_forward_also_when_it_raises():
    class Raises(nn.Module):
        def forward(self, x):
            checkpoint(torch.sin, x, use_reentrant=False)
            raise ValueError("forward failed")

    bl.capture(CheckpointedNet(), torch.randn(4, 8))
    with pytest.raises(ValueError):
        bl.capture(Raises(), torch.randn(4, 8, requires_grad=True))
    assert torch.utils.checkpoint._checkpoint_hook is TORCH_HOOKS_CLASS
    assert torch.utils.checkpoint.CheckpointFunction.forward is TORCH_REENTRANT_FORWARD


def test_checkpoints_read_back_from_a_bundle(tmp_path):
    torch.manual_seed(0)
    cap = bl.capture(TwoCheckpoints(), torch.randn(4, 8))
    cap.output.sum().backward()
    loaded = bl.load(cap.save(tmp_path / "b"))
    assert loaded.checkpoint_verdict == cap.checkpoint_verdict
    assert loaded.checkpoint_reasons == cap.checkpoint_reasons
    for live, read in zip(cap.checkpoints, loaded.checkpoints, strict=True):
        for field in type(live).FIELDS:
            assert getattr(live, field) == getattr(read, field), field
    assert loaded.checkpoints.to_pandas().equals(cap.checkpoints.to_pandas())


def test_an_unknown_verdict_reads_back_with_its_reasons(tmp_path):
    torch.manual_seed(0)
    cap = bl.capture(Reentrant(), torch.randn(4, 8, requires_grad=True))
    loaded = bl.load(cap.save(tmp_path / "b"))
    assert loaded.checkpoint_verdict == "unknown" and loaded.checkpoint_reasons == cap.checkpoint_reasons


def test_doctor_lists_the_checkpoint_capabilities(capsys):
    flags = bl.doctor()
    assert flags["HAS_CHECKPOINT_HOOK_CLASS"] and flags["HAS_REENTRANT_CHECKPOINT_FUNCTION"]
    assert "HAS_CHECKPOINT_HOOK_CLASS" in capsys.readouterr().out


def gpt2_checkpointed():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    plain = copy.deepcopy(model)
    non_reentrant = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    return model, plain


def test_gpt2_with_gradient_checkpointing_has_one_record_per_block():
    model, plain = gpt2_checkpointed()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    cap = bl.capture(model, ids)
    cap.output.logits.sum().backward()
    assert cap.checkpoint_verdict == "observed"
    assert [c.module for c in cap.checkpoints] == ["transformer.h.0", "transformer.h.1"]
    rows = recompute_rows(cap)
    for record in cap.checkpoints:
        assert record.ops == cap.modules[record.module].ops
        (recompute,) = record.recomputed
        assert cap.grad_fn_calls[recompute.call].grad_fn.module.startswith(record.module)
        assert recompute.recompute_flops == rows[recompute.call]
    assert sum(r.recomputed[0].recompute_flops for r in cap.checkpoints) == sum(rows.values())

    # Packed: what torch's saved-tensor hooks see when the same blocks run unchecked.
    counts = {}
    current = []

    def leave(module, args, output):
        current.pop()

    for i, block in enumerate(plain.transformer.h):
        block.register_forward_pre_hook(lambda m, a, i=i: current.append(i))
        block.register_forward_hook(leave)

    def pack(t):
        if current:
            counts[current[-1]] = counts.get(current[-1], 0) + 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(ids)
    assert [c.packed for c in cap.checkpoints] == [counts[0], counts[1]]
