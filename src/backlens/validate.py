"""``bl.validate``: a captured run against a stock run, and the records' invariants.

The stock run takes its references with plain PyTorch only: parameter ``.grad``
and, for module outputs, a forward hook that puts a tensor hook on each child
module call's output, named by the address grammar of API.md §1 (``"shared"``
for a module called once, ``"shared:1"``, ``"shared:2"`` for one called twice),
so both sides name the same call the same way. Both runs start from the same
state: parameters, buffers (BatchNorm's running statistics), absent parameter
gradients, training modes and the RNG seeded alike. Afterwards everything is
put back as it was, and whatever the captured run opened is closed, also when
the model, the loss or the backward raises.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from backlens import _args
from backlens._nested import first_tensor, iter_tensors
from backlens.capturing import capture
from backlens.errors import BacklensWarning, UnsupportedInputError
from backlens.graph.labels import CALL_LABEL_PATTERN, NODE_LABEL_PATTERN, call_label

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
    children = [address for address, _ in model.named_modules() if address]
    result = ValidationResult(ok=True)
    start = _ModelState(model, _devices(model, args, kwargs))
    try:
        stock_params, stock_modules = _stock_run(model, args, kwargs, loss_fn, children, seed, start)
        start.reset()  # the captured run starts where the stock run did
        cap = None
        try:
            with start.seeded(seed):
                cap = capture(model, *args, save_grads=True, **kwargs)
                _args.differentiable_loss(loss_fn(cap.output), "bl.validate").backward()
            _compare_params(model, stock_params, result)
            if validate_layer_grads:
                _compare_modules(cap, stock_modules, children, result)
            _check_invariants(cap, result)
        finally:
            if cap is not None:
                cap.close()
    finally:
        start.restore()
    return result


class _ModelState:
    """What a run of the model may change, as it was before the first run.

    Parameter and buffer values are copied (a train-mode BatchNorm moves its
    running statistics and ``num_batches_tracked``; a model may update a
    parameter in place), gradients and buffer objects are kept by reference,
    training modes per module, and the RNG of every device the model or the
    inputs use.
    """

    def __init__(self, model: torch.nn.Module, cuda_devices: list[int]):
        self.model = model
        self.devices = cuda_devices
        self.params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
        self.buffers = [(module, name, buffer, buffer.detach().clone())
                        for module in model.modules()
                        for name, buffer in module.named_buffers(recurse=False) if buffer is not None]
        self.training = [(module, module.training) for module in model.modules()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(device) for device in cuda_devices]

    @contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """The RNG of the run's devices starts from ``seed`` inside, and is put back after."""
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed)
            yield

    def reset(self) -> None:
        """Values and modes back to the start, parameter gradients absent (for the next run)."""
        with torch.no_grad():
            for param, value, _grad in self.params:
                param.copy_(value)
                param.grad = None
            for module, name, buffer, value in self.buffers:
                setattr(module, name, buffer)  # the model may have replaced the object
                buffer.copy_(value)
        for module, training in self.training:
            module.training = training

    def restore(self) -> None:
        """Everything as it was before ``bl.validate``: values, modes, gradients, RNG."""
        self.reset()
        for param, _value, grad in self.params:
            param.grad = grad
        torch.set_rng_state(self.rng)
        for device, state in zip(self.devices, self.cuda_rng):
            torch.cuda.set_rng_state(state, device)


def _devices(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[int]:
    """The CUDA devices whose RNG a run of ``model`` on these inputs may draw from."""
    tensors = [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


def _stock_run(model, args, kwargs, loss_fn, children, seed, start: _ModelState):
    """Parameter gradients and each child module call's output gradients of a plain run."""
    start.reset()
    module_grads: dict[tuple[str, int], list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    modules = dict(model.named_modules())

    def keep(address: str):
        def hook(module, _inputs, output):
            counts[address] = counts.get(address, 0) + 1
            call = (address, counts[address])
            first = first_tensor(output)
            if first is not None and first.requires_grad:
                first.register_hook(lambda g: module_grads.setdefault(call, []).append(g))
        return hook

    handles = []
    try:  # registered inside the try: a Ctrl-C between two registrations leaves none behind
        for address in children:
            handles.append(modules[address].register_forward_hook(keep(address)))
        with start.seeded(seed):
            output = model(*args, **kwargs)
            _args.differentiable_loss(loss_fn(output), "bl.validate").backward()
    finally:
        for handle in handles:
            handle.remove()
    params = {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    # Named as API.md §1 names a call: the address when the module ran once, "address:k" otherwise.
    named = {(address if counts[address] == 1 else call_label(address, k)): grads
             for (address, k), grads in module_grads.items()}
    return params, named


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
