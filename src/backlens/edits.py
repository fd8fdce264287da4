"""Declarative edits: a site, an edit, and ``when`` to arm one on a capture.

A site is an op label (``"relu_3"``: its activation), ``bl.grad("relu_3")``
(the gradient of its output), a module address (the output of every call;
``bl.grad("encoder.layer.0")`` its output gradient; ``"encoder.layer.0:2"``
the second call only), or a selector (every matching op). Sites combine with ``|``. An edit maps a tensor to a tensor of
the same shape and dtype: ``scale``, ``zero_ablate``, ``clamp``,
``add_noise``, ``clip_norm``, or any ``fn(value, *, ctx)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from backlens import _args
from backlens.errors import BacklensError, UnsupportedInputError

__all__ = [
    "EditContext",
    "Intervention",
    "Interventions",
    "Site",
    "add_noise",
    "clamp",
    "clip_norm",
    "grad",
    "keep_grad",
    "scale",
    "when",
    "zero_ablate",
]


@dataclass(frozen=True)
class EditContext:
    """What an edit callable is told about where it applies."""

    site: str
    op: str | None
    module: str | None
    pass_number: int | None
    invoke_rows: tuple[int, int] | None = None
    application: int = 0


class Site:
    """Where an edit applies: activations or gradients of ops or module calls."""

    def __init__(self, targets: tuple[Any, ...], gradient: bool):
        self.targets = targets  # labels / addresses (str) or selectors
        self.gradient = gradient

    def __or__(self, other: Any) -> SiteUnion:
        return SiteUnion((self, as_site(other)))

    def parts(self) -> tuple[Site, ...]:
        return (self,)

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.targets)
        return f"grad({inner})" if self.gradient else inner


class SiteUnion(Site):
    def __init__(self, sites: tuple[Site, ...]):
        self.sites = tuple(p for s in sites for p in s.parts())
        self.gradient = any(s.gradient for s in self.sites)
        self.targets = tuple(t for s in self.sites for t in s.targets)

    def parts(self) -> tuple[Site, ...]:
        return self.sites

    def __repr__(self) -> str:
        return " | ".join(repr(s) for s in self.sites)


def as_site(value: Any) -> Site:
    if isinstance(value, Site):
        return value
    if isinstance(value, str) and not value.strip():
        raise UnsupportedInputError(
            f"An edit site names an op or a module, got the empty name {value!r} (an empty variable is the "
            "likelier cause than a wish to edit the whole model's output).", code="bad_site",
            remedy="Pass e.g. 'relu_1' or 'encoder.layer.0'; for the model's output, name the op that makes it "
            "(cap.ops[-1].label).")
    if isinstance(value, str) or hasattr(value, "matches"):
        return Site((value,), gradient=False)
    raise UnsupportedInputError(
        f"An edit site is an op label, a module address, bl.grad(...) or a selector, not {value!r} "
        f"({type(value).__name__}).", code="bad_site",
        remedy="Pass e.g. 'relu_1', 'encoder.layer.0', bl.grad('relu_1') or bl.func('relu').")


def grad(target: Any) -> Site:
    """The gradient of an op's output or of a module call's output (or of what a selector matches)."""
    site = as_site(target)
    return SiteUnion(tuple(Site(p.targets, gradient=True) for p in site.parts()))


# -- edits -----------------------------------------------------------------

class Edit:
    """A named tensor -> tensor map; ``repr`` is what records show."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor, EditContext], torch.Tensor]):
        self.name = name
        self._fn = fn

    def __call__(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        return self._fn(value, ctx)

    def __repr__(self) -> str:
        return self.name


def scale(factor: float) -> Edit:
    """Multiply by ``factor`` (a finite number)."""
    _args.number(factor, "factor", "bl.scale", finite=True, example="0.5")
    return Edit(f"scale({factor!r})", lambda v, ctx: v * factor)


def zero_ablate() -> Edit:
    return Edit("zero_ablate()", lambda v, ctx: torch.zeros_like(v))


def clamp(min: float | None = None, max: float | None = None) -> Edit:  # noqa: A002 - torch's names
    """Clamp into ``[min, max]`` (either bound may be None, not both)."""
    for name, bound in (("min", min), ("max", max)):
        if bound is not None:
            _args.number(bound, name, "bl.clamp", example="-1.0, 1.0")
    if min is None and max is None:
        raise UnsupportedInputError("bl.clamp needs min or max (or both).", code="bad_argument",
                                    remedy="Pass e.g. bl.clamp(-1.0, 1.0) or bl.clamp(max=1.0).")
    if min is not None and max is not None and float(min) > float(max):
        raise UnsupportedInputError(f"bl.clamp: min ({min!r}) is above max ({max!r}).", code="bad_argument",
                                    remedy="Pass min <= max, e.g. bl.clamp(-1.0, 1.0).")
    return Edit(f"clamp({min!r}, {max!r})", lambda v, ctx: v.clamp(min=min, max=max))


def add_noise(std: float, *, seed: int = 0) -> Edit:
    """Gaussian noise; the k-th application in a capture draws from ``seed + k``."""
    _args.number(std, "std", "bl.add_noise", low=0.0, finite=True, example="0.1")
    _args.integer(seed, "seed", "bl.add_noise", low=0, example="0")

    def apply(value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        generator = torch.Generator(device=value.device).manual_seed(seed + ctx.application)
        noise = torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)
        return value + noise * std

    return Edit(f"add_noise({std!r}, seed={seed!r})", apply)


def clip_norm(max_norm: float) -> Edit:
    """Rescale so the tensor's 2-norm is at most ``max_norm`` (more than 0; bl.zero_ablate() zeroes)."""
    _args.number(max_norm, "max_norm", "bl.clip_norm", low=0.0, above=True, finite=True, example="1.0")

    def apply(value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        norm = value.detach().float().norm()
        factor = torch.clamp(max_norm / (norm + 1e-12), max=1.0).to(value.dtype)
        return value * factor

    return Edit(f"clip_norm({max_norm!r})", apply)


class KeepGrad(Edit):
    """An edit whose output keeps the gradient path of its input (see :func:`keep_grad`)."""

    def __init__(self, edit: Edit):
        super().__init__(f"keep_grad({edit!r})", self._apply)
        self.edit = edit

    def _apply(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        with torch.no_grad():
            edited = self.edit(value, ctx)
        if not isinstance(edited, torch.Tensor) or not value.requires_grad:
            return edited
        return _StraightThrough.apply(value, edited)


class _StraightThrough(torch.autograd.Function):
    """Forward: the edited value, exactly. Backward: the gradient passes to the unedited input."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, edited: torch.Tensor) -> torch.Tensor:
        return edited.clone() if edited is value else edited

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def keep_grad(edit: Any) -> KeepGrad:
    """``edit`` with its output keeping the gradient path: the forward sees the edited value, and the
    gradient reaching it passes on to the unedited input as it arrives (straight through).

    ``bl.keep_grad(bl.zero_ablate())`` ablates a value while the parameters upstream still train. Under
    differentiable replay the path ends at the frontier leaves, and it warns ``keep_grad_replay_frontier``.
    """
    return KeepGrad(as_edit(edit, "bl.keep_grad"))


def as_edit(value: Any, where: str = "bl.when") -> Edit:
    if isinstance(value, Edit):
        return value
    if callable(value):
        _args.edit_callable(value, where)  # now, not when it first applies inside the user's backward
        name = getattr(value, "__name__", type(value).__name__)
        return Edit(f"{name}(...)", lambda v, ctx: value(v, ctx=ctx))
    raise UnsupportedInputError(
        f"An edit is bl.scale(...), bl.zero_ablate(), ... or a callable fn(value, *, ctx), not {value!r} "
        f"({type(value).__name__}).", code="bad_edit",
        remedy="Pass e.g. bl.scale(0.5), or a function taking the tensor and ctx= and returning a tensor.")


# -- arming ----------------------------------------------------------------

@dataclass
class Intervention:
    site: Site
    edit: Edit

    def __or__(self, other: Any) -> Interventions:
        return Interventions([self, *as_interventions(other)])

    def bind(self, model: torch.nn.Module) -> BoundModel:
        """A callable running ``model`` live with this edit armed (see :class:`BoundModel`)."""
        return BoundModel(model, [self])

    def __repr__(self) -> str:
        return f"when({self.site!r}, {self.edit!r})"


@dataclass
class Interventions:
    items: list[Intervention] = field(default_factory=list)

    def __or__(self, other: Any) -> Interventions:
        return Interventions([*self.items, *as_interventions(other)])

    def __iter__(self):
        return iter(self.items)

    def bind(self, model: torch.nn.Module) -> BoundModel:
        """A callable running ``model`` live with these edits armed (see :class:`BoundModel`)."""
        return BoundModel(model, list(self.items))


class BoundModel:
    """``bl.when(site, edit).bind(model)``: call it as the model; the edits apply in the real graph.

    Each call runs ``model(*args, **kwargs)`` with the edits armed and returns its output, still
    attached to the graph, so parameters upstream of a site train through the edit. Gradient edits
    stay armed on the graph of the latest call (until the next call).
    """

    def __init__(self, model: torch.nn.Module, interventions: list[Intervention]):
        if not isinstance(model, torch.nn.Module):
            raise UnsupportedInputError(
                f"bl.when(...).bind(model) needs a torch.nn.Module, got {type(model).__name__}.",
                code="not_a_module",
                remedy="Bind the model itself: bl.when(site, edit).bind(model).")
        self.model = model
        self.interventions = interventions
        self._gradient = any(part.gradient for i in interventions for part in i.site.parts())
        self._latest: Any = None

    # ``bl.capture``, which runs the model with the edits armed. The capture sits a layer above the
    # edits it arms, so it hands itself down when backlens.capturing loads (with the package).
    capture: ClassVar[Callable[..., Any]]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._latest = None
        cap = BoundModel.capture(self.model, *args, intervene=self.interventions, backward=self._gradient,
                      flops=False, timing=False, **kwargs)
        if self._gradient:
            self._latest = cap  # its hooks apply the gradient edits in the backward
        return cap.output

    def __repr__(self) -> str:
        return f"<BoundModel {type(self.model).__name__} with {' | '.join(map(repr, self.interventions))}>"


def when(site: Any, edit: Any) -> Intervention:
    """Arm ``edit`` at ``site``: ``bl.capture(..., intervene=bl.when(bl.grad("relu_3"), bl.scale(0.5)))``."""
    return Intervention(as_site(site), as_edit(edit))


def as_interventions(value: Any) -> list[Intervention]:
    if value is None or (type(value) in (tuple, list) and not value):
        return []  # the default, on every capture: skip the Iterable check
    if isinstance(value, Intervention):
        return [value]
    if isinstance(value, Interventions):
        return list(value.items)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items: list[Intervention] = []
        for item in value:
            items.extend(as_interventions(item))
        return items
    raise UnsupportedInputError(
        f"intervene= takes bl.when(site, edit), a | of them, or a list of them, not {value!r} "
        f"({type(value).__name__}).", code="bad_intervention",
        remedy="Pass e.g. intervene=bl.when(bl.grad('relu_1'), bl.scale(0.5)).")


def apply_checked(edit: Edit, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
    """Run an edit and refuse a result whose shape or dtype differs from its input."""
    result = edit(value, ctx)
    if not isinstance(result, torch.Tensor) or result.shape != value.shape or result.dtype != value.dtype:
        got = (f"{type(result).__name__}" if not isinstance(result, torch.Tensor)
               else f"shape {tuple(result.shape)} {result.dtype}")
        raise BacklensError(
            f"Edit {edit!r} at site {ctx.site!r} returned {got}, but the value there is "
            f"shape {tuple(value.shape)} {value.dtype}.",
            code="edit_changed_shape",
            remedy="Return a tensor of the same shape and dtype as the edit's input.",
        )
    return result
