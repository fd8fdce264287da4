"""Which block body is running, and what it saved.

A *block* is one body of user code that backlens runs itself: a trace body, an
invoke body, or a ``with t.backward():`` body. Bodies run as coroutines in the
caller's thread, each in its own copy of the caller's ``contextvars`` context,
so a context variable knows, per thread and per body, where ``save()``
registers and which trace a ``.grad`` or ``.output`` request belongs to.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: contextvars.ContextVar[Block | None] = contextvars.ContextVar("backlens_live_block", default=None)


class Block:
    """One running body.

    ``kind`` is ``"trace"`` (a trace body that only declares invokes),
    ``"invoke"`` (a body run in step with the forward) or ``"backward"`` (a
    body run in step with the backward). ``saved`` maps ``id(value)`` to the
    value for every ``save()`` made in this body (or pushed up by a nested
    block); only names bound to these objects leave the body.
    """

    __slots__ = ("kind", "tracer", "forward", "invoke", "backward", "mediator", "saved")

    def __init__(
        self,
        kind: str,
        tracer: Any = None,  # the Tracer (tracer.py)
        forward: Any = None,  # the ForwardRun serving an invoke body (forward.py)
        invoke: Any = None,  # its Invoke
        backward: Any = None,  # the BackwardRun of a backward body (backward.py)
    ):
        self.kind = kind
        self.tracer = tracer
        self.forward = forward
        self.invoke = invoke
        self.backward = backward
        self.mediator: Any = None  # the Mediator running this body (mediator.py)
        self.saved: dict[int, Any] = {}

    def keep(self, value: Any) -> None:
        self.saved[id(value)] = value

    def is_saved(self, value: Any) -> bool:
        return self.saved.get(id(value), _MISSING) is value


_MISSING = object()

current_block = _current.get
"""The block the calling body runs, or None outside every block."""


@contextmanager
def running(block: Block) -> Iterator[Block]:
    """Make ``block`` the current block for the duration."""
    token = _current.set(block)
    try:
        yield block
    finally:
        _current.reset(token)


enter_block = _current.set
"""Make a block current; returns the token :func:`leave_block` takes (the context variable's own
methods: entered at every body's start, so no Python frame of ours)."""
leave_block = _current.reset


def saved_names(final_locals: dict[str, Any], block: Block, assigned: frozenset[str]) -> dict[str, Any]:
    """The names the body assigned whose final values were saved in ``block``.

    Saving marks an object, not a name: every name the body bound to it leaves
    with it. Names the body only read are skipped: they still hold the
    caller's own objects.
    """
    saved = block.saved  # Block.is_saved, inlined: runs at every body's end
    if not saved:
        return {}
    found = {}
    for name in assigned:  # fewer than the final locals, which hold the copied names too
        value = final_locals.get(name, _MISSING)
        if value is not _MISSING and saved.get(id(value), _MISSING) is value:
            found[name] = value
    return found
