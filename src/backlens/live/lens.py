"""``bl.wrap(model)``: a lens that mirrors the module tree.

``lens.transformer.h[5]`` is the lens of that submodule; its ``.output``,
``.input`` and ``.inputs`` are the real values while a trace runs, and
setting them replaces the value for the rest of the forward. Attributes that
are not submodules (``lens.config``) read through to the module. A submodule
whose name clashes with a lens attribute (BERT's ``layer[0].output`` module)
is reached by name: ``lens.encoder.layer[0]["output"]``. Each lens keeps the
path the user typed to reach it (``transformer.h[1]``), which is how errors
name its values. A compiled model (``torch.compile``) is seen, and traced,
through its original module tree.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from backlens import _args, _torch
from backlens._module_calls import module_classes
from backlens.derive.frameworks import refuse_other_framework
from backlens.errors import BacklensError, TraceError, UnsupportedInputError
from backlens.live import entry
from backlens.live.batching import Batcher, ConcatBatcher
from backlens.live.context import current_block
from backlens.live.mediator import Event
from backlens.live.naming import INPUT, OUTPUT, site_name
from backlens.live.tracer import Tracer

_OWN = ("output", "input", "inputs")
_children_dict = _torch.children_dict


@dataclass(eq=False)
class _Root:
    model: nn.Module
    batcher: Batcher
    # The classes whose module calls a trace watches (ForwardRun): those of the model's modules
    # when the first trace ran, and of every module a lens of this model reached since.
    watched: frozenset[type] | None = None
    reached: set[type] = field(default_factory=set)

    def classes_to_watch(self) -> frozenset[type]:
        if self.watched is None:
            self.watched = frozenset(module_classes(self.model) | self.reached)
        return self.watched

    def reach(self, module: nn.Module) -> None:
        """A lens was made for ``module``: watch its class from now on, in a running trace of
        this model too (a body reaches a module before asking for its values)."""
        cls = type(module)
        if cls in self.reached:
            return
        self.reached.add(cls)
        if self.watched is not None and cls not in self.watched:
            self.watched = self.watched | {cls}
        block = current_block()
        forward = block.forward if block is not None else None
        if forward is not None and forward.tracer._lens._lens_root is self:
            forward.watch_class(cls)


class Lens:
    """One module of a wrapped model, seen through backlens.

    ``_lens_address`` is the module's dotted path (``transformer.h.1``);
    ``_lens_spelled`` the way the user reached it (``transformer.h[1]``).
    """

    __slots__ = ("_lens_module", "_lens_root", "_lens_address", "_lens_spelled", "_lens_name", "_lens_children")

    def __init__(self, module: nn.Module, root: _Root, address: str = "", spelled: str | None = None, name: str = ""):
        object.__setattr__(self, "_lens_module", module)
        object.__setattr__(self, "_lens_root", root)
        object.__setattr__(self, "_lens_address", address)
        object.__setattr__(self, "_lens_spelled", address if spelled is None else spelled)
        object.__setattr__(self, "_lens_name", name)  # its module's name in its parent's
        # Children as reached before (a body reaches the same ones at every trace): by (name,
        # step as typed), and, for the fast paths of __getattr__ and __getitem__, by the
        # attribute's name and by a ModuleList's index.
        object.__setattr__(self, "_lens_children", {})

    # -- tracing -------------------------------------------------------------
    def trace(self, *args: Any, keep_graph: bool = False, **kwargs: Any) -> Any:
        """A ``with`` block whose body runs during the real forward (see API.md §2).

        With inputs, the body runs against ``model(*args, **kwargs)``; without,
        the body declares ``tracer.invoke(...)`` blocks that are batched into
        one forward call. ``keep_graph=True`` retains the autograd graph for
        every backward in the trace and frees it when the trace exits.
        """
        tracer = Tracer(self, args, kwargs, keep_graph=keep_graph)
        error: BacklensError | None = None
        if keep_graph is not False and keep_graph is not True:
            error = _args.problem(_args.flag, keep_graph, "keep_graph", "lens.trace")
        if self._lens_address:
            error = TraceError(
                f"trace() was called on the lens of {self._lens_spelled}; a trace runs the whole "
                "wrapped model.",
                code="trace_on_submodule",
                remedy="Call trace() on the lens bl.wrap(model) returned.",
            )
        return tracer._made_at(sys._getframe(1), error)

    # -- values ----------------------------------------------------------------
    @property
    def output(self) -> Any:
        """This module's output in the running forward (the invoke's rows of it)."""
        return self._event(OUTPUT, "output").value

    @output.setter
    def output(self, value: Any) -> None:
        self._event(OUTPUT, "output").replace(value)

    @property
    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """This module's call inputs as ``(args, kwargs)``."""
        return self._event(INPUT, "inputs").value

    @inputs.setter
    def inputs(self, value: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
            raise UnsupportedInputError(
                f"{site_name(self._lens_spelled, 'inputs')} must be set to a pair (args, kwargs).",
                code="bad_inputs_value",
                remedy="Set .inputs = (args_tuple, kwargs_dict), or set .input for the first argument.",
            )
        self._event(INPUT, "inputs").replace((tuple(value[0]), dict(value[1])))

    @property
    def input(self) -> Any:
        """This module's first positional input (its first keyword input if it has none)."""
        args, kwargs = self._event(INPUT, "input").value
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise self._no_input()

    @input.setter
    def input(self, value: Any) -> None:
        event = self._event(INPUT, "input")
        args, kwargs = event.value
        if args:
            event.replace(((value, *args[1:]), dict(kwargs)))
        elif kwargs:
            first = next(iter(kwargs))
            event.replace((tuple(args), {**kwargs, first: value}))
        else:
            raise self._no_input()

    def _no_input(self) -> TraceError:
        return TraceError(
            f"{site_name(self._lens_spelled, 'input')} does not exist: the module was called without arguments.",
            code="no_input",
            remedy="Read .inputs to see what the module was called with.",
        )

    def _event(self, kind: str, attr: str) -> Event:
        block = current_block()
        if (
            block is not None
            and block.kind == "invoke"
            and block.forward is not None
            and block.mediator is not None
            and block.forward.tracer._lens._lens_root is self._lens_root
        ):
            return block.forward.value_for(block.mediator, self._lens_module, self._lens_spelled, kind)
        raise self._refusal(block, attr)

    def _refusal(self, block: Any, attr: str) -> TraceError:
        """Why this value cannot be served here (worked out only on the error path)."""
        site = site_name(self._lens_spelled, attr)
        if block is None:
            return TraceError(
                f"{site} is only available inside a trace, while the model runs.",
                code="not_in_trace",
                remedy="Read it inside `with lens.trace(...):` (or a tracer.invoke block) and .save() it.",
            )
        if block.kind == "backward":
            return TraceError(
                f"{site} was read inside a backward block; only .grad is served there, because "
                "the forward has finished by the time the backward runs.",
                code="forward_value_in_backward",
                remedy=f"Read {site} before the `with ....backward():` block and use that variable inside it.",
            )
        if block.kind == "trace" or block.forward is None or block.mediator is None:
            return TraceError(
                f"{site} was read in the trace body outside any invoke; in a trace without inputs, "
                "module values are served only inside `with tracer.invoke(...):` blocks.",
                code="outside_invoke",
                remedy="Move the read into an invoke block, or pass the inputs to lens.trace(...).",
            )
        return TraceError(
            f"{site} belongs to another lens than the one being traced.",
            code="foreign_lens",
            remedy="Read values through the lens whose trace() is running.",
        )

    # -- the module tree -----------------------------------------------------
    def _child(self, module: nn.Module, name: str, step: str | None = None) -> Lens:
        """The lens of a child, reached by ``.name`` (or by ``step``, an index as typed: ``[1]``)."""
        children = self._lens_children
        known = children.get((name, step))
        if known is not None and known._lens_module is module:  # (a replaced submodule gets a new lens)
            return known
        address = f"{self._lens_address}.{name}" if self._lens_address else name
        spelled = step if step is not None else (f".{name}" if self._lens_spelled else name)
        child = Lens(module, self._lens_root, address, self._lens_spelled + spelled, name)
        children[(name, step)] = child
        self._lens_root.reach(module)
        return child

    # A body reads its modules' lenses right after a hand-over, with the caches the model's
    # kernels emptied, where each call costs: a child reached before that is still the module's
    # is returned in a few lookups (filed only where HAS_MODULE_DICTS).

    def __getattr__(self, name: str) -> Any:
        known = self._lens_children.get(name)
        if known is not None and _children_dict(self._lens_module).get(name) is known._lens_module:
            return known
        return self._attribute(name)

    def _attribute(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        module = self._lens_module
        child = _torch.module_children(module).get(name)
        if child is not None:
            lens = self._child(child, name)
            if _torch.HAS_MODULE_DICTS:
                self._lens_children[name] = lens
            return lens
        try:
            value = getattr(module, name)
        except AttributeError:
            where = self._lens_address or "the wrapped model"
            raise AttributeError(f"{type(module).__name__} at {where} has no attribute {name!r}") from None
        if isinstance(value, nn.Module):
            return self._child(value, name)
        return value

    def __getitem__(self, key: Any) -> Any:
        if type(key) is int:
            known = self._lens_children.get(key)
            if known is not None and _children_dict(self._lens_module).get(known._lens_name) is known._lens_module:
                return known
        return self._item(key)

    def _item(self, key: Any) -> Any:
        module = self._lens_module
        if isinstance(key, str):
            child = module.get_submodule(key)
            return self._child(child, key, f"[{key!r}]")
        if type(key) is int and isinstance(module, (nn.Sequential, nn.ModuleList)):
            children = _torch.module_children(module)
            count = len(children)
            if isinstance(module, nn.ModuleList):
                # Its children are named "0", "1", ... in order (its own indexing relies on that):
                # no list of names per index, which a loop over a deep model's layers would build.
                position = key + count if key < 0 else key
                name = str(position) if 0 <= position < count else None
            else:
                names = list(children)
                name = names[key] if -count <= key < count else None
            if name is None or name not in children:
                raise IndexError(f"index {key} is out of range for {self!r} ({count} children)")
            lens = self._child(children[name], name, f"[{key}]")  # type: ignore[arg-type]
            # Filed by index only where the index always names the same child: a ModuleList's
            # (it renames its children when one is inserted or deleted), counted from the start.
            if key >= 0 and isinstance(module, nn.ModuleList) and _torch.HAS_MODULE_DICTS:
                self._lens_children[key] = lens
            return lens
        item = module[key]  # type: ignore[index]
        if isinstance(key, slice):
            return [self._child(m, name, f"[{name}]") for m, name in ((m, self._name_of(m)) for m in item)]
        if isinstance(item, nn.Module):
            return self._child(item, self._name_of(item), f"[{key!r}]")
        return item

    def _name_of(self, child: nn.Module) -> str:
        for name, module in _torch.module_children(self._lens_module).items():
            if module is child:
                return name
        return type(child).__name__

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
            return
        raise AttributeError(
            f"a lens only lets you set .output, .input and .inputs, not {name!r}; "
            "set other attributes on the module itself."
        )

    def __iter__(self) -> Iterator[Lens]:
        indexed = isinstance(self._lens_module, (nn.Sequential, nn.ModuleList))
        for name, module in _torch.module_children(self._lens_module).items():
            if module is not None:
                yield self._child(module, name, f"[{name}]" if indexed else None)

    def __len__(self) -> int:
        return len(_torch.module_children(self._lens_module))

    def __bool__(self) -> bool:  # a leaf module has no children but is still a lens
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module itself (inside a body: on values you pass, e.g. a logit lens)."""
        return self._lens_module(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *_torch.module_children(self._lens_module)})

    def __repr__(self) -> str:
        where = self._lens_address or "<model>"
        return f"Lens({where}: {type(self._lens_module).__name__})"


def wrap(model: nn.Module, batcher: Batcher | None = None) -> Lens:
    """A :class:`Lens` over ``model``; ``batcher`` combines invokes (default: concat on dim 0).

    The first call in a process installs ``Tensor.backward`` (``with t.backward():``
    on any tensor) and ``Tensor.save``; importing backlens installs nothing.
    """
    if not isinstance(model, nn.Module):
        refuse_other_framework(model, (), {}, "bl.wrap")
        raise UnsupportedInputError(
            f"bl.wrap() needs a torch.nn.Module, got {type(model).__name__}.",
            code="not_a_module",
            remedy="Pass the model (an nn.Module) itself.",
        )
    if batcher is not None:
        _args.batcher(batcher, "bl.wrap")
    entry.install()
    model = original_module(model)
    return Lens(model, _Root(model, batcher if batcher is not None else ConcatBatcher()))


def original_module(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper was made from (the model itself otherwise).

    A trace's hooks and hand-overs need the forward to run eagerly, so a
    compiled model is navigated and run as the original module tree.
    """
    inner = model
    while (original := _torch.compiled_original(inner)) is not None:
        inner = original
    return inner
