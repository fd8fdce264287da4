"""Saved gradients and the one rule for reading a single one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backlens.errors import AmbiguousGradError, UnsupportedInputError


@dataclass(frozen=True)
class GradRecord:
    """One saved gradient: the tensor and the backward pass that produced it."""

    tensor: torch.Tensor
    pass_number: int

    def __repr__(self) -> str:
        shape = tuple(self.tensor.shape) if isinstance(self.tensor, torch.Tensor) else "?"
        return f"GradRecord(pass_number={self.pass_number}, shape={shape})"


def single_grad(grads: Sequence[GradRecord], what: str, why: Callable[[], str] | None = None) -> torch.Tensor:
    """The tensor when exactly one gradient was saved; else AmbiguousGradError.

    ``why()`` says why none was saved, when the caller can tell.
    """
    if len(grads) == 1:
        return grads[0].tensor
    if not grads:
        cause = why() if why is not None else "no pass ran yet, or save_grads did not select it"
        raise AmbiguousGradError(
            f"{what} has no saved gradient: {cause}.",
            code="no_saved_grad",
            remedy="Run a backward with save_grads=True (or a selector that matches it), "
            "then read .grad.",
        )
    passes = ", ".join(str(g.pass_number) for g in grads)
    raise AmbiguousGradError(
        f"{what} has {len(grads)} saved gradients (from passes {passes}); .grad needs exactly one.",
        remedy=f"Pick one: .grads[i] (0..{len(grads) - 1}) or .grad_for(pass_=k) with k in {{{passes}}}.",
    )


def check_pass_number(k: Any, where: str) -> None:
    """Pass numbers are integers from 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UnsupportedInputError(
            f"{where}: a backward pass number is an integer from 1, got {k!r} ({type(k).__name__}).",
            code="bad_pass_number", remedy="Pass numbers are 1-based: the first backward pass is 1.")


def why_none_saved(state: Any, node: int | None, untracked: str | None = None) -> str:
    """Why no gradient was kept for what ``node`` carries (None: no node carries it;
    ``untracked``: the reason, when that is known)."""
    if not state.passes:
        return "no backward pass has run over this capture yet"
    if node is None:
        return untracked or "no autograd node of this capture's graph carries it (no backward pass reached it)"
    if not state.node_calls[node]:
        return f"no backward pass reached its node {state.nodes[node].label}"
    return "the passes that reached it did not keep it (save_grads did not select it)"


def grad_for_pass(grads: Sequence[GradRecord], pass_: int, what: str) -> torch.Tensor:
    """The gradient saved in pass ``pass_`` (1-based)."""
    check_pass_number(pass_, f"{what}: grad_for(pass_=...)")
    chosen = [g for g in grads if g.pass_number == pass_]
    if len(chosen) == 1:
        return chosen[0].tensor
    saved_in = sorted({g.pass_number for g in grads})
    raise AmbiguousGradError(
        f"{what} has {len(chosen)} saved gradients in pass {pass_} "
        f"(passes with one: {saved_in or 'none'}).",
        code="no_saved_grad" if not chosen else "ambiguous_grad",
        remedy="Choose a pass that saved it, from the list in the message.",
    )


def describe_grads(grads: Sequence[GradRecord]) -> dict[str, Any]:
    """``grad`` and ``num_saved_grads`` columns for tables; never raises."""
    return {
        "grad": grads[0].tensor if len(grads) == 1 else None,
        "num_saved_grads": len(grads),
    }
