"""Armed edits on one capture: activation edits in the forward, gradient edits
through node pre-hooks in every pass. Every application is journalled with the
tensor norms before and after.

A gradient site names op outputs (a label, a module address, a selector of
forward terms: ``bl.func``, ``bl.label``, ``bl.module``), edited in every
pass at the node that made them, or node calls: a selector with a backward
term (``bl.grad_fn``, ``bl.without_op``, ``bl.in_pass``, ``bl.grad_output``),
or one that matched no op (a node label, a custom selector), is asked about
every node when each pass opens, as a save policy is, and edits the
gradients arriving at each node it matches in that pass. A combination that
cannot name a gradient there is refused when the capture is made; a site
that matches nothing warns (``edit_site_matched_nothing``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from backlens._nested import replace_first_tensor
from backlens._warn import warn
from backlens.capture.forward import OpEntry
from backlens.capture.policy import GradSite
from backlens.capture.state import EditApplication
from backlens.capture.unmatched import ruled_out_passes
from backlens.capture.views import NodeView, OpView
from backlens.edits import EditContext, Intervention, apply_checked
from backlens.errors import BackwardUnavailableError, UnsupportedInputError
from backlens.graph.labels import label_not_found, split_call
from backlens.select import BACKWARD_TERMS

MATCHED_NOTHING = "edit_site_matched_nothing"


def _names_call(site: str, call: Any) -> bool:
    """Whether address ``site`` names module call ``call`` (while the forward runs)."""
    if site == call.address:
        return True
    address, number = split_call(site)
    return number is not None and address == call.address and number == call.call


def _norm(tensor: torch.Tensor) -> float:
    return float(tensor.detach().float().norm())


class ArmedEdits:
    """The interventions of one capture, split into forward and gradient sites."""

    def __init__(self, interventions: list[Intervention], forward_applications: list[EditApplication]):
        self.activation: list[tuple[Any, Intervention]] = []
        self.gradient: list[tuple[Any, Intervention]] = []
        for intervention in interventions:
            for part in intervention.site.parts():
                for target in part.targets:
                    if not isinstance(target, str):
                        _check_selector_site(target, part.gradient)
                    (self.gradient if part.gradient else self.activation).append((target, intervention))
        # Gradient sites asked about every node when each pass opens (see the module docstring).
        self.node_sites: list[tuple[Any, Intervention]] = []
        self._ruled_out_warned: set[str] = set()
        self.forward_applications = forward_applications  # the state's forward_edits
        # (position in forward_applications, module call) of the applications made in the forward.
        self._forward_calls: list[tuple[int, int | None]] = []
        self._counts: dict[int, int] = {}
        # (kind, op or module call index, intervention, site) of gradient edits not yet on a node.
        self._pending: list[tuple[str, int, Intervention, str]] = []

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
    def op_hook(self, state: Any):
        """The ForwardRecorder op hook (``state``: the CaptureState being recorded)."""

        def hook(entry: OpEntry, out: Any) -> Any:
            view = state.view(OpView, entry.index)
            for target, intervention in self.activation:
                if isinstance(target, str):
                    if target != entry.label:
                        continue
                elif not target.matches(view):
                    continue
                out = self._edit_output(out, intervention, target, entry.label, entry.module_call,
                                        state.journal.call_label(entry.module_call))
            return out

        return hook

    @property
    def edits_module_outputs(self) -> bool:
        return any(isinstance(t, str) for t, _ in self.activation)

    def module_hook(self, call: Any, output: Any) -> Any:
        """Edit a module call's output as it returns: a site names the module (every
        call) or one call (``"lin:2"``; ``"lin:1"`` is the first)."""
        for target, intervention in self.activation:
            if isinstance(target, str) and _names_call(target, call):
                label = call.address if call.call == 1 else f"{call.address}:{call.call}"  # so far
                output = self._edit_output(output, intervention, target, None, call.index, label)
        return output

    def _edit_output(self, out: Any, intervention: Intervention, target: Any, op: str | None,
                     module_call: int | None, label: str | None) -> Any:
        site = target if isinstance(target, str) else repr(target)

        def run(value: torch.Tensor) -> torch.Tensor:
            # The call's label is known once the forward ends (``lin`` becomes ``lin:1``
            # when ``lin`` runs again): the application names it then (``label_applications``).
            ctx = EditContext(site, op, label, None, application=self._next(intervention))
            new = apply_checked(intervention.edit, value, ctx)
            self._forward_calls.append((len(self.forward_applications), module_call))
            self.forward_applications.append(
                EditApplication(site, repr(intervention.edit), op, None, None, _norm(value), _norm(new))
            )
            return new

        return replace_first_tensor(out, run)

    def label_applications(self, journal: Any) -> None:
        """After the forward: name each forward application's module call by its final label."""
        for position, module_call in self._forward_calls:
            applied = self.forward_applications[position]
            self.forward_applications[position] = replace(applied, module=journal.call_label(module_call))
        self._forward_calls = []

    def check_sites(self, journal: Any) -> None:
        """A site string that names no op and no module call: KeyError with close labels."""
        labels = {op.label for op in journal.ops}
        for target, _ in [*self.activation, *self.gradient]:
            if isinstance(target, str) and target not in labels and journal.resolve(target) is None:
                calls = journal.module_calls
                names = {journal.call_label(c.index) for c in calls} | {c.address for c in calls}
                raise label_not_found("op or module", target, sorted(labels | names))

    def warn_unmatched_activation_sites(self, state: Any) -> None:
        """After the forward: an activation selector site that edited no op warns."""
        for target, intervention in self.activation:
            if isinstance(target, str) or any(a.site == repr(target) for a in self.forward_applications):
                continue
            if not any(target.matches(state.view(OpView, op.index)) for op in state.journal.ops):
                funcs = sorted({op.name for op in state.journal.ops})
                warn(f"The edit {intervention!r} matched no op of the forward, so it edited nothing. Op "
                     f"functions that ran: {', '.join(funcs[:12]) or 'none'}.", MATCHED_NOTHING)

    # -- backward ------------------------------------------------------------
    def find_gradient_sites(self, state: Any) -> None:
        """Every op and module call a gradient site names, to arm as their nodes are found."""
        journal = state.journal
        for target, intervention in self.gradient:
            site = target if isinstance(target, str) else repr(target)
            if isinstance(target, str):
                self._pending += [("op", op.index, intervention, site) for op in journal.ops if op.label == target]
                self._pending += [("module", call, intervention, site) for call in journal.resolve(target) or ()]
                continue
            ops = [] if _names_node_calls(target) else [
                op.index for op in journal.ops if target.matches(state.view(OpView, op.index))]
            if ops:
                self._pending += [("op", index, intervention, site) for index in ops]
            else:
                self.node_sites.append((target, intervention))

    # -- gradient sites resolved per pass ------------------------------------
    def node_edits(self, state: Any, pass_number: int, count: int) -> dict[int, Any]:
        """For a pass opening: node index -> pre-hook body editing what arrives at that node,
        for every node-call site matching it in this pass (of the first ``count`` nodes)."""
        per_node: dict[int, list[tuple[Any, Intervention]]] = {}
        for target, intervention in self.node_sites:
            scope = target.pass_scope(pass_number)
            if scope is False:
                self._warn_ruled_out(target, intervention, pass_number)
                continue
            matched = [index for index in range(count)
                       if target.matches(GradSite(state.view(NodeView, index), pass_number, "grad_output"))]
            if not matched:
                types = sorted({state.nodes[i].type for i in range(count)})
                warn(f"The edit {intervention!r} matched no node of backward pass {pass_number}, so it edits "
                     f"nothing there. Node types in the graph: {', '.join(types[:12]) or 'none'}.",
                     MATCHED_NOTHING, in_hook=True)
            for index in matched:
                per_node.setdefault(index, []).append((target, intervention))
        return {index: self._node_edit(state, index, sites) for index, sites in per_node.items()}

    def _warn_ruled_out(self, target: Any, intervention: Any, number: int) -> None:
        if repr(target) in self._ruled_out_warned:
            return
        when = ruled_out_passes(target.pass_scope, number)
        if when is not None:
            self._ruled_out_warned.add(repr(target))
            warn(f"The edit {intervention!r} matched nothing in backward pass {number}, and {when} "
                 "(pass numbers start at 1).", MATCHED_NOTHING, in_hook=True)

    def _node_edit(self, state: Any, index: int, sites: list[tuple[Any, Intervention]]):
        """A pre-hook body editing every gradient arriving at node ``index``."""
        view = state.view(NodeView, index)
        op = view.op.label if view.op is not None else None
        module = view.module_call

        def pre(grad_outputs: tuple, pass_: Any) -> tuple:
            grads = list(grad_outputs)
            for target, intervention in sites:
                site = repr(target)
                for position, value in enumerate(grads):
                    if value is None:
                        continue
                    ctx = EditContext(site, op, module, pass_.number, application=self._next(intervention))
                    new = apply_checked(intervention.edit, value, ctx)
                    pass_.edits.append(EditApplication(site, repr(intervention.edit), op, module, pass_.number,
                                                       _norm(value), _norm(new)))
                    grads[position] = new
            return tuple(grads)

        return pre

    def arm(self, state: Any, pre_edits: dict[int, Any]) -> None:
        """Put each pending gradient edit on the pre-hook of the node its site's output came from."""
        if not self._pending:
            return
        journal = state.journal
        per_node: dict[int, list] = {}
        still_pending = []
        for kind, index, intervention, site in self._pending:
            if kind == "op":
                node, entry = state.node_of_op(index), journal.ops[index]
                op, module = entry.label, journal.call_label(entry.module_call)
            else:
                node, entry = state.node_of_module_call(index), journal.module_calls[index]
                op, module = None, journal.call_label(index)
            if node is None:
                still_pending.append((kind, index, intervention, site))
                continue
            per_node.setdefault(node, []).append((entry.output_nr, intervention, site, op, module))
        self._pending = still_pending
        for node, edits in per_node.items():
            pre_edits[node] = self.grad_edit(edits)

    def grad_edit(self, edits: list[tuple[int, Intervention, str, str | None, str | None]]):
        """A node pre-hook body applying ``edits`` (output_nr, intervention, site, op, module)."""

        def pre(grad_outputs: tuple, pass_: Any) -> tuple:
            grads = list(grad_outputs)
            for output_nr, intervention, site, op, module in edits:
                value = grads[output_nr]
                if value is None:
                    continue
                ctx = EditContext(site, op, module, pass_.number, application=self._next(intervention))
                new = apply_checked(intervention.edit, value, ctx)
                pass_.edits.append(
                    EditApplication(site, repr(intervention.edit), op, module, pass_.number, _norm(value), _norm(new))
                )
                grads[output_nr] = new
            return tuple(grads)

        return pre


def _names_node_calls(selector: Any) -> bool:
    """Whether a selector has a term only backward objects answer (so it names node calls)."""
    return any(kind in BACKWARD_TERMS for kind, _positive in selector.terms())


def _check_selector_site(selector: Any, gradient: bool) -> None:
    """Refuse, when the capture is made, a selector site that could never name what it edits."""
    terms = selector.terms()
    if not gradient and any(kind in BACKWARD_TERMS for kind, _positive in terms):
        raise UnsupportedInputError(
            f"The activation site {selector!r} has backward terms (bl.grad_fn, bl.without_op, bl.in_pass, "
            "bl.grad_input, bl.grad_output): an activation site is matched against forward ops, which those "
            "never match, so it would edit nothing.",
            code="activation_site_backward_selector",
            remedy=f"To edit gradients wrap it: bl.grad({selector!r}); to edit activations select ops with "
            "bl.func, bl.label or bl.module.",
        )
    if gradient and ("grad_input", True) in terms:
        raise UnsupportedInputError(
            f"The gradient site bl.grad({selector!r}) selects bl.grad_input(): an edit site edits the gradient "
            "arriving at a node (its grad_output side); the gradients a node sends on are what arrives at "
            "the nodes after it, so grad_input names no gradient an edit can replace here.",
            code="grad_input_edit_site",
            remedy="Drop bl.grad_input() and select the nodes those gradients reach (or bl.grad_output()).",
        )
