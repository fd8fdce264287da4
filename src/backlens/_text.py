"""Printing text read from untrusted files (a bundle's names and messages) as text.

A bundle's module types, triggers, addresses and leaf names are whatever its
file says. Printed through rich as they are, ``[/]`` is markup (and a
``MarkupError`` that stops ``backlens show``), and an ``ESC`` starts a
terminal control sequence (a retitled window, a cleared screen). So
:func:`printable` writes every control character (C0, DEL, C1, and the
bidirectional overrides that reorder what the eye sees) as its escape, and
:func:`text_console` is a rich console that reads no markup or emoji codes in
any string it renders and prints every control character it is handed as its
escape; styles come only from rich objects built in code (``Text``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # rich's own line ends


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(_escape, text)


def text_console(**options: Any) -> Any:
    """A ``rich.console.Console`` printing strings as plain text (see the module docstring)."""
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

    return TextConsole(markup=False, emoji=False, **options)
