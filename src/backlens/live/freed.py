"""The shared autograd graph of a trace: who freed it, and keeping it.

All invokes of a trace run in one batched forward, so they share one autograd
graph. A second ``.backward()`` after one that did not retain it fails with
torch's "Trying to backward through the graph a second time", which says
nothing about invokes or about which earlier call freed it;
:func:`freed_graph_error` says it in those terms, naming the earlier call
(a ``.backward()`` of a block, or a ``torch.autograd.grad`` a body made: the
engine wrapper tells a running trace of every run). No other error is
reworded: torch's error is recognised by the one detector both faces use
(``graph/freed.py``).

``keep_graph=True`` keeps the graph alive for every backward in the trace and
frees it at exit. Retaining is ``retain_graph=True`` on each backward;
freeing is done by :class:`GraphStore`: the forward's saved tensors are
packed into the store (``saved_tensors_hooks``), and clearing the store at
trace exit frees them even while the user still holds the output.
"""

from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch

from backlens._fence import complete
from backlens._frames import user_frame
from backlens.errors import FreedGraphError
from backlens.graph import engine
from backlens.live.context import current_block
from backlens.live.source import where


class BackwardCall(NamedTuple):
    """One backward engine run started inside a trace (``.backward()`` or ``torch.autograd.grad``)."""

    invoke: int | None
    retain: bool
    filename: str
    line: int
    call: str = ".backward()"
    single: bool = False  # a trace of one input: no invoke wording

    @property
    def where(self) -> str:
        return where(self.filename, self.line)

    def owner(self) -> str:
        """``invoke 0's .backward()``; a single-input trace's calls are plain ``.backward()``."""
        if self.invoke is not None and not self.single:
            return f"invoke {self.invoke}'s {self.call}"
        return self.call if self.single else f"the trace's {self.call}"


def freed_graph_error(exc: RuntimeError, failing: BackwardCall, earlier: list[BackwardCall]) -> FreedGraphError:
    """Torch's freed-graph error, explained in the trace's terms (see API.md §2)."""
    culprit = next((call for call in reversed(earlier) if not call.retain), None)
    if culprit is not None:
        who = f"the earlier {culprit.owner()} at {culprit.where}"
    else:
        who = "an earlier backward (not one made in this trace)"
    keep = "(lens.trace(..., keep_graph=True) retains it for every .backward() in the trace.)"
    if failing.single:
        shared = "A backward without retain_graph=True frees the autograd graph when it finishes."
        fix = "Pass retain_graph=True to every backward but the last."
        other = "retain_graph=True to that earlier call too"
    else:
        shared = (
            "Every invoke contributes to a single batched forward pass, so all invokes share one "
            "autograd graph, and a .backward() without retain_graph=True frees that graph when it finishes."
        )
        fix = "Pass retain_graph=True to every .backward() but the last, or run each invoke in its own trace."
        other = "retain_graph=True to that earlier .backward() too (to every .backward() but the last), or run each invoke in its own trace"
    if failing.retain:
        head = (
            f"{_capital(failing.owner())} at {failing.where} passed retain_graph=True, but {who} did not, "
            "so the graph was already freed."
        )
        fix = f"Pass {other}."
    else:
        head = f"{_capital(failing.owner())} at {failing.where} needs the autograd graph that {who} already freed."
    message = f"{head} {shared}\nFix: {fix} {keep}\nOriginal error from torch.autograd: {exc}"
    return FreedGraphError(message, remedy=fix)


def _capital(text: str) -> str:
    if text.startswith("the "):
        return "T" + text[1:]
    return f"The {text}" if text.startswith(".") or text.startswith("torch.") else text


# -- backward runs a body starts itself (torch.autograd.grad, torch.autograd.backward)

# Set while backlens runs a `.backward()` it records itself.
recording_own = contextvars.ContextVar("backlens_recording_own_backward", default=False)


def _on_engine_run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if recording_own.get():  # a backward backlens records itself (every block's)
        return
    block = current_block()
    tracer = block.tracer if block is not None else None
    if tracer is None:
        return
    frame, _ = user_frame(1)
    if frame is None:
        return
    accumulate, retain = engine.run_arguments(args, kwargs)
    call = "torch.autograd.backward()" if accumulate else "torch.autograd.grad()"
    invoke = block.invoke.index if block.invoke is not None else None  # type: ignore[union-attr]
    tracer._backwards.append(BackwardCall(invoke, retain, frame.f_code.co_filename, frame.f_lineno, call, tracer._single))


def engine_watched() -> _EngineWatch:
    """Have the engine wrapper tell the traces running now of the runs their bodies start (to
    name who freed a graph): observed while any trace runs, so that outside traces torch's
    engine entry point is its own again. A Ctrl-C cannot leave the observer behind."""
    return _EngineWatch()


class _EngineWatch:
    """One trace's share of the engine observer (a plain class: entered once per trace)."""

    __slots__ = ("_token",)

    def __init__(self) -> None:
        self._token = object()

    def __enter__(self) -> None:
        try:
            engine.watch(_on_engine_run, self._token)
        except BaseException:
            complete(self._leave)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._leave()
        except KeyboardInterrupt:
            complete(self._leave)
            raise

    def _leave(self) -> None:
        engine.unwatch(_on_engine_run, self._token)


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
