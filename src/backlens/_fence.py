"""Cleanup that a Ctrl-C cannot cut short.

A ``KeyboardInterrupt`` may arrive between any two lines of Python, also in
the middle of undoing what backlens installed in torch. :func:`complete`
runs an idempotent cleanup again until it finishes once without being
interrupted, then re-raises the interrupt it swallowed: the user's Ctrl-C
still stops the program, and nothing is left installed.
"""

from __future__ import annotations

from collections.abc import Callable

_RETRIES = 50


def complete(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (idempotent) to completion; a KeyboardInterrupt during it is re-raised after."""
    interrupted: KeyboardInterrupt | None = None
    for _ in range(_RETRIES):
        try:
            cleanup()
            break
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted
