"""Driving the forward: one batched model call, invoke bodies served from hooks.

A :class:`ForwardRun` combines its invokes' inputs into one batch, sets up one
mediator per invoke, and calls the model once. A process-wide module forward
hook, acting only in this run's thread (every module call must take torch's
hooked path, or a module already running when its output is requested would
never report it), plus a pre-hook on each module whose inputs were asked for,
hands each value a body waits for to it, cut to that invoke's rows, and writes
back the rows the body replaced. When the model returns, any body still
waiting is told, in module terms, what it waited for and why it never came.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from backlens.errors import TraceError
from backlens.live import rows as rows_mod
from backlens.live.context import Block, saved_names
from backlens.live.lens import navigate
from backlens.live.mediator import CallerState, Event, Mediator, StopRun
from backlens.live.naming import INPUT, OUTPUT, Site, site_name
from backlens.live.source import BlockSource

if TYPE_CHECKING:
    from backlens.live.tracer import Tracer

_MISSING = object()


@dataclass(eq=False)
class Invoke:
    """One invoke: its inputs, its body, and its rows of the batch."""

    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    body: Callable[..., dict[str, Any]]
    namespace: dict[str, Any]
    source: BlockSource
    rows: tuple[int, int] | None = None
    updates: dict[str, Any] = field(default_factory=dict)


class ForwardRun:
    """One model call serving every invoke of a trace."""

    def __init__(self, tracer: Tracer, invokes: list[Invoke], state: CallerState):
        self.tracer = tracer
        self.invokes = invokes
        self.state = state
        self.model: nn.Module = tracer._model
        self.batch = 0
        self.driver: int | None = None
        self.mediators: list[Mediator] = []
        self._waiting: dict[tuple[str, nn.Module], list[Mediator]] = {}
        self._ran: dict[nn.Module, int] = {}
        self._addresses: dict[nn.Module, str] = {}
        self._params: dict[int, str] | None = None
        self._sites: dict[int, Site] = {}
        self._handles: list[Any] = []
        self._pre_hooked: set[nn.Module] = set()
        self._inline = 0

    # -- what bodies ask for ---------------------------------------------
    def value_for(self, mediator: Mediator, module: nn.Module, address: str, kind: str) -> Event:
        """The event holding ``module``'s ``kind`` value for this mediator (waits for it)."""
        key = (kind, module)
        event = mediator.event
        if event is not None and event.key == key:
            return event
        queued = mediator.queued
        if queued and queued[0].key == key:
            return queued.popleft()
        if mediator.inline:  # runs in the driver's thread after the model's output: nothing more comes
            self._addresses[module] = address
            raise self._unserved(mediator, module, kind)
        self._wait_for(mediator, key, address)
        return mediator.request(key)

    def _wait_for(self, mediator: Mediator, key: tuple[str, nn.Module], address: str) -> None:
        kind, module = key
        self._addresses[module] = address
        if kind == INPUT and module not in self._pre_hooked:
            self._pre_hooked.add(module)
            self._handles.append(module.register_forward_pre_hook(self._on_input, with_kwargs=True))
        self._waiting.setdefault(key, []).append(mediator)

    def _predict(self, invoke: Invoke) -> list[tuple[tuple[str, nn.Module], str]]:
        """The keys the invoke's body asks for first, when nothing observable runs between them."""
        plan = []
        for request in invoke.source.leading_requests:
            root = invoke.namespace.get(request.name, _MISSING)
            if root is _MISSING:
                root = invoke.body.__globals__.get(request.name)
            lens = navigate(root, request.steps)
            if lens is None or lens._lens_root is not self.tracer._lens_root_of:
                break
            kind = OUTPUT if request.attr == OUTPUT else INPUT
            key = (kind, lens._lens_module)
            if any(key == planned for planned, _ in plan):
                break  # a second read of one value is served from the same event
            plan.append((key, lens._lens_address))
        return plan

    def site_of(self, tensor: Any) -> Site | None:
        site = self._sites.get(id(tensor))
        return site if site is not None and site.view is tensor else None

    def site_name(self, key: tuple[str, nn.Module]) -> str:
        return site_name(self.address(key[1]), key[0])

    def param_name(self, tensor: Any) -> str | None:
        if self._params is None:
            self._params = {id(p): name for name, p in self.model.named_parameters()}
        return self._params.get(id(tensor))

    def address(self, module: nn.Module) -> str:
        """The module's address as the user reached it (``""`` for the model itself)."""
        if module is self.model:
            return ""
        found = self._addresses.get(module)
        if found is None:
            found = next((name for name, m in self.model.named_modules() if m is module), type(module).__name__)
            self._addresses[module] = found
        return found

    # -- the run -----------------------------------------------------------
    def execute(self) -> Any:
        """Run the model once with every invoke in step; raises the first body error."""
        args, kwargs = self._batch_inputs()
        store = self.tracer._graph_store
        context = store.hooks if store is not None else None
        predicted = []
        for invoke in self.invokes:
            block = Block("invoke", tracer=self.tracer, forward=self, invoke=invoke)
            self.mediators.append(Mediator(block, invoke.body, invoke.namespace, self.state, context))
            predicted.append(self._predict(invoke))
            invoke.body = invoke.namespace = None  # type: ignore[assignment]  # the mediator owns them now
        self.driver = threading.get_ident()
        error: BaseException | None = None
        output = None
        try:
            # One process-wide hook instead of one per module: registering a
            # handle per module costs more than a small model's whole forward.
            self._handles.append(register_module_forward_hook(self._on_output))
            for mediator, plan in zip(self.mediators, predicted):
                if plan:
                    for key, address in plan:
                        self._addresses[key[1]] = address
                    mediator.defer([key for key, _ in plan])
                    source = mediator.block.invoke.source  # type: ignore[union-attr]
                    complete = len(plan) == len(source.leading_requests)
                    # Inline (in this thread, no hand-off) when nothing after the
                    # plan could wait for the model: the body only reads, or its
                    # last planned value is the model's output, after which
                    # nothing more of the forward can be served anyway.
                    mediator.inline = complete and (source.reads_only or plan[-1][0] == (OUTPUT, self.model))
                    self._wait_for(mediator, *plan[0])
                    continue
                mediator.start()
                if mediator.error is not None:
                    raise StopRun()
            with context() if context is not None else nullcontext():
                output = self.model(*args, **kwargs)
            self._finish()
        except StopRun:
            pass
        except BaseException as exc:  # the model (or an interrupt) failed: stop every body
            error = exc
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for mediator in self.mediators:
                mediator.cancel()
            self._sites.clear()
            self._waiting.clear()
        failed = next((m.error for m in self.mediators if m.error is not None), None)
        if failed is not None:
            raise failed
        if error is not None:
            raise error
        for mediator, invoke in zip(self.mediators, self.invokes):
            if mediator.result is not None:
                invoke.updates = saved_names(mediator.result, mediator.block, invoke.source.assigned)
            mediator.result = None
        return output

    def _batch_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(self.invokes) == 1:
            invoke = self.invokes[0]
            invoke.rows = None
            return invoke.args, invoke.kwargs
        batcher = self.tracer._batcher
        start = 0
        for invoke in self.invokes:
            size = int(batcher.size(*invoke.args, **invoke.kwargs))
            invoke.rows = (start, start + size)
            start += size
        self.batch = start
        args, kwargs = batcher.combine([(inv.args, inv.kwargs) for inv in self.invokes])
        return tuple(args), dict(kwargs)

    def _finish(self) -> None:
        """Tell every body still waiting that its value never came, and why."""
        for mediator in self.mediators:
            attempts = 0
            while not mediator.done and mediator.pending is not None:
                attempts += 1
                if attempts > 100:  # a body that keeps catching and asking again
                    mediator.cancel()
                    break
                kind, module = mediator.pending
                self._drop_waiter(mediator)
                mediator.fail(self._unserved(mediator, module, kind))
                if mediator.error is not None:
                    raise StopRun()

    def _drop_waiter(self, mediator: Mediator) -> None:
        waiters = self._waiting.get(mediator.pending)
        if waiters and mediator in waiters:
            waiters.remove(mediator)

    def _unserved(self, mediator: Mediator, module: nn.Module, kind: str) -> TraceError:
        address = self.address(module)
        site = site_name(address, kind)
        who = address or f"the model ({type(self.model).__name__})"
        invoke = mediator.block.invoke
        label = f"{site} (invoke {invoke.index})" if invoke is not None else site
        if self._ran.get(module):
            return TraceError(
                f"{label} was requested after {who} had already run: values are served while "
                "the model runs, in the order its modules run, so a module's value must be "
                "requested before that module runs.",
                code="module_already_ran",
                remedy="Request module values in forward order (earlier layers first).",
            )
        return TraceError(
            f"{label} was never served: {who} did not run in this forward pass.",
            code="module_not_run",
            remedy="Check that the model actually calls this module for these inputs.",
        )

    # -- hooks (driver thread) -------------------------------------------------
    def _on_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._inline or threading.get_ident() != self.driver:  # a body calling a module itself
            return None
        self._ran[module] = self._ran.get(module, 0) + 1
        waiters = self._waiting.pop((OUTPUT, module), None)
        if not waiters:
            return None
        value, changed = self._serve((OUTPUT, module), output, waiters)
        return value if changed else None

    def _on_input(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._inline or threading.get_ident() != self.driver:
            return None
        waiters = self._waiting.pop((INPUT, module), None)
        if not waiters:
            return None
        value, changed = self._serve((INPUT, module), (args, kwargs), waiters)
        return value if changed else None

    def _serve(self, key: tuple[str, nn.Module], value: Any, waiters: list[Mediator]) -> tuple[Any, bool]:
        changed = False
        if len(waiters) > 1:
            waiters = sorted(waiters, key=_invoke_index)
        for mediator in waiters:
            invoke = mediator.block.invoke
            assert invoke is not None

            def remember(view: torch.Tensor, full: torch.Tensor, _inv: Invoke = invoke) -> None:
                # The first-served name wins: fc2's output is also the model's.
                if id(view) not in self._sites:
                    rows = _inv.rows if view is not full else None
                    self._sites[id(view)] = Site(self, key, _inv.index, full, rows, view)

            event = Event(key, rows_mod.take(value, invoke.rows, self.batch, remember))
            if mediator.hold(event):
                # A planned read that only binds a name: kept for the body,
                # which runs at its next planned request.
                self._wait_for(mediator, mediator.pending, self._addresses.get(mediator.pending[1], ""))
                continue
            if mediator.inline and not mediator.started:
                self._inline += 1  # the body runs in this thread: its module calls are its own
                try:
                    mediator.serve(event)
                finally:
                    self._inline -= 1
            else:
                mediator.serve(event)
            if mediator.error is not None:
                raise StopRun()
            if event.replaced:
                label = f"{site_name(self.address(key[1]), key[0])} (invoke {invoke.index})"
                value = rows_mod.put(value, event.value, invoke.rows, self.batch, label)
                changed = True
        return value, changed


def _invoke_index(mediator: Mediator) -> int:
    invoke = mediator.block.invoke
    return invoke.index if invoke is not None else 0
