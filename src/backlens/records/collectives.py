"""Records of the collectives a backward issued (``pass_.collectives``, ``cap.collectives``)."""

from __future__ import annotations

from typing import Any

from backlens.capture.views import entry_field
from backlens.records.base import Record, RecordList


class CollectiveRecord(Record):
    """One collective issued during a backward pass (a DDP bucket's all-reduce, an FSDP
    unit's all-gather or reduce-scatter)."""

    __slots__ = ()
    kind = "collective"
    noun = "collective"
    FIELDS = ("kind", "bytes", "start", "duration", "params", "modules", "pass_number", "label")
    COLUMNS = ("label", "kind", "pass_number", "bytes", "start", "duration", "num_params", "params", "modules")

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        entry = state.collectives[at]
        ordinal = sum(1 for e in state.collectives[:at] if e.kind == entry.kind and e.pass_number == entry.pass_number)
        return f"{entry.kind}_{ordinal + 1}:{entry.pass_number}"

    @property
    def _entry(self) -> Any:
        return self._state.collectives[self._at]

    bytes = entry_field("bytes", "Bytes of the buffer it reduces or gathers (a bucket, an unsharded group).")
    params = entry_field("params", "Names of the parameters whose gradients or values it carries.")
    modules = entry_field("modules", "Addresses of the modules owning those parameters.")
    pass_number = entry_field("pass_number", "The 1-based number of the pass it ran in.")

    @property
    def label(self) -> str:
        """``{kind}_{k}:{pass}``: the k-th collective of that kind in that pass."""
        return self.key_of(self._state, self._at)

    @property
    def start(self) -> float:
        """Seconds from its pass's start to when it was issued."""
        entry = self._entry
        return (entry.start_ns - self._state.passes[entry.pass_number - 1].start_ns) / 1e9

    @property
    def duration(self) -> float | None:
        """Seconds from when it was issued until its work completed (None: not seen complete)."""
        entry = self._entry
        return (entry.end_ns - entry.start_ns) / 1e9 if entry.end_ns is not None else None

    def row(self) -> dict[str, Any]:
        entry = self._entry
        return {
            "label": self.label,
            "kind": entry.kind,
            "pass_number": entry.pass_number,
            "bytes": entry.bytes,
            "start": self.start,
            "duration": self.duration,
            "num_params": len(entry.params),
            "params": list(entry.params),
            "modules": list(entry.modules),
        }


# The record registry reads a record type's ``kind`` when the class is made; a collective's
# own ``kind`` (what API.md names) then takes its place.
CollectiveRecord.kind = entry_field("kind", "``all_reduce``, ``all_gather`` or ``reduce_scatter``.")


class CollectiveList(RecordList[CollectiveRecord]):
    """Collectives, by position or label (``"all_reduce_1:1"``)."""

    def __init__(self, state: Any, positions: Any):
        super().__init__(state, CollectiveRecord, positions)
