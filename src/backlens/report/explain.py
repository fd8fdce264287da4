"""Autograd errors explained in model terms.

Torch's texts for its commonest backward failures point away from the cause.
Given the error and, when there is one, what a capture recorded (ops, modules,
passes, the node that was running), :func:`explain` says what happened, which
op and module are involved, and the fix, ending with torch's original text.
Only errors recognised here are reworded; everything else passes through.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from backlens.errors import (
    BacklensError,
    FreedGraphError,
    NonFiniteGradError,
    OnceOnlyNodeError,
    SavedTensorModifiedError,
    UnsupportedInputError,
)
from backlens.graph.freed import is_freed_graph

ORIGINAL_PREFIX = "Original error from torch.autograd: "

_INPLACE = re.compile(
    r"modified by an inplace operation: \[(?P<tensor>.*?)\], which is output (?P<output>\d+) of "
    r"(?P<producer>\w+), is at version (?P<version>\d+); expected version (?P<expected>\d+)"
)
_SHAPE_OR_STORAGE = (
    "shapes cannot be multiplied",
    "out of bounds for storage",
    "size mismatch",
    "must match the size",
    "doesn't match the broadcast shape",
    "shape '",
    "is invalid for input of size",
    "setStorage",
)
_INPLACE_NAMES = ("setitem", "iadd", "isub", "imul", "itruediv", "ipow", "copy_", "zero_", "fill_")


@dataclass
class Explanation:
    """What backlens can say about an error.

    ``code`` is None when backlens does not recognise the error; then
    ``message`` is torch's text unchanged.
    """

    code: str | None
    message: str
    remedy: str | None
    original: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.code is None:
            return self.original
        return f"{self.message}\nFix: {self.remedy}\n{ORIGINAL_PREFIX}{self.original}"

    def error(self) -> BacklensError | None:
        """The backlens error to raise in place of the original (None: leave it)."""
        cls = {
            "freed_graph": FreedGraphError,
            "once_only_node": OnceOnlyNodeError,
            "saved_tensor_modified": SavedTensorModifiedError,
            "nonfinite_grad": NonFiniteGradError,
        }.get(self.code or "")
        if cls is None:
            return None
        err = cls(str(self), remedy=self.remedy)
        err.explanation = self  # type: ignore[attr-defined]
        return err


@dataclass
class FailureContext:
    """What a capture knows about a failed pass (all optional)."""

    pass_number: int | None = None
    failed_node: Any = None          # the node that was running (a GradFn or a NodeView)
    earlier_passes: list[Any] = field(default_factory=list)  # passes before this one (records or entries)
    ops: list[Any] = field(default_factory=list)             # the forward's ops (records or views)
    grad_fns: list[Any] = field(default_factory=list)        # the capture's nodes (records or views)
    changed_saved: dict[str, str] = field(default_factory=dict)  # node label -> what changed


def explain(exc: BaseException, context: FailureContext | None = None) -> Explanation:
    """Explain ``exc``; with a capture's ``context`` the explanation names ops and modules."""
    if not isinstance(exc, BaseException):
        raise UnsupportedInputError(f"bl.explain takes an exception, got {type(exc).__name__}.",
                                    code="bad_argument",
                                    remedy="Pass the caught error: except RuntimeError as err: bl.explain(err).")
    explanation = getattr(exc, "explanation", None)
    if isinstance(explanation, Explanation):
        return explanation
    context = context or FailureContext()
    text = str(exc)
    if is_freed_graph(exc):
        return _freed_graph(text, context)
    if isinstance(exc, FreedGraphError):  # a trace's, explained in its terms already
        head, _, original = text.partition(f"\n{ORIGINAL_PREFIX}")
        return Explanation("freed_graph", head.split("\nFix: ")[0], exc.remedy, original or text)
    match = _INPLACE.search(text)
    if match:
        return _saved_tensor_modified(text, match, context)
    if isinstance(exc, (RuntimeError, IndexError, ValueError)) and any(s in text for s in _SHAPE_OR_STORAGE):
        found = _once_only(text, context)
        if found is not None:
            return found
    return Explanation(None, text, None, text)


def _where(record: Any) -> str:
    module = getattr(record, "module", None)
    if module is None:
        return "outside any module (built after the forward)"
    return f"in module '{module}'" if module else "in the model's own forward"


def _freed_graph(text: str, context: FailureContext) -> Explanation:
    freeing = [p for p in context.earlier_passes if p.retain_graph is False and p.status in ("ok", "recording_failed")]
    if freeing:
        culprit = freeing[-1]
        site = f" at {culprit.call_site}" if culprit.call_site is not None else ""
        cause = (
            f"Backward pass {culprit.number} ({culprit.trigger}{site}) ran without retain_graph=True "
            "and freed the saved tensors of this graph"
        )
    else:
        cause = "An earlier backward over this graph ran without retain_graph=True and freed its saved tensors"
    this = f"Backward pass {context.pass_number}" if context.pass_number else "This backward"
    message = f"{this} needs them again: {cause}."
    remedy = (
        "Pass retain_graph=True to every backward over this graph but the last, "
        "or run a fresh forward for each backward."
    )
    return Explanation("freed_graph", message, remedy, text,
                       {"freeing_pass": freeing[-1].number if freeing else None})


def _saved_tensor_modified(text: str, match: re.Match, context: FailureContext) -> Explanation:
    producer_type = match.group("producer")
    version, expected = match.group("version"), match.group("expected")
    producer = _producer_op(producer_type, context)
    inplace = _inplace_op_after(producer, context)
    parts = []
    if producer is not None:
        parts.append(f"The output of forward op '{producer.label}' ({producer.func}, {_where(producer)}) "
                     "was saved for backward")
    else:
        parts.append(f"A tensor produced by a {producer_type} node was saved for backward")
    failed = context.failed_node
    if failed is not None:
        needing = f"'{failed.op.label}'" if failed.op is not None else f"node {failed.label}"
        parts[-1] += f" by {needing} ({failed.type}, {_where(failed)})"
    if inplace is not None:
        parts.append(f"then in-place op '{inplace.label}' ({inplace.func}, {_where(inplace)}) modified it")
    else:
        parts.append("then an in-place operation modified it")
    message = ", ".join(parts) + f" (version {version}, expected {expected})."
    remedy = (
        f"Use the out-of-place form of '{inplace.func if inplace else 'the in-place op'}' "
        "(e.g. torch.relu instead of relu_, inplace=False on the module), or clone its input first."
    )
    return Explanation("saved_tensor_modified", message, remedy, text, {
        "producer_op": producer.label if producer else None,
        "inplace_op": inplace.label if inplace else None,
    })


def _producer_op(producer_type: str, context: FailureContext) -> Any:
    stem = producer_type.lower().removesuffix("backward0").removesuffix("backward")
    failed = context.failed_node
    candidates = []
    for grad_fn in context.grad_fns:
        if grad_fn.op is None:
            continue
        if grad_fn.type.lower().startswith(stem):
            candidates.append(grad_fn.op)
    if failed is not None and failed.op is not None:
        related = {failed.op.label, *failed.op.parents}
        close = [op for op in candidates if op.label in related]
        if close:
            return close[-1]
    return candidates[-1] if candidates else None


def _inplace_op_after(producer: Any, context: FailureContext) -> Any:
    for op in context.ops:
        if producer is not None and op.index <= producer.index:
            continue
        is_inplace = getattr(op, "inplace", False) or op.func.endswith("_") or op.func in _INPLACE_NAMES
        if is_inplace and (producer is None or producer.label in op.parents):
            return op
    return None


def explain_once_only(text: str, context: FailureContext, *, before_running: bool = False) -> Explanation | None:
    """The once-only-node explanation, when ``context`` shows changed saved tensors."""
    return _once_only(text, context, before_running=before_running)


def _once_only(text: str, context: FailureContext, *, before_running: bool = False) -> Explanation | None:
    failed = context.failed_node
    changed = context.changed_saved
    if not changed:
        return None
    label = failed.label if failed is not None and failed.label in changed else next(iter(changed))
    node = next((g for g in context.grad_fns if g.label == label), failed)
    op_part = f"forward op '{node.op.label}'" if node is not None and node.op is not None else "a custom Function"
    message = (
        f"Node {label} ({node.type if node else 'custom Function'}, from {op_part}, {_where(node)}) "
        f"freed its own saved tensors during an earlier backward ({changed[label]}), so it can run only once. "
        "retain_graph=True cannot keep what a node frees itself. "
        + (
            "backlens stopped this pass before it ran: it would fail with a misleading shape or "
            "storage error, or crash."
            if before_running
            else "The shape/storage error below is a consequence of that, not a bug in your shapes."
        )
    )
    remedy = (
        "Run a fresh forward for each backward. The Function's author can free saved tensors only when the "
        "graph is not retained, e.g. with ctx.maybe_clear_saved_tensors() instead of t.data = torch.empty(0) "
        "or untyped_storage().resize_(0)."
    )
    return Explanation("once_only_node", message, remedy, text, {"node": label})


def nonfinite_explanation(grad_fn: Any, pass_number: int, bad: str) -> Explanation:
    """Explain the first node call whose gradients became non-finite from finite inputs."""
    op = f"forward op '{grad_fn.op.label}' ({grad_fn.op.func})" if grad_fn.op is not None else "no forward op"
    message = (
        f"Backward pass {pass_number}: node {grad_fn.label} ({grad_fn.type}, {op}, {_where(grad_fn)}) "
        f"turned finite incoming gradients into {bad}."
    )
    remedy = NonFiniteGradError.remedy
    original = f"non-finite gradient produced by {grad_fn.type}"
    return Explanation("nonfinite_grad", message, remedy, original, {"node": grad_fn.label})
