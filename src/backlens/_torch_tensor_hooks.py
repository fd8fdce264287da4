"""A tensor's gradient hooks, added straight to its hook dictionary, for backlens._torch (which
alone imports this module and re-exports its names: the rest of backlens reaches them as
``_torch.add_tensor_hook``; the capability flag is ``_torch.HAS_TENSOR_HOOK_DICT``, read there
at each call so that it can be turned off in one place).

``Tensor.register_hook`` is Python that, on each call, checks for ``__torch_function__``
overrides, imports its handle class and builds a ``RemovableHandle`` holding a weak
reference. A live backward body registers one hook per gradient it reads, in the middle of
the backward, between kernels that have just left the caches cold: there those steps cost
about 40 µs a read. :func:`add_tensor_hook` does what ``register_hook`` does for a plain
tensor, through the same private dictionary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from backlens import _torch  # the module importing this one: only its flag is read, at each call

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # neither overrides __torch_function__


def hook_dict_present() -> bool:
    """Whether tensors keep their hooks in ``_backward_hooks`` and handles count their keys."""
    return hasattr(torch.Tensor, "_backward_hooks") and isinstance(getattr(RemovableHandle, "next_id", None), int)


class TensorHookHandle:
    """Takes off one hook added by :func:`add_tensor_hook` (a second time: nothing)."""

    __slots__ = ("_hooks", "_key")

    def __init__(self, hooks: dict[int, Any], key: int):
        self._hooks = hooks
        self._key = key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


def add_tensor_hook(tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """``tensor.register_hook(hook)``: the same dictionary, registered with the tensor's node the
    same way the first time, keys from the same counter (so hooks run in the order they were
    added, whoever added them); a subclass, or a tensor that cannot take a hook, goes through
    ``register_hook`` itself. A torch function mode does not see the call: the hook is
    backlens's own bookkeeping. Returns a handle whose ``remove()`` takes the hook off."""
    if not _torch.HAS_TENSOR_HOOK_DICT or type(tensor) not in _PLAIN_TENSOR_TYPES or not tensor.requires_grad:
        return tensor.register_hook(hook)  # a subclass's override, or torch's own error
    hooks = tensor._backward_hooks
    if hooks is None:
        node = tensor.grad_fn
        register = getattr(node, "_register_hook_dict", None) if node is not None else None
        if node is not None and register is None:
            return tensor.register_hook(hook)
        hooks = OrderedDict()
        tensor._backward_hooks = hooks  # a leaf's hooks run from here, a result's from its node
        if register is not None:
            register(tensor)
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    hooks[key] = hook
    return TensorHookHandle(hooks, key)
