"""``bl.load("run/")`` on a directory of rank bundles: a :class:`RankSet`.

Each rank of a distributed run captures on its own and writes its own bundle
(``bl.to_disk("run/rank{rank}")``), whose manifest records its rank and the
world size. A directory holding such bundles (and no manifest of its own)
loads as one :class:`RankSet`: the captures in rank order, a cross-rank cost
table and a check that replicated gradients agree.

Only directories directly inside are looked at, never through a symlink; a
set that misses a rank, repeats one, or mixes world sizes is refused, since a
cross-rank view over part of a run would mislead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backlens.distributed.rank_table import RankCostTable, rank_cost_table
from backlens.errors import BundleError, LabelNotFoundError, UnsupportedInputError
from backlens.io.names import MANIFEST, STREAM_MARKER
from backlens.records.grads import check_pass_number


def rank_bundle_dirs(path: str | os.PathLike) -> list[Path] | None:
    """The bundle directories inside ``path`` when it is a directory of rank bundles
    (no manifest of its own, at least one bundle inside), else None."""
    root = Path(path)
    if not root.is_dir() or root.is_symlink() or (root / MANIFEST).exists() or (root / STREAM_MARKER).exists():
        return None
    found = []
    for child in sorted(root.iterdir()):
        if child.is_symlink() or not child.is_dir():
            continue
        if (child / MANIFEST).is_file() or (child / STREAM_MARKER).exists():
            found.append(child)
    return found or None


class RankSet:
    """One loaded capture per rank of a distributed run, in rank order.

    ``ranks[k]`` is rank k's capture (a read-only capture, as ``bl.load`` gives
    for one bundle); ``cost_tree()`` compares their backward per module;
    ``check_grads()`` checks that gradients the ranks all-reduced agree.
    """

    def __init__(self, path: str | os.PathLike, captures: list[Any]):
        self.path = Path(path)
        self.world_size = _check_ranks(self.path, captures)
        self.ranks: list[Any] = sorted(captures, key=lambda cap: cap.rank)

    @classmethod
    def load(cls, path: str | os.PathLike, load_bundle: Callable[[Path], Any]) -> RankSet:
        """Load every rank bundle in ``path`` with ``load_bundle``."""
        directories = rank_bundle_dirs(path)
        if not directories:
            raise BundleError(f"{path}: holds no rank bundles.", code="bundle_not_a_bundle",
                              remedy="Point bl.load at the directory the ranks' bundles were written into.")
        return cls(path, [load_bundle(directory) for directory in directories])

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.ranks)

    def __getitem__(self, rank: int) -> Any:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise UnsupportedInputError(f"ranks[...]: a rank is an integer, got {rank!r} ({type(rank).__name__}).",
                                        code="bad_argument", remedy=f"Pass a rank from 0 to {len(self.ranks) - 1}.")
        if not -len(self.ranks) <= rank < len(self.ranks):
            raise LabelNotFoundError(f"No rank {rank}: this run had {len(self.ranks)} ranks.",
                                     remedy=f"Pass a rank from 0 to {len(self.ranks) - 1}.")
        return self.ranks[rank]

    def cost_tree(self, pass_: int | None = None) -> RankCostTable:
        """Per module, the backward time on each rank, the slowest rank and the skew (every
        counted pass, or pass ``pass_`` on each rank)."""
        if pass_ is not None:
            check_pass_number(pass_, "ranks.cost_tree(pass_=...)")
        return rank_cost_table(self.ranks, pass_)

    def check_grads(self) -> GradCheck:
        """Whether the gradients that should agree across ranks after the reduce do."""
        return check_grads(self.ranks)

    def __repr__(self) -> str:
        return f"<RankSet {str(self.path)!r}: {self.world_size} ranks>"


def _check_ranks(path: Path, captures: list[Any]) -> int:
    for cap in captures:
        if cap.rank is None or cap.world_size is None:
            raise BundleError(f"{cap.path}: not a rank bundle (captured outside torch.distributed, so it records "
                              "no rank).", code="bundle_not_a_rank",
                              remedy=f"Keep only the ranks' bundles in {path}, or load this one on its own.")
    sizes = sorted({cap.world_size for cap in captures})
    if len(sizes) > 1:
        raise BundleError(f"{path}: its bundles come from runs of different world sizes {sizes}.",
                          code="bundle_ranks_mismatch", remedy="Keep one run's rank bundles per directory.")
    world_size = sizes[0]
    by_rank: dict[int, list[Any]] = {}
    for cap in captures:
        by_rank.setdefault(cap.rank, []).append(cap)
    repeated = dict(list({rank: [str(c.path.name) for c in caps[:3]] for rank, caps in by_rank.items()
                          if len(caps) > 1}.items())[:10])
    if repeated:
        raise BundleError(f"{path}: several bundles claim the same rank ({repeated}).",
                          code="bundle_ranks_mismatch", remedy="Keep one run's rank bundles per directory.")
    if len(by_rank) < world_size:  # ranks are below world_size (the schema's check): some are missing
        missing = [rank for rank in range(min(world_size, len(by_rank) + 10)) if rank not in by_rank][:10]
        more = " and more" if world_size - len(by_rank) > len(missing) else ""
        raise BundleError(f"{path}: holds {len(captures)} of the run's {world_size} ranks; missing rank(s) "
                          f"{missing}{more}.", code="bundle_ranks_missing",
                          remedy="Save every rank's capture (bl.to_disk('run/rank{rank}') on each rank).")
    return world_size


@dataclass
class GradCheck:
    """The answer of ``RankSet.check_grads()``: true when every gradient compared agrees.

    ``compared`` names the parameters whose gradients should agree across ranks
    (those an all-reduce carried: DDP's buckets); ``mismatched`` those that do
    not, with ``max_abs_diff`` (per parameter, across ranks; ``inf`` when a
    rank holds no gradient or another shape). With nothing to compare it is
    false, and ``reason`` says why (never a pass without evidence).
    """

    compared: list[str]
    mismatched: list[str]
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.compared) and not self.mismatched

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame([{"param": name, "agree": name not in self.mismatched,
                              "max_abs_diff": self.max_abs_diff.get(name, 0.0)} for name in self.compared],
                            columns=["param", "agree", "max_abs_diff"])

    def __repr__(self) -> str:
        if not self.compared:
            return f"<GradCheck: nothing compared ({self.reason})>"
        if not self.mismatched:
            return f"<GradCheck: the {len(self.compared)} all-reduced gradients agree on every rank>"
        return f"<GradCheck: {len(self.mismatched)} of {len(self.compared)} disagree: {', '.join(self.mismatched)}>"


def check_grads(captures: list[Any]) -> GradCheck:
    """Compare, across ``captures`` (one per rank), the gradients of the parameters an
    all-reduce carried on any rank: after it, every rank holds the same bits."""
    import torch

    replicated: dict[str, None] = {}
    for cap in captures:
        for collective in cap.collectives:
            if collective.kind == "all_reduce":
                replicated.update(dict.fromkeys(collective.params))
    if not replicated:
        kinds = sorted({c.kind for cap in captures for c in cap.collectives})
        why = (f"no all-reduce was recorded (collectives seen: {', '.join(kinds)}; FSDP shards gradients, so "
               "each rank holds a different shard)" if kinds else "no collective was recorded in these bundles")
        return GradCheck([], [], reason=why)
    compared, mismatched, diffs = [], [], {}
    for name in replicated:
        grads = [cap.params[name].grad if name in cap.params else None for cap in captures]
        if all(g is None for g in grads):
            continue
        compared.append(name)
        first = grads[0]
        differs, worst = False, 0.0
        for other in grads[1:]:
            if first is None or other is None or other.shape != first.shape or other.dtype != first.dtype:
                differs, worst = True, float("inf")
            elif not torch.equal(first, other):
                differs = True
                worst = max(worst, float((first.double() - other.double()).abs().nan_to_num(float("inf")).max()))
        if differs:
            mismatched.append(name)
            diffs[name] = worst
    reason = None if compared else "the all-reduced parameters have no gradient saved on any rank"
    return GradCheck(compared, mismatched, diffs, reason)
