"""The ``selector_matched_nothing`` warning: a save policy never silently saves nothing.

* Backward: :class:`UnmatchedSelectorWarner` is a pass observer. When a pass
  closes without error and its ``save_grads`` selector saved no gradient in
  that pass, it warns once for the pass. A pass that the selector's
  ``in_pass`` terms rule out (``bl.func("relu") & bl.in_pass(2)`` during pass
  1) is not warned about when the next pass is one it selects: saving nothing
  there is what was asked. When the next pass is ruled out too
  (``bl.in_pass(5)`` during pass 1, often an off-by-one or too few passes),
  it warns once per capture, naming the first pass the selector can save in.
* Forward: :func:`warn_if_no_activation_kept` warns after the forward when a
  ``save_activations`` selector kept no op.

Both run once per pass or forward, never per node fire.
"""

from __future__ import annotations

import warnings
from typing import Any

from backlens._frames import user_frame
from backlens.errors import BacklensWarning

_CODE = "selector_matched_nothing"


_LOOK_AHEAD = 1000  # passes searched for the first one a selector's in_pass terms allow


class UnmatchedSelectorWarner:
    """Pass observer for a capture's :class:`BackwardRecorder` (see ``observers``)."""

    def __init__(self) -> None:
        self._ruled_out_warned: set[str] = set()

    def on_pass_close(self, state: Any, pass_: Any, error: BaseException | None) -> None:
        spec = pass_.policy.spec
        if error is not None or isinstance(spec, bool) or spec is None:
            return
        scope = getattr(spec, "pass_scope", None)
        if scope is not None and scope(pass_.number) is False:
            self._ruled_out(spec, scope, pass_.number)
            return
        fired = [state.calls[i] for i in pass_.calls]
        if any(c.grad_inputs is not None or c.grad_outputs is not None for c in fired):
            return
        if any(number == pass_.number for _i, _g, number in state.extra_input_grads):
            return  # a non-leaf input's gradient was kept
        nodes = state.nodes
        types = sorted({nodes[c.node].type for c in fired})
        seen = f" Node types that ran: {_short(types)}." if types else " No node of this capture ran."
        _warn(
            f"save_grads={spec!r} matched nothing in backward pass {pass_.number} "
            f"({pass_.trigger}): no gradient was saved.{seen} "
            "Check the names (cap.ops.labels(), cap.grad_fns.to_pandas()) or widen the selector.",
        )


    def _ruled_out(self, spec: Any, scope: Any, number: int) -> None:
        """A pass the selector rules out: warn (once per selector) when it allowed no pass so far and
        does not allow the next one either."""
        if repr(spec) in self._ruled_out_warned:
            return
        when = ruled_out_passes(scope, number)
        if when is None:
            return
        self._ruled_out_warned.add(repr(spec))
        _warn(
            f"save_grads={spec!r} matched nothing in backward pass {number}: no gradient was saved, and {when} "
            "(pass numbers start at 1). Check bl.in_pass(...) against the passes you run.",
        )


def ruled_out_passes(scope: Any, number: int) -> str | None:
    """For a pass ``number`` that a selector's ``in_pass`` terms rule out: why that looks like
    a mistake (it allowed no earlier pass and allows not the next one either), or None."""
    if scope(number + 1) is not False:
        return None
    if any(scope(k) is not False for k in range(1, number)):
        return None  # it selected an earlier pass (bl.in_pass(1) during pass 2): nothing is amiss
    first = next((k for k in range(number + 2, number + _LOOK_AHEAD) if scope(k) is not False), None)
    return f"it selects no pass before pass {first}" if first is not None else "it selects no later pass at all"


def warn_if_no_activation_kept(spec: Any, journal: Any) -> None:
    """After the forward: warn when a ``save_activations`` selector kept no op."""
    if isinstance(spec, bool) or spec is None:
        return
    ops = journal.ops
    if any(op.activation is not None for op in ops):
        return
    funcs = sorted({op.name for op in ops})
    seen = f" Op functions that ran: {_short(funcs)}." if funcs else " The forward ran no op."
    _warn(
        f"save_activations={spec!r} matched no op in the forward: no activation was kept.{seen} "
        "Check the names (cap.ops.labels()) or widen the selector.",
    )


def _short(names: list[str], limit: int = 12) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _warn(message: str) -> None:
    _frame, level = user_frame(1)  # level 1: the caller of _warn
    warnings.warn(BacklensWarning(message, code=_CODE), stacklevel=level + 1)
