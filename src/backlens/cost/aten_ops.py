"""A pass's per-call ATen census (``pass_.aten_ops``), as plain columns for the cost journal.

The backward census already sees every ATen call of a counted pass; this
turns its ``aten`` list into columns: each call's overload name (an index
into ``names``), the position of the node call it ran under (``None``: no
node, or a node with no recorded call in this pass), its FLOPs, the grad
mode it ran in, and when it started and ended (backlens._clock nanoseconds). Columns keep a long pass small in a bundle's manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def aten_columns(aten: tuple[list, list, list[int], list[bool], list[int], list[int]],
                 call_of: Callable[[Any], int | None],
                 mine: Callable[[Any], bool] | None = None) -> dict[str, list]:
    """``{"names", "op", "call", "flops", "grad_enabled", "start_ns", "end_ns"}`` for the census's calls.

    ``aten``: its columns ``(funcs, nodes, flops, grad_enabled, starts, ends)``; ``call_of(node)``:
    the position of that autograd node's call entry in this pass, or None;
    ``mine(node)``: whether a call under that node (None: under no node) is this
    capture's share of a run several captures took part in (all when None).
    """
    funcs, nodes, flops, grad_enabled, starts, ends = aten
    kept = range(len(funcs)) if mine is None else [i for i, node in enumerate(nodes) if mine(node)]
    names: dict[str, int] = {}
    name_of: dict[Any, int] = {}
    op = []
    for i in kept:
        func = funcs[i]
        index = name_of.get(func)
        if index is None:
            index = name_of[func] = names.setdefault(str(func), len(names))
        op.append(index)
    call = [call_of(nodes[i]) if nodes[i] is not None else None for i in kept]
    return {"names": list(names), "op": op, "call": call, "flops": [flops[i] for i in kept],
            "grad_enabled": [grad_enabled[i] for i in kept], "start_ns": [starts[i] for i in kept],
            "end_ns": [ends[i] for i in kept]}
