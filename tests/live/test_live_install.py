"""Importing backlens changes nothing in torch; live tracing installs what it needs at the first `bl.wrap()`."""

from __future__ import annotations

import ast
import json
import linecache
import subprocess
import sys

import pytest
import torch

import backlens.live as bl
from backlens.live import backward as backward_mod
from backlens.live import source

# Run in a fresh process: what torch looks like before and after `import backlens`.
_FRESH = r"""
import json, sys
import torch, torch.autograd, torch.autograd.graph, torch.nn as nn
from torch.nn.modules import module as modules

probes = []
for name in ("cuda", "xpu", "mps", "hpu", "mtia"):
    backend = getattr(torch, name, None)
    available = getattr(backend, "is_available", None)
    if available is not None:
        def spy(*args, _name=name, _real=available, **kwargs):
            probes.append(_name)
            return _real(*args, **kwargs)
        backend.is_available = spy

def snapshot():
    seen = {}
    for owner in (torch.Tensor, nn.Module, torch.autograd, torch.autograd.graph, torch.autograd.Function):
        for key, value in list(vars(owner).items()):
            seen[f"{owner.__name__}.{key}"] = id(value)
    seen["global module hooks"] = [len(modules._global_forward_hooks), len(modules._global_forward_pre_hooks),
                                   len(modules._global_backward_hooks), len(modules._global_backward_pre_hooks)]
    seen["tracer"] = repr(sys.gettrace())
    seen["mode stacks"] = [torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()]
    return seen

before = snapshot()
stock_backward = torch.Tensor.backward
import backlens
after = snapshot()
print(json.dumps({
    "same_backward": torch.Tensor.backward is stock_backward,
    "has_save": hasattr(torch.Tensor, "save"),
    "changed": sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key)),
    "probes": probes,
}))
"""


@pytest.fixture(scope="module")
def fresh_import():
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tensor_backward_is_the_same_object_before_and_after_import(fresh_import):
    assert fresh_import["same_backward"]


def test_import_adds_no_tensor_save(fresh_import):
    assert not fresh_import["has_save"]


def test_import_changes_no_attribute_hook_mode_or_tracer_of_torch(fresh_import):
    assert fresh_import["changed"] == []


def test_import_probes_no_accelerator_backend(fresh_import):
    assert fresh_import["probes"] == []


def test_wrap_installs_tensor_backward_and_save():
    bl.wrap(torch.nn.Linear(2, 2))
    assert getattr(torch.Tensor.backward, "__backlens_live__", False)
    assert torch.Tensor.save is not None


def _fresh_cell(name: str, text: str) -> str:
    """A piece of code with its own file name, its source known to linecache (as a notebook cell's is)."""
    filename = f"<backlens-test-{name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    return filename


def test_a_plain_backward_outside_a_trace_reads_no_source(monkeypatch):
    bl.wrap(torch.nn.Linear(2, 2))
    text = "w = torch.ones(3, requires_grad=True)\nloss = (w * w).sum()\nresult = loss.backward()\n"
    filename = _fresh_cell("plain-backward", text)

    def no_source(*args, **kwargs):
        raise AssertionError("the source was read")

    monkeypatch.setattr(linecache, "getlines", no_source)
    monkeypatch.setattr(ast, "parse", no_source)
    scope = {"torch": torch}
    exec(compile(text, filename, "exec"), scope)
    assert scope["result"] is None
    assert torch.equal(scope["w"].grad, torch.full((3,), 2.0))


def test_a_backward_block_in_a_trace_works_with_torchs_own_tensor_backward(mlp, lens, x, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "backward", backward_mod._stock_backward)
    with lens.trace(x):
        hidden = lens.fc2.output
        with lens.output.sum().backward():
            got = hidden.grad.save()
    expected = {}
    out = mlp.fc2(mlp.act(mlp.fc1(x)))
    out.register_hook(lambda grad: expected.setdefault("grad", grad))
    backward_mod._stock_backward(mlp.fc3(torch.tanh(out)).sum())
    assert torch.equal(got, expected["grad"])


def test_the_parsed_source_cache_keeps_a_bounded_number_of_files():
    bl.wrap(torch.nn.Linear(2, 2))
    text = "w = torch.ones(2, requires_grad=True)\nh = w * 3\nwith h.sum().backward():\n    g = h.grad.save()\n"
    for i in range(80):
        filename = _fresh_cell(f"cell-{i}", text)
        scope = {"torch": torch}
        exec(compile(text, filename, "exec"), scope)
        assert torch.equal(scope["g"], torch.ones(2))
    assert len(source._files) <= 32
