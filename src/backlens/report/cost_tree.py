"""The cost tree: forward and backward FLOPs and backward time per module call.

``bl.report.cost_tree(cap)`` has one :class:`CostRow` per module call, in call
order (a parent before its children), plus two rows that make the backward
column add up: backward work of nodes with no forward op (the loss, built
after the forward) and unattributed work (ATen calls under no node of the
captured graph; the forward FLOPs of an op outside every module call land
there too). Under ``torch.distributed``, one more row per collective kind
(``"(all_reduce)"``, ``"(all_gather)"``, ``"(reduce_scatter)"``, kind
``"collective"``): how many the covered passes issued and the time from each
one's issue to its completion; collectives run no autograd kernel, so their
backward FLOPs are 0, and the time a rank waited for them is theirs, not a
module's.

A node call's FLOPs and time go to the module call its node belongs to: its
forward op's, or for AccumulateGrad its parameter's module (its first call, or
its nearest called ancestor's first call for a module never called itself).
Rows are named by call label (``lin``; ``lin:1`` and ``lin:2`` when ``lin`` ran
twice).
``self_*`` columns count a module call's own ops; ``subtree_*`` add its
descendants. Summing ``self_backward_flops`` over all rows gives the executed
backward FLOPs of the passes the tree covers. Backward columns are ``None``
when no counted pass is covered; ``backward_state`` and ``backward_reason``
say why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backlens import _args
from backlens._pandas import data_frame
from backlens.cost.journal import CostJournal
from backlens.errors import AmbiguousLabelError, LabelNotFoundError
from backlens.graph.labels import NO_FORWARD_OP, split_call
from backlens.records.grads import check_pass_number
from backlens.report.backward_status import backward_status
from backlens.report.display import flops_text, seconds_text

UNATTRIBUTED = "(unattributed)"


@dataclass
class CostRow:
    """One module call (or one of the two catch-all rows) of the cost tree."""

    address: str
    kind: str  # "module" | "no_forward_op" | "unattributed" | "collective"
    module_type: str | None
    parent: str | None
    depth: int
    self_forward_mac_flops: int | None
    self_backward_flops: int | None
    self_recompute_flops: int | None
    self_backward_time: float | None
    backward_calls: int
    subtree_forward_mac_flops: int | None = None
    subtree_backward_flops: int | None = None
    subtree_recompute_flops: int | None = None
    subtree_backward_time: float | None = None

    @property
    def self_forward_backward_flops(self) -> int | None:
        return _add(self.self_forward_mac_flops, self.self_backward_flops)

    @property
    def subtree_forward_backward_flops(self) -> int | None:
        return _add(self.subtree_forward_mac_flops, self.subtree_backward_flops)

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in TREE_COLUMNS}


TREE_COLUMNS = [
    "address", "kind", "module_type", "parent", "depth",
    "self_forward_mac_flops", "self_backward_flops", "self_recompute_flops", "self_forward_backward_flops",
    "subtree_forward_mac_flops", "subtree_backward_flops", "subtree_recompute_flops",
    "subtree_forward_backward_flops", "self_backward_time", "subtree_backward_time", "backward_calls",
]


@dataclass
class CostTree:
    """Per-module-call cost of one capture (see the module docstring)."""

    rows: list[CostRow]
    passes: list[int]
    backward_state: str
    backward_reason: str | None
    executed_flops: int | None
    forward_flops: int | None
    _by_address: dict[str, CostRow] = field(default_factory=dict, repr=False)

    def __getitem__(self, address: str) -> CostRow:
        """The row of one module call, by its label (``"lin"``, ``"lin:2"``; ``"lin:1"``
        also when ``lin`` ran once). A module that ran several times has one row per call:
        its address alone raises ``AmbiguousLabelError`` naming them."""
        found = self._by_address.get(address)
        if found is not None:
            return found
        calls = [row.address for row in self.rows if row.kind == "module"
                 and split_call(row.address) == (address, split_call(row.address)[1])
                 and split_call(row.address)[1] is not None]
        if len(calls) > 1:
            raise AmbiguousLabelError(
                f"Module {address!r} ran {len(calls)} times: the cost tree has one row per call "
                f"({', '.join(calls)}).",
                remedy=f"Name one call: {calls[0]!r} ... {calls[-1]!r}.",
            )
        name, number = split_call(address)
        if number == 1 and name in self._by_address:
            return self._by_address[name]
        raise LabelNotFoundError(f"No row {address!r} in the cost tree.",
                                 remedy="Use a module call label from tree.rows.")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_pandas(self):
        return data_frame([r.row() for r in self.rows], TREE_COLUMNS)

    def __rich__(self):
        from rich.table import Table

        title = "cost tree"
        if self.backward_state == "counted":
            title += f": backward passes {self.passes}, {flops_text(self.executed_flops)} FLOPs executed"
        else:
            title += f" (backward: {self.backward_reason})"
        table = Table(title=title)
        for name in ("module call", "type", "fwd FLOPs", "bwd FLOPs", "recompute", "fwd+bwd",
                     "subtree fwd+bwd", "bwd time", "subtree bwd time"):
            table.add_column(name, justify="left" if name in ("module call", "type") else "right")
        for row in self.rows:
            table.add_row(
                "  " * row.depth + (row.address or "(model)"), row.module_type or "",
                flops_text(row.self_forward_mac_flops), flops_text(row.self_backward_flops),
                flops_text(row.self_recompute_flops), flops_text(row.self_forward_backward_flops),
                flops_text(row.subtree_forward_backward_flops), seconds_text(row.self_backward_time),
                seconds_text(row.subtree_backward_time),
            )
        return table


def cost_tree(cap: Any, pass_: int | None = None) -> CostTree:
    """Build the cost tree of ``cap`` over every counted pass, or pass ``pass_`` only."""
    _args.capture(cap, "bl.report.cost_tree(cap)")
    if pass_ is not None:
        check_pass_number(pass_, "bl.report.cost_tree(pass_=...)")
    journal: CostJournal = cap._state.cost or CostJournal()
    status = backward_status(cap)
    counted = [p.number for p in status.passes if p.counted]
    state, reason = "counted", None
    if pass_ is not None:
        chosen = next((p for p in status.passes if p.number == pass_), None)
        if chosen is None:
            raise LabelNotFoundError(f"No backward pass number {pass_}.",
                                     remedy="Pass numbers are 1-based; see cap.passes.")
        counted = [pass_] if chosen.counted else []
        if not chosen.counted:
            state, reason = "not_counted", f"pass {pass_}: {chosen.reason}"
    elif not counted:
        state, reason = status.state, status.reason
    # Times come from the fire timings of the counted passes; without any, of every finished one.
    timed = set(counted) or ({pass_} if pass_ is not None else
                             {p.number for p in status.passes if p.status == "ok"})
    flops_on = bool(counted)

    rows: list[CostRow] = []
    by_address: dict[str, CostRow] = {}
    depth_of: dict[str, int] = {}
    for call in cap.modules:
        depth = depth_of[call.parent] + 1 if call.parent is not None and call.parent in depth_of else 0
        depth_of[call.label] = depth
        row = CostRow(call.label, "module", call.module_type, call.parent, depth,
                      0 if journal.forward is not None else None,
                      0 if flops_on else None, 0 if flops_on else None, None, 0)
        rows.append(row)
        by_address[call.label] = row
    no_op = CostRow(NO_FORWARD_OP, "no_forward_op", None, None, 0, 0 if journal.forward is not None else None,
                    0 if flops_on else None, 0 if flops_on else None, None, 0)
    unattributed = CostRow(UNATTRIBUTED, "unattributed", None, None, 0, 0 if journal.forward is not None else None,
                           0 if flops_on else None, None, None, 0)

    for op in cap.ops:
        target = by_address.get(op.module) if op.module is not None else None
        target = target or unattributed
        if target.self_forward_mac_flops is not None:
            target.self_forward_mac_flops = _add(target.self_forward_mac_flops, op.forward_flops)

    recompute_known = True
    for call in cap.grad_fn_calls:
        if call.pass_number not in timed:
            continue
        # A node belongs to its forward op's module call; AccumulateGrad to its
        # parameter's module (shown under its first call, or under its nearest
        # called ancestor's when it was never called); the loss to none.
        module = call.grad_fn.module_call
        target = by_address.get(module) if module is not None else None
        target = target or no_op
        target.backward_calls += 1
        if call.duration is not None:
            target.self_backward_time = (target.self_backward_time or 0.0) + call.duration
        if flops_on and call.pass_number in counted:
            target.self_backward_flops = _add(target.self_backward_flops, call.flops)
            if call.recompute_flops is None:
                recompute_known = False
            elif target.self_recompute_flops is not None:
                target.self_recompute_flops += call.recompute_flops
    if flops_on:
        unattributed.self_backward_flops = sum(journal.pass_cost(n)["unattributed_flops"] for n in counted)
    collective_rows = _collective_rows(cap, timed, forward_known=journal.forward is not None, flops_on=flops_on)
    for row in (*rows, no_op, unattributed):
        if not recompute_known:
            row.self_recompute_flops = None
        row.subtree_forward_mac_flops = row.self_forward_mac_flops
        row.subtree_backward_flops = row.self_backward_flops
        row.subtree_recompute_flops = row.self_recompute_flops
        row.subtree_backward_time = row.self_backward_time
    for row in reversed(rows):  # children come after their parent: fold upwards
        parent = by_address.get(row.parent) if row.parent is not None else None
        if parent is None:
            continue
        parent.subtree_forward_mac_flops = _add(parent.subtree_forward_mac_flops, row.subtree_forward_mac_flops)
        parent.subtree_backward_flops = _add(parent.subtree_backward_flops, row.subtree_backward_flops)
        parent.subtree_recompute_flops = _add(parent.subtree_recompute_flops, row.subtree_recompute_flops)
        if row.subtree_backward_time is not None:
            parent.subtree_backward_time = (parent.subtree_backward_time or 0.0) + row.subtree_backward_time
    rows += [no_op, unattributed, *collective_rows]
    by_address[NO_FORWARD_OP] = no_op
    by_address[UNATTRIBUTED] = unattributed
    by_address.update((row.address, row) for row in collective_rows)
    executed = sum(journal.pass_cost(n)["executed_flops"] for n in counted) if flops_on else None
    return CostTree(rows=rows, passes=sorted(counted), backward_state=state, backward_reason=reason,
                    executed_flops=executed, forward_flops=journal.forward_flops, _by_address=by_address)


def collective_row_name(kind: str) -> str:
    """The cost tree's row for collectives of ``kind`` (``"(all_reduce)"``)."""
    return f"({kind})"


def _collective_rows(cap: Any, timed: set[int], *, forward_known: bool, flops_on: bool) -> list[CostRow]:
    """One row per collective kind the capture saw (in any pass, so every pass's tree has the
    same rows), over the collectives of the covered passes."""
    rows: dict[str, CostRow] = {}
    for collective in cap.collectives:
        row = rows.get(collective.kind)
        if row is None:
            row = rows[collective.kind] = CostRow(
                collective_row_name(collective.kind), "collective", None, None, 0, 0 if forward_known else None,
                0 if flops_on else None, 0 if flops_on else None, None, 0)
        if collective.pass_number not in timed:
            continue
        row.backward_calls += 1
        if collective.duration is not None:
            row.self_backward_time = (row.self_backward_time or 0.0) + collective.duration
    for row in rows.values():
        row.subtree_forward_mac_flops = row.self_forward_mac_flops
        row.subtree_backward_flops = row.self_backward_flops
        row.subtree_recompute_flops = row.self_recompute_flops
        row.subtree_backward_time = row.self_backward_time
    return list(rows.values())


def _add(a: int | float | None, b: int | float | None) -> int | float | None:
    """Sum where both are known; unknown (None) otherwise."""
    return None if a is None or b is None else a + b

