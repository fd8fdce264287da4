"""``cap.checkpoints``: one record per ``torch.utils.checkpoint`` invocation in the forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backlens.capture.views import entry_field
from backlens.graph.labels import call_label
from backlens.records.base import Record

NOT_WITNESSED = "this capture did not witness checkpoints (it was not recorded by bl.capture's forward)"


@dataclass(frozen=True)
class Recompute:
    """One recomputation of a checkpoint invocation in one pass."""

    pass_number: int
    call: str | None  # the node call that triggered it ("mm_back_1_3:1"); None when unknown
    recompute_flops: int | None  # FLOPs of the recomputed forward kernels (None: not counted)
    duration: float | None  # seconds the recomputation took (None: unknown)


class CheckpointRecord(Record):
    """One checkpoint invocation: what ran inside it, what it packed, and each recomputation."""

    __slots__ = ()
    kind = "checkpoint"
    noun = "checkpoint"
    FIELDS = ("index", "module", "ops", "packed", "reentrant", "recomputed")
    COLUMNS = ("index", "module", "num_ops", "packed", "reentrant", "num_recomputes", "recompute_flops")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        return f"checkpoint_{at + 1}"

    @property
    def _entry(self) -> Any:
        return self._state.checkpoints.entries[self._at]

    @property
    def index(self) -> int:
        return self._at

    packed = entry_field("packed", "Tensors its saved-tensor hook packed (None for a reentrant checkpoint).")
    reentrant = entry_field("reentrant", "Whether it was a reentrant checkpoint (use_reentrant=True).")

    @property
    def module(self) -> str | None:
        """Address of the checkpointed module's call (None for a plain function)."""
        return self._state.journal.call_label(self._entry.module_call)

    @property
    def ops(self) -> list[str]:
        """Labels of the forward ops that ran inside it."""
        ops, entry = self._state.journal.ops, self._entry
        return [ops[i].label for i in range(entry.op_start, entry.op_end)]

    @property
    def recomputed(self) -> list[Recompute]:
        """One entry per pass that recomputed it, in order."""
        state = self._state
        found = []
        for item in self._entry.recomputed:
            if item.call is None and item.call_entry is not None:
                continue  # its pass is still running
            label = None
            if item.call is not None:
                call = state.calls[item.call]
                label = call_label(state.nodes[call.node].label, call.ordinal)
            duration = item.duration_ns / 1e9 if item.duration_ns is not None else None
            found.append(Recompute(item.pass_number, label, item.recompute_flops, duration))
        return found

    def row(self) -> dict[str, Any]:
        recomputed = self.recomputed
        flops = [r.recompute_flops for r in recomputed]
        return {
            "index": self.index,
            "module": self.module,
            "num_ops": len(self.ops),
            "packed": self.packed,
            "reentrant": self.reentrant,
            "num_recomputes": len(recomputed),
            "recompute_flops": None if any(f is None for f in flops) else sum(flops),
        }
