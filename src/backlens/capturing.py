"""``bl.capture`` and ``bl.load``: the :class:`Capture` a user holds over one capture state.

:func:`capture` runs the forward under the forward recorder, fills a
:class:`~backlens.capture.state.CaptureState` and arms its backward recorder
with FLOP counting (cost/), failure explanations (report/) and the armed
edits. :func:`load` reads a bundle into the same kind of state (io/). Either
way the :class:`Capture` reads its records over that state.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from backlens import _args, _torch
from backlens._clock import profiler_clock_offset
from backlens._distributed import rank_and_world_size
from backlens._fence import complete
from backlens._nested import iter_tensors
from backlens._warn import warn
from backlens.capture.backward import BackwardRecorder
from backlens.capture.collectives import CollectiveRecorder
from backlens.capture.compiled import NOT_COUNTED, is_opaque, original_module, run_opaque
from backlens.capture.compiled import check_mode as check_compiled_mode
from backlens.capture.forward import ActivationPolicy, ForwardRecorder
from backlens.capture.interventions import ArmedEdits
from backlens.capture.memory import MemoryRecorder
from backlens.capture.policy import GradPolicy
from backlens.capture.replay_record import ReplayRecording
from backlens.capture.state import CaptureState, InputEntry, ParamEntry
from backlens.capture.unmatched import UnmatchedSelectorWarner, warn_if_no_activation_kept
from backlens.capture.walk import named_inputs, walk_model
from backlens.cost.checkpoint_witness import COMPILED_OPAQUE, CheckpointWitness
from backlens.cost.forward_count import FlopForwardRecorder
from backlens.cost.journal import CostJournal
from backlens.cost.observer import FlopObserver, census_left_behind
from backlens.derive.bundle import is_derived
from backlens.derive.bundle import load as load_derived
from backlens.derive.frameworks import refuse_other_framework
from backlens.distributed.rankset import RankSet, rank_bundle_dirs
from backlens.edits import BoundModel, as_interventions, when
from backlens.errors import (
    BackwardUnavailableError,
    CaptureClosedError,
    NoGradientPathError,
    UnsupportedInputError,
)
from backlens.graph import engine
from backlens.io.bundle import BundleInfo, read_bundle, save_state
from backlens.io.disk_store import make_store
from backlens.io.replace import recover
from backlens.records.capture import CaptureRecords
from backlens.replaying import replay_fork
from backlens.report.failures import PassFailures

# The options of bl.capture: a keyword close to one of these is a typo, not the model's.
CAPTURE_OPTIONS = ("save_grads", "save_activations", "storage", "flops", "timing", "intervene", "backward",
                   "detect_nonfinite", "compiled", "memory")
# What cap.backward passes on to torch.autograd.backward.
BACKWARD_OPTIONS = ("grad_tensors", "retain_graph", "create_graph", "inputs")


def capture(
    model: torch.nn.Module,
    *args: Any,
    save_grads: Any = False,
    save_activations: Any = False,
    storage: Any = None,
    flops: bool = True,
    timing: bool = True,
    intervene: Any = (),
    backward: bool = True,
    detect_nonfinite: bool = False,
    compiled: str = "eager",
    memory: bool = False,
    **kwargs: Any,
) -> Capture:
    """Run ``model(*args, **kwargs)`` once, record it, and arm backward capture.

    The user's graph is not changed: no clone or identity nodes are inserted,
    inputs are not copied, and gradients reach leaves and parameters exactly as
    without backlens. See API.md §1 for every option; ``compiled`` says how a
    ``torch.compile`` model is captured (docs/capture.md).
    """
    if not isinstance(model, torch.nn.Module):
        if isinstance(model, type) and issubclass(model, torch.nn.Module):
            raise UnsupportedInputError(
                f"bl.capture got the class {model.__name__}, not a model: it needs an instance.",
                code="module_class_not_instance",
                remedy=f"Instantiate it first: bl.capture({model.__name__}(...), x).",
            )
        refuse_other_framework(model, args, kwargs, "bl.capture")
        raise UnsupportedInputError(
            f"bl.capture needs a torch.nn.Module, got {type(model).__name__}.",
            code="not_a_module",
            remedy="Wrap the callable in an nn.Module (its forward calls the function) and capture that.",
        )
    _torch.drop_dispatch_modes(census_left_behind)  # what an interrupted earlier pass may have left
    # Every option is checked before anything runs or is created (a to_disk directory).
    check_compiled_mode(compiled)
    forward = (_torch.compiled_original(model) or model).forward
    _args.no_mistyped_options(kwargs, CAPTURE_OPTIONS, forward, "bl.capture")
    for name, value in (("flops", flops), ("timing", timing), ("backward", backward),
                        ("detect_nonfinite", detect_nonfinite), ("memory", memory)):
        _args.flag(value, name, "bl.capture")
    _args.policy(save_grads, "save_grads", "bl.capture")
    _args.policy(save_activations, "save_activations", "bl.capture")
    policy = GradPolicy(save_grads)
    activations = ActivationPolicy(save_activations)
    interventions = as_interventions(intervene)
    compiled_model, opaque = model, is_opaque(model, compiled)
    if memory and opaque:
        raise UnsupportedInputError(
            "bl.capture(..., memory=True, compiled='opaque'): the saved tensors of opaque compiled regions "
            "cannot be seen (nothing of backlens may run while dynamo traces them).",
            code="memory_needs_eager_forward",
            remedy="Capture with compiled='eager' (the default), which records the original module's forward.")
    model = original_module(model, compiled)  # a compiled model's own modules and parameters
    # The forward, recorded into the state's journal.
    state = CaptureState(make_store(storage))
    armed = ArmedEdits(interventions, state.forward_edits)
    armed.check_backward(backward)
    if backward and not _torch.HAS_NODE_PREHOOK:
        state.backward_unavailable = NO_NODE_PREHOOKS
        if armed.gradient:
            raise _no_node_prehooks()
        warn(f"{NO_NODE_PREHOOKS}: bl.capture records the forward only.", "backward_capture_unavailable")
    journal = state.journal
    # flops=True: the recorder also counts or notes the ops that may carry FLOPs (no dispatch mode).
    recorder = (FlopForwardRecorder if flops else ForwardRecorder)(
        state, activations, op_hook=armed.op_hook(state) if armed.activation else None
    )
    if armed.edits_module_outputs:
        recorder.module_output_hook = armed.module_hook
    if recorder.activations.keeps_any:  # differentiable replay starts from kept activations
        state.replay = ReplayRecording()
        recorder.record_replay(state.replay)
    addresses, module_types, params, buffers = walk_model(model)
    recorder.register_sources("param", params.items())
    recorder.register_sources("buffer", buffers.items())
    inputs = named_inputs(args, kwargs)
    input_sources = recorder.register_sources("input", inputs)
    memory_recorder = (MemoryRecorder(state, recorder, params, buffers, [t for _name, t in inputs])
                       if memory else None)
    recorder.memory = memory_recorder
    grad_enabled = torch.is_grad_enabled()
    inference_mode = torch.is_inference_mode_enabled()

    witness = CheckpointWitness(state)
    witness.memory = memory_recorder
    state.forward_clock_offset_ns = profiler_clock_offset()
    journal.seq_start = _torch.sequence_nr()
    if opaque:  # nothing of backlens in the forward: dynamo sees the model alone
        witness.journal.add_reason(COMPILED_OPAQUE)
        output = run_opaque(journal, compiled_model, args, kwargs)
    else:
        # Everything the forward installs in torch (the module-call wrapper, the function
        # mode, the checkpoint witness) is installed inside this try and removed in its
        # finally, also on Ctrl-C.
        try:
            recorder.attach(addresses, module_types)
            saving = memory_recorder.saving() if memory_recorder is not None else contextlib.nullcontext()
            with witness, _torch.function_mode(recorder), saving:
                output = model(*args, **kwargs)
        finally:
            complete(lambda: (recorder.detach(), witness.leave()))
    journal.seq_end = _torch.sequence_nr()
    recorder.finish(output)
    if memory_recorder is not None:
        memory_recorder.finish_forward(journal)
    warn_if_no_activation_kept(save_activations, journal)
    if armed.any:
        armed.check_sites(journal)
        armed.label_applications(journal)
        armed.warn_unmatched_activation_sites(state)

    # What the capture knows beside the journal.
    state.params = [ParamEntry(name, tuple(p.shape), p.dtype, p.requires_grad, weakref.ref(p))
                    for name, p in params.items()]
    state.inputs = [InputEntry(name, tuple(t.shape), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter))
                    for name, t in inputs]
    outputs = list(iter_tensors(output))
    state.inference_only = not any(t.requires_grad for t in outputs)
    state.inference_cause = _inference_cause((grad_enabled, inference_mode), params, inputs)
    state.backward_requested = backward
    state.flops_enabled = flops
    state.rank, state.world_size = rank_and_world_size()
    state.cost = CostJournal(pending_forward=recorder.forward_cost() if flops else None)

    # The backward recorder: it discovers the graph when first asked, and records
    # passes over it when one is wanted and possible.
    if armed.gradient:
        armed.find_gradient_sites(state)
    live = backward and not state.inference_only and state.backward_unavailable is None
    # Under torch.distributed: the collectives of DDP and FSDP2 parts, each pass's own.
    collectives = (CollectiveRecorder.for_model(state, model, addresses, params)
                   if live and state.rank is not None else None)
    source_ids = {id(p): i for i, p in enumerate(params.values())}
    if collectives is not None:
        source_ids |= collectives.param_aliases({name: i for i, name in enumerate(params)})
    state.recorder = BackwardRecorder(
        state,
        [t.grad_fn for t in outputs if t.grad_fn is not None],
        policy,
        timing=timing,
        input_tensors=[t for _name, t in inputs],
        source_ids=source_ids | {id(t): source for (_name, t), source in zip(inputs, input_sources)},
        failures=PassFailures(),
        observers=(([FlopObserver(NOT_COUNTED if opaque else None)] if flops else [])
                   + [UnmatchedSelectorWarner(), witness]
                   + ([collectives] if collectives is not None else [])
                   + ([memory_recorder] if memory_recorder is not None else [])) if live else [],
        edits=armed if armed.gradient else None,
        detect_nonfinite=detect_nonfinite,
    )
    state.recorder.end_fires_at_drain = collectives is not None
    state.recorder.memory = memory_recorder if live else None
    if live:
        state.recorder.arm()
    else:
        state.recorder.hooking = False  # no pass will open
    options = dict(save_grads=save_grads, save_activations=save_activations, flops=flops, timing=timing,
                   backward=backward, detect_nonfinite=detect_nonfinite, compiled=compiled, memory=memory)
    return Capture(state, output=output, model=compiled_model if opaque else model,
                   rerun=(args, kwargs, options, intervene))


BoundModel.capture = staticmethod(capture)


def load(path: str | os.PathLike, *, verify: bool = True) -> LoadedCapture | RankSet:
    """Read the bundle at ``path`` as a read-only capture (API.md §6, docs/bundles.md).

    A directory of rank bundles (``bl.to_disk("run/rank{rank}")`` on every rank
    of a distributed run) reads as a :class:`RankSet` (API.md §10,
    docs/distributed.md). ``verify=False`` skips hashing the shards up front
    (faster for very large bundles); sizes and headers are still checked, and
    each tensor is checked against its sha256 when first read.
    """
    _args.path(path, "path", "bl.load", "bl.load('runs/capture1')")
    _args.flag(verify, "verify", "bl.load")
    recover(Path(path))  # a replacement that died between its two renames: the old bundle goes back
    if is_derived(path):
        return load_derived(path, verify=verify)
    if rank_bundle_dirs(path) is not None:
        return RankSet.load(path, lambda directory: LoadedCapture(*read_bundle(directory, verify=verify)))
    state, info = read_bundle(path, verify=verify)
    return LoadedCapture(state, info)


def _inference_cause(grad_mode: tuple[bool, bool], params: dict, inputs: list) -> str:
    grad_enabled, inference_mode = grad_mode
    if inference_mode:
        return "under torch.inference_mode()"
    if not grad_enabled:
        return "under torch.no_grad() (grad mode disabled)"
    if not any(p.requires_grad for p in params.values()) and not any(t.requires_grad for _n, t in inputs):
        return "with no parameter or input that requires grad (a frozen model)"
    return "without building an autograd graph to its output"


class Capture(CaptureRecords):
    """A recorded forward and the backward passes run over its graph.

    Its records are views over its :class:`~backlens.capture.state.CaptureState`
    and hold that state, never this object: dropping the capture frees it, its
    graph and its saved gradients at once, and records you still hold read on
    (the same objects as before).
    """

    def __init__(self, state: CaptureState, *, output: Any = None, model: torch.nn.Module | None = None,
                 rerun: tuple | None = None, frontier: dict[str, torch.Tensor] | None = None):
        self._state = state
        self.output = output  # what the model returned (set it to None to let go of the graph)
        self._model = model
        self._rerun = rerun
        # A fork made by differentiable replay (no model ran): its ops are the replayed ones, under
        # the source's labels and module calls, and its inputs are these fresh leaves, by the
        # frontier op's label or the input's name. None on a capture of a model run.
        self.frontier = frontier

    @property
    def inference_only(self) -> bool:
        return self._state.inference_only

    @property
    def backward_requested(self) -> bool:
        return self._state.backward_requested

    @property
    def flops_enabled(self) -> bool:
        return self._state.flops_enabled

    @property
    def forward_edits(self) -> list:
        """Every activation edit applied in this capture's forward, with norms before and after."""
        return list(self._state.forward_edits)

    # -- backward ------------------------------------------------------------
    def backward(self, loss: torch.Tensor | None = None, *, save_grads: Any = None, **backward_kwargs: Any) -> None:
        """Run ``torch.autograd.backward(loss)`` as one recorded pass.

        ``save_grads`` widens or narrows the save policy for this pass only;
        ``backward_kwargs`` (``retain_graph``, ``create_graph``, ``inputs``,
        ``grad_tensors``) go to autograd.
        """
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise UnsupportedInputError(
                f"cap.backward: loss must be a tensor, got {type(loss).__name__}.", code="bad_argument",
                remedy="Pass the loss tensor, cap.backward(loss), or nothing when the output is a scalar.")
        for key in backward_kwargs:
            if key not in BACKWARD_OPTIONS:
                option = _args.close_option(key, [*BACKWARD_OPTIONS, "save_grads"])
                hint = f"; did you mean {option}=?" if option else ""
                raise UnsupportedInputError(
                    f"cap.backward: unknown option {key}={hint} It takes save_grads= and autograd's "
                    f"{', '.join(BACKWARD_OPTIONS)}.",
                    code="mistyped_option" if option else "unknown_option",
                    remedy=f"Spell it {option}=." if option else "Drop it, or pass one of the options named.")
        _args.backward_options("cap.backward", backward_kwargs.get("grad_tensors"), backward_kwargs.get("retain_graph"),
                               backward_kwargs.get("create_graph", False), backward_kwargs.get("inputs"),
                               gradient_name="grad_tensors")
        if loss is not None and loss.numel() != 1 and backward_kwargs.get("grad_tensors") is None:
            raise UnsupportedInputError(
                f"cap.backward: loss is a tensor of shape {tuple(loss.shape)}; without grad_tensors= the loss "
                "must be a scalar.", code="loss_required",
                remedy="Reduce it (cap.backward(loss.sum())) or pass grad_tensors=torch.ones_like(loss).")
        policy = GradPolicy(save_grads) if save_grads is not None else None
        self._check_backward_available()
        if loss is None:
            loss = self._default_loss()
        recorder = self._state.recorder
        if recorder.armed and not engine.reaches(recorder, loss):
            raise _foreign_loss()
        recorder.use_policy_for_next_pass(policy)
        engine.set_trigger_override("cap.backward")
        try:
            torch.autograd.backward(loss, **backward_kwargs)
        finally:
            engine.set_trigger_override(None)
            recorder.use_policy_for_next_pass(None)

    def _check_backward_available(self) -> None:
        state = self._state
        if state.interrupted is not None:
            raise CaptureClosedError(
                f"This capture stopped recording: {state.interrupted} (a Ctrl-C or an error at that "
                "moment), so its records could disagree with the graph; it removed its hooks.",
                code="capture_interrupted",
                remedy="Make a new capture with bl.capture(...); the records so far stay readable.",
            )
        if state.closed:
            raise CaptureClosedError(
                "This capture was closed; its hooks are gone, so it cannot record a backward.",
            )
        if state.backward_unavailable is not None:
            raise _no_node_prehooks()
        if not state.backward_requested:
            raise BackwardUnavailableError(
                "This capture was made with backward=False: it recorded the forward only "
                "and installed no gradient hooks.",
                code="backward_not_requested",
                remedy="Capture again without backward=False.",
            )
        if state.inference_only:
            raise BackwardUnavailableError(
                f"This capture has no autograd graph: the forward ran {state.inference_cause}.",
                code="inference_only",
                remedy="Capture the forward with gradients enabled (outside torch.no_grad() / "
                "torch.inference_mode(), with parameters or inputs that require grad).",
            )

    def _default_loss(self) -> torch.Tensor:
        tensors = list(iter_tensors(self.output))
        if len(tensors) == 1 and tensors[0].numel() == 1:
            return tensors[0]
        raise BackwardUnavailableError(
            "cap.backward() needs a loss: the output is not a single scalar tensor.",
            code="loss_required",
            remedy="Pass the loss explicitly: cap.backward(loss).",
        )

    def do(self, site: Any, edit: Any, inputs: Any = None, loss: Any = None, *,
           differentiable: bool = False) -> Capture:
        """Rerun the forward with ``edit`` armed at ``site`` (and the backward when ``loss`` is given).

        Returns a new capture; this one is untouched. ``inputs`` replaces the
        original positional inputs (a tuple, or one tensor); ``loss`` is
        ``lambda cap: tensor``. ``differentiable=True`` runs no model: it
        replays the recorded ops downstream of ``site`` from the recorded
        activations with ``edit`` applied, and returns a fork whose output
        carries a fresh graph (docs/edits.md).
        """
        if self.frontier is not None:
            raise CaptureClosedError(
                "A fork made by differentiable replay has no model to rerun and no recorded calls to replay.",
                code="fork_cannot_rerun",
                remedy="Call do() on the capture the fork came from.",
            )
        if self._rerun is None or self._model is None:
            raise CaptureClosedError("This capture cannot rerun its forward (closed or loaded from disk).")
        armed_here = when(site, edit)
        _args.flag(differentiable, "differentiable", "cap.do")
        if loss is not None:
            _args.callable_(loss, "loss", "cap.do", "loss=lambda c: c.output.sum()")
        args, kwargs, options, intervene = self._rerun
        if differentiable:
            if inputs is not None:
                raise UnsupportedInputError(
                    "cap.do(..., differentiable=True) replays the recorded run; it takes no new inputs.",
                    code="replay_takes_no_inputs",
                    remedy="Drop inputs=, or rerun with them: cap.do(site, edit, inputs=...).",
                )
            state, output, frontier = replay_fork(self._state, self._model, self._rerun, self.output, site, edit)
            new = Capture(state, output=output, frontier=frontier)
        else:
            if inputs is not None:
                args = inputs if isinstance(inputs, tuple) else (inputs,)
            armed = [*as_interventions(intervene), armed_here]
            new = capture(self._model, *args, intervene=armed, **options, **kwargs)
        if loss is not None:
            try:
                new.backward(loss(new))
            except BaseException:
                new.close()  # the caller never gets the fork: nothing of it stays armed
                raise
        return new

    # -- lifetime ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._state.closed

    def disarm(self) -> None:
        """Stop recording later passes; keep every record."""
        if self._state.recorder is not None:
            self._state.recorder.remove_hooks()

    def save(self, path: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
        """Write this capture as a bundle directory (API.md §6, docs/bundles.md); returns its path."""
        if path is not None:
            _args.path(path, "path", "cap.save", "cap.save('runs/capture1')")
        _args.flag(overwrite, "overwrite", "cap.save")
        return save_state(self._state, path, overwrite=overwrite)

    def close(self) -> None:
        """Remove every hook and drop every autograd node this capture holds.

        A ``storage=bl.to_disk(path)`` capture then writes its bundle manifest.
        """
        state = self._state
        if state.closed:
            return
        state.close()
        self._model = self._rerun = None
        finish = getattr(state.store, "finish", None)
        try:
            if finish is not None:
                finish(state)  # to_disk: write the bundle manifest (records outlive close)
        finally:
            state.store.close()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._state
        how = "closed" if state.closed else "inference-only" if state.inference_only else "armed"
        return (f"<Capture {how}: {len(state.journal.ops)} ops, {len(state.journal.module_calls)} module calls, "
                f"{len(state.passes)} backward passes>")


NO_NODE_PREHOOKS = ("this torch has no Node.register_prehook (bl.doctor(): HAS_NODE_PREHOOK), which backward "
                    "capture records node fires and applies gradient edits with")


def _no_node_prehooks() -> BackwardUnavailableError:
    return BackwardUnavailableError(
        f"This capture cannot record a backward: {NO_NODE_PREHOOKS}.",
        code="no_node_prehooks",
        remedy="Use a torch with Node.register_prehook (2.0 or later), or capture with backward=False.",
    )


def _foreign_loss() -> NoGradientPathError:
    return NoGradientPathError(
        "cap.backward(loss): the loss does not depend on this capture's graph: its backward reaches "
        "none of the nodes this capture's forward made (at most leaf inputs or parameters it shares "
        "with them), so it would not be this capture's pass. Nothing ran.",
        code="loss_not_from_capture",
        remedy="Compute the loss from cap.output; to backpropagate another loss without recording it, "
        "call loss.backward() directly.",
    )


class LoadedCapture(Capture):
    """A capture read from a bundle: the same records over a read-only state.

    There is no model and no graph: ``output`` is None and ``backward()``
    raises. Tensors come back on the CPU, memory-mapped from the bundle's shards.
    """

    def __init__(self, state: CaptureState, info: BundleInfo):
        super().__init__(state)
        self.path = info.path
        self.format_version = info.format_version
        self.backlens_version = info.backlens_version
        self.torch_version = info.torch_version

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise BackwardUnavailableError(
            f"This capture was loaded from the bundle {str(self.path)!r}; it is read-only: "
            "there is no model or autograd graph to run a backward over.",
            code="read_only_bundle",
            remedy="Capture the model again with bl.capture(...) to record new passes.",
        )

    def close(self) -> None:
        """Mark closed; records stay readable (their tensors keep their own maps)."""
        self._state.closed = True

    def __repr__(self) -> str:
        state = self._state
        return (f"<LoadedCapture {str(self.path)!r}: {len(state.journal.ops)} ops, "
                f"{len(state.journal.module_calls)} module calls, {len(state.passes)} backward passes>")
