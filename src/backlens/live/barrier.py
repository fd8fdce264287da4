"""``barrier = tracer.barrier(n)``: a meeting point of ``n`` invokes.

Invokes run in the order the model reaches what each asks for, so a value
one invoke binds is not there yet when another runs. ``barrier()`` called in
``n`` invokes holds each until all ``n`` have reached it; then the names each
bound above it are handed to the others (activation patching from a clean to
a corrupted prompt) and they go on, in invoke order. A barrier fills again
for its next round once it has opened, so it may stand in a loop.

The hand-over itself is the forward run's (:mod:`backlens.live.forward`):
``barrier()`` only asks the driver for a :class:`BarrierWait`, as a body asks
for a module's output.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backlens.errors import TraceError
from backlens.live.context import current_block
from backlens.live.source import where

if TYPE_CHECKING:
    from backlens.live.mediator import Mediator


class Barrier:
    """What ``tracer.barrier(n)`` returns; call it (``barrier()``) in each of ``n`` invokes."""

    __slots__ = ("n", "_tracer", "_where")

    def __init__(self, tracer: Any, n: int, made_at: str):  # tracer: the Tracer that made it
        self.n = n
        self._tracer = tracer
        self._where = made_at

    def __call__(self) -> None:
        block = current_block()
        mediator = block.mediator if block is not None else None
        if (
            block is None
            or block.kind != "invoke"
            or block.tracer is not self._tracer
            or block.forward is None
            or mediator is None
            or mediator.body is None
        ):
            raise TraceError(
                f"{self} was called outside the invoke bodies of its trace; a barrier is where "
                "invokes of one trace meet.",
                code="barrier_outside_invoke",
                remedy="Call barrier() directly in the body of each `with tracer.invoke(...):` block.",
            )
        mediator.request(BarrierWait(self, _body_frame(sys._getframe(1), mediator.body.code)))

    @property
    def where(self) -> str:
        return self._where

    def __repr__(self) -> str:
        return f"tracer.barrier({self.n}) made at {self._where}"


def make_barrier(tracer: Any, n: Any, frame: types.FrameType) -> Barrier:
    made_at = where(frame.f_code.co_filename, frame.f_lineno)
    if type(n) is not int or n < 1:
        raise TraceError(
            f"tracer.barrier({n!r}) at {made_at}: the number of invokes that meet must be a positive int.",
            code="bad_barrier",
            remedy="Pass the number of invokes that call the barrier, e.g. tracer.barrier(2).",
        )
    return Barrier(tracer, n, made_at)


@dataclass(eq=False)
class BarrierWait:
    """What an invoke body waiting at a barrier asks for; ``frame`` is its body's frame."""

    barrier: Barrier
    frame: types.FrameType | None


def _body_frame(frame: types.FrameType | None, code: types.CodeType) -> types.FrameType | None:
    """The invoke body's own frame (``barrier()`` may be called from a helper it calls)."""
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


def unfilled_error(barrier: Barrier, waiting: list[Mediator], others: list[tuple[Mediator, str]]) -> TraceError:
    """``barrier_unfilled``: which invokes were left waiting, and what the others did."""
    names = ", ".join(f"invoke {_index(m)}" for m in waiting)
    missing = "; ".join(f"invoke {_index(m)} {why}" for m, why in others) or "no other invoke is left to reach it"
    return TraceError(
        f"{barrier} never filled: it needs {barrier.n} invokes to reach it, and only {len(waiting)} did "
        f"({missing}). Invokes left waiting: {names}.",
        code="barrier_unfilled",
        remedy=f"Call barrier() in {barrier.n} invokes of the trace, or make it tracer.barrier({len(waiting)}).",
    )


def _index(mediator: Mediator) -> int:
    invoke = mediator.block.invoke
    return invoke.index if invoke is not None else 0
