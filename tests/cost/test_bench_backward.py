"""bl.bench.backward: the backward pass timed alone, and nodes that cannot run twice."""

from __future__ import annotations

import pytest
import torch
from cost_refs import FreesCtxTensor, FreesSavedByData, FreesSavedStorage, FusedNet

import backlens as bl
import backlens.bench
from models import build, loss_of


def test_bench_backward_times_passes_node_types_and_module_calls():
    model, args, _kwargs = build("gpt2")
    result = backlens.bench.backward(model, args, loss_of, repeats=3, warmup=1)
    assert result.method == "retained_graph" and result.once_only == []
    assert len(result.passes.samples) == 3 and len(result.instrumented_passes.samples) == 3
    assert 0 < result.passes.min <= result.passes.median <= result.passes.max
    assert "AddmmBackward0" in result.by_node_type and "AccumulateGrad" in result.by_node_type
    layer = result.by_module["transformer.h.0"]
    assert layer.module_type == "GPT2Block" and layer.subtree.median > 0
    assert layer.subtree.median >= layer.self.median
    assert result.by_module[""].subtree.median >= layer.subtree.median
    assert any(label.startswith("addmm_back") for label in result.by_node)


def test_bench_backward_leaves_parameter_gradients_as_they_were():
    torch.manual_seed(0)
    model, args, _kwargs = build("mlp")
    model.net[0].weight.grad = torch.full_like(model.net[0].weight, 7.0)
    before = model.net[0].weight.grad
    backlens.bench.backward(model, args, lambda out: out.sum(), repeats=2, warmup=0)
    assert model.net[0].weight.grad is before
    assert model.net[2].weight.grad is None


@pytest.mark.parametrize("function", [FreesSavedByData, FreesSavedStorage, FreesCtxTensor],
                         ids=["data_assign", "storage_resize", "ctx_attribute"])
def test_bench_backward_names_a_te_style_clearing_function_and_still_returns_timings(function):
    torch.manual_seed(0)
    model = FusedNet(function)
    x = torch.randn(4, 8)
    result = backlens.bench.backward(model, x, lambda out: out.sum(), repeats=3, warmup=1)
    assert result.method == "forward_backward_minus_forward"
    (node,) = [n for n in result.once_only if n.type == f"{function.__name__}Backward"]
    assert node.label is not None and node.label.startswith(function.__name__.lower())
    assert node.module == "fused"
    assert node.label in str(node) and "fused" in str(node)
    assert node.label in result.note
    assert len(result.passes.samples) == 3 and len(result.forward.samples) == 3
    assert result.by_node_type[f"{function.__name__}Backward"].median > 0
    assert result.by_module["fused"].subtree.median > 0


def test_a_once_only_node_is_named_with_its_forward_op_when_the_capture_pairs_one():
    torch.manual_seed(0)
    model = FusedNet(FreesSavedByData)
    x = torch.randn(4, 8)
    result = backlens.bench.backward(model, x, lambda out: out.sum(), repeats=1, warmup=0)
    (node,) = result.once_only
    cap = bl.capture(model, x)
    paired = cap.grad_fns[node.label].op
    assert node.op == (paired.label if paired is not None else None)


def test_bench_backward_refuses_a_loss_that_is_not_a_scalar():
    model, args, _kwargs = build("mlp")
    with pytest.raises(ValueError, match="scalar loss"):
        backlens.bench.backward(model, args, repeats=1)


def test_bench_result_exports_to_pandas_and_renders_a_rich_table():
    from rich.console import Console

    model, args, _kwargs = build("mlp")
    result = backlens.bench.backward(model, args, lambda out: out.sum(), repeats=2, warmup=0)
    frame = result.to_pandas()
    assert {"pass", "instrumented_pass", "node_type", "node", "module_self", "module_subtree"} <= set(frame["kind"])
    assert (frame["min"] <= frame["median"]).all() and (frame["median"] <= frame["max"]).all()
    console = Console(record=True, width=160)
    console.print(result)
    text = console.export_text()
    assert "backward alone" in text and "per node type" in text and "net.2" in text
