"""Raising a BacklensWarning at the user's line, also from inside an autograd hook."""

from __future__ import annotations

import warnings

from backlens._frames import user_frame
from backlens.errors import BacklensWarning


def warn(message: str, code: str, *, in_hook: bool = False) -> None:
    """Warn ``message`` (a BacklensWarning with ``code``) pointing at the user's innermost line.

    ``in_hook``: the caller runs inside the user's backward, which a warning
    must never abort, so a filter that turns warnings into errors is not
    allowed to raise there (the warning is then lost, not the backward).
    """
    _frame, level = user_frame(1)
    try:
        warnings.warn(BacklensWarning(message, code=code), stacklevel=level + 1)
    except Exception:  # noqa: BLE001 - "-W error" must not break the user's backward
        if not in_hook:
            raise
