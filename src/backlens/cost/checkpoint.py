"""Evidence that an ATen call inside a backward node is checkpoint recomputation.

Ordinary backward kernels run with grad mode off (unless the pass builds a
graph, ``create_graph=True``). Activation checkpointing re-runs the forward
inside the node that first unpacks a checkpointed tensor, under
``torch.enable_grad()``: non-reentrant ``torch.utils.checkpoint`` from its
unpack hook, with its ``_recomputation_hook`` as the innermost saved-tensor
hook; reentrant checkpointing and custom Functions that recompute from their
own ``backward``. So: grad mode on inside a node is recomputation; in a
``create_graph`` pass, where grad mode is on for every kernel, only the
recomputation hook tells, and without it nothing does (``None``, never a guess).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backlens import _torch

_grad_enabled = torch.is_grad_enabled


def is_recomputation_hook(pack_hook: object) -> bool:
    """Whether a pack hook is ``torch.utils.checkpoint``'s recomputation hook."""
    return _torch.is_checkpoint_recomputation_hook(pack_hook)


def recompute_probe(create_graph: bool) -> Callable[[], bool] | None:
    """A cheap test, valid inside a backward node of one pass, that says whether
    the running ATen call is recomputation; ``None`` when this pass cannot tell."""
    if not create_graph:
        return _grad_enabled
    if not (_torch.HAS_TOP_SAVED_TENSORS_HOOKS and _torch.HAS_RECOMPUTATION_HOOK_CLASS):
        return None

    def probe() -> bool:
        return is_recomputation_hook(_torch.top_saved_tensors_pack_hook())

    return probe
