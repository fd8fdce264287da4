"""The rich consoles the command prints to.

Width. Rich fits output to 80 columns when stdout is not a terminal, which cuts
long module names (``featu…``) in output sent to a file or ``grep``. Piped output
is read whole, so it gets a width no table reaches; ``COLUMNS`` still wins when set.

Untrusted text. A bundle's module types, triggers, addresses and leaf names (and
the names a monitor run's files hold) are whatever the file says. Printed through
rich as they are, ``[/]`` is markup (and a ``MarkupError`` that stops the
command), and an ``ESC`` starts a terminal control sequence (a retitled window, a
cleared screen). So :func:`printable` writes every control character (C0, DEL,
C1, and the bidirectional overrides that reorder what the eye sees) as its
escape, and :func:`text_console` is a console that reads no markup or emoji codes
in any string it renders and prints every control character it is handed as its
escape; styles come only from rich objects built in code (``Text``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from typing import Any

PIPE_WIDTH = 1000
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # rich's own line ends


def stdout_options() -> dict[str, Any]:
    """The options of a rich ``Console`` writing to stdout (a width only when piped)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return {}
    return {"width": PIPE_WIDTH}


def stdout_console() -> Any:
    """A console for text backlens writes itself (markup in it is read)."""
    from rich.console import Console

    return Console(**stdout_options())


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(_escape, text)


def text_console() -> Any:
    """A console on stdout printing strings as plain text (see the module docstring)."""
    from rich.console import Console
    from rich.segment import Segment

    class TextConsole(Console):
        def render_str(self, text: str, **kwargs: Any) -> Any:
            kwargs["markup"] = False
            kwargs["emoji"] = False
            return super().render_str(printable(text), **kwargs)

        def render(self, renderable: Any, options: Any = None) -> Iterable[Any]:
            for segment in super().render(renderable, options):
                if segment.control or not _CONTROL_BUT_NEWLINE.search(segment.text):
                    yield segment
                else:
                    yield Segment(_CONTROL_BUT_NEWLINE.sub(_escape, segment.text), segment.style)

    return TextConsole(markup=False, emoji=False, **stdout_options())
