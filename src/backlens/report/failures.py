"""A capture's failed or refused passes, explained in model terms.

The backward recorder's ``failures``: autograd errors raised inside a captured
pass are translated with what the capture knows (its ops, modules, earlier
passes, the node that was running). Custom Functions' saved tensors are
fingerprinted when their nodes are discovered, so a pass over a retained graph
whose node freed its own saved tensors is refused before it runs (it would
fail misleadingly, or crash). It reads the capture's entries through the same
views save policies and edits see (capture/views.py), and runs only when a
pass fails or is refused.
"""

from __future__ import annotations

from typing import Any

from backlens.capture.views import NodeView, OpView
from backlens.cost.once_only import Fingerprint, changed_since, saved_of
from backlens.errors import BacklensError
from backlens.report.explain import (
    FailureContext,
    explain,
    explain_once_only,
    nonfinite_explanation,
)


class PassFailures:
    """Explains one capture's refused and failed passes (see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[Any, dict[str, Fingerprint | None]] = {}

    def remember(self, node: Any) -> None:
        """Fingerprint a custom Function node's saved tensors (at discovery)."""
        saved = saved_of(node)
        if saved:
            self._saved[node] = saved

    def forget(self) -> None:
        self._saved = {}

    def _changed(self, state: Any) -> dict[str, str]:
        index_of, nodes = state.table.index_of, state.nodes
        return {nodes[index_of[node]].label: detail for node, detail in changed_since(self._saved) if node in index_of}

    def _context(self, state: Any, pass_: Any, changed: dict[str, str]) -> FailureContext:
        view = state.view
        return FailureContext(
            pass_number=pass_.number,
            failed_node=view(NodeView, pass_.failed_node) if pass_.failed_node is not None else None,
            earlier_passes=state.passes[:pass_.number - 1],
            ops=[view(OpView, i) for i in range(len(state.journal.ops))],
            grad_fns=[view(NodeView, i) for i in range(len(state.nodes))],
            changed_saved=changed,
        )

    def translate(self, state: Any, pass_: Any, error: BaseException) -> BaseException | None:
        """The error to raise in model terms (None leaves ``error`` as it is)."""
        if isinstance(error, BacklensError):
            return None
        translated = explain(error, self._context(state, pass_, self._changed(state))).error()
        if translated is not None:
            pass_.error = translated
        return translated

    def refuse(self, state: Any, pass_: Any) -> BaseException | None:
        """Before a pass: an error if a node freed its own saved tensors in an earlier one."""
        if not self._saved or pass_.number == 1:
            return None
        changed = self._changed(state)
        if not changed:
            return None
        label = next(iter(changed))
        original = f"{label}: saved tensors changed since the forward ({changed[label]})"
        explanation = explain_once_only(original, self._context(state, pass_, changed), before_running=True)
        error = explanation.error() if explanation is not None else None
        if error is not None:
            pass_.error = error
        return error

    def nonfinite(self, state: Any, index: int, pass_: Any, bad: str) -> BaseException:
        """The error for the first node turning finite incoming gradients into ``bad`` (NaN/Inf)."""
        return nonfinite_explanation(state.view(NodeView, index), pass_.number, bad).error()
