"""Where ``.backward()``, ``.grad`` and ``.save()`` reach live tracing.

Importing backlens changes nothing in torch. What live tracing needs comes
in two ways:

* **In a body** (a trace, invoke or backward block, which backlens compiles
  from its source), the statements are rewritten (``rewrite.py``) to call
  the helpers here directly: ``X.backward(...)`` as a ``with`` expression
  makes a backward block, a plain one runs torch's (warning, inside a trace,
  that intermediate ``.grad`` stays ``None``), and in a backward block every
  form of ``X.grad`` goes through the running backward.
* **Outside any body**, the first ``bl.wrap()`` installs, once per process,
  ``Tensor.backward`` (so ``with t.backward():`` works on any tensor, also
  outside a trace) and ``Tensor.save``. The installed ``Tensor.backward``
  first asks the calling instruction's neighbour whether the result is
  entered by a ``with`` (:func:`~backlens.live.source.may_enter_with`, no
  source read); a plain ``t.backward()`` outside a trace then runs torch's
  own with no source lookup, keeping its stock return, effect and errors.
"""

from __future__ import annotations

import builtins
import functools
import operator
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from backlens.errors import TraceError
from backlens.live import backward as backward_mod
from backlens.live import rewrite
from backlens.live.backward import BackwardBlock, BackwardRun, bare_in_trace
from backlens.live.context import current_block
from backlens.live.save import install_tensor_save
from backlens.live.skip import guarding
from backlens.live.source import may_enter_with, where, with_item_at

# ---------------------------------------------------------------------------
# `.grad` in a backward block's body


def _served(value: Any) -> BackwardRun | None:
    """The backward run serving ``value``'s gradient: the running block's, for a tensor."""
    if isinstance(value, torch.Tensor):
        block = current_block()
        if block is not None and block.kind == "backward":
            return block.backward
    return None


def _grad_of(value: Any) -> Any:
    """``X.grad`` read in a backward body."""
    # _served, spelled out: this runs at every read, mid-backward, where each call costs.
    if isinstance(value, torch.Tensor):
        block = current_block()
        if block is not None and block.kind == "backward":
            return block.backward.read_grad(value, sys._getframe(1))
    return value.grad


_OPERATORS = {
    "Add": "iadd", "Sub": "isub", "Mult": "imul", "MatMult": "imatmul", "Div": "itruediv",
    "FloorDiv": "ifloordiv", "Mod": "imod", "Pow": "ipow", "LShift": "ilshift", "RShift": "irshift",
    "BitOr": "ior", "BitXor": "ixor", "BitAnd": "iand",
}  # fmt: skip
_IN_PLACE = {op: getattr(operator, name) for op, name in _OPERATORS.items()}


class _GradTarget:
    """``X`` where a backward body assigns ``X.grad`` (``_GradTarget(X).grad = g``).

    Any assignment target Python has (a tuple, a ``for`` target, ``with ...
    as``) ends in an attribute store, so every one of them sets the gradient
    here, at the moment Python assigns it.
    """

    __slots__ = ("_of",)

    def __init__(self, of: Any):
        object.__setattr__(self, "_of", of)

    def __setattr__(self, name: str, grad: Any) -> None:
        of = self._of
        run = _served(of)
        if run is not None:
            run.write_grad(of, grad, sys._getframe(1))
        else:
            setattr(of, name, grad)

    def augment(self, op: str) -> Callable[[Any], None]:
        """``X.grad op= v``: reads the gradient now; the returned function applies ``v`` and stores it."""
        of = self._of
        run = _served(of)
        if run is None:
            current = of.grad

            def store(operand: Any) -> None:
                of.grad = _IN_PLACE[op](current, operand)

            return store
        frame = sys._getframe(1)
        served = run.read_grad(of, frame)

        def apply(operand: Any) -> None:
            # On a copy: the served gradient is autograd's own buffer (or a view of it).
            base = served.clone() if isinstance(served, torch.Tensor) else served
            run.write_grad(of, _IN_PLACE[op](base, operand), frame)

        return apply


class _GradItems:
    """``X.grad`` where a backward body assigns one of its items (``_GradItems(X)[k] = v``):
    the item is set in a copy of the gradient, and the copy becomes the gradient."""

    __slots__ = ("_of",)

    def __init__(self, of: Any):
        self._of = of

    def __getitem__(self, key: Any) -> Any:
        # Read by ``X.grad[k] op= v`` before the operation: a copy, so the operation cannot
        # change autograd's buffer in place.
        run = _served(self._of)
        if run is None:
            return self._of.grad[key]
        item = run.read_grad(self._of, sys._getframe(1))[key]
        return item.clone() if isinstance(item, torch.Tensor) else item

    def __setitem__(self, key: Any, value: Any) -> None:
        of = self._of
        run = _served(of)
        if run is None:
            of.grad[key] = value
            return
        frame = sys._getframe(1)
        edited = run.read_grad(of, frame).clone()
        edited[key] = value
        run.write_grad(of, edited, frame)


def _grad_attr(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``getattr``/``setattr``/``delattr`` called in a backward body: a ``"grad"`` name is served."""
    if len(args) >= 2 and type(args[1]) is str and args[1] == "grad" and not kwargs:
        run = _served(args[0])
        if run is not None:
            frame = sys._getframe(1)
            if fn is builtins.getattr:
                return run.read_grad(args[0], frame)
            if fn is builtins.setattr and len(args) == 3:
                run.write_grad(args[0], args[2], frame)
                return None
            if fn is builtins.delattr:
                raise TraceError(
                    f"delattr(..., 'grad') at {where(frame.f_code.co_filename, frame.f_lineno)} cannot run in "
                    "a backward block: there `.grad` is the gradient flowing into a tensor as the backward "
                    "runs, and deleting it has no meaning for it.",
                    code="unsupported_grad_form",
                    remedy="Set .grad instead (to stop the gradient, set it to zeros), or do this after the block.",
                )
    return fn(*args, **kwargs)


# ---------------------------------------------------------------------------
# `.backward()` in a body


def _own_backward(value: Any) -> bool:
    """A tensor whose class keeps torch's ``backward`` (a subclass may define its own)."""
    if not isinstance(value, torch.Tensor):
        return False
    method = getattr(type(value), "backward", None)
    return method is _backward or method is backward_mod._stock_backward


def _with_backward(value: Any) -> Any:
    """``X.backward`` where the call is a ``with`` expression in a body."""
    return types.MethodType(_block_in_body, value) if _own_backward(value) else value.backward


def _guarded_backward(value: Any) -> Any:
    """``X.backward`` where the call is the only backward ``with`` item of its statement in a
    body (whose statements the rewrite put under :func:`_body_here`)."""
    return types.MethodType(_guarded_block_in_body, value) if _own_backward(value) else value.backward


def _body_here() -> bool:
    """Whether a body's backward ``with`` statement runs its statements in place: not when
    the block it just entered runs them itself (the block then reads torch's modes here,
    where its body starts)."""
    block = guarding()
    return block is None or block._reach_guard(sys._getframe(1))


def _call_backward(value: Any) -> Any:
    """``X.backward`` where the call is anything else in a body."""
    return types.MethodType(_plain_in_body, value) if _own_backward(value) else value.backward


def _block_in_body(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):  # noqa: ANN001, ANN202
    frame = sys._getframe(1)
    found = with_item_at(frame, "backward", BackwardBlock._what, need_source=False)
    if found is not None:
        return BackwardBlock._make(self, (gradient, retain_graph, create_graph, inputs), found, frame)
    return _plain_in_body(self, gradient, retain_graph, create_graph, inputs)


def _guarded_block_in_body(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):  # noqa: ANN001, ANN202
    frame = sys._getframe(1)
    found = with_item_at(frame, "backward", BackwardBlock._what, need_source=False)
    if found is not None:
        block = BackwardBlock._make(self, (gradient, retain_graph, create_graph, inputs), found, frame)
        if type(block) is BackwardBlock:
            block._guarded = True
        return block
    return _plain_in_body(self, gradient, retain_graph, create_graph, inputs)


def _plain_in_body(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):  # noqa: ANN001, ANN202
    block = current_block()
    if block is None or block.tracer is None:
        return backward_mod._stock_backward(self, gradient, retain_graph, create_graph, inputs)
    return bare_in_trace(self, block, sys._getframe(1), gradient, retain_graph, create_graph, inputs)


rewrite.HELPERS.update(
    {
        rewrite.GRAD: _grad_of,
        rewrite.GRAD_TARGET: _GradTarget,
        rewrite.GRAD_ITEMS: _GradItems,
        rewrite.GRAD_ATTR: _grad_attr,
        rewrite.WITH_BACKWARD: _with_backward,
        rewrite.GUARDED_BACKWARD: _guarded_backward,
        rewrite.BODY_HERE: _body_here,
        rewrite.CALL_BACKWARD: _call_backward,
    }
)


# ---------------------------------------------------------------------------
# Tensor.backward and Tensor.save, from the first bl.wrap() on


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):  # noqa: ANN001, ANN202
    frame = sys._getframe(1)
    if may_enter_with(frame):
        found = with_item_at(frame, "backward", BackwardBlock._what, need_source=False)
        if found is not None:
            return BackwardBlock._make(self, (gradient, retain_graph, create_graph, inputs), found, frame)
    block = current_block()
    if block is None or block.tracer is None:
        return backward_mod._stock_backward(self, gradient, retain_graph, create_graph, inputs)
    return bare_in_trace(self, block, frame, gradient, retain_graph, create_graph, inputs)


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install ``Tensor.backward`` and ``Tensor.save`` (the first ``bl.wrap()`` does; once per process)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        current = torch.Tensor.backward
        if not getattr(current, "__backlens_live__", False):
            backward_mod._stock_backward = current
            functools.update_wrapper(_backward, current)
            _backward.__backlens_live__ = True  # type: ignore[attr-defined]
            torch.Tensor.backward = _backward  # type: ignore[method-assign]
        install_tensor_save()
        _installed = True
