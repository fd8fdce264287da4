"""What a capture knows about activation checkpointing in its forward, as plain entries.

One :class:`CheckpointEntry` per ``torch.utils.checkpoint`` invocation the
forward ran (``cap.checkpoints``), each with one :class:`RecomputeEntry` per
pass that recomputed it; a :class:`CheckpointJournal` holds them with the
reasons the evidence is incomplete. The verdict is ``"unknown"`` whenever
there is a reason, so "none observed" is only said with complete evidence.
Filled by :mod:`backlens.cost.checkpoint_witness` (live) or a bundle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RecomputeEntry:
    """One recomputation of one checkpoint invocation, in one pass."""

    pass_number: int
    call: int | None  # position of the node call that triggered it in the state's calls
    recompute_flops: int | None  # None: not counted (or no evidence)
    duration_ns: int | None
    call_entry: Any = None  # live only: the fire until the pass closes and ``call`` is known


@dataclass(eq=False)
class CheckpointEntry:
    """One checkpoint invocation in the forward (ops ``op_start`` .. ``op_end - 1`` ran inside it)."""

    module_call: int | None  # the checkpointed module's call; None for a plain function
    op_start: int
    op_end: int
    packed: int | None  # tensors its saved-tensor hook packed; None for a reentrant checkpoint
    reentrant: bool
    recomputed: list[RecomputeEntry] = field(default_factory=list)
    sequence_nr: int | None = None  # live only: a reentrant checkpoint's node
    # live only, until the forward ends: (the module call open around it, the first call inside it)
    calls: tuple[int | None, int] | None = None


VERDICTS = ("observed", "none_observed", "unknown")


class CheckpointJournal:
    """Every checkpoint invocation of one forward and why the evidence may be incomplete."""

    def __init__(self, entries: list[CheckpointEntry] | None = None, reasons: list[str] | None = None):
        self.entries: list[CheckpointEntry] = entries if entries is not None else []
        self.reasons: list[str] = reasons if reasons is not None else []

    def add_reason(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    @property
    def verdict(self) -> str:
        if self.reasons:
            return "unknown"
        return "observed" if self.entries else "none_observed"
