"""Comparing a loaded capture with the live one it was saved from, record by record."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backlens.io import manifest as manifest_io


def same_value(a, b) -> bool:
    """Equality that compares tensors with torch.equal, inside tuples and lists too."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a).__name__ == type(b).__name__ and str(a) == str(b)  # a loaded error keeps both
    return a == b


def same_grads(a, b) -> bool:
    return [g.pass_number for g in a] == [g.pass_number for g in b] and all(
        same_value(x.tensor, y.tensor) for x, y in zip(a, b))


def assert_same_fields(live, loaded, skip=()):
    for name in type(live).FIELDS:
        if name in skip:
            continue
        a, b = getattr(live, name), getattr(loaded, name)
        assert same_value(a, b), (type(live).__name__, name, a, b)


def assert_same_tables(live, loaded):
    for name in ("ops", "modules", "params", "inputs", "passes", "grad_fns", "grad_fn_calls"):
        a, b = getattr(live, name).to_pandas(), getattr(loaded, name).to_pandas()
        assert list(a.columns) == list(b.columns), name
        assert len(a) == len(b), name
        for column in a.columns:
            for x, y in zip(a[column], b[column]):
                assert same_value(x, y) or (x != x and y != y), (name, column, x, y)  # NaN == NaN


def assert_same_capture(live, loaded):
    """Everything a user reads from ``live`` reads the same from ``loaded``."""
    assert live.ops.labels() == loaded.ops.labels()
    for a, b in zip(live.ops, loaded.ops):
        assert_same_fields(a, b)
        assert same_grads(a.grads, b.grads), a.label
        assert (a.grad_fn.label if a.grad_fn else None) == (b.grad_fn.label if b.grad_fn else None)
    for a, b in zip(live.modules, loaded.modules):
        assert_same_fields(a, b)
        assert same_grads(a.output_grads, b.output_grads), a.address
    for a, b in zip(live.params, loaded.params):
        assert_same_fields(a, b)
        assert same_grads(a.increments, b.increments), a.name
        assert same_value(a.grad, b.grad) or (a.grad is None and b.grad is None), a.name
    for a, b in zip(live.inputs, loaded.inputs):
        assert_same_fields(a, b)
        assert same_grads(a.grads, b.grads), a.name
    assert live.grad_fns.labels() == loaded.grad_fns.labels()
    for a, b in zip(live.grad_fns, loaded.grad_fns):
        assert_same_fields(a, b, skip=("op",))
        assert (a.op.label if a.op else None) == (b.op.label if b.op else None)
        assert [c.label for c in a.calls] == [c.label for c in b.calls]
    assert live.grad_fn_calls.labels() == loaded.grad_fn_calls.labels()
    for a, b in zip(live.grad_fn_calls, loaded.grad_fn_calls):
        assert_same_fields(a, b, skip=("grad_fn",))
        assert a.grad_fn.label == b.grad_fn.label
    assert len(live.passes) == len(loaded.passes)
    for a, b in zip(live.passes, loaded.passes):
        assert_same_fields(a, b)
        assert [c.label for c in a.calls] == [c.label for c in b.calls]
    assert_same_tables(live, loaded)


def reseal(path: Path, change) -> None:
    """Edit a bundle's manifest in place (``change(body)``) and seal it with a correct checksum
    again, as a careless tool or an attacker would."""
    body = json.loads((Path(path) / "manifest.json").read_text())
    body.pop("checksum")
    change(body)
    manifest_io.write(Path(path), body)
