"""``with lens.trace(...) as tracer:`` and ``with tracer.invoke(...):``.

With inputs, the trace body is the one invoke's body and runs in step with
``model(*inputs)``. Without, the trace body runs first, in the caller's
thread, and only declares invokes: each ``tracer.invoke(...)`` block records
its inputs and body; when the trace body ends, every invoke runs in one
batched forward call (:class:`~backlens.live.forward.ForwardRun`). Saved
values reach the caller's scope when the outermost block ends.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from torch import nn

from backlens.errors import TraceError
from backlens.live.batching import Batcher
from backlens.live.context import Block, current_block, running, saved_names
from backlens.live.forward import ForwardRun, Invoke
from backlens.live.freed import BackwardCall, GraphStore
from backlens.live.mediator import CallerState
from backlens.live.source import compile_body, run_body
from backlens.live.withbody import WithBody

if TYPE_CHECKING:
    from backlens.live.lens import Lens


class Tracer(WithBody):
    """A trace of one forward call; the object ``with lens.trace(...) as tracer`` binds."""

    _what = "lens.trace()"

    def __init__(self, lens: Lens, args: tuple[Any, ...], kwargs: dict[str, Any], keep_graph: bool = False):
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
        self._state: CallerState | None = None

    @property
    def _lens_root_of(self) -> Any:
        return self._lens._lens_root

    @property
    def _model(self) -> nn.Module:
        return self._lens._lens_module

    @property
    def _batcher(self) -> Batcher:
        return self._lens._lens_root.batcher

    def invoke(self, *args: Any, **kwargs: Any) -> InvokeBlock:
        """A ``with`` block whose body sees and edits only these inputs' rows of the batch."""
        return InvokeBlock(self, args, kwargs)

    def __enter__(self) -> Tracer:
        if self._used:
            raise TraceError(
                "this tracer was already used; each `with lens.trace(...)` runs once.",
                code="tracer_reused",
                remedy="Call lens.trace(...) again for another run.",
            )
        self._used = True
        self._state = CallerState.capture()
        self._arm(sys._getframe(1))
        return self

    def _run(self, frame: types.FrameType) -> dict[str, Any]:
        assert self._source is not None and self._state is not None
        body, namespace = compile_body(self._source, frame, self._what)
        if self.keep_graph:
            self._graph_store = GraphStore()
        updates: dict[str, Any] = {}
        if self._has_inputs:
            args, kwargs = self._inputs
            self._invokes = [Invoke(0, args, kwargs, body, namespace, self._source)]
        else:
            block = Block("trace", tracer=self)
            self._collecting = True
            try:
                with running(block):
                    final = run_body(body, namespace)
            finally:
                self._collecting = False
            updates.update(saved_names(final, block, self._source.assigned))
            if not self._invokes:
                raise TraceError(
                    f"the trace at {self._source.where} has no inputs: pass them to lens.trace(...) "
                    "or declare `with tracer.invoke(...):` blocks in its body.",
                    code="no_inputs",
                    remedy="Call lens.trace(x) or add tracer.invoke(x) blocks.",
                )
        ForwardRun(self, self._invokes, self._state).execute()
        for invoke in self._invokes:
            updates.update(invoke.updates)
        return updates

    def _cleanup(self) -> None:
        if self._graph_store is not None:
            self._graph_store.free()
        self._invokes = []

    def _add_invoke(self, args: tuple[Any, ...], kwargs: dict[str, Any], body: Any, namespace: dict[str, Any], source: Any) -> None:
        self._invokes.append(Invoke(len(self._invokes), args, kwargs, body, namespace, source))

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
        self._tracer._check_can_invoke()
        self._arm(sys._getframe(1))
        return self

    def _run(self, frame: types.FrameType) -> dict[str, Any]:
        assert self._source is not None
        body, namespace = compile_body(self._source, frame, self._what)
        args, kwargs = self._inputs
        self._tracer._add_invoke(args, kwargs, body, namespace, self._source)
        return {}  # the invoke runs (and saves) when the trace body ends
