"""What a monitor watches: the model's parameters and modules, named as the model names them.

Parameters are listed once each (a tied weight under its first name), in
registration order. A module's statistics roll up every parameter it holds,
its children's included (``""``, the model, holds them all: its norm is the
global gradient norm); modules that hold none have no parameter rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from backlens import _torch
from backlens.errors import UnsupportedInputError
from backlens.graph.labels import owning_module


def unwrapped(model: nn.Module) -> nn.Module:
    """The module whose names the user knows: inside DDP/DataParallel and torch.compile."""
    while True:
        inner = _torch.compiled_original(model)
        if inner is None and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


def dtensor_class() -> type | None:
    """torch's DTensor class when the program has imported it (FSDP2 shards are DTensors)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


@dataclass
class Layout:
    names: list[str]  # parameter names
    params: list[torch.Tensor]
    owners: list[str]  # the module that holds each parameter itself
    modules: list[str]  # addresses of modules holding parameters, model first
    members: np.ndarray  # bool [modules, params]: the parameters each module holds
    stepped: np.ndarray  # bool [params]: the optimizer updates it
    called: list[tuple[str, nn.Module]]  # every module, for output gradients
    sharded: np.ndarray  # bool [params]: a DTensor sharded across ranks (FSDP2)
    mesh_group: object | None  # the process group of the sharded parameters' mesh


def layout_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Layout:
    names, params, index = [], [], {}
    for name, param in model.named_parameters():
        index[id(param)] = len(params)
        names.append(name)
        params.append(param)
    modules, rows, called = [], [], []
    for address, module in model.named_modules():
        called.append((address, module))
        held = [index[id(p)] for p in module.parameters() if id(p) in index]
        if held:
            row = np.zeros(len(params), dtype=bool)
            row[held] = True
            modules.append(address)
            rows.append(row)
    members = np.stack(rows) if rows else np.zeros((0, len(params)), dtype=bool)
    stepped = np.zeros(len(params), dtype=bool)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in index:
                    stepped[index[id(param)]] = True
    sharded, group = _shards(names, params)
    return Layout(names, params, [owning_module(n) for n in names], modules, members, stepped, called,
                  sharded, group)


def _shards(names: list[str], params: list[torch.Tensor]) -> tuple[np.ndarray, object | None]:
    """Which parameters are sharded DTensors, and the one 1-D mesh they are sharded over."""
    sharded = np.zeros(len(params), dtype=bool)
    dtensor = dtensor_class()
    if dtensor is None:
        return sharded, None
    mesh = None
    for i, param in enumerate(params):
        if not isinstance(param, dtensor):
            continue
        placements = param.placements
        if param.device_mesh.ndim != 1 or not all(p.is_shard() or p.is_replicate() for p in placements):
            raise UnsupportedInputError(
                f"bl.monitor: parameter {names[i]!r} is a DTensor placed {placements} on a "
                f"{param.device_mesh.ndim}-D mesh; the monitor reads parameters sharded over one mesh "
                f"dimension (FSDP2's fully_shard) or replicated.",
                code="monitor_unsupported_sharding",
                remedy="Monitor the model under FSDP2 on a 1-D mesh, or unsharded.")
        if mesh is not None and param.device_mesh is not mesh and param.device_mesh != mesh:
            raise UnsupportedInputError(
                f"bl.monitor: parameter {names[i]!r} lives on another device mesh than the others.",
                code="monitor_unsupported_sharding", remedy="Shard every parameter over one device mesh.")
        mesh = param.device_mesh
        sharded[i] = any(p.is_shard() for p in placements)
    return sharded, (mesh.get_group() if mesh is not None else None)
