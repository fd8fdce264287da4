"""The backward ATen census: every ATen call of one explicit backward run.

A :class:`BackwardCensus` is a counting dispatch mode entered around one engine
run (through the backward recorder's ``run_context``), never outside it. For
each ATen call it reads the node the engine is executing; calls carrying FLOPs
are journalled with that node, calls under no node (the seed gradient) are
journalled by name whatever their FLOPs. Nothing is mapped to records here:
that happens once, when the pass closes (:mod:`backlens.cost.settle`).

Hot path: one dict lookup for the plan and one call reading the node per ATen
call; formulas run only for matmul, convolution and attention.
"""

from __future__ import annotations

from typing import Any

import torch

from backlens import _torch
from backlens._clock import now as _now
from backlens.cost.checkpoint import recompute_probe
from backlens.cost.counting import CountingMode
from backlens.cost.formulas import op_name

_grad_enabled = torch.is_grad_enabled


class BackwardCensus(CountingMode):
    """Journal of one backward run's ATen calls.

    ``charged``: ``(node, func, flops, recomputed)`` per call with FLOPs under a
    node (``recomputed`` is None when the pass cannot tell). ``unattributed``:
    ``(func, flops)`` per call under no node. ``formula_errors``: formulas that
    raised (their calls are not counted, so the pass is not either).
    ``aten``: every call in dispatch order (the pass's ``aten_ops``), as six
    columns ``(funcs, nodes, flops, grad_enabled, starts, ends)`` (times on
    backlens._clock): appending to lists makes no new objects for the garbage
    collector to track, as a tuple per call would.
    """

    def __init__(self, create_graph: bool):
        super().__init__()
        self.aten_calls = 0
        self.charged: list[tuple[Any, Any, int, bool | None]] = []
        self.unattributed: list[tuple[Any, int]] = []
        self.formula_errors: list[str] = []
        self.aten: tuple[list, list, list[int], list[bool], list[int], list[int]] = ([], [], [], [], [], [])
        self._funcs, self._nodes, self._flops, self._grad, self._starts, self._ends = self.aten
        self._current_node = _torch.current_autograd_node_function()
        self._recomputing = recompute_probe(create_graph)
        self.recompute_known = self._recomputing is not None
        self.closed = False  # its pass closed: it must no longer be on torch's mode stack

    def seen(self, func: Any, counter: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        ended = _now()
        self.aten_calls += 1
        node = self._current_node()
        if counter is None:
            self._starts.append(self.began)
            self._ends.append(ended)
            self._funcs.append(func)
            self._nodes.append(node)
            self._flops.append(0)
            self._grad.append(_grad_enabled())
            if node is None:
                self.unattributed.append((func, 0))
            return
        try:
            flops = counter(args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - a formula bug must not break the user's backward
            self.formula_errors.append(f"{op_name(func)}: {type(exc).__name__}: {exc}")
            return
        self._starts.append(self.began)
        self._ends.append(ended)
        self._funcs.append(func)
        self._nodes.append(node)
        self._flops.append(flops)
        self._grad.append(_grad_enabled())
        if node is None:
            self.unattributed.append((func, flops))
        elif flops:
            probe = self._recomputing
            self.charged.append((node, func, flops, probe() if probe is not None else None))
