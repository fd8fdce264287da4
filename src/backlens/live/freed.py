"""The shared autograd graph of a trace: who freed it, and keeping it.

All invokes of a trace run in one batched forward, so they share one autograd
graph. A second ``.backward()`` after one that did not retain it fails with
torch's "Trying to backward through the graph a second time", which says
nothing about invokes; :func:`freed_graph_error` says it in those terms. No
other error is reworded: the match is on torch's exact opening words.

``keep_graph=True`` keeps the graph alive for every backward in the trace and
frees it at exit. Retaining is ``retain_graph=True`` on each backward;
freeing is done by :class:`GraphStore`: the forward's saved tensors are
packed into the store (``saved_tensors_hooks``), and clearing the store at
trace exit frees them even while the user still holds the output.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from backlens.errors import BacklensError, FreedGraphError
from backlens.live.source import where

TORCH_FREED_TEXT = "Trying to backward through the graph a second time"


@dataclass(frozen=True)
class BackwardCall:
    """One ``.backward()`` made inside a trace."""

    invoke: int | None
    retain: bool
    filename: str
    line: int

    @property
    def where(self) -> str:
        return where(self.filename, self.line)

    def owner(self) -> str:
        return f"invoke {self.invoke}'s .backward()" if self.invoke is not None else "the trace's .backward()"


def is_freed_graph(exc: BaseException) -> bool:
    """True only for torch's own freed-graph error (never one of ours, never anything else)."""
    return (
        isinstance(exc, RuntimeError)
        and not isinstance(exc, BacklensError)
        and str(exc).startswith(TORCH_FREED_TEXT)
    )


def freed_graph_error(exc: RuntimeError, failing: BackwardCall, earlier: list[BackwardCall]) -> FreedGraphError:
    """Torch's freed-graph error, explained in invoke terms (see API.md §2)."""
    culprit = next((call for call in reversed(earlier) if not call.retain), None)
    if culprit is not None:
        who = f"the earlier {culprit.owner()} at {culprit.where}"
    else:
        who = "an earlier .backward() (not one made in this trace)"
    shared = (
        "Every invoke contributes to a single batched forward pass, so all invokes share one "
        "autograd graph, and a .backward() without retain_graph=True frees that graph when it finishes."
    )
    if failing.retain:
        fix = (
            "Pass retain_graph=True to that earlier .backward() too (to every .backward() but the last), "
            "or run each invoke in its own trace."
        )
        head = (
            f"{failing.owner()} at {failing.where} passed retain_graph=True, but {who} did not, "
            "so the graph was already freed."
        )
    else:
        fix = "Pass retain_graph=True to every .backward() but the last, or run each invoke in its own trace."
        head = f"{failing.owner()} at {failing.where} needs the autograd graph that {who} already freed."
    message = (
        f"{head} {shared}\nFix: {fix} (lens.trace(..., keep_graph=True) retains it for every .backward() "
        f"in the trace.)\nOriginal error from torch.autograd: {exc}"
    )
    return FreedGraphError(message, remedy=fix)


class GraphStore:
    """Holds a ``keep_graph`` trace's saved tensors until the trace exits."""

    def __init__(self) -> None:
        self._tensors: dict[int, torch.Tensor] = {}
        self._next = 0

    def _pack(self, tensor: torch.Tensor) -> int:
        key = self._next
        self._next += 1
        self._tensors[key] = tensor
        return key

    def _unpack(self, key: int) -> torch.Tensor:
        tensor = self._tensors.get(key)
        if tensor is None:
            raise FreedGraphError(
                "this autograd graph was built inside lens.trace(..., keep_graph=True), which frees "
                "it when the trace exits, so no backward can run over it afterwards.",
                remedy="Run the backward inside the trace, in a `with loss.backward():` block.",
            )
        return tensor

    def hooks(self) -> AbstractContextManager[Any]:
        """The saved-tensor hooks to enter in every thread that builds the graph."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def free(self) -> None:
        self._tensors.clear()
