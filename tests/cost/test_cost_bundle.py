"""Cost data survives a bundle: a loaded capture's reports read as the live one's."""

from __future__ import annotations

import torch
from cost_refs import CheckpointedNet

import backlens as bl


def load(path):
    loader = getattr(bl, "load", None)
    if loader is None:
        from backlens.io.bundle import load as loader
    return loader(path)


def rows(status):
    return [(r.call_label, r.op_label, r.module, r.flops, r.recompute_flops)
            for attr in status.flops_attributions for r in attr.rows]


def test_a_loaded_capture_reads_the_same_status_and_cost_tree(tmp_path):
    torch.manual_seed(0)
    cap = bl.capture(CheckpointedNet(), torch.randn(4, 8))
    loss = cap.output.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    cap.save(tmp_path / "bundle")
    loaded = load(tmp_path / "bundle")
    live, back = bl.report.backward_status(cap), bl.report.backward_status(loaded)
    assert back.executed_flops == live.executed_flops and back.forward_flops == live.forward_flops
    assert rows(back) == rows(live) and rows(live)
    assert [p.recompute_flops for p in back.passes] == [p.recompute_flops for p in live.passes]
    flops_columns = ["address", "self_forward_mac_flops", "self_backward_flops", "subtree_recompute_flops"]
    assert bl.report.cost_tree(loaded).to_pandas()[flops_columns].equals(
        bl.report.cost_tree(cap).to_pandas()[flops_columns])
