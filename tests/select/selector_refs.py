"""Plain-autograd references for selector tests: what each module output and its gradient are."""

from __future__ import annotations

import copy

import torch

from models import MLP, loss_of

# MLP() is net = Sequential(Linear, ReLU, Linear, ReLU, Linear): op k sits in module net.{k}.
OPS = ["linear_1", "relu_1", "linear_2", "relu_2", "linear_3"]
MODULE_OF = {label: f"net.{k}" for k, label in enumerate(OPS)}


def mlp_and_input(seed: int = 0):
    torch.manual_seed(seed)
    return MLP(), torch.randn(4, 6, requires_grad=True)


def references(model, x, scales=(1.0,)):
    """Outputs of every net.k and, per pass (loss * scale), their gradients, param and input grads.

    Runs on a deep copy with plain hooks, so the model under test is untouched.
    """
    twin = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_(True)
    outputs, grads = {}, []
    handles = []
    for k in range(len(twin.net)):
        def keep(module, inputs, output, k=k):
            outputs[f"net.{k}"] = output.detach().clone()
            output.register_hook(lambda g, k=k: grads[-1].__setitem__(f"net.{k}", g.clone()))
        handles.append(twin.net[k].register_forward_hook(keep))
    loss = loss_of(twin(x))
    for h in handles:
        h.remove()
    params, inputs = [], []
    for scale in scales:
        grads.append({})
        for p in twin.parameters():
            p.grad = None
        x.grad = None
        (loss * scale).backward(retain_graph=True)
        params.append({n: p.grad.clone() for n, p in twin.named_parameters()})
        inputs.append(x.grad.clone())
    return {"outputs": outputs, "grads": grads, "params": params, "inputs": inputs}


def saved_ops(cap):
    """Labels of the ops that have at least one saved gradient."""
    return [op.label for op in cap.ops if op.grads]
