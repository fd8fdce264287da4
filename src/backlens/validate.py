"""``bl.validate``: a captured run against a stock run, and the records' invariants.

The stock run takes its references with plain PyTorch only: parameter ``.grad``
and, for module outputs, a forward hook that puts a tensor hook on each child
module's output. Both runs start from the same RNG state and the same (absent)
parameter gradients; the model's gradients are restored afterwards.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from backlens import _args
from backlens._nested import first_tensor
from backlens.capturing import capture
from backlens.errors import BacklensWarning, UnsupportedInputError
from backlens.graph.labels import CALL_LABEL_PATTERN, NODE_LABEL_PATTERN

_OP_LABEL = re.compile(r"^.+_\d+$")


@dataclass
class ValidationResult:
    """Truthy when every comparison held; lists what was compared and what differed."""

    ok: bool
    compared: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = "valid" if self.ok else "NOT valid"
        lines = [f"{head}: {len(self.compared)} checks"]
        lines += [f"  differs: {d}" for d in self.differences]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def validate(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    validate_layer_grads: bool = True,
    seed: int = 0,
) -> ValidationResult:
    """Check that capture changes no gradient and that its records hold together.

    ``inputs`` is a tuple of positional arguments, a dict of keyword arguments,
    or a single tensor. ``loss_fn`` receives the model's own output object in
    both runs.
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedInputError(f"bl.validate needs a torch.nn.Module, got {type(model).__name__}.",
                                    code="not_a_module", remedy="Pass the model first: bl.validate(model, x, loss_fn).")
    _args.callable_(loss_fn, "loss_fn", "bl.validate", "lambda out: out.sum()")
    _args.flag(validate_layer_grads, "validate_layer_grads", "bl.validate")
    _args.integer(seed, "seed", "bl.validate", low=0, example="0")
    args, kwargs = _split_inputs(inputs)
    saved_grads = {name: p.grad for name, p in model.named_parameters()}
    children = [address for address, _ in model.named_modules() if address]
    result = ValidationResult(ok=True)
    try:
        stock_params, stock_modules = _stock_run(model, args, kwargs, loss_fn, children, seed)
        _zero_grads(model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            cap = capture(model, *args, save_grads=True, **kwargs)
            _args.scalar_loss(loss_fn(cap.output), "bl.validate").backward()
        try:
            _compare_params(model, stock_params, result)
            if validate_layer_grads:
                _compare_modules(cap, stock_modules, children, result)
            _check_invariants(cap, result)
        finally:
            cap.close()
    finally:
        for name, p in model.named_parameters():
            p.grad = saved_grads[name]
    return result


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


def _zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _stock_run(model, args, kwargs, loss_fn, children, seed):
    _zero_grads(model)
    module_grads: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    modules = dict(model.named_modules())

    def keep(address: str):
        def hook(module, _inputs, output):
            counts[address] = counts.get(address, 0) + 1
            call = address if counts[address] == 1 else f"{address}:{counts[address]}"
            first = first_tensor(output)
            if first is not None and first.requires_grad:
                first.register_hook(lambda g: module_grads.setdefault(call, []).append(g))
        return hook

    handles = []
    try:  # registered inside the try: a Ctrl-C between two registrations leaves none behind
        for address in children:
            handles.append(modules[address].register_forward_hook(keep(address)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            output = model(*args, **kwargs)
            _args.scalar_loss(loss_fn(output), "bl.validate").backward()
    finally:
        for handle in handles:
            handle.remove()
    params = {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    return params, module_grads


def _compare_params(model, stock, result: ValidationResult) -> None:
    for name, p in model.named_parameters():
        expected = stock[name]
        result.compared.append(f"param {name}.grad")
        if (expected is None) != (p.grad is None) or (
            expected is not None and not torch.equal(expected, p.grad)
        ):
            result.ok = False
            result.differences.append(f"parameter gradient {name}")


def _compare_modules(cap, stock_modules, children, result: ValidationResult) -> None:
    if not children:
        warnings.warn(
            BacklensWarning(
                "validate: the model has no child module, so there is no module-output gradient "
                "to compare; returning False rather than a vacuous pass.",
                code="backward_validation_no_module_output_evidence",
            ),
            stacklevel=3,
        )
        result.ok = False
        result.notes.append("no child module: no module-output evidence")
        return
    for call, grads in stock_modules.items():
        result.compared.append(f"module {call} output grad")
        record = cap.modules.get(call)
        if record is None:
            result.ok = False
            result.differences.append(f"module call {call} missing from the capture")
            continue
        expected = grads[-1] if len(grads) == 1 else None
        saved = record.output_grads
        if expected is None:
            result.notes.append(f"module {call}: {len(grads)} stock gradients, compared the sum")
            expected = torch.stack(grads).sum(0)
        if len(saved) != 1 or not torch.equal(saved[0].tensor, expected):
            result.ok = False
            result.differences.append(f"module output gradient {call}")


def _check_invariants(cap, result: ValidationResult) -> None:
    def check(description: str, holds: bool) -> None:
        result.compared.append(description)
        if not holds:
            result.ok = False
            result.differences.append(description)

    passes = cap.passes
    check("pass numbers are dense from 1", [p.number for p in passes] == list(range(1, len(passes) + 1)))
    labels = [g.label for g in cap.grad_fns]
    check("one record per autograd node", len(labels) == len(set(labels)))
    check("node labels follow {type}_back_{k}_{n}", all(NODE_LABEL_PATTERN.match(label) for label in labels))
    check("op labels follow {name}_{k}", all(_OP_LABEL.match(op.label) for op in cap.ops))
    dense = True
    for grad_fn in cap.grad_fns:
        ordinals = [c.index for c in grad_fn.calls]
        dense &= ordinals == list(range(1, len(ordinals) + 1))
    check("call ordinals are dense per node", dense)
    calls = cap.grad_fn_calls
    check("call labels follow {node}:{c}", all(CALL_LABEL_PATTERN.match(c.label) for c in calls))
    check("every first-order node has a resolved order", all(g.order is not None for g in cap.grad_fns))
    labels = {m.label for m in cap.modules}
    contained = all(op.module in labels for op in cap.ops if op.module is not None)
    contained &= all(g.module_call in labels for g in cap.grad_fns if g.module is not None)
    check("every op and node belongs to a recorded module call", contained)
    check("every pass completed", all(p.status == "ok" for p in passes))
    fired = {c.grad_fn.label for c in calls}
    check("gradient flowed through at least one node", bool(fired))
