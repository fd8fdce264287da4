"""Every record of one capture state, as the lists API.md names.

:class:`CaptureRecords` is what a live capture and a loaded bundle share: both
are a ``CaptureRecords`` over a :class:`~backlens.capture.state.CaptureState`,
so they read exactly alike.
"""

from __future__ import annotations

from typing import Any

from backlens.errors import UnsupportedInputError
from backlens.graph.labels import label_not_found
from backlens.records.backward import BackwardPass, CallList, GradFn, PassList
from backlens.records.base import RecordList
from backlens.records.checkpoints import NOT_WITNESSED, CheckpointRecord
from backlens.records.collectives import CollectiveList
from backlens.records.forward import InputRecord, ModuleCallList, OpRecord, ParamRecord
from backlens.records.memory import MemoryTable


class CaptureRecords:
    """The record lists of ``self._state``."""

    _state: Any

    @property
    def ops(self) -> RecordList[OpRecord]:
        """Forward ops, by position or label (``cap.ops["linear_2"]``)."""
        return RecordList(self._state, OpRecord, range(len(self._state.journal.ops)))

    @property
    def modules(self) -> ModuleCallList:
        """Module calls, by position or address (``"encoder.layer.0"``, ``"encoder.layer.0:2"``)."""
        return ModuleCallList(self._state, range(len(self._state.journal.module_calls)))

    @property
    def params(self) -> RecordList[ParamRecord]:
        return RecordList(self._state, ParamRecord, range(len(self._state.params)))

    @property
    def inputs(self) -> RecordList[InputRecord]:
        return RecordList(self._state, InputRecord, range(len(self._state.inputs)))

    @property
    def grad_fns(self) -> RecordList[GradFn]:
        """One record per distinct autograd node of the captured graph."""
        self._state.sync()
        return RecordList(self._state, GradFn, range(len(self._state.table)))

    @property
    def grad_fn_calls(self) -> CallList:
        """Every fire of every node, by position or ``"label:k"``."""
        self._state.sync()
        return CallList(self._state, range(len(self._state.calls)))

    @property
    def passes(self) -> PassList:
        self._state.sync()
        return PassList(self._state, range(len(self._state.passes)))

    @property
    def collectives(self) -> CollectiveList:
        """Every collective issued in a backward pass of this capture (``pass_.collectives``
        holds one pass's)."""
        self._state.sync()
        return CollectiveList(self._state, range(len(self._state.collectives)))

    @property
    def memory(self) -> MemoryTable | None:
        """What the forward saved for the backward, per op and per module call (a
        ``memory=True`` capture; None otherwise). ``pass_.memory`` has each pass's live set."""
        if self._state.memory is None:
            return None
        self._state.sync()
        return MemoryTable(self._state)

    @property
    def rank(self) -> int | None:
        """This process's rank under ``torch.distributed`` when it captured (None outside)."""
        return self._state.rank

    @property
    def world_size(self) -> int | None:
        """The world size under ``torch.distributed`` when it captured (None outside)."""
        return self._state.world_size

    @property
    def last_pass(self) -> BackwardPass | None:
        passes = self.passes
        return passes[-1] if len(passes) else None

    @property
    def checkpoints(self) -> RecordList[CheckpointRecord]:
        """One record per ``torch.utils.checkpoint`` invocation in the forward."""
        journal = self._state.checkpoints
        return RecordList(self._state, CheckpointRecord, range(len(journal.entries) if journal is not None else 0))

    @property
    def checkpoint_verdict(self) -> str:
        """``"observed"``, ``"none_observed"`` (complete evidence of none) or ``"unknown"``."""
        journal = self._state.checkpoints
        return journal.verdict if journal is not None else "unknown"

    @property
    def checkpoint_reasons(self) -> list[str]:
        """Why the checkpoint evidence is incomplete (empty when it is complete)."""
        journal = self._state.checkpoints
        return list(journal.reasons) if journal is not None else [NOT_WITNESSED]

    def __getitem__(self, label: str) -> Any:
        """An op by label, else a module call by address, a node or a node call by label."""
        if not isinstance(label, str):
            raise UnsupportedInputError(
                f"cap[...] looks records up by label (a str), not {type(label).__name__} ({label!r}).",
                code="bad_index",
                remedy="Use a label such as cap['linear_1']; by position, use a list: cap.ops[3], cap.passes[0].")
        lists = (self.ops, self.modules, self.grad_fns, self.grad_fn_calls)
        for records in lists:
            found = records.get(label)
            if found is not None:
                return found
        raise label_not_found("record", label, [key for records in lists[:3] for key in records.labels()])

    def to_pandas(self):
        """The ops table (``grad`` is None and ``num_saved_grads`` says why when ambiguous)."""
        return self.ops.to_pandas()
