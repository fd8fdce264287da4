"""A capture's failed or refused passes, explained in model terms.

Autograd errors raised inside a captured pass are translated with what the
capture knows (ops, modules, earlier passes, the node that was running).
Custom Functions' saved tensors are fingerprinted when their nodes are
discovered, so a pass over a retained graph whose node freed its own saved
tensors is refused before it runs (it would fail misleadingly, or crash).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backlens.cost.once_only import Fingerprint, changed_since, saved_of
from backlens.errors import BacklensError
from backlens.report.explain import (
    FailureContext,
    explain,
    explain_once_only,
    nonfinite_explanation,
)

if TYPE_CHECKING:
    from backlens.capture.backward import PassState
    from backlens.capture.capture import Capture
    from backlens.graph.table import NodeTable


class FailureTranslator:
    def __init__(self, table: NodeTable, records: Callable[[], Capture]):
        self._table = table
        self._records = records  # the capture whose records explanations name
        self._saved: dict[Any, dict[str, Fingerprint | None]] = {}

    def remember_saved(self, node: Any) -> None:
        """Fingerprint a custom Function node's saved tensors (at discovery)."""
        saved = saved_of(node)
        if saved:
            self._saved[node] = saved

    def forget(self) -> None:
        self._saved = {}

    def _changed(self) -> dict[str, str]:
        index_of = self._table.index_of
        entries = self._table.entries
        return {
            entries[index_of[node]].label: detail
            for node, detail in changed_since(self._saved)
            if node in index_of
        }

    def _context(self, state: PassState, changed: dict[str, str]) -> FailureContext:
        cap = self._records()
        return FailureContext(
            pass_number=state.record.number,
            failed_node=cap._grad_fn_records[state.failed_node] if state.failed_node is not None else None,
            earlier_passes=[s.record for s in cap._backward.passes if s.record.number < state.record.number],
            ops=cap._ops,
            grad_fns=cap._grad_fn_records,
            changed_saved=changed,
        )

    def translate(self, state: PassState, error: BaseException) -> BaseException | None:
        """Re-raise an autograd error in model terms (None leaves it untouched)."""
        if isinstance(error, BacklensError):
            return None
        translated = explain(error, self._context(state, self._changed())).error()
        if translated is not None:
            state.record.error = translated
        return translated

    def refuse_once_only_rerun(self, state: PassState) -> BaseException | None:
        """Before a pass: an error if a node freed its own saved tensors in an earlier one."""
        if not self._saved or state.record.number == 1:
            return None
        changed = self._changed()
        if not changed:
            return None
        label = next(iter(changed))
        original = f"{label}: saved tensors changed since the forward ({changed[label]})"
        explanation = explain_once_only(original, self._context(state, changed), before_running=True)
        error = explanation.error() if explanation is not None else None
        if error is not None:
            state.record.error = error
        return error

    def nonfinite_error(self, index: int, state: PassState, bad: str) -> BaseException:
        grad_fn = self._records()._grad_fn_records[index]
        return nonfinite_explanation(grad_fn, state.record.number, bad).error()
