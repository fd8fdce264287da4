"""``rankset.cost_tree()``: the backward of every rank, side by side, per module.

One :class:`RankRow` per module address (its calls together), in module
order, plus the rows of each rank's cost tree that are not modules (backward
work with no forward op, unattributed work, one row per collective kind).
A module's time on a rank is the time of its own nodes' fires
(``self_backward_time`` of the cost tree: children not included, so a slow
module shows in its own row, not in its ancestors'); a collective kind's is
the time from each collective's issue to its completion. ``slowest_rank`` is
the rank with the greatest time, ``skew`` the slowest minus the fastest.

The time a rank waits for another is charged to the collective it waits in,
never to a module (capture/collectives.py), so a slow module shows on the
slow rank, and the waiting on the others shows in their collective rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backlens.errors import LabelNotFoundError
from backlens.report.cost_tree import cost_tree
from backlens.report.display import seconds_text


@dataclass
class RankRow:
    """One module (or catch-all, or collective kind) across ranks: ``times[k]`` is its
    backward time on rank k in seconds (None where rank k recorded none)."""

    address: str
    kind: str  # "module" | "no_forward_op" | "unattributed" | "collective"
    times: list[float | None]

    @property
    def slowest_rank(self) -> int | None:
        """The rank with the greatest time (None unless every rank has one)."""
        if any(t is None for t in self.times) or not self.times:
            return None
        return max(range(len(self.times)), key=lambda rank: self.times[rank])

    @property
    def fastest_rank(self) -> int | None:
        if any(t is None for t in self.times) or not self.times:
            return None
        return min(range(len(self.times)), key=lambda rank: self.times[rank])

    @property
    def skew(self) -> float | None:
        """Seconds: the slowest rank's time minus the fastest's (None unless every rank has one)."""
        slowest, fastest = self.slowest_rank, self.fastest_rank
        if slowest is None or fastest is None:
            return None
        return self.times[slowest] - self.times[fastest]

    def row(self) -> dict[str, Any]:
        return {"address": self.address, "kind": self.kind,
                **{f"rank{rank}": time for rank, time in enumerate(self.times)},
                "slowest_rank": self.slowest_rank, "skew": self.skew}


@dataclass
class RankCostTable:
    """The cross-rank table (see the module docstring)."""

    rows: list[RankRow]
    world_size: int
    passes: list[list[int]]  # per rank: the passes its times cover

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, address: str) -> RankRow:
        for row in self.rows:
            if row.address == address:
                return row
        raise LabelNotFoundError(f"No row {address!r} in the cross-rank table.",
                                 remedy="Use an address from [row.address for row in table.rows].")

    @property
    def slowest_module(self) -> RankRow | None:
        """The module row with the greatest skew (None when no module has a time on every rank)."""
        modules = [row for row in self.rows if row.kind == "module" and row.skew is not None]
        return max(modules, key=lambda row: row.skew, default=None)

    def to_pandas(self):
        import pandas as pd

        columns = ["address", "kind", *(f"rank{rank}" for rank in range(self.world_size)), "slowest_rank", "skew"]
        return pd.DataFrame([row.row() for row in self.rows], columns=columns)

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"backward time per module on each of {self.world_size} ranks")
        table.add_column("module")
        for rank in range(self.world_size):
            table.add_column(f"rank {rank}", justify="right")
        table.add_column("slowest rank", justify="right")
        table.add_column("skew", justify="right")
        for row in self.rows:
            if all(time is None for time in row.times):
                continue
            slowest = row.slowest_rank
            table.add_row(row.address or "(model)", *(seconds_text(time) for time in row.times),
                          "" if slowest is None else str(slowest), seconds_text(row.skew))
        worst = self.slowest_module
        if worst is None:
            return table
        line = Text(f"Greatest skew: module {worst.address or '(model)'!r} is slowest on rank {worst.slowest_rank} "
                    f"(+{seconds_text(worst.skew)} over rank {worst.fastest_rank}).")
        return Group(table, line)


def rank_cost_table(captures: list[Any], pass_: int | None = None) -> RankCostTable:
    """The cross-rank table of ``captures`` (one per rank, in rank order)."""
    world_size = len(captures)
    order: dict[str, str] = {}  # address -> kind, in order of first appearance
    times: dict[str, list[float | None]] = {}
    covered = []
    for rank, cap in enumerate(captures):
        tree = cost_tree(cap, pass_=pass_)
        covered.append(list(tree.passes))
        for row in tree.rows:
            order.setdefault(row.address, row.kind)
            per_rank = times.setdefault(row.address, [None] * world_size)
            if row.self_backward_time is not None:
                per_rank[rank] = (per_rank[rank] or 0.0) + row.self_backward_time
    rows = [RankRow(address, kind, times[address]) for address, kind in order.items()]
    return RankCostTable(rows, world_size, covered)
