"""The cost tree: per module call forward/backward FLOPs and time, and their sums."""

from __future__ import annotations

import pytest
import torch

import backlens as bl
from backlens.report.cost_tree import NO_FORWARD_OP, UNATTRIBUTED
from models import MLP, build, loss_of


def tree_after_backward(name="gpt2", passes=1):
    model, args, kwargs = build(name)
    cap = bl.capture(model, *args, **kwargs)
    loss = loss_of(cap.output)
    for number in range(passes):
        loss.backward(retain_graph=number < passes - 1)
    return cap, bl.report.cost_tree(cap)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert"])
def test_backward_column_sums_to_the_executed_flops(name):
    cap, tree = tree_after_backward(name)
    executed = bl.report.backward_status(cap).executed_flops
    assert tree.backward_state == "counted" and tree.executed_flops == executed
    assert sum(row.self_backward_flops for row in tree.rows) == executed


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_forward_column_sums_to_the_forward_flops(name):
    cap, tree = tree_after_backward(name)
    assert sum(row.self_forward_mac_flops for row in tree.rows) == tree.forward_flops
    assert tree.forward_flops == sum(op.forward_flops for op in cap.ops)


def test_the_root_subtree_plus_the_catch_all_rows_is_everything():
    cap, tree = tree_after_backward("gpt2")
    root = tree.rows[0]
    assert root.address == "" and root.depth == 0
    catch_all = tree[NO_FORWARD_OP].self_backward_flops + tree[UNATTRIBUTED].self_backward_flops
    assert root.subtree_backward_flops + catch_all == tree.executed_flops
    assert root.subtree_forward_backward_flops == root.subtree_forward_mac_flops + root.subtree_backward_flops


def test_subtree_columns_add_the_children_to_the_module_s_own():
    _cap, tree = tree_after_backward("gpt2")
    for row in tree.rows:
        if row.kind != "module":
            continue
        children = [r for r in tree.rows if r.parent == row.address and r.kind == "module"]
        for column in ("forward_mac_flops", "backward_flops"):
            expected = getattr(row, f"self_{column}") + sum(getattr(c, f"subtree_{column}") for c in children)
            assert getattr(row, f"subtree_{column}") == expected, (row.address, column)


def test_a_linear_layer_s_row_holds_its_forward_and_backward_flops():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    cap.output.sum().backward()
    tree = bl.report.cost_tree(cap)
    middle = tree["net.2"]  # Linear(16, 16) on a batch of 4
    assert middle.module_type == "Linear" and middle.depth == 2
    assert middle.self_forward_mac_flops == 2 * 4 * 16 * 16
    assert middle.self_backward_flops == 2 * (2 * 4 * 16 * 16)
    assert middle.self_forward_backward_flops == 3 * (2 * 4 * 16 * 16)


def test_backward_work_of_the_loss_lands_in_the_no_forward_op_row():
    torch.manual_seed(0)
    model = MLP()
    cap = bl.capture(model, torch.randn(4, 6))
    projection = torch.randn(3, 5, requires_grad=True)
    (cap.output @ projection).sum().backward()  # an mm built after the forward
    tree = bl.report.cost_tree(cap)
    assert tree[NO_FORWARD_OP].self_backward_flops == 2 * (2 * 4 * 3 * 5)
    assert tree[NO_FORWARD_OP].backward_calls >= 2
    assert sum(row.self_backward_flops for row in tree.rows) == tree.executed_flops


def test_node_time_from_fire_timings_lands_in_the_tree():
    cap, tree = tree_after_backward("gpt2")
    total = sum(c.duration for c in cap.grad_fn_calls)
    assert sum(row.self_backward_time or 0.0 for row in tree.rows) == pytest.approx(total)
    assert tree["transformer.h.0"].subtree_backward_time > 0


def test_several_passes_add_up_and_one_can_be_picked():
    cap, tree = tree_after_backward("mlp", passes=2)
    status = bl.report.backward_status(cap)
    assert tree.passes == [1, 2] and tree.executed_flops == status.executed_flops
    second = bl.report.cost_tree(cap, pass_=2)
    assert second.passes == [2]
    assert sum(row.self_backward_flops for row in second.rows) == status.passes[1].executed_flops


def test_no_backward_yet_leaves_backward_columns_none_and_says_why():
    model, args, kwargs = build("mlp")
    cap = bl.capture(model, *args, **kwargs)
    tree = bl.report.cost_tree(cap)
    assert tree.backward_state == "no_backward" and "no backward pass has run" in tree.backward_reason
    assert all(row.self_backward_flops is None and row.subtree_backward_flops is None for row in tree.rows)
    assert all(row.self_forward_backward_flops is None for row in tree.rows)
    assert sum(row.self_forward_mac_flops for row in tree.rows) == tree.forward_flops > 0


@pytest.mark.parametrize(
    ("options", "state", "words"),
    [
        ({"backward": False}, "backward_not_requested", "backward=False"),
        ({"flops": False}, "flops_off", "flops=False"),
    ],
)
def test_a_capture_that_cannot_count_says_why_in_backward_state(options, state, words):
    model, args, kwargs = build("mlp")
    cap = bl.capture(model, *args, **options, **kwargs)
    if options.get("backward", True):
        loss_of(cap.output).backward()
    tree = bl.report.cost_tree(cap)
    assert tree.backward_state == state and words in tree.backward_reason
    assert all(row.self_backward_flops is None for row in tree.rows)


def test_the_tree_exports_to_pandas_and_renders_as_a_rich_table():
    from rich.console import Console

    _cap, tree = tree_after_backward("mlp")
    frame = tree.to_pandas()
    assert list(frame["address"])[-2:] == [NO_FORWARD_OP, UNATTRIBUTED]
    assert frame["self_backward_flops"].sum() == tree.executed_flops
    console = Console(record=True, width=200)
    console.print(tree)
    text = console.export_text()
    assert "cost tree" in text and "net.2" in text and "bwd FLOPs" in text
