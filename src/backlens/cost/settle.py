"""Closing one pass's count: FLOPs onto its call entries, the rest into a pass dict.

Called once per pass, when it closes. Every counted FLOP lands either on the
pass's call of the node that ran it or in the unattributed bucket (calls under
no node, under a node outside this capture's graph, or under a node that made
no recorded call), so rows plus unattributed equal the executed count by
construction. A pass without a count (implicit run, refused or raising pass,
formula failure) leaves every call's FLOPs ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backlens import _torch
from backlens.cost.aten_ops import aten_columns
from backlens.cost.census import BackwardCensus
from backlens.cost.formulas import op_name


def uncounted(number: int, reason: str) -> dict[str, Any]:
    """The pass dict of a pass with no count."""
    return {
        "pass": number, "counted": False, "reason": reason, "executed_flops": None,
        "unattributed_flops": None, "unattributed_ops": [], "recompute_known": False,
        "recompute_flops": None, "attributed": False, "aten_calls": None, "aten_ops": None,
    }


def no_count_reason(census: BackwardCensus | None, trigger: str, explicit: bool,
                    error: BaseException | None) -> str | None:
    """Why a pass has no count, or None when it has one."""
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"the pass raised {type(error).__name__}" + (f" ({first})" if first else "") + \
            "; a partial count is not reported"
    if census is None:
        if not explicit:
            return ("implicit pass: the engine ran without going through loss.backward(), "
                    "torch.autograd.backward/grad or cap.backward(), so no counter was active")
        return f"no counter was active during this {trigger} pass"
    if census.formula_errors:
        return "a FLOP formula failed: " + "; ".join(census.formula_errors[:3])
    return None


def settle(census: BackwardCensus, number: int, calls: list[Any], state: Any, *,
           elsewhere: Callable[[Any], bool] | None = None, holder: bool = True) -> dict[str, Any]:
    """Write each call entry's ``flops``/``recompute_flops`` and return the pass dict.

    ``calls`` are the pass's call entries of ``state`` (a CaptureState); a node
    fires at most once per engine run, so node index -> call is one-to-one.
    When the run took part in several captures, FLOPs under a node another one
    recorded (``elsewhere(node)``) are that capture's, and the calls under no
    capture's node are counted by the census's ``holder`` alone.
    """
    index_of = state.table.index_of
    attributed = _torch.HAS_CURRENT_AUTOGRAD_NODE
    known = census.recompute_known
    call_of_node: dict[int, Any] = {}
    for entry in calls:
        call_of_node.setdefault(entry.node, entry)
        entry.flops = 0 if attributed else None
        entry.recompute_flops = 0 if known and attributed else None
    buckets: dict[tuple[str, str | None], list[int]] = {}

    def bucket(func: Any, under: str | None, flops: int) -> None:
        slot = buckets.setdefault((op_name(func), under), [0, 0])
        slot[0] += 1
        slot[1] += flops

    executed = 0
    recompute = 0
    for node, func, flops, recomputed in census.charged:
        index = index_of.get(node)
        entry = call_of_node.get(index) if index is not None else None
        if entry is None and (not holder or (elsewhere is not None and elsewhere(node))):
            continue  # another capture's node (or share) of the run
        executed += flops
        if entry is None:
            if index is None:
                under = f"{type(node).__name__} (a node outside this capture's graph)"
            else:
                under = f"{state.nodes[index].label} (a node with no recorded call in this pass)"
            bucket(func, under, flops)
            continue
        entry.flops += flops
        if recomputed:
            recompute += flops
            if entry.recompute_flops is not None:
                entry.recompute_flops += flops
    for func, flops in census.unattributed if holder else ():
        executed += flops
        bucket(func, None, flops)
    unattributed_ops = [
        {"op": name, "under": under, "calls": n, "flops": flops}
        for (name, under), (n, flops) in buckets.items()
    ]
    position_of = {entry.node: position for entry, position in zip(calls, state.passes[number - 1].calls)}

    def call_of(node: Any) -> int | None:
        index = index_of.get(node)
        return position_of.get(index) if index is not None else None

    def mine(node: Any) -> bool:
        if node is None:
            return holder
        return call_of(node) is not None or (holder and not (elsewhere is not None and elsewhere(node)))

    aten_ops = aten_columns(census.aten, call_of, mine)

    return {
        "pass": number,
        "counted": True,
        "reason": None,
        "executed_flops": executed,
        "unattributed_flops": sum(op["flops"] for op in unattributed_ops),
        "unattributed_ops": unattributed_ops,
        "recompute_known": known,
        "recompute_flops": recompute if known else None,
        "attributed": attributed,
        "aten_calls": len(aten_ops["op"]),
        "aten_ops": aten_ops,
    }
