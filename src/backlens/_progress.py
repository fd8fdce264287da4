"""Progress bars for long work, shown only to a person at a terminal.

A bar goes to stderr (stdout stays the command's output), disappears when the
work is done, and is off when stderr is not a TTY, under pytest, or with
``BACKLENS_PROGRESS=0``. Advance it between units of work (a backward pass, a
file written), never from inside an autograd hook: a hook runs in the middle
of the user's backward, and drawing there would be timed as the node's work.

Byte-sized work (saving or loading a bundle) passes ``unit="bytes"`` and
``min_total=LARGE_BYTES``, so small bundles never show a bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

LARGE_BYTES = 256 * 2**20  # bundles from this size up get a bar when saved or loaded


def progress_shown(stream: IO[str] | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default stderr)."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("BACKLENS_PROGRESS", "").strip() == "0" or "PYTEST_CURRENT_TEST" in os.environ:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _ignore(_amount: float = 1) -> None:
    return None


@contextmanager
def progress(
    description: str,
    total: float,
    *,
    unit: str = "steps",
    sizes: bool = True,
    min_total: float = 0,
    stream: IO[str] | None = None,
    shown: bool | None = None,
) -> Iterator[Callable[[float], None]]:
    """A bar of ``total`` units; yields ``advance(amount=1)``.

    ``unit="bytes"`` shows sizes and a transfer rate; with ``sizes=False`` a
    percentage instead of sizes (bytes read that are not the size of what is
    made, such as a save that writes repeated tensors once). Below ``min_total`` or
    where :func:`progress_shown` is false, ``advance`` does nothing and nothing
    is drawn. ``shown`` overrides the terminal check (tests draw into a buffer).
    """
    stream = sys.stderr if stream is None else stream
    if shown is None:
        shown = progress_shown(stream)
    if not shown or total < min_total or total <= 0:
        yield _ignore
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    if unit == "bytes":
        counted = [DownloadColumn() if sizes else TaskProgressColumn(), TransferSpeedColumn()]
    else:
        counted = [MofNCompleteColumn(), TextColumn(unit)]
    columns = [TextColumn("{task.description}"), BarColumn(), *counted, TimeElapsedColumn(), TimeRemainingColumn()]
    console = Console(file=stream, force_terminal=True if shown else None)
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(amount: float = 1) -> None:
            bar.advance(task, amount)

        yield advance
