"""The dispatch mode both FLOP counters build on: run each ATen call, then report it.

A :class:`CountingMode` looks up its plan for each ATen overload
(:func:`backlens.cost.formulas.plan_for`), lets an op that only decomposes run
its decomposition through the mode (so the kernels inside are seen), runs
everything else unchanged, and hands ``(func, counter, args, kwargs, out)`` to
:meth:`CountingMode.seen`. ``counter`` is ``None`` for calls with no formula.
"""

from __future__ import annotations

from typing import Any

from backlens import _torch
from backlens._clock import now as _now
from backlens.cost.formulas import DECOMPOSE, plan_for, refresh_plans


class CountingMode(_torch.EagerDispatchMode):
    """``began``: when the call being reported started (backlens._clock), for :meth:`seen`."""

    def __init__(self) -> None:
        super().__init__()
        self._plans = refresh_plans()
        self.began = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plan = self._plans.get(func, self)
        if plan is self:
            plan = plan_for(func)
        if plan is DECOMPOSE:
            with _torch.dispatch_mode(self):  # the inner calls come back through this mode
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
            plan = None
        began = _now()
        out = func(*args, **kwargs) if kwargs else func(*args)
        self.began = began
        self.seen(func, plan, args, kwargs, out)
        return out

    def seen(self, func: Any, counter: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        raise NotImplementedError
