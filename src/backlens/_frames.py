"""Finding the user's own line on the stack: the innermost frame outside torch and backlens."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# Files of the package that are user-level code (their lines are call sites).
_USER_LEVEL = tuple(os.path.join(PACKAGE_DIR, name) for name in ("demo.py",))


def is_internal(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    return filename.startswith((TORCH_DIR, PACKAGE_DIR)) and not filename.startswith(_USER_LEVEL)


def user_frame(depth: int = 1) -> tuple[FrameType | None, int]:
    """The first user frame, starting ``depth`` frames above the caller, and how many
    frames above the caller it is (``warnings.warn`` from the caller takes that + 1)."""
    frame = sys._getframe(depth + 1)
    level = depth
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            return frame, level
        frame = frame.f_back
        level += 1
    return None, depth
