"""Armed edits on one capture: activation edits in the forward, gradient edits
through node pre-hooks in every pass. Every application is journalled with the
tensor norms before and after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backlens._nested import replace_first_tensor
from backlens.capture.forward import ForwardJournal, OpEntry, OpView
from backlens.edits import EditContext, Intervention, apply_checked
from backlens.errors import BackwardUnavailableError
from backlens.records.base import label_not_found


@dataclass(frozen=True)
class EditApplication:
    """One application of an edit (on a pass's ``edits`` or the capture's ``forward_edits``)."""

    site: str
    edit: str
    op: str | None
    module: str | None
    pass_number: int | None
    norm_before: float
    norm_after: float


def _norm(tensor: torch.Tensor) -> float:
    return float(tensor.detach().float().norm())


class ArmedEdits:
    """The interventions of one capture, split into forward and gradient sites."""

    def __init__(self, interventions: list[Intervention]):
        self.activation: list[tuple[Any, Intervention]] = []
        self.gradient: list[tuple[Any, Intervention]] = []
        for intervention in interventions:
            for part in intervention.site.parts():
                for target in part.targets:
                    (self.gradient if part.gradient else self.activation).append((target, intervention))
        self.forward_applications: list[EditApplication] = []
        self._counts: dict[int, int] = {}

    @property
    def any(self) -> bool:
        return bool(self.activation or self.gradient)

    def check_backward(self, backward: bool) -> None:
        if self.gradient and not backward:
            raise BackwardUnavailableError(
                "A gradient edit was armed on a capture made with backward=False, which installs no "
                "gradient hooks.",
                code="backward_not_requested",
                remedy="Drop backward=False, or arm only activation edits.",
            )

    def _next(self, intervention: Intervention) -> int:
        count = self._counts.get(id(intervention), 0)
        self._counts[id(intervention)] = count + 1
        return count

    # -- forward -----------------------------------------------------------
    def op_hook(self, journal: ForwardJournal):
        """The ForwardRecorder op hook, or None when no activation edit is armed."""

        def hook(entry: OpEntry, out: Any) -> Any:
            module = journal.module_calls[entry.module_call].address if entry.module_call is not None else None
            view = OpView(entry.label, entry.name, module)
            for target, intervention in self.activation:
                if isinstance(target, str):
                    if target != entry.label:
                        continue
                elif not target.matches(view):
                    continue
                out = self._edit_output(out, intervention, target, entry.label, module)
            return out

        return hook if self.activation else None

    @property
    def edits_module_outputs(self) -> bool:
        return any(isinstance(t, str) for t, _ in self.activation)

    def module_hook(self, call: Any, output: Any) -> Any:
        for target, intervention in self.activation:
            if isinstance(target, str) and target in (call.address, call.module_address):
                output = self._edit_output(output, intervention, target, None, call.address)
        return output

    def _edit_output(self, out: Any, intervention: Intervention, target: Any, op: str | None,
                     module: str | None) -> Any:
        site = target if isinstance(target, str) else repr(target)

        def run(value: torch.Tensor) -> torch.Tensor:
            ctx = EditContext(site, op, module, None, application=self._next(intervention))
            new = apply_checked(intervention.edit, value, ctx)
            self.forward_applications.append(
                EditApplication(site, repr(intervention.edit), op, module, None, _norm(value), _norm(new))
            )
            return new

        return replace_first_tensor(out, run)

    def check_sites(self, ops: list[OpEntry], module_calls: list[Any]) -> None:
        """A site string that names no op and no module call: KeyError with close labels."""
        labels = {op.label for op in ops}
        addresses = {c.address for c in module_calls} | {c.module_address for c in module_calls}
        for target, _ in [*self.activation, *self.gradient]:
            if isinstance(target, str) and target not in labels and target not in addresses:
                raise label_not_found("op or module", target, sorted(labels | addresses))

    # -- backward ------------------------------------------------------------
    def gradient_targets(self, ops: list[OpEntry], module_calls: list[Any], module_of: Any):
        """(kind, index, intervention, site) for every op or module call a gradient site names."""
        for target, intervention in self.gradient:
            site = target if isinstance(target, str) else repr(target)
            if isinstance(target, str):
                for op in ops:
                    if op.label == target:
                        yield "op", op.index, intervention, site
                for call in module_calls:
                    if target in (call.address, call.module_address):
                        yield "module", call.index, intervention, site
            else:
                for op in ops:
                    if target.matches(OpView(op.label, op.name, module_of(op))):
                        yield "op", op.index, intervention, site

    def grad_edit(self, edits: list[tuple[int, Intervention, str, str | None, str | None]]):
        """A node pre-hook body applying ``edits`` (output_nr, intervention, site, op, module)."""

        def pre(grad_outputs: tuple, state: Any) -> tuple:
            grads = list(grad_outputs)
            for output_nr, intervention, site, op, module in edits:
                value = grads[output_nr]
                if value is None:
                    continue
                ctx = EditContext(site, op, module, state.record.number, application=self._next(intervention))
                new = apply_checked(intervention.edit, value, ctx)
                state.record.edits.append(
                    EditApplication(site, repr(intervention.edit), op, module, state.record.number,
                                    _norm(value), _norm(new))
                )
                grads[output_nr] = new
            return tuple(grads)

        return pre
