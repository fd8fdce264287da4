"""Save policies: which gradients a pass keeps as tensors.

A policy answers one question, ``matches(site)``, for a :class:`GradSite`:
one side (``grad_output`` or ``grad_input``) of one node in one pass. Passes
evaluate it once per node when they open, never per fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRAD_OUTPUT = 1  # gradients w.r.t. the node's forward outputs (arriving at it)
GRAD_INPUT = 2   # gradients w.r.t. the node's forward inputs (leaving it)


@dataclass(frozen=True)
class GradSite:
    """What a save policy sees: a node, a pass, a side."""

    grad_fn: Any
    pass_number: int
    side: str  # "grad_output" | "grad_input"
    kind: str = "grad_site"

    @property
    def op(self):
        return self.grad_fn.op

    @property
    def module(self) -> str | None:
        return self.grad_fn.module

    @property
    def label(self) -> str:
        return self.grad_fn.label


class GradPolicy:
    """``True`` keeps both sides of every node call, ``False`` none, a selector what it matches."""

    def __init__(self, spec: Any):
        if isinstance(spec, GradPolicy):
            spec = spec.spec
        if not (spec is True or spec is False or spec is None or hasattr(spec, "matches")):
            from backlens.errors import UnsupportedInputError

            raise UnsupportedInputError(
                f"save_grads must be True, False or a selector, not {type(spec).__name__}.",
                remedy="Pass save_grads=True, save_grads=False, or a selector such as bl.func('relu').",
            )
        self.spec = False if spec is None else spec

    @property
    def saves_nothing(self) -> bool:
        return self.spec is False

    def matches(self, site: GradSite) -> bool:
        if self.spec is True:
            return True
        if self.spec is False:
            return False
        return bool(self.spec.matches(site))

    def sides(self, grad_fn: Any, pass_number: int) -> int:
        """Bit mask of the sides to keep for ``grad_fn`` in that pass."""
        if self.spec is False:
            return 0
        if self.spec is True:
            return GRAD_OUTPUT | GRAD_INPUT
        mask = 0
        if self.matches(GradSite(grad_fn, pass_number, "grad_output")):
            mask |= GRAD_OUTPUT
        if self.matches(GradSite(grad_fn, pass_number, "grad_input")):
            mask |= GRAD_INPUT
        return mask

    def __repr__(self) -> str:
        return f"save_grads={self.spec!r}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GradPolicy) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))
