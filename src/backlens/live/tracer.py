"""``with lens.trace(...) as tracer:``, ``with tracer.invoke(...):`` and ``tracer.barrier(n)``.

With inputs, the trace body is the one invoke's body and runs in step with
``model(*inputs)``. Without, the trace body runs first, in the caller's
frame's place, and only declares invokes: each ``tracer.invoke(...)`` block
records its inputs and body; when the trace body ends, every invoke runs in
one batched forward call (:class:`~backlens.live.forward.ForwardRun`). Saved
values reach the caller's scope when the outermost block ends.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torch import nn

from backlens.errors import BacklensError, TraceError
from backlens.live.barrier import Barrier, make_barrier
from backlens.live.batching import Batcher
from backlens.live.compiler import compile_body
from backlens.live.context import Block, current_block, running, saved_names
from backlens.live.forward import ForwardRun, Invoke
from backlens.live.freed import BackwardCall, GraphStore, engine_watched
from backlens.live.source import with_item_at
from backlens.live.torchstate import CallerState
from backlens.live.withbody import WithBody, refusal


class Tracer(WithBody):
    """A trace of one forward call; the object ``with lens.trace(...) as tracer`` binds."""

    _what = "lens.trace()"

    def __init__(self, lens: Any, args: tuple[Any, ...], kwargs: dict[str, Any], keep_graph: bool = False):
        # lens: the Lens of the wrapped model (lens.py, which makes tracers)
        self._lens = lens
        self._inputs = (args, kwargs)
        self._has_inputs = bool(args or kwargs)
        self.keep_graph = bool(keep_graph)
        self._backwards: list[BackwardCall] = []
        self._warned_bare = False
        self._graph_store: GraphStore | None = None
        self._invokes: list[Invoke] = []
        self._collecting = False
        self._used = False

    def _made_at(self, frame: types.FrameType, error: BacklensError | None) -> Any:
        """This tracer, or a block that refuses at once when ``error`` or its source says so."""
        found = with_item_at(frame, "trace", self._what, need_source=True)
        if found is None:  # not the expression of a `with`: checked when entered
            if error is not None:
                raise error
            return self
        try:
            if error is not None:
                raise error
            if isinstance(found, TraceError):
                raise found
            self._prepare(found)
        except BacklensError as err:
            return refusal(err)
        return self

    @property
    def _model(self) -> nn.Module:
        return self._lens._lens_module

    @property
    def _batcher(self) -> Batcher:
        return self._lens._lens_root.batcher

    @property
    def _single(self) -> bool:
        """A trace of one input (no invokes): its messages never speak of invokes."""
        return self._has_inputs

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        """A ``with`` block whose body sees and edits only these inputs' rows of the batch."""
        block = InvokeBlock(self, args, kwargs)
        found = with_item_at(sys._getframe(1), "invoke", block._what, need_source=True)
        try:
            self._check_can_invoke()
            if isinstance(found, TraceError):
                raise found
            if found is not None:
                block._prepare(found)
        except BacklensError as err:
            if found is None:
                raise
            return refusal(err)
        return block

    def barrier(self, n: int) -> Barrier:
        """A meeting point of ``n`` invokes (see API.md §2): ``barrier()`` in each of them."""
        return make_barrier(self, n, sys._getframe(1))

    def __enter__(self) -> Tracer:
        if self._used:
            raise TraceError(
                "this tracer was already used; each `with lens.trace(...)` runs once.",
                code="tracer_reused",
                remedy="Call lens.trace(...) again for another run.",
            )
        self._used = True
        self._arm(sys._getframe(1))
        return self

    def _run(self, frame: types.FrameType, state: CallerState) -> dict[str, Any]:
        assert self._source is not None
        body = compile_body(self._source, frame, self._what)
        if self.keep_graph:
            self._graph_store = GraphStore()
        updates: dict[str, Any] = {}
        with engine_watched(), state.applied():
            if self._has_inputs:
                args, kwargs = self._inputs
                self._invokes = [Invoke(0, args, kwargs, body, state)]
            else:
                block = Block("trace", tracer=self)
                self._collecting = True
                try:
                    with running(block):
                        final = body.run()
                finally:
                    self._collecting = False
                updates.update(saved_names(final, block, body.assigned))
                if body.writeback:  # nonlocal names the body assigned (rare)
                    updates.update({name: final[name] for name in body.writeback if name in final})
                if not self._invokes:
                    raise TraceError(
                        f"the trace at {self._source.where} has no inputs: pass them to lens.trace(...) "
                        "or declare `with tracer.invoke(...):` blocks in its body.",
                        code="no_inputs",
                        remedy="Call lens.trace(x) or add tracer.invoke(x) blocks.",
                    )
            ForwardRun(self, self._invokes, state).execute()
        for invoke in self._invokes:
            updates.update(invoke.updates)
        return updates

    def _cleanup(self) -> None:
        if self._graph_store is not None:
            self._graph_store.free()
        self._invokes = []

    def _add_invoke(self, args: tuple[Any, ...], kwargs: dict[str, Any], body: Any, state: CallerState) -> None:
        self._invokes.append(Invoke(len(self._invokes), args, kwargs, body, state))

    def _check_can_invoke(self) -> None:
        block = current_block()
        if self._has_inputs:
            raise TraceError(
                "tracer.invoke() was used in a trace that already has inputs; a trace either takes "
                "its inputs in lens.trace(...) or declares invokes, not both.",
                code="invoke_with_trace_inputs",
                remedy="Call lens.trace() without inputs and give each input to its own invoke.",
            )
        if not self._collecting or block is None or block.tracer is not self or block.kind != "trace":
            raise TraceError(
                "tracer.invoke() can only open a block directly in the body of its "
                "`with lens.trace() as tracer:` block.",
                code="invoke_outside_trace",
                remedy="Move the invoke block into the trace body (not into another invoke).",
            )


class InvokeBlock(WithBody):
    """``with tracer.invoke(*args, **kwargs):`` — one invoke of a trace."""

    _what = "tracer.invoke()"

    def __init__(self, tracer: Tracer, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._tracer = tracer
        self._inputs = (args, kwargs)

    def __enter__(self) -> InvokeBlock:
        self._arm(sys._getframe(1))
        return self

    def _run(self, frame: types.FrameType, state: CallerState) -> dict[str, Any]:
        assert self._source is not None
        body = compile_body(self._source, frame, self._what)
        args, kwargs = self._inputs
        self._tracer._add_invoke(args, kwargs, body, state)
        return {}  # the invoke runs (and saves) when the trace body ends
