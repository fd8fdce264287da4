"""What a capture names in a model and its call: modules, parameters, buffers, input tensors."""

from __future__ import annotations

import torch

from backlens import _torch
from backlens._nested import iter_named_tensors


def walk_model(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, str], dict, dict]:
    """Module addresses (by module id) and types, parameters and buffers by name, in one walk.

    The order and names are those of ``named_modules`` / ``named_parameters``
    (pre-order, a shared module or tensor under its first name); an explicit
    stack because the generator chain costs more than the rest of the setup.
    """
    addresses: dict[int, str] = {}
    types: dict[str, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    pending = [("", model)]
    while pending:
        address, module = pending.pop()
        if id(module) in addresses:
            continue
        addresses[id(module)] = address
        types[address] = type(module).__name__
        prefix = f"{address}." if address else ""
        own_params, own_buffers, children = _torch.module_parts(module)
        for name, param in own_params:
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params[prefix + name] = param
        for name, buffer in own_buffers:
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                buffers[prefix + name] = buffer
        if children:
            pending.extend((prefix + name, child) for name, child in reversed(children) if child is not None)
    return addresses, types, params, buffers


def named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The input tensors of a call by name (``args[0]``, ``mask``, ``args[1][0]``...), each once."""
    named = []
    for position, arg in enumerate(args):
        named.extend(iter_named_tensors(arg, f"args[{position}]"))
    for key, value in kwargs.items():
        named.extend(iter_named_tensors(value, key))
    seen: set[int] = set()
    unique = []
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append((name, tensor))
    return unique
