"""Driving the forward: one batched model call, invoke bodies served from hooks.

A :class:`ForwardRun` combines its invokes' inputs into one batch, starts one
mediator per invoke, and calls the model once, in the caller's thread. The
run subscribes to module calls (``backlens._module_calls``, for the whole
run, so a module already running when its output is requested still reports
it; acting only for the coroutine that drives the run) and hands each value
a body waits for (a module's inputs before it runs, its output after) to it,
cut to that invoke's rows, and writes back the rows the body replaced. Bodies meet at barriers here too.
When the model returns, any body still waiting is told, in module terms, what
it waited for and why it never came.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from backlens import _module_calls as module_calls
from backlens.errors import TraceError
from backlens.live import rows as rows_mod
from backlens.live.barrier import Barrier, BarrierWait, unfilled_error
from backlens.live.compiler import CompiledBody
from backlens.live.context import Block, saved_names
from backlens.live.launch import drive
from backlens.live.mediator import Event, Mediator, StopRun, answer_unserved, getcurrent
from backlens.live.naming import INPUT, OUTPUT, Site, site_name, spelled_path
from backlens.live.skip import write_locals
from backlens.live.torchstate import CallerState


@dataclass(eq=False)
class Invoke:
    """One invoke: its inputs, its body, the torch modes where it started, and its rows of the batch."""

    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    body: CompiledBody | None
    state: CallerState
    rows: tuple[int, int] | None = None
    updates: dict[str, Any] = field(default_factory=dict)


class ForwardRun:
    """One model call serving every invoke of a trace."""

    def __init__(self, tracer: Any, invokes: list[Invoke], state: CallerState):  # tracer: the Tracer it runs for
        self.tracer = tracer
        self.invokes = invokes
        self.state = state
        self.model: nn.Module = tracer._model
        self.batch = 0
        self.driver: Any = None
        self.mediators: list[Mediator] = []
        self._waiting: dict[tuple[str, nn.Module], list[Mediator]] = {}
        self._ran: set[nn.Module] = set()  # modules whose call returned
        self._addresses: dict[nn.Module, str] = {}
        self._params: dict[int, str] | None = None
        # id(view) -> its Site, or the Site's fields (made into one when first asked for)
        self._sites: dict[int, Site | tuple[Any, ...]] = {}
        self._inputs_wanted: set[nn.Module] = set()
        self._arrived: dict[Barrier, list[Mediator]] = {}
        self._injected: dict[Mediator, dict[str, Any]] = {}  # what barriers handed each body
        # The module calls this run watches: those of the classes of the model's modules and of
        # every module its lens reached (module_calls explains why not every module call).
        self._watched: frozenset[type] = tracer._lens._lens_root.classes_to_watch()
        self._watched_late: set[type] = set()  # watched only once the model ran: whether they ran is unknown
        self._model_called = False
        self._subscription: module_calls.Subscription | None = None

    # -- what bodies ask for (body side) ---------------------------------------
    def value_for(self, mediator: Mediator, module: nn.Module, address: str, kind: str) -> Event:
        """The event holding ``module``'s ``kind`` value for this mediator (waits for it)."""
        key = (kind, module)
        event = mediator.event
        if event is not None and event.key == key:
            return event
        self._addresses[module] = address
        if type(module) not in self._watched:  # its class changed since its lens was made
            self.watch_class(type(module))
        if kind == INPUT:
            self._inputs_wanted.add(module)
        self._waiting.setdefault(key, []).append(mediator)
        return mediator.request(key)

    def watch_class(self, cls: type) -> None:
        """Watch the calls of ``cls``'s modules from now on (a body reached one that this run
        did not watch: a module added since, or not registered in the model)."""
        if cls in self._watched:
            return
        self._watched = self._watched | {cls}
        if self._model_called:
            self._watched_late.add(cls)
        if self._subscription is not None:
            self._subscription.widen((cls,))

    def site_of(self, tensor: Any) -> Site | None:
        site = self._sites.get(id(tensor))
        if type(site) is tuple:
            if site[5] is not tensor:
                return None
            site = self._sites[id(tensor)] = Site(*site)
        return site if site is not None and site.view is tensor else None

    def served_rows(self, tensor: Any) -> tuple[tuple[int, int] | None, Any] | None:
        """``(rows, full)`` of a served tensor (see :class:`Site`), making no Site."""
        site = self._sites.get(id(tensor))
        if type(site) is tuple:
            return (site[4], site[3]) if site[5] is tensor else None
        return (site.rows, site.full) if site is not None and site.view is tensor else None

    def site_name(self, key: tuple[str, nn.Module]) -> str:
        return site_name(self.address(key[1]), key[0])

    def param_name(self, tensor: Any) -> str | None:
        if self._params is None:
            self._params = {id(p): name for name, p in self.model.named_parameters()}
        return self._params.get(id(tensor))

    def address(self, module: nn.Module) -> str:
        """The module's path as the user reached it (``""`` for the model itself)."""
        if module is self.model:
            return ""
        found = self._addresses.get(module)
        if found is None:
            dotted = next((name for name, m in self.model.named_modules() if m is module), None)
            found = spelled_path(self.model, dotted) if dotted is not None else type(module).__name__
            self._addresses[module] = found
        return found

    # -- the run ---------------------------------------------------------------
    def execute(self) -> Any:
        """Run the model once with every invoke in step; raises the first body error."""
        args, kwargs = self._batch_inputs()
        for invoke in self.invokes:
            block = Block("invoke", tracer=self.tracer, forward=self, invoke=invoke)
            assert invoke.body is not None
            self.mediators.append(Mediator(block, invoke.body, invoke.state))
            invoke.body = None  # the mediator owns it now
        try:
            # The model runs in a driver coroutine (see live.mediator.drive).
            output, error, failed = drive(functools.partial(self._run_model, args, kwargs))
            if failed is not None:
                raise failed
            if error is not None:
                raise error
            for mediator, invoke in zip(self.mediators, self.invokes):
                result, body = mediator.result, mediator.body
                if result is not None and body is not None:
                    invoke.updates = saved_names(result, mediator.block, body.assigned)
                    if body.writeback:  # nonlocal names the body assigned (rare)
                        invoke.updates.update({name: result[name] for name in body.writeback if name in result})
                mediator.result = None
        finally:
            for mediator in self.mediators:
                mediator.release()
            self.mediators = []
        return output

    def _run_model(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, BaseException | None, BaseException | None]:
        """The driver: start the bodies, call the model, unwind the bodies; returns the
        model's output, what failed in the run and the first body error."""
        store = self.tracer._graph_store
        self.driver = getcurrent()
        error: BaseException | None = None
        failed: BaseException | None = None
        output = None
        subscription = None
        try:
            subscription = self._subscription = module_calls.subscribe(self, self._watched)
            if store is None:
                output = self._call_model(args, kwargs)
            else:
                with store.hooks():
                    output = self._call_model(args, kwargs)
        except StopRun:
            pass
        except BaseException as exc:  # the model (or an interrupt) failed: stop every body
            error = exc
        finally:
            if subscription is not None:
                subscription.cancel()
                self._subscription = None
            self._inputs_wanted.clear()
            for mediator in self.mediators:  # the first body error (a loop: this runs every trace)
                if mediator.error is not None:
                    failed = mediator.error
                    break
            for mediator in self.mediators:
                mediator.cancel()
            self._sites.clear()
            self._waiting.clear()
            self._arrived.clear()
            self._injected.clear()
        return output, error, failed

    def _call_model(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for mediator in self.mediators:
            mediator.start()
            self._after(mediator)
        self._model_called = True
        output = self.model(*args, **kwargs)
        # The model's own output is served here, once its call has
        # returned: what a body does next (its backward, often) then
        # runs with no forward frame left waiting under it, which
        # measurably slows a backward run from inside a forward hook.
        output = self._serve_all((OUTPUT, self.model), output)
        self._finish()
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

    def _after(self, mediator: Mediator) -> None:
        """What the driver does each time a body hands control back."""
        if mediator.error is not None:
            raise StopRun()
        pending = mediator.pending
        if type(pending) is BarrierWait:
            self._arrive(mediator, pending)
        elif mediator.done and self._arrived:
            self._check_barriers()

    def _finish(self) -> None:
        """Tell every body still waiting that its value never came, and why."""
        for mediator in self.mediators:
            if not mediator.done:
                answer_unserved(mediator, _is_module_request, lambda pending, m=mediator: self._unserved(m, pending), self._after)
        while self._arrived:
            self._unfilled(next(iter(self._arrived)))

    def _unserved(self, mediator: Mediator, key: tuple[str, nn.Module]) -> TraceError:
        kind, module = key
        waiters = self._waiting.get(key)
        if waiters and mediator in waiters:
            waiters.remove(mediator)
        address = self.address(module)
        site = site_name(address, kind)
        who = address or f"the model ({type(self.model).__name__})"
        invoke = mediator.block.invoke
        label = f"{site} (invoke {invoke.index})" if invoke is not None else site
        if type(module) in self._watched_late and module not in self._ran:
            return TraceError(
                f"{label} was never served: {who} did not run after the body reached it, and whether "
                f"it ran before cannot be told: its class, {type(module).__name__}, was not among the "
                "model's modules when the trace began (it is not a registered submodule, or its class "
                "changed), so its calls were watched only from then on.",
                code="module_not_run",
                remedy="Request module values in forward order; the next trace watches this module "
                "from its start.",
            )
        if module in self._ran:
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

    # -- barriers ----------------------------------------------------------------
    def _arrive(self, mediator: Mediator, wait: BarrierWait) -> None:
        barrier = wait.barrier
        arrived = self._arrived.setdefault(barrier, [])
        arrived.append(mediator)
        if len(arrived) < barrier.n:
            self._check_barriers()
            return
        del self._arrived[barrier]
        arrived.sort(key=_invoke_index)
        self._hand_over(arrived)
        for waiting in arrived:
            if not waiting.done and waiting.pending is not None:
                waiting.serve(Event(waiting.pending, None))
                self._after(waiting)

    def _hand_over(self, meeting: list[Mediator]) -> None:
        """Bind in each body the names the others bound above the barrier.

        A name a body bound itself keeps its own value; when several others
        bound it, the later invoke's value is the one seen (as if the bodies
        had run one after another, up to the barrier).
        """
        frames = []
        for mediator in meeting:
            wait = mediator.pending
            frame = wait.frame if type(wait) is BarrierWait else None
            frames.append((mediator, frame, dict(frame.f_locals) if frame is not None else {}))
        for mediator, frame, own in frames:
            if frame is None:
                continue
            copied = mediator.body.namespace if mediator.body is not None else {}
            injected = self._injected.setdefault(mediator, {})
            updates: dict[str, Any] = {}
            for other, _, theirs in frames:
                if other is mediator:
                    continue
                bound = other.body.assigned if other.body is not None else frozenset()
                for name, value in theirs.items():
                    if name not in bound or name.startswith("__backlens_"):
                        continue
                    mine = own.get(name, _UNSET)
                    if mine is not _UNSET and mine is not copied.get(name, _UNSET) and mine is not injected.get(name, _UNSET):
                        continue  # bound by this body itself
                    updates[name] = value
            injected.update(updates)
            write_locals(frame, updates)

    def _check_barriers(self) -> None:
        """Raise ``barrier_unfilled`` as soon as a barrier can no longer fill."""
        if not self._arrived:
            return
        waiting = {id(m) for ms in self._arrived.values() for m in ms}
        running = [m for m in self.mediators if not m.done]
        if all(id(m) in waiting for m in running):  # everyone left waits at a barrier
            self._unfilled(next(iter(self._arrived)))
            return
        for barrier, arrived in list(self._arrived.items()):
            here = {id(m) for m in arrived}
            if len(arrived) + sum(1 for m in running if id(m) not in here) < barrier.n:
                self._unfilled(barrier)
                return

    def _unfilled(self, barrier: Barrier) -> None:
        arrived = sorted(self._arrived.pop(barrier, []), key=_invoke_index)
        here = {id(m) for m in arrived}
        others = [(m, self._doing(m)) for m in self.mediators if id(m) not in here]
        error = unfilled_error(barrier, arrived, others)
        first, rest = arrived[0], arrived[1:]
        for mediator in rest:  # they stay waiting; the run stops with the first one's error
            mediator.cancel()
        first.fail(error)
        self._after(first)

    def _doing(self, mediator: Mediator) -> str:
        if mediator.done:
            return "finished without reaching it" if mediator.error is None else "failed"
        pending = mediator.pending
        if type(pending) is BarrierWait:
            return f"waits at {pending.barrier}"
        if isinstance(pending, tuple):
            return f"waits for {self.site_name(pending)}"
        return "has not run yet"

    # -- module calls (the driver's coroutine; see backlens._module_calls) ----------
    def module_called(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getcurrent() is not self.driver:  # another coroutine: a body calling a module itself
            return None
        if module in self._inputs_wanted:
            return self._on_input(module, args, kwargs)
        return True

    def module_raised(self, module: nn.Module, token: Any) -> None:
        return None

    def module_returned(self, module: nn.Module, token: Any, output: Any) -> Any:
        self._ran.add(module)
        if module is self.model:  # served when the model call returns (see execute)
            return output
        key = (OUTPUT, module)
        if key not in self._waiting:
            return output
        return self._serve_all(key, output)

    def _serve_all(self, key: tuple[str, nn.Module], value: Any) -> Any:
        """Serve ``value`` to every body waiting for ``key``; the value as they left it."""
        waiters = self._waiting.pop(key, None)
        while waiters:  # bodies may ask again for the value still at hand (after a barrier)
            value, _ = self._serve(key, value, waiters)
            waiters = self._waiting.pop(key, None)
        return value

    def _on_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = (INPUT, module)
        waiters = self._waiting.pop(key, None)
        if not waiters:
            return True
        value, changed = (args, kwargs), False
        while waiters:
            value, served_changed = self._serve(key, value, waiters)
            changed = changed or served_changed
            waiters = self._waiting.pop(key, None)
        return module_calls.NewInputs(value[0], value[1], True) if changed else True

    def _serve(self, key: tuple[str, nn.Module], value: Any, waiters: list[Mediator]) -> tuple[Any, bool]:
        changed = False
        if len(waiters) > 1:
            waiters = sorted(waiters, key=_invoke_index)
        batch = self.batch
        for mediator in waiters:
            invoke = mediator.block.invoke
            assert invoke is not None
            rows = invoke.rows
            if rows is None and type(value) is torch.Tensor:  # one invoke, one tensor: the usual case
                if id(value) not in self._sites:
                    self._sites[id(value)] = (self, key, invoke.index, value, None, value)
                event = Event(key, value)
            else:
                merge = self._merger(key, invoke, value) if rows is not None else None
                event = Event(key, rows_mod.take(value, rows, batch, self._remember(key, invoke)), merge)
            mediator.serve(event)
            self._after(mediator)
            if event.replaced:
                value = event.merged
                changed = True
        return value, changed

    def _remember(self, key: tuple[str, nn.Module], invoke: Invoke) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def remember(view: torch.Tensor, full: torch.Tensor) -> None:
            # The first-served name wins: fc2's output is also the model's.
            if id(view) not in self._sites:
                rows = invoke.rows if view is not full else None
                self._sites[id(view)] = (self, key, invoke.index, full, rows, view)

        return remember

    def _merger(self, key: tuple[str, nn.Module], invoke: Invoke, full: Any) -> Callable[[Any], Any] | None:
        if invoke.rows is None:
            return None

        def merge(part: Any) -> Any:
            label = f"{site_name(self.address(key[1]), key[0])} (invoke {invoke.index})"
            return rows_mod.put(full, part, invoke.rows, self.batch, label)

        return merge


_UNSET = object()


def _is_module_request(pending: Any) -> bool:
    return isinstance(pending, tuple)


def _invoke_index(mediator: Mediator) -> int:
    invoke = mediator.block.invoke
    return invoke.index if invoke is not None else 0
