"""torch's freed-graph error, recognised in one place.

A backward over a graph that an earlier backward freed (no
``retain_graph=True``) fails with torch's "Trying to backward through the
graph a second time". Both faces explain it in their own terms (a capture
names the pass that freed it, ``report/explain.py``; a trace names the
earlier ``.backward()`` of its shared graph, ``live/freed.py``) and reword
nothing else, so the match is narrow: torch's own error, by its exact
opening words.
"""

from __future__ import annotations

from backlens.errors import BacklensError

TORCH_TEXT = "Trying to backward through the graph a second time"


def is_freed_graph(exc: BaseException) -> bool:
    """True only for torch's own freed-graph error (never one of ours, never anything else)."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, BacklensError) and str(exc).startswith(TORCH_TEXT)
