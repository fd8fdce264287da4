"""The rich console commands print to: a terminal's width, or no cut at all when piped.

Rich fits output to 80 columns when stdout is not a terminal, which cuts long
module names (``featu…``) in output sent to a file or ``grep``. Piped output is
read whole, so it gets a width no table reaches; ``COLUMNS`` still wins when set.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PIPE_WIDTH = 1000


def stdout_options() -> dict[str, Any]:
    """The options of a rich ``Console`` writing to stdout (a width only when piped)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return {}
    return {"width": PIPE_WIDTH}


def stdout_console() -> Any:
    from rich.console import Console

    return Console(**stdout_options())
