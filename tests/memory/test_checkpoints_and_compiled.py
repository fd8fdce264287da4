"""Memory under activation checkpointing and torch.compile's eager fallback."""

from __future__ import annotations

import pytest
import torch
from memory_refs import CheckpointedBlocks, saved_rows, stock_grads

import backlens as bl
import models
from backlens.errors import UnsupportedInputError


def captured(checkpointed: bool):
    torch.manual_seed(0)
    model = CheckpointedBlocks(checkpointed)
    cap = bl.capture(model, torch.randn(4, 8), memory=True)
    cap.output.sum().backward()
    return cap


def test_a_checkpointed_block_saves_nothing_in_the_forward_but_its_input():
    plain, checkpointed = captured(False), captured(True)
    assert checkpointed.memory["block"].saved_bytes == 0
    assert plain.memory["block"].saved_bytes > 0
    # The checkpoint keeps the block's input (torch's own save, outside any op): 4x8 floats.
    assert checkpointed.memory.unattributed_bytes == 4 * 8 * 4
    assert checkpointed.memory.saved_bytes == plain.memory.saved_bytes - plain.memory["block"].saved_bytes + 4 * 8 * 4


def test_recomputed_saves_are_charged_to_the_node_call_that_recomputed_them():
    plain, checkpointed = captured(False), captured(True)
    (record,) = checkpointed.checkpoints
    (recompute,) = record.recomputed
    memory = checkpointed.passes[0].memory
    # What the recomputation keeps for the block's nodes is what the block saved without checkpointing.
    assert memory.recomputed == {recompute.call: plain.memory["block"].saved_bytes}
    at = [s.call for s in memory.samples].index(recompute.call)
    before, after = memory.samples[at - 1], memory.samples[at]
    assert after.saved_bytes > before.saved_bytes


def test_memory_true_never_changes_a_gradient_under_checkpointing():
    torch.manual_seed(0)
    model = CheckpointedBlocks(True)
    x = torch.randn(4, 8)
    stock = stock_grads(model, lambda out: out.sum(), x)
    cap = bl.capture(model, x, memory=True)
    cap.output.sum().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, stock[name]), name


def test_a_compiled_model_captured_through_its_eager_fallback_saves_what_the_model_saves():
    model, args, kwargs = models.build("mlp")
    compiled = torch.compile(model)
    eager = bl.capture(model, *args, memory=True, **kwargs)
    with pytest.warns(bl.BacklensWarning, match="eagerly"):
        through = bl.capture(compiled, *args, memory=True, **kwargs)  # compiled="eager": the original module
    assert saved_rows(through) == saved_rows(eager) and saved_rows(eager)
    models.loss_of(through.output).backward()
    assert through.passes[0].memory.peak_bytes > 0


def test_memory_true_refuses_an_opaque_compiled_model_by_name():
    model, args, kwargs = models.build("mlp")
    with pytest.raises(UnsupportedInputError) as caught:
        bl.capture(torch.compile(model), *args, memory=True, compiled="opaque", **kwargs)
    assert caught.value.code == "memory_needs_eager_forward" and "compiled='eager'" in caught.value.remedy


def test_an_outer_saved_tensor_hook_keeps_working_and_is_named_in_the_reasons():
    model, args, kwargs = models.build("mlp")
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cap = bl.capture(model, *args, memory=True, **kwargs)
    assert len(packed) == cap.memory.saved_tensors > 0  # the user's hook still saw every save
    assert any("saved_tensors_hooks" in reason for reason in cap.memory.reasons)


def test_an_internal_error_in_memory_bookkeeping_leaves_the_forward_and_gradients_untouched(monkeypatch):
    from backlens.capture import memory as memory_module

    def broken(self, tensor, kind):
        raise RuntimeError("bookkeeping broke")

    model, args, kwargs = models.build("mlp")
    stock = stock_grads(model, models.loss_of, *args, **kwargs)
    monkeypatch.setattr(memory_module._StorageIndex, "of", broken)
    with pytest.warns(bl.BacklensWarning, match="could not record") as caught:
        cap = bl.capture(model, *args, memory=True, **kwargs)
        models.loss_of(cap.output).backward()
    assert [w.message.code for w in caught.list] == ["memory_incomplete"]  # once per capture
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, stock[name]), name
    assert any("bookkeeping broke" in reason for reason in cap.memory.reasons)
