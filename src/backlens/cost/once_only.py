"""Once-only nodes: nodes that free their own saved tensors and cannot run twice.

Some fused-kernel libraries' custom Functions release what they saved at the
end of ``backward`` (``t.data = torch.empty(0)``, ``t.untyped_storage().resize_(0)``,
or dropping a tensor kept on ``ctx``). A second backward over the retained
graph then fails with a misleading shape or storage error, or reads freed
memory. :func:`snapshot` records the shape and storage size of every saved
tensor in a graph before a backward; :func:`changed_since` lists the nodes
whose saved tensors shrank or vanished after it, before any second backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backlens import _torch
from backlens.graph.discovery import walk as walk_graph

Fingerprint = tuple[tuple[int, ...] | None, int | None]


@dataclass(frozen=True)
class OnceOnlyNode:
    """A node that freed its own saved tensors, in model terms."""

    label: str | None
    type: str
    op: str | None
    module: str | None
    detail: str

    def __str__(self) -> str:
        where = ", ".join(
            part for part in (
                f"forward op {self.op}" if self.op else None,
                f"module {self.module!r}" if self.module is not None else None,
            ) if part
        )
        name = self.label or self.type
        return f"{name} ({self.type}{'; ' + where if where else ''}): {self.detail}"


def walk(roots: list[Any]) -> list[Any]:
    """Every node reachable from ``roots`` through ``next_functions``."""
    return walk_graph(roots).found


def _fingerprint(value: Any) -> Fingerprint | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return tuple(value.shape), value.untyped_storage().nbytes()
    except RuntimeError:  # tensors without storage (meta, some subclasses)
        return tuple(value.shape), None


def saved_of(node: Any) -> dict[str, Fingerprint | None]:
    """Fingerprints of what ``node`` keeps for its backward, by where it keeps it."""
    found: dict[str, Fingerprint | None] = {}
    if _torch.is_custom_function_node(node):
        try:
            saved = node.saved_tensors
        except RuntimeError:  # already freed by autograd (no retained graph)
            saved = ()
        for position, tensor in enumerate(saved):
            found[f"saved_tensors[{position}]"] = _fingerprint(tensor)
        for name, value in vars(node).items():  # tensors a Function keeps on ctx directly
            if isinstance(value, torch.Tensor):
                found[f"ctx.{name}"] = _fingerprint(value)
        return found
    for name, value in _torch.saved_tensor_attributes(node).items():
        if isinstance(value, torch.Tensor):
            found[f"saved_{name}"] = _fingerprint(value)
    return found


def snapshot(roots: list[Any]) -> dict[Any, dict[str, Fingerprint | None]]:
    """Saved-tensor fingerprints of every node of the graph under ``roots``."""
    result = {}
    for node in walk(roots):
        saved = saved_of(node)
        if saved:
            result[node] = saved
    return result


def changed_since(before: dict[Any, dict[str, Fingerprint | None]]) -> list[tuple[Any, str]]:
    """``(node, what changed)`` for each node whose saved tensors shrank or vanished."""
    changes = []
    for node, saved in before.items():
        now = saved_of(node)
        diffs = []
        for where, was in saved.items():
            is_ = now.get(where)
            if was is None or is_ == was:
                continue
            if is_ is None:
                diffs.append(f"{where} is gone (was shape {was[0]})")
            elif is_[0] != was[0]:
                diffs.append(f"{where} changed shape {was[0]} -> {is_[0]}")
            elif was[1] is not None and is_[1] is not None and is_[1] < was[1]:
                diffs.append(f"{where} storage shrank {was[1]} -> {is_[1]} bytes")
        if diffs:
            changes.append((node, "; ".join(diffs)))
    return changes


def describe(node: Any, detail: str, grad_fns: Any) -> OnceOnlyNode:
    """Name ``node`` with its capture record (matched by sequence number) when there is one."""
    seq = _torch.node_sequence_nr(node)
    record = None
    if grad_fns is not None and seq is not None:
        record = next((g for g in grad_fns if g.sequence_nr == seq and g.type == type(node).__name__), None)
    return OnceOnlyNode(
        label=record.label if record is not None else None,
        type=type(node).__name__,
        op=record.op.label if record is not None and record.op is not None else None,
        module=record.module if record is not None else None,
        detail=detail,
    )
