"""The public record surface shared by a live capture and a loaded bundle.

Subclasses hand over their record lists through the ``_*_list`` hooks; this
class turns them into the indexable, ``to_pandas``-able lists API.md names,
so a loaded capture reads exactly as the live one.
"""

from __future__ import annotations

from typing import Any

from backlens.records.backward import GRAD_FN_COLUMNS, BackwardPass, CallList, GradFn, PassList
from backlens.records.base import RecordList, label_not_found
from backlens.records.forward import (
    INPUT_COLUMNS,
    MODULE_COLUMNS,
    OP_COLUMNS,
    PARAM_COLUMNS,
    InputRecord,
    ModuleCallRecord,
    OpRecord,
    ParamRecord,
)


def _listed(records: list, label_of, row_of, columns, kind: str) -> RecordList:
    view = RecordList(records, label_of, row_of, columns)
    view.kind = kind
    return view


class RecordView:
    def _op_list(self) -> list[OpRecord]:
        raise NotImplementedError

    def _module_list(self) -> list[ModuleCallRecord]:
        raise NotImplementedError

    def _param_list(self) -> list[ParamRecord]:
        raise NotImplementedError

    def _input_list(self) -> list[InputRecord]:
        raise NotImplementedError

    def _grad_fn_list(self) -> list[GradFn]:
        raise NotImplementedError

    def _call_list(self) -> list[Any]:
        raise NotImplementedError

    def _pass_list(self) -> list[BackwardPass]:
        raise NotImplementedError

    @property
    def ops(self) -> RecordList[OpRecord]:
        """Forward ops, by position or label (``cap.ops["linear_2"]``)."""
        return _listed(self._op_list(), lambda r: r.label, OpRecord.row, OP_COLUMNS, "op")

    @property
    def modules(self) -> RecordList[ModuleCallRecord]:
        """Module calls, by position or address (``"encoder.layer.0"``, ``"...:2"``)."""
        return _listed(self._module_list(), lambda r: r.address, ModuleCallRecord.row, MODULE_COLUMNS,
                       "module call")

    @property
    def params(self) -> RecordList[ParamRecord]:
        return _listed(self._param_list(), lambda r: r.name, ParamRecord.row, PARAM_COLUMNS, "parameter")

    @property
    def inputs(self) -> RecordList[InputRecord]:
        return _listed(self._input_list(), lambda r: r.name, InputRecord.row, INPUT_COLUMNS, "input")

    @property
    def grad_fns(self) -> RecordList[GradFn]:
        """One record per distinct autograd node of the captured graph."""
        return _listed(self._grad_fn_list(), lambda r: r.label, GradFn.row, GRAD_FN_COLUMNS, "grad_fn")

    @property
    def grad_fn_calls(self) -> CallList:
        """Every fire of every node, by position or ``"label:k"``."""
        return CallList(self._call_list())

    @property
    def passes(self) -> PassList:
        return PassList(self._pass_list())

    @property
    def last_pass(self) -> BackwardPass | None:
        passes = self._pass_list()
        return passes[-1] if passes else None

    def __getitem__(self, label: str) -> Any:
        """An op by label, else a module call by address, a node or a node call by label."""
        ops, modules, grad_fns = self._op_list(), self._module_list(), self._grad_fn_list()
        for records, key in ((ops, "label"), (modules, "address"), (grad_fns, "label")):
            for record in records:
                if getattr(record, key) == label:
                    return record
        found = self.grad_fn_calls.get(label)
        if found is not None:
            return found
        labels = [r.label for r in ops] + [r.address for r in modules] + [r.label for r in grad_fns]
        raise label_not_found("record", label, labels)

    def to_pandas(self):
        """The ops table (``grad`` is None and ``num_saved_grads`` says why when ambiguous)."""
        return self.ops.to_pandas()
