"""Forward FLOPs per op: counted without touching the user's forward or graph."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cost_refs import stock_counts

import backlens as bl
from backlens.cost.forward_count import _spec, replay
from backlens.cost.forward_shapes import SHAPE_COUNTS
from models import build


def node_types(output):
    seen, stack, types = set(), [output.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        types[type(node).__name__] = types.get(type(node).__name__, 0) + 1
        stack.extend(child for child, _ in node.next_functions)
    return types


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_flops_capture_builds_the_same_autograd_nodes_as_a_stock_forward(name):
    # A dispatch mode during the forward would turn reshape's ReshapeAliasBackward0 into ViewBackward0.
    model, args, kwargs = build(name)
    stock = node_types(model(*args, **kwargs).logits if name == "gpt2" else model(*args, **kwargs)[0])
    cap = bl.capture(model, *args, flops=True, **kwargs)
    out = cap.output.logits if name == "gpt2" else cap.output[0]
    assert node_types(out) == stock


class Assorted(nn.Module):
    """Ops counted by replay on meta tensors rather than from their shapes."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.up = nn.ConvTranspose1d(2, 3, 3, stride=2)
        self.v = nn.Parameter(torch.randn(5))

    def forward(self, x):
        h = torch.matmul(x, self.w)                             # 3-D @ 2-D folds into mm
        h = torch.einsum("bij,jk->bik", h, torch.ones(5, 4))    # bmm
        h = self.up(h.transpose(1, 2)[:, :2])                    # transposed convolution
        return h.sum() + (x @ self.v.new_ones(6)).sum()          # mv: no FLOPs by convention


def test_ops_without_a_shape_count_are_replayed_and_equal_flop_counter():
    torch.manual_seed(0)
    model, x = Assorted(), torch.randn(2, 4, 6)
    forward, _backward = stock_counts(model, (x,), {}, lambda out: out)
    cap = bl.capture(model, x)
    assert cap._state.cost.forward["replay_failures"] == []
    assert sum(op.forward_flops for op in cap.ops) == forward > 0
    assert cap.ops["matmul_1"].forward_flops == 2 * 8 * 6 * 5


CASES = {
    "linear_3d": (F.linear, (torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)), {}),
    "linear_1d_no_bias": (F.linear, (torch.randn(4), torch.randn(5, 4)), {}),
    "addmm": (torch.addmm, (torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)), {}),
    "addmm_method": (torch.Tensor.addmm, (torch.randn(3, 5), torch.randn(3, 4), torch.randn(4, 5)), {"beta": 0.5}),
    "mm": (torch.mm, (torch.randn(3, 4), torch.randn(4, 5)), {}),
    "bmm": (torch.bmm, (torch.randn(2, 3, 4), torch.randn(2, 4, 5)), {}),
    "baddbmm": (torch.baddbmm, (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)), {}),
    "sdpa_4d": (F.scaled_dot_product_attention, (torch.randn(2, 2, 5, 4),) * 3, {"is_causal": True}),
    "sdpa_3d": (F.scaled_dot_product_attention, (torch.randn(2, 5, 4),) * 3, {}),
    "sdpa_gqa": (F.scaled_dot_product_attention,
                 (torch.randn(1, 4, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)), {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_counts_equal_a_meta_replay(case):
    func, args, kwargs = CASES[case]
    out = func(*args, **kwargs)
    from_shapes = SHAPE_COUNTS[func](args, kwargs, out)
    replayed = replay([(0, func, _spec(args), _spec(kwargs))], 1)["op_flops"][0]
    assert from_shapes == replayed > 0


@torch.library.custom_op("backlens_tests::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # no fake (meta) kernel registered: a replay cannot run it


class UsesCustomOp(nn.Module):
    def forward(self, x):
        return twice(x.detach()).sum() * x.sum()


def test_an_op_that_cannot_replay_reads_none_and_is_named():
    cap = bl.capture(UsesCustomOp(), torch.randn(8, requires_grad=True))
    (failure,) = cap._state.cost.forward["replay_failures"]
    label = cap.ops[failure["op_index"]].label
    assert "twice" in failure["func"] and "twice" in label
    assert cap.ops[label].forward_flops is None and cap.ops["sum_1"].forward_flops == 0
    assert bl.report.backward_status(cap).forward_flops is None



def test_a_replay_refuses_arguments_that_could_hold_a_real_tensor():
    Pair = collections.namedtuple("Pair", "tensor other")
    real = torch.zeros(3)

    def bump(pair):
        return pair.tensor.add_(1)

    result = replay([(0, bump, _spec((Pair(real, None),)), None)], 1)
    assert result["op_flops"] == [None]
    assert "cannot be replayed safely" in result["replay_failures"][0]["error"]
    assert torch.equal(real, torch.zeros(3))
