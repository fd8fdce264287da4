"""Names for what a user asked about, in module terms, never ids.

Errors name a tensor the way the user reached it: the lens site it was
served from (``fc1.output``, invoke 0), else the parameter it is
(``fc1.weight``), else the variable holding it in the body that asked,
else its shape and the autograd node that made it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backlens import _torch

if TYPE_CHECKING:
    from backlens.live.context import Block


OUTPUT = "output"
INPUT = "input"


@dataclass(frozen=True)
class Label:
    """A name for a value, and the invoke whose rows it is (if in a trace)."""

    name: str
    invoke: int | None = None

    def _suffix(self) -> str:
        return f" (invoke {self.invoke})" if self.invoke is not None else ""

    def __str__(self) -> str:
        return f"{self.name}{self._suffix()}"

    @property
    def grad(self) -> str:
        """How the user spells the gradient request: ``fc1.output.grad (invoke 0)``."""
        return f"{self.name}.grad{self._suffix()}"


@dataclass(eq=False)
class Site:
    """Where a served tensor came from.

    ``full`` is the batched tensor the model computed (what a gradient hook
    goes on), ``rows`` the invoke's rows of it (``None``: all of it). The name
    is only worked out when a message needs it.
    """

    run: Any
    key: tuple[str, Any]
    invoke: int | None
    full: torch.Tensor
    rows: tuple[int, int] | None
    view: torch.Tensor

    @property
    def name(self) -> str:
        return self.run.site_name(self.key)

    def label(self) -> Label:
        return Label(self.name, self.invoke)


def site_name(address: str, kind: str) -> str:
    """``fc1.output``; the wrapped model's own values are plain ``output``/``input``."""
    return f"{address}.{kind}" if address else kind


def describe(tensor: Any, block: Block | None, frame: types.FrameType | None) -> Label:
    """A readable name for ``tensor`` (see the module docstring for the order tried)."""
    forward = block.forward if block is not None else None
    if forward is not None:
        site = forward.site_of(tensor)
        if site is not None:
            return site.label()
        param = forward.param_name(tensor)
        if param is not None:
            return Label(param)
    invoke = block.invoke.index if block is not None and block.invoke is not None else None
    names = _local_names(tensor, frame)
    if names:
        return Label(f"`{names[0]}`", invoke)
    if isinstance(tensor, torch.Tensor):
        made_by = f", made by {type(tensor.grad_fn).__name__}" if tensor.grad_fn is not None else ""
        return Label(f"a tensor of shape {list(tensor.shape)}{made_by}", invoke)
    return Label(f"a {type(tensor).__name__}", invoke)


def _local_names(value: Any, frame: types.FrameType | None) -> list[str]:
    if frame is None:
        return []
    try:
        items = list(frame.f_locals.items())
    except Exception:
        return []
    return [name for name, v in items if v is value and not name.startswith("__backlens_")]


def spelled_path(model: Any, dotted: str) -> str:
    """A module path as a user types it through a lens: ``transformer.h.1`` -> ``transformer.h[1]``."""
    spelled = ""
    module = model
    for part in dotted.split(".") if dotted else []:
        indexed = isinstance(module, (nn.Sequential, nn.ModuleList)) and part.lstrip("-").isdigit()
        spelled += f"[{part}]" if indexed else (f".{part}" if spelled else part)
        module = _torch.module_children(module).get(part) if isinstance(module, nn.Module) else None
    return spelled
