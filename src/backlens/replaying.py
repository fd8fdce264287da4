"""``cap.do(site, edit, differentiable=True)``: a fork of a capture made by replaying its recorded ops.

capture/replay.py replays the ops downstream of the site into a fresh state;
this arms a backward recorder on the fork's graph, as ``bl.capture`` does on a
model's, so ``fork.backward(loss)`` records passes, FLOPs and gradients as
usual. The frontier leaves are the fork's inputs (``fork.inputs``, and by name
in ``fork.frontier``).
"""

from __future__ import annotations

from typing import Any

import torch

from backlens._nested import iter_tensors
from backlens.capture.backward import BackwardRecorder
from backlens.capture.policy import GradPolicy
from backlens.capture.replay import Replay, find_sites
from backlens.capture.unmatched import UnmatchedSelectorWarner
from backlens.capturing import Capture, _named_inputs, _walk_model
from backlens.cost.checkpoints import CheckpointJournal
from backlens.cost.journal import CostJournal
from backlens.cost.observer import FlopObserver
from backlens.edits import as_interventions, when
from backlens.errors import CaptureClosedError, ReplayError
from backlens.report.failures import PassFailures


class Fork(Capture):
    """A capture made by differentiable replay (no model ran): its ops are the replayed ones, under
    the source's labels and module calls, and its inputs are the frontier leaves."""

    def __init__(self, state: Any, *, output: Any, frontier: dict[str, torch.Tensor]):
        super().__init__(state, output=output)
        self.frontier = frontier  # fresh leaves by name: the frontier op's label, or the input's name

    def do(self, *args: Any, **kwargs: Any) -> Capture:
        raise CaptureClosedError(
            "A fork made by differentiable replay has no model to rerun and no recorded calls to replay.",
            code="fork_cannot_rerun",
            remedy="Call do() on the capture the fork came from.",
        )


def replay_fork(cap: Capture, site: Any, edit: Any, options: dict[str, Any], intervene: Any) -> Fork:
    """Replay ``cap``'s ops downstream of ``site`` with ``edit`` applied (see the module docstring)."""
    if as_interventions(intervene):
        raise ReplayError(
            "This capture was made with edits armed (intervene=...); its recorded activations are the "
            "values before those edits, so a replay would not follow the run it recorded.",
            code="replay_source_has_edits",
            remedy="Capture without intervene= and replay with all the edits at once "
            "(cap.do(site_a, edit_a | ...)), or rerun: cap.do(site, edit) without differentiable=True.",
        )
    source = cap._state
    model = cap._model
    args, kwargs, _options, _intervene = cap._rerun
    _addresses, _types, params, buffers = _walk_model(model)
    inputs = dict(_named_inputs(args, kwargs))
    by_kind = {"param": params, "buffer": buffers, "input": inputs}

    def tensor_of_source(kind: str, name: str) -> torch.Tensor | None:
        return by_kind.get(kind, {}).get(name)

    interventions = as_interventions(when(site, edit))
    replay = Replay(source, find_sites(source, interventions), tensor_of_source)
    output = replay.run(cap.output)
    state = replay.fork
    outputs = list(iter_tensors(output))
    state.inference_only = not any(t.requires_grad for t in outputs)
    state.inference_cause = "with no replayed op reading a frontier leaf or a parameter that requires grad"
    state.flops_enabled = bool(options.get("flops", True))
    state.checkpoints = CheckpointJournal()  # a replay runs the recorded ops, never a checkpoint
    state.cost = CostJournal(forward=_forward_flops(source, replay.replayed))
    live = not state.inference_only
    flops = state.flops_enabled
    frontier = replay.frontier
    state.recorder = BackwardRecorder(
        state,
        [t.grad_fn for t in outputs if t.grad_fn is not None],
        GradPolicy(options.get("save_grads", False)),
        timing=bool(options.get("timing", True)),
        input_tensors=list(frontier.values()),
        source_ids=replay.source_ids(),
        failures=PassFailures(),
        observers=(([FlopObserver()] if flops else []) + [UnmatchedSelectorWarner()]) if live else [],
        detect_nonfinite=bool(options.get("detect_nonfinite", False)),
    )
    if live:
        state.recorder.arm()
    else:
        state.recorder.hooking = False
    return Fork(state, output=output, frontier=frontier)


def _forward_flops(source: Any, replayed: list[int]) -> dict[str, Any] | None:
    """The replayed ops' forward FLOPs, as the source counted them (the same calls on the same shapes)."""
    cost = source.cost
    if cost is None or cost.forward is None:
        return None
    return {"op_flops": [cost.op_flops(i) for i in replayed], "replay_failures": []}
