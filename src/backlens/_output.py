"""Writing a file a user asked for (a report, a timeline): its folder made if missing, and a
failure named as an :class:`~backlens.errors.OutputPathError` with the path, never a bare OSError."""

from __future__ import annotations

import os

from backlens.errors import OutputPathError


def write_text(path: str | os.PathLike, text: str, what: str) -> str:
    """Write ``text`` to ``path`` (UTF-8), making its folder if missing; returns ``path`` as given."""
    try:
        make_parent(path)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise not_writable(path, exc, what) from exc
    return os.fspath(path)


def make_parent(path: str | os.PathLike) -> None:
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(parent, exist_ok=True)


def not_writable(path: str | os.PathLike, exc: OSError, what: str) -> OutputPathError:
    """The error for ``what`` (e.g. "timeline.save") failing to write ``path``."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        reason += ": part of the path is a file, not a folder"
    return OutputPathError(f"{what}: cannot write {os.fspath(path)!r} ({reason}).")
