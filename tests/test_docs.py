"""Every python block in README.md and docs/*.md runs (each file in one namespace)."""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PAGES = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")] if BLOCK.search(p.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_in_the_page_run(page: Path):
    namespace: dict = {"__name__": "__docs__"}
    for number, block in enumerate(BLOCK.findall(page.read_text()), start=1):
        filename = f"<docs {page.name} block {number}>"
        # Registered like a notebook cell, so live traces can read their with-blocks.
        linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)
        exec(compile(block, filename, "exec"), namespace)
