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


def aten_columns(aten: tuple[list, list, list[int], list[bool]],
                 call_of: Callable[[Any], int | None]) -> dict[str, list]:
    """``{"names", "op", "call", "flops", "grad_enabled"}`` for the census's calls.

    ``aten``: its columns ``(funcs, nodes, flops, grad_enabled)``; ``call_of(node)``:
    the position of that autograd node's call entry in this pass, or None.
    """
    funcs, nodes, flops, grad_enabled = aten
    names: dict[str, int] = {}
    name_of: dict[Any, int] = {}
    op = []
    for func in funcs:
        index = name_of.get(func)
        if index is None:
            index = name_of[func] = names.setdefault(str(func), len(names))
        op.append(index)
    call = [call_of(node) if node is not None else None for node in nodes]
    return {"names": list(names), "op": op, "call": call, "flops": list(flops), "grad_enabled": list(grad_enabled)}
