"""``with t.backward(...):`` — a body that runs during the real backward.

A ``t.backward(...)`` that is the expression of a ``with`` statement returns a
:class:`BackwardBlock` (how the call reaches backlens, in a body or outside
any trace, is ``entry.py``'s); a plain one runs torch's own
``Tensor.backward`` with the same arguments, keeping its stock return, effect
and errors (inside a trace it also warns once that intermediate ``.grad``
stays ``None``, and a freed shared graph is explained in the trace's terms:
:func:`bare_in_trace`).

Inside a backward block, ``h.grad`` is the gradient flowing into ``h`` as it
arrives: the first read registers a tensor hook on ``h`` (on the batched
tensor and cut to the invoke's rows, when ``h`` came from a lens) and waits
for the engine to reach it; ``h.grad = g`` makes that hook return ``g``
instead. The engine runs in the caller's thread, single-threaded for devices
too, so its hooks switch to the body right there. The body's own ``x.grad``
(as it is spelled in the block, its comprehensions and functions) is compiled
to go through the running backward (``rewrite.py``, ``entry.py``);
``Tensor.grad`` itself is never patched, so ``.grad`` read anywhere else keeps
its stock meaning.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backlens import _args, _torch
from backlens.errors import (
    BacklensError,
    BacklensWarning,
    NoGradForwardError,
    NoGradientPathError,
    OutOfOrderError,
    TraceError,
)
from backlens.graph.freed import is_freed_graph
from backlens.live import rows as rows_mod
from backlens.live.compiler import CompiledBody, compile_body
from backlens.live.context import Block, current_block, saved_names
from backlens.live.freed import BackwardCall, freed_graph_error, recording_own
from backlens.live.gradpath import GraphIndex, met_within, reaches
from backlens.live.launch import drive
from backlens.live.mediator import Event, Mediator, StopRun, answer_unserved, getcurrent
from backlens.live.naming import Label, describe
from backlens.live.source import BlockSource
from backlens.live.torchstate import CallerState, single_threaded_engine
from backlens.live.withbody import WithBody, refusal

if TYPE_CHECKING:
    from backlens.live.forward import ForwardRun
    from backlens.live.tracer import Tracer


# ---------------------------------------------------------------------------
# Running torch's backward (the entry points are in entry.py)


def _find_stock() -> Any:
    current = torch.Tensor.backward
    while getattr(current, "__backlens_live__", False):
        current = current.__wrapped__
    return current


_stock_backward = _find_stock()
_graph_task_id = _torch.graph_task_id_function()


def bare_in_trace(tensor, block, frame, gradient, retain_graph, create_graph, inputs):  # noqa: ANN001
    tracer = block.tracer
    if not tracer._warned_bare:
        tracer._warned_bare = True
        warnings.warn(
            BacklensWarning(
                "loss.backward() inside a trace runs the whole backward at once, so intermediate "
                ".grad stays None. To read or replace gradients as they flow, use the with form:\n"
                "    with loss.backward():\n"
                "        g = h.grad.save()",
                code="bare_backward_in_trace",
            ),
            stacklevel=3,
        )
    if tracer.keep_graph:
        retain_graph = True
    invoke = block.invoke.index if block.invoke is not None else None
    kept = bool(retain_graph if retain_graph is not None else create_graph)
    call = BackwardCall(invoke, kept, frame.f_code.co_filename, frame.f_lineno, single=tracer._single)
    return _run_engine(tracer, call, tensor, gradient, retain_graph, create_graph, inputs)


def _run_engine(tracer: Tracer | None, call: BackwardCall, tensor, gradient, retain_graph, create_graph, inputs):  # noqa: ANN001
    """Run torch's backward; explain a freed shared graph in the trace's terms."""
    before = len(tracer._backwards) if tracer is not None else 0
    if tracer is not None:
        tracer._backwards.append(call)
    token = recording_own.set(True)
    try:
        return _stock_backward(tensor, gradient, retain_graph, create_graph, inputs)
    except RuntimeError as exc:
        if tracer is not None and is_freed_graph(exc):
            raise freed_graph_error(exc, call, tracer._backwards[:before]) from exc
        raise
    finally:
        recording_own.reset(token)


# ---------------------------------------------------------------------------
# The block


class BackwardBlock(WithBody):
    """What ``t.backward(...)`` returns as the expression of a ``with``."""

    _what = "loss.backward()"
    _grads = True

    def __init__(self, tensor: torch.Tensor, args: tuple[Any, ...]):
        self._tensor = tensor
        self._args = args

    @classmethod
    def _make(cls, tensor: torch.Tensor, args: tuple[Any, ...], source: BlockSource | TraceError, frame: types.FrameType) -> Any:
        """The block, or one that refuses at once (no graph to run in, a body that cannot run)."""
        try:
            gradient, retain_graph, create_graph, inputs = args
            if gradient is not None or retain_graph is not None or create_graph is not False or inputs is not None:
                _args.backward_options("loss.backward", *args)  # the defaults need no check
            if isinstance(source, TraceError):
                raise source
            if tensor.grad_fn is None and not tensor.requires_grad:
                label = describe(tensor, current_block(), frame)
                why = (
                    "it is an inference tensor, made under torch.inference_mode()"
                    if tensor.is_inference()
                    else "the forward ran under torch.no_grad() or torch.inference_mode(), or nothing in it "
                    "requires grad (a frozen model, or generate())"
                )
                raise NoGradForwardError(
                    f"{label} carries no autograd graph, so there is no backward pass for this block to "
                    f"run in: {why}.",
                    remedy="Run the forward with gradients enabled (no torch.no_grad / inference_mode).",
                )
            block = cls(tensor, args)
            block._prepare(source)
        except BacklensError as err:
            return refusal(err)
        return block

    def __enter__(self) -> BackwardBlock:
        self._arm(sys._getframe(1))
        return self

    def _run(self, frame: types.FrameType, state: CallerState) -> dict[str, Any]:
        assert self._source is not None
        body = compile_body(self._source, frame, self._what, grads=True)
        run = BackwardRun(self._tensor, self._args, current_block(), self._source, frame)
        return run.execute(body, state)

    def _cleanup(self) -> None:
        self._tensor = None  # type: ignore[assignment]


_NEAR_LOSS = 16  # nodes a request made before the run is looked for among, from the loss down


def _is_request(pending: Any) -> bool:
    return pending is not None


def _stop_on_error(mediator: Mediator) -> None:
    if mediator.error is not None:
        raise StopRun()


@dataclass(eq=False)
class _Target:
    """A tensor whose gradient a body asked for; named only if a message needs it (by the
    site it was served at, when it was: ``describe`` looks there first)."""

    tensor: torch.Tensor
    block: Block | None
    frame: types.FrameType | None
    node: Any
    rows: tuple[int, int] | None
    full: torch.Tensor

    @property
    def label(self) -> Label:
        return describe(self.tensor, self.block, self.frame)


class BackwardRun:
    """One backward engine run with one block body in step with it."""

    def __init__(
        self, tensor: torch.Tensor, args: tuple[Any, ...], parent: Block | None, source: BlockSource, frame: types.FrameType
    ):
        self.tensor = tensor
        self.gradient, self.retain_graph, self.create_graph, self.inputs = args
        self.parent = parent
        self.tracer: Tracer | None = parent.tracer if parent is not None else None
        self.forward: ForwardRun | None = parent.forward if parent is not None else None
        self.invoke = parent.invoke if parent is not None else None
        self.source = source
        self._frame = frame  # to name the loss, only if an error needs it
        self.mediator: Mediator | None = None
        self.driver: Any = None
        self._graph: GraphIndex | None = None
        self._engine_task: int | None = None  # the id of this block's engine run, once it started
        self._check_hooked = False  # _check_in_engine is registered (or the run is over)
        self._expect: dict[int, _Target] = {}
        self._served: dict[int, Event] = {}
        self._last: _Target | None = None
        self._handles: list[Any] = []
        self._version_of = _torch.tensor_version_reader()
        # Whether the engine run can say which nodes it runs (not for ``inputs=``: it runs only
        # the paths to them, and a request off them gets its own error at the end).
        self._engine_answers = _torch.HAS_ENGINE_NODE_QUERY and self.inputs is None and tensor.grad_fn is not None

    @property
    def loss(self) -> Label:
        return describe(self.tensor, self.parent, self._frame)

    # -- the driver -------------------------------------------------------------
    def execute(self, body: CompiledBody, state: CallerState) -> dict[str, Any]:
        block = Block("backward", tracer=self.tracer, forward=self.forward, invoke=self.invoke, backward=self)
        mediator = Mediator(block, body, state)
        self.mediator = mediator
        try:
            # The engine runs in a driver coroutine (see live.mediator.drive): a torch error
            # raised in the engine or the body then walks only sound native frames.
            error = drive(self._drive_engine)
        finally:
            mediator.release()
            self.mediator = None
            self.driver = None
            self._graph = None
            self._engine_task = None
            self._expect.clear()
            self._served.clear()
            self._last = None
            self._frame = None
        if mediator.error is not None:
            raise mediator.error
        if error is not None:
            raise error
        result = mediator.result or {}
        mediator.result = None
        updates = saved_names(result, block, body.assigned)
        if body.writeback:  # nonlocal names the body assigned (rare)
            updates.update({name: result[name] for name in body.writeback if name in result})
        return updates

    def _drive_engine(self) -> BaseException | None:
        """The driver: start the body, run the engine, unwind the body; returns what failed."""
        mediator = self.mediator
        assert mediator is not None
        self.driver = getcurrent()
        error: BaseException | None = None
        try:
            mediator.start()
            if mediator.error is None:
                retain = self.retain_graph
                if self.tracer is not None and self.tracer.keep_graph:
                    retain = True
                kept = bool(retain if retain is not None else self.create_graph)
                invoke = self.invoke.index if self.invoke is not None else None
                single = self.tracer._has_inputs if self.tracer is not None else False  # Tracer._single
                call = BackwardCall(invoke, kept, self.source.filename, self.source.with_line, single=single)
                if single_threaded_engine():
                    with torch.autograd.set_multithreading_enabled(False):
                        _run_engine(self.tracer, call, self.tensor, self.gradient, retain, self.create_graph, self.inputs)
                else:
                    _run_engine(self.tracer, call, self.tensor, self.gradient, retain, self.create_graph, self.inputs)
                self._engine_task = None
                self._check_hooked = True  # the run is over: nothing left to check as it starts
                self._finish()
        except StopRun:
            pass
        except BaseException as exc:  # the engine failed: stop the body, then report
            error = exc
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            mediator.cancel()
        return error

    def _finish(self) -> None:
        """Tell a body still waiting that its gradient never came, and why."""
        assert self.mediator is not None
        if self.mediator.done:
            return
        answer_unserved(
            self.mediator, _is_request, lambda pending: self._never_arrived(self._expect[pending]), _stop_on_error
        )

    def _never_arrived(self, target: _Target) -> BaseException:
        if self.inputs is not None:
            return TraceError(
                f"{target.label.grad} never arrived: this backward computes gradients only on the way "
                "to the `inputs` given to backward(), and its path is not among them.",
                code="grad_not_computed",
                remedy="Drop `inputs=` or include a tensor the gradient flows into.",
            )
        last = f" (the last one served was {self._last.label.grad})" if self._last is not None else ""
        return OutOfOrderError(
            f"{target.label.grad} never arrived: its gradient had already flowed past when it was "
            f"requested{last}. Gradients arrive in reverse forward order, so request later layers first.",
        )

    # -- what the body asks for -------------------------------------------------
    def read_grad(self, tensor: torch.Tensor, frame: types.FrameType) -> Any:
        event, target = self._event_for(tensor, frame, writing=False)
        rows = target.rows
        return event.value if rows is None else event.value[rows[0] : rows[1]]

    def write_grad(self, tensor: torch.Tensor, value: Any, frame: types.FrameType) -> None:
        event, target = self._event_for(tensor, frame, writing=True)
        batch = self.forward.batch if self.forward is not None else 0
        event.replace(rows_mod.put_gradient(event.value, value, target.rows, batch, target.label.grad))

    def _event_for(self, tensor: torch.Tensor, frame: types.FrameType, writing: bool) -> tuple[Event, _Target]:
        """The event carrying the gradient of ``tensor``'s target, waiting for it if needed.

        The event holds the whole (batched) gradient; the target's ``rows`` say
        which part is ``tensor``'s, so two invokes' views of one batched tensor
        share one event and each reads and writes only its own rows.
        """
        # The hot path of every read: few calls, as each one runs with the caches the
        # engine's kernels have just emptied.
        mediator = self.mediator
        assert mediator is not None
        served_rows = self.forward.served_rows(tensor) if self.forward is not None else None
        if served_rows is None:
            target = _Target(tensor, mediator.block, frame, None, None, tensor)
        else:
            target = _Target(tensor, mediator.block, frame, None, served_rows[0], served_rows[1])
        key = id(target.full)
        event = mediator.event
        if event is not None and event.key == key:
            return event, target
        served = self._served.get(key)
        if served is not None:
            if writing:
                raise TraceError(
                    f"{target.label.grad} can no longer be replaced: its gradient has already flowed on "
                    "towards the inputs.",
                    code="grad_already_passed",
                    remedy="Set .grad while it arrives, before requesting an earlier layer's gradient.",
                )
            return served, target
        return mediator.request(self._arm(target)), target

    def _arm(self, target: _Target) -> int:
        """Check a new request and hook its tensor; returns the key its event will carry."""
        key = id(target.full)
        target.node = node = self._check_path(target)
        last = self._last
        # Made before the one served last (the usual order): answered by sequence numbers.
        if last is not None and node is not None and last.node is not None and not _torch.made_before(node, last.node):
            self._check_order(target, last)
        self._expect[key] = target
        self._handles.append(_torch.add_tensor_hook(target.full, functools.partial(self._on_grad, key)))
        return key

    def _check_path(self, target: _Target) -> Any:
        full = target.full
        if not full.requires_grad:
            raise NoGradientPathError(
                f"{target.label.grad} was requested, but {target.label} does not require grad, so no "
                f"gradient flows into it from {self.loss}."
            )
        node = full.grad_fn
        if node is not None and self._engine_answers:
            # Asked of the engine run, which knows its nodes: walking a fresh graph costs more
            # than the rest of a block. Before the run starts, asked as it starts (_check_in_engine).
            if node is self.tensor.grad_fn:
                return node
            if self._engine_task is None:
                # Before the run: a node near the loss is found by a short walk, any other asked
                # of the engine as it starts (a hook the engine calls costs more than a short walk).
                if not met_within(self.tensor.grad_fn, node, _NEAR_LOSS):
                    self._check_when_engine_starts()
                return node
            runs = _torch.engine_will_run(node) if self._engine_task == _graph_task_id() else None
            if runs is False:
                raise self._no_path(target)
            if runs:
                return node
        if self._graph is None:
            root = self.tensor.grad_fn
            self._graph = GraphIndex([root] if root is not None else [])
        node = self._graph.node_of(full)
        if node is None and full is self.tensor:
            return None  # a leaf backpropagated from itself
        if node is None:
            raise self._no_path(target)
        return node

    def _no_path(self, target: _Target) -> NoGradientPathError:
        return NoGradientPathError(
            f"{target.label.grad} was requested, but {self.loss} does not depend on {target.label}, "
            "so no gradient flows into it in this backward."
        )

    def _check_when_engine_starts(self) -> None:
        """Have the engine's first node check the request made before the run (once, before it).

        A pre-hook of the loss's node, which the engine runs first: the body's
        first request waits there, and its own hook is on another tensor's node.
        """
        if not self._check_hooked and self.driver is not None and self._engine_task is None:
            self._check_hooked = True
            self._handles.append(self.tensor.grad_fn.register_prehook(self._check_in_engine))

    def _check_in_engine(self, _grads: Any) -> None:
        """The loss's node, the engine's first: note the run and check the request the body
        is waiting on (made before the run, so not checked yet)."""
        if getcurrent() is not self.driver or self._engine_task is not None:
            return
        self._engine_task = _graph_task_id()
        mediator = self.mediator
        if mediator is None or mediator.done or mediator.pending is None:
            return
        target = self._expect[mediator.pending]
        node = target.node
        if node is not None and node is not self.tensor.grad_fn and _torch.engine_will_run(node) is False:
            mediator.fail(self._no_path(target))
            if mediator.error is not None:
                raise StopRun()

    def _check_order(self, target: _Target, last: _Target) -> None:
        """Refuse a request whose gradient arrives before the one served last (both have nodes)."""
        node = target.node
        if node is last.node or reaches(node, last.node):
            new, old = target.label, last.label
            raise OutOfOrderError(
                f"{new.grad} was requested after {old.grad}, but gradients arrive in reverse "
                f"forward order: {new.name}'s gradient is computed before {old.name}'s, so it had "
                f"already passed. Request {new.grad} before {old.grad}."
            )

    # -- the hook (the engine, in the driver's coroutine) ---------------------------
    def _on_grad(self, key: int, grad: torch.Tensor) -> Any:
        mediator = self.mediator
        if mediator is None or mediator.done or mediator.pending != key or getcurrent() is not self.driver:
            return None
        if self._engine_task is None:  # no request waited for the run to start
            self._engine_task = _graph_task_id()
        event = Event(key, grad)
        # Recorded before the body runs on: its next request is checked against it.
        self._served[key] = event
        self._last = self._expect[key]
        version_of = self._version_of  # without a version counter, a copy to compare with
        version = version_of(grad) if version_of is not None else None
        before = grad.clone() if version_of is None else None
        mediator.serve(event)
        if mediator.error is not None:
            raise StopRun()
        # (also when replaced: the buffer may reach other paths)
        if not _same_values(grad, before) if before is not None else version_of(grad) != version:
            raise self._changed_in_place(self._expect[key])
        return event.value if event.replaced else None

    def _changed_in_place(self, target: _Target) -> TraceError:
        return TraceError(
            f"{target.label.grad} was changed in place by the backward block (an in-place operation "
            "such as .mul_() or .zero_() on the gradient it served). That gradient is autograd's own "
            "buffer, which it may also be handing to other paths of the graph, so the edit could reach "
            "gradients it was not meant for; the backward was stopped.",
            code="grad_changed_in_place",
            remedy="Assign a new tensor instead (h.grad = h.grad * 2); item assignments "
            "(h.grad[0] = 0, h.grad[0] *= 2) work too: they edit a copy.",
        )


def _same_values(now: torch.Tensor, before: torch.Tensor) -> bool:
    """The same bits (NaNs and signed zeros included), as an unchanged version counter would say."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return False
    return torch.equal(now.reshape(-1).view(torch.uint8), before.reshape(-1).view(torch.uint8))
