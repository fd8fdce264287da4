"""A pass's per-call ATen census (``pass_.aten_ops``), as plain columns for the cost journal.

The backward census already sees every ATen call of a counted pass; this
turns its ``aten`` list into columns: each call's overload name (an index
into ``names``), the position of the node call it ran under (``None``: no
node, or a node with no recorded call in this pass), its FLOPs and the grad
mode it ran in. Columns keep a long pass small in a bundle's manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def aten_columns(aten: list[tuple[Any, Any, int, bool]], call_of: Callable[[Any], int | None]) -> dict[str, list]:
    """``{"names", "op", "call", "flops", "grad_enabled"}`` for the calls in ``aten``.

    ``call_of(node)``: the position of that autograd node's call entry in this pass, or None.
    """
    names: dict[str, int] = {}
    name_of: dict[Any, int] = {}
    op, call, flops, grad_enabled = [], [], [], []
    for func, node, count, enabled in aten:
        index = name_of.get(func)
        if index is None:
            index = name_of[func] = names.setdefault(str(func), len(names))
        op.append(index)
        call.append(call_of(node) if node is not None else None)
        flops.append(count)
        grad_enabled.append(enabled)
    return {"names": list(names), "op": op, "call": call, "flops": flops, "grad_enabled": grad_enabled}
