"""The python blocks of docs/selectors.md, docs/bundles.md and docs/records.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import backlens
from backlens import load, select
from backlens.io.disk_store import to_disk

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)

# The names these pages use, for as long as backlens/__init__.py does not export them yet.
NAMES = {
    **{name: getattr(select, name) for name in (
        "Selector", "func", "label", "module", "grad_fn", "without_op", "grad_input", "grad_output",
        "in_pass")},
    "to_disk": to_disk,
    "load": load,
}


@pytest.mark.parametrize("page", ["selectors.md", "bundles.md", "records.md"])
def test_python_blocks_in_the_page_run(page, monkeypatch):
    for name, value in NAMES.items():
        if not hasattr(backlens, name):
            monkeypatch.setattr(backlens, name, value, raising=False)
    text = (DOCS / page).read_text()
    namespace: dict = {"__name__": "__docs__"}
    blocks = BLOCK.findall(text)
    assert blocks
    for number, block in enumerate(blocks, start=1):
        exec(compile(block, f"{page} block {number}", "exec"), namespace)


def test_every_table_column_is_documented():
    from backlens.records import backward, forward

    text = (DOCS / "records.md").read_text()
    sections = {
        "cap.ops": forward.OpRecord.COLUMNS, "cap.modules": forward.ModuleCallRecord.COLUMNS,
        "cap.params": forward.ParamRecord.COLUMNS, "cap.inputs": forward.InputRecord.COLUMNS,
        "cap.passes": backward.BackwardPass.COLUMNS, "cap.grad_fns": backward.GradFn.COLUMNS,
        "cap.grad_fn_calls": backward.GradFnCall.COLUMNS,
    }
    for heading, columns in sections.items():
        start = text.index(f"## `{heading}`")
        end = text.find("\n## ", start + 1)
        documented = re.findall(r"^\| `(\w+)` \|", text[start:end if end > 0 else None], re.M)
        assert documented == list(columns), f"docs/records.md {heading}: {documented} != {columns}"
