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
from backlens.capture.state import CaptureState
from backlens.capture.unmatched import UnmatchedSelectorWarner
from backlens.capture.walk import named_inputs, walk_model
from backlens.cost.checkpoints import CheckpointJournal
from backlens.cost.journal import CostJournal
from backlens.cost.observer import FlopObserver
from backlens.edits import as_interventions, when
from backlens.errors import ReplayError
from backlens.report.failures import PassFailures


def replay_fork(source: CaptureState, model: torch.nn.Module, rerun: tuple, output: Any, site: Any,
                edit: Any) -> tuple[CaptureState, Any, dict[str, torch.Tensor]]:
    """Replay the ops of the capture over ``source`` downstream of ``site`` with ``edit`` applied;
    returns the fork's state, its output and its frontier leaves (see the module docstring).

    ``model`` and ``rerun`` (args, kwargs, options, intervene) are those the source ran with;
    ``output`` is what its model returned.
    """
    args, kwargs, options, intervene = rerun
    if as_interventions(intervene):
        raise ReplayError(
            "This capture was made with edits armed (intervene=...); its recorded activations are the "
            "values before those edits, so a replay would not follow the run it recorded.",
            code="replay_source_has_edits",
            remedy="Capture without intervene= and replay with all the edits at once "
            "(cap.do(site_a, edit_a | ...)), or rerun: cap.do(site, edit) without differentiable=True.",
        )
    _addresses, _types, params, buffers = walk_model(model)
    inputs = dict(named_inputs(args, kwargs))
    by_kind = {"param": params, "buffer": buffers, "input": inputs}

    def tensor_of_source(kind: str, name: str) -> torch.Tensor | None:
        return by_kind.get(kind, {}).get(name)

    interventions = as_interventions(when(site, edit))
    replay = Replay(source, find_sites(source, interventions), tensor_of_source)
    output = replay.run(output)
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
    return state, output, frontier


def _forward_flops(source: Any, replayed: list[int]) -> dict[str, Any] | None:
    """The replayed ops' forward FLOPs, as the source counted them (the same calls on the same shapes)."""
    cost = source.cost
    if cost is None or cost.forward is None:
        return None
    return {"op_flops": [cost.op_flops(i) for i in replayed], "replay_failures": []}
