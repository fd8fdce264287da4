"""Every ```python block of docs/live.md runs, in order, as one notebook."""

from __future__ import annotations

import linecache
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "live.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_docs_live_has_examples():
    assert len(python_blocks(DOC.read_text())) >= 5


def test_every_example_in_docs_live_runs(capsys):
    namespace: dict = {"__name__": "__docs__"}
    for number, block in enumerate(python_blocks(DOC.read_text())):
        # Like a notebook cell: the source is registered, so traces can read it.
        filename = f"<docs/live.md example {number}>"
        linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)
        try:
            exec(compile(block, filename, "exec"), namespace)
        finally:
            linecache.cache.pop(filename, None)
    printed = capsys.readouterr().out
    assert "torch.Size([5, 8]) torch.Size([5, 8])" in printed
    assert printed.count("True") >= 3
    assert "invoke 1's .backward()" in printed
