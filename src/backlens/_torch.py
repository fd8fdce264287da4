"""The one place backlens touches private torch APIs.

Each private entry point is looked up once, behind a capability flag that
``bl.doctor()`` prints. A missing one degrades the feature that needs it and
says why (see ``CAPABILITIES``), instead of failing at import. The accessors
below read their flag when called, and the recorders take the raw readers they
cache when a capture starts, so a flag set to False (as the tests do, one by
one) takes the degraded path from the next capture on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd
import torch.autograd.graph

_autograd_c = getattr(torch._C, "_autograd", None)


@dataclass(frozen=True)
class Capability:
    name: str
    present: bool
    used_for: str
    without_it: str


def _lookup(owner: Any, name: str) -> Callable[..., Any] | None:
    return getattr(owner, name, None) if owner is not None else None


_get_sequence_nr = _lookup(_autograd_c, "_get_sequence_nr")
_current_autograd_node = _lookup(torch._C, "_current_autograd_node")
_current_graph_task_id = _lookup(torch._C, "_current_graph_task_id")
_keep_graph = _lookup(_autograd_c, "_get_current_graph_task_keep_graph")
_execution_engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
_queue_callback = _lookup(_execution_engine, "queue_callback")
_engine_in_graph = getattr(torch.autograd.graph, "_engine_run_backward", None)
_engine_in_autograd = getattr(torch.autograd, "_engine_run_backward", None)
_will_engine_execute_node = _lookup(torch._C, "_will_engine_execute_node")

HAS_SEQUENCE_NR = _get_sequence_nr is not None
HAS_CURRENT_AUTOGRAD_NODE = _current_autograd_node is not None
HAS_CURRENT_GRAPH_TASK_ID = _current_graph_task_id is not None
HAS_GRAPH_TASK_KEEP_GRAPH = _keep_graph is not None
HAS_ENGINE_QUEUE_CALLBACK = _queue_callback is not None
HAS_ENGINE_RUN_BACKWARD = _engine_in_graph is not None and _engine_in_autograd is not None
HAS_NODE_PREHOOK = hasattr(torch.autograd.graph.Node, "register_prehook")
HAS_ENGINE_NODE_QUERY = _will_engine_execute_node is not None and _current_graph_task_id is not None

CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "HAS_SEQUENCE_NR",
        HAS_SEQUENCE_NR,
        "pairing autograd nodes with the forward op and module that created them",
        "a node is paired with the first op whose output it made (through the output's grad_fn); other "
        "nodes made in the forward (a linear's TBackward0) have no op and no module, and no node is "
        "paired with a create_graph pass's fire (order 1)",
    ),
    Capability(
        "HAS_ENGINE_RUN_BACKWARD",
        HAS_ENGINE_RUN_BACKWARD,
        "opening one BackwardPass per backward()/grad() call with its call site",
        "every pass is implicit, with call_site None",
    ),
    Capability(
        "HAS_CURRENT_GRAPH_TASK_ID",
        HAS_CURRENT_GRAPH_TASK_ID,
        "telling engine runs apart (implicit passes, shared parameter nodes)",
        "fires are assigned to the open pass of the capture",
    ),
    Capability(
        "HAS_ENGINE_QUEUE_CALLBACK",
        HAS_ENGINE_QUEUE_CALLBACK,
        "closing an implicit pass when the engine drains",
        "implicit passes close at the next read of the capture",
    ),
    Capability(
        "HAS_GRAPH_TASK_KEEP_GRAPH",
        HAS_GRAPH_TASK_KEEP_GRAPH,
        "reading retain_graph of implicit passes",
        "an implicit pass reports retain_graph None",
    ),
    Capability(
        "HAS_CURRENT_AUTOGRAD_NODE",
        HAS_CURRENT_AUTOGRAD_NODE,
        "charging each backward ATen call to the node that ran it (FLOP attribution)",
        "all backward FLOPs land in the unattributed bucket",
    ),
    Capability(
        "HAS_NODE_PREHOOK",
        HAS_NODE_PREHOOK,
        "timing node fires and editing gradients before a node runs",
        "fire timing and gradient edits are unavailable",
    ),
    Capability(
        "HAS_ENGINE_NODE_QUERY",
        HAS_ENGINE_NODE_QUERY,
        "checking a live .grad request against the running backward without walking its graph",
        "each live backward block walks the autograd graph to check its requests",
    ),
)


_disable_torch_function = getattr(torch._C, "DisableTorchFunction", None)
HAS_DISABLE_TORCH_FUNCTION = _disable_torch_function is not None


def torch_function_disabled():
    """A context in which torch function modes do not see calls (our own bookkeeping
    reads of ``.grad_fn``, ``.shape`` between ops would otherwise go through them).
    Without it, a null context: the forward recorder then passes its own reads through
    (``capture/forward.py``)."""
    if not HAS_DISABLE_TORCH_FUNCTION:
        from contextlib import nullcontext

        return nullcontext()
    return _disable_torch_function()


def sequence_nr_function() -> Callable[[], int]:
    """The raw sequence-number reader, for hot paths (returns 0 when unavailable)."""
    return _get_sequence_nr if HAS_SEQUENCE_NR else (lambda: 0)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (``Tensor._base``; None: not a view)."""
    return getattr(tensor, "_base", None)


def sequence_nr() -> int | None:
    """The calling thread's next autograd sequence number (None if unknown)."""
    return _get_sequence_nr() if HAS_SEQUENCE_NR else None


def graph_task_id_function() -> Callable[[], int]:
    """The raw reader of the id of the engine run executing on this thread, for hot
    paths (-1 outside the engine, and always when unavailable)."""
    return _current_graph_task_id if HAS_CURRENT_GRAPH_TASK_ID else (lambda: -1)


def engine_will_run(node: Any) -> bool | None:
    """Whether the engine run executing on this thread runs ``node`` (None when it cannot tell:
    no run on this thread, or a torch without the query). Answered from the run's own node set,
    so no graph walk; with ``inputs=`` it is the nodes on the way to those inputs."""
    if not HAS_ENGINE_NODE_QUERY:
        return None
    try:
        return bool(_will_engine_execute_node(node))
    except (RuntimeError, TypeError):
        return None


def current_keep_graph() -> bool | None:
    """Whether the running engine task retains its graph (None if unknown)."""
    if not HAS_GRAPH_TASK_KEEP_GRAPH:
        return None
    try:
        return bool(_keep_graph())
    except RuntimeError:
        return None


def queue_engine_callback(fn: Callable[[], None]) -> bool:
    """Run ``fn`` when the current engine run drains. False when unavailable."""
    if not HAS_ENGINE_QUEUE_CALLBACK:
        return False
    _queue_callback(fn)
    return True


def install_engine_wrapper(wrapper_factory: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``_engine_run_backward`` under both names it is imported by.

    ``torch.autograd.backward`` and ``torch.autograd.grad`` look the name up in
    ``torch.autograd``; ``torch.autograd.graph`` holds the definition. Both are
    rebound to one wrapper, once per process.
    """
    if not HAS_ENGINE_RUN_BACKWARD:
        return False
    original = torch.autograd.graph._engine_run_backward
    if getattr(original, "__backlens_wrapper__", False):
        return True
    wrapped = wrapper_factory(original)
    wrapped.__backlens_wrapper__ = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped
    return True


def uninstall_engine_wrapper() -> None:
    """Put torch's own ``_engine_run_backward`` back under both names (when backlens's is there)."""
    current = getattr(torch.autograd.graph, "_engine_run_backward", None)
    original = getattr(current, "__wrapped__", None)
    if not getattr(current, "__backlens_wrapper__", False) or original is None:
        return
    torch.autograd.graph._engine_run_backward = original
    if getattr(torch.autograd, "_engine_run_backward", None) is current:
        torch.autograd._engine_run_backward = original


def engine_wrapper_installed() -> bool:
    return bool(getattr(getattr(torch.autograd, "_engine_run_backward", None), "__backlens_wrapper__", False))


def is_accumulate_grad(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def accumulate_grad_variable(node: Any) -> torch.Tensor | None:
    return getattr(node, "variable", None)


def node_sequence_nr(node: Any) -> int | None:
    if not HAS_SEQUENCE_NR:
        return None
    fn = getattr(node, "_sequence_nr", None)
    return fn() if fn is not None else None


def made_before(first: Any, second: Any) -> bool | None:
    """Whether node ``first`` was made before node ``second`` in the forward (by their sequence
    numbers); None when unknown (an AccumulateGrad node carries none, or no HAS_SEQUENCE_NR)."""
    # Spelled out (no helper calls): a live backward body asks this at every gradient read.
    if not HAS_SEQUENCE_NR or type(first).__name__ == "AccumulateGrad" or type(second).__name__ == "AccumulateGrad":
        return None
    try:
        return first._sequence_nr() < second._sequence_nr()
    except AttributeError:  # a node type without the number
        return None


def is_custom_function_node(node: Any) -> bool:
    """True for nodes of user ``torch.autograd.Function`` subclasses."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)



# cost ---------------------------------------------------------------------
# FLOP counting (backlens.cost) reads which autograd node runs an ATen call
# (above), which saved-tensor hooks are active (checkpoint recomputation) and
# whether an op only decomposes.

_top_saved_tensors_hooks = _lookup(_autograd_c, "_top_saved_tensors_default_hooks")
_has_kernel_for_key = _lookup(torch._C, "_dispatch_has_kernel_for_dispatch_key")

HAS_TOP_SAVED_TENSORS_HOOKS = _top_saved_tensors_hooks is not None
HAS_DISPATCH_KERNEL_QUERY = _has_kernel_for_key is not None

CAPABILITIES = CAPABILITIES + (
    Capability(
        "HAS_TOP_SAVED_TENSORS_HOOKS",
        HAS_TOP_SAVED_TENSORS_HOOKS,
        "telling checkpoint recomputation apart in create_graph=True passes",
        "recompute_flops is None in create_graph=True passes",
    ),
    Capability(
        "HAS_DISPATCH_KERNEL_QUERY",
        HAS_DISPATCH_KERNEL_QUERY,
        "counting FLOPs inside composite ops that have no kernel of their own",
        "composite ops that reach the counter are counted as one op",
    ),
)


def current_autograd_node_function() -> Callable[[], Any]:
    """The raw executing-node reader, for hot paths (returns None when unavailable)."""
    return _current_autograd_node if HAS_CURRENT_AUTOGRAD_NODE else (lambda: None)


def top_saved_tensors_pack_hook() -> Callable[..., Any] | None:
    """The pack hook of the innermost ``saved_tensors_hooks`` context, if any."""
    if not HAS_TOP_SAVED_TENSORS_HOOKS:
        return None
    hooks = _top_saved_tensors_hooks(False)
    return hooks[0] if hooks else None


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks`` context, if any."""
    if _top_saved_tensors_hooks is None:
        return None
    hooks = _top_saved_tensors_hooks(False)
    return (hooks[0], hooks[1]) if hooks else None


# Keys whose kernel runs instead of a CompositeImplicitAutograd decomposition.
_OWN_KERNEL_KEYS = (
    "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
    "CPU", "CUDA", "XPU", "MPS", "HIP", "HPU", "PrivateUse1",
)


def only_decomposes(op: Any) -> bool:
    """Whether an ATen overload has a CompositeImplicitAutograd decomposition and no
    kernel of its own, so running the decomposition is what would run anyway."""
    composite = any(getattr(key, "name", None) == "CompositeImplicitAutograd"
                    for key in getattr(op, "py_kernels", ()))
    if not HAS_DISPATCH_KERNEL_QUERY:
        return False
    try:
        name = op.name()
        composite = composite or bool(_has_kernel_for_key(name, "CompositeImplicitAutograd"))
        return composite and not any(_has_kernel_for_key(name, key) for key in _OWN_KERNEL_KEYS)
    except (RuntimeError, AttributeError):
        return False


# live tracing

# Switching torch's thread-local modes between a live body and the model at
# each hand-over (they share one thread). The raw setters skip building a
# context-manager object per switch; the public ones do the same, slower.
_raw_set_grad_enabled = getattr(torch._C, "_set_grad_enabled", None)
_raw_inference_guard = getattr(torch._C, "_InferenceMode", None)
_raw_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
HAS_RAW_MODE_SWITCHES = _raw_set_grad_enabled is not None and _raw_inference_guard is not None

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_RAW_MODE_SWITCHES",
        HAS_RAW_MODE_SWITCHES,
        "keeping a live body's grad/inference/autocast modes apart from the model's at each hand-over, cheaply",
        "the same through torch's public context managers, a few microseconds slower per hand-over",
    ),
)


def set_grad_enabled_function() -> Callable[[bool], Any]:
    """Set the calling thread's grad mode at once (no context-manager object)."""
    if HAS_RAW_MODE_SWITCHES:
        return _raw_set_grad_enabled
    return lambda mode: torch.set_grad_enabled(mode)


def inference_mode_guard(enabled: bool) -> Any:
    """An object whose ``__enter__``/``__exit__`` switch inference mode (and restore it wholesale)."""
    if HAS_RAW_MODE_SWITCHES:
        return _raw_inference_guard(enabled)
    return torch.inference_mode(enabled)


def any_autocast_enabled_function() -> Callable[[], bool] | None:
    """A cheap 'is autocast on for any device' check, or None (then check each device)."""
    return _raw_any_autocast if HAS_RAW_MODE_SWITCHES else None


# distributed: DDP's and FSDP2's private parts, in backlens/_torch_distributed.py (imported only here)

from backlens._torch_distributed import FSDP_COMM_OBJECTS  # noqa: E402
from backlens._torch_distributed import ddp_comm_hooks as ddp_comm_hooks  # noqa: E402
from backlens._torch_distributed import fsdp_comms as fsdp_comms  # noqa: E402
from backlens._torch_distributed import fsdp_param_groups as fsdp_param_groups  # noqa: E402
from backlens._torch_distributed import fsdp_unsharded_params as fsdp_unsharded_params  # noqa: E402
from backlens._torch_distributed import set_fsdp_comms as set_fsdp_comms  # noqa: E402

CAPABILITIES = (*CAPABILITIES, FSDP_COMM_OBJECTS)


# tensor hooks: a live read's gradient hook, in backlens/_torch_tensor_hooks.py (imported only here)

from backlens._torch_tensor_hooks import TensorHookHandle as TensorHookHandle  # noqa: E402
from backlens._torch_tensor_hooks import add_tensor_hook as add_tensor_hook  # noqa: E402
from backlens._torch_tensor_hooks import hook_dict_present  # noqa: E402

HAS_TENSOR_HOOK_DICT = hook_dict_present()

CAPABILITIES = (*CAPABILITIES, Capability(
    "HAS_TENSOR_HOOK_DICT",
    HAS_TENSOR_HOOK_DICT,
    "adding a live read's gradient hook without Tensor.register_hook's Python (about 40 µs a read, "
    "mid-backward)",
    "each live read calls Tensor.register_hook",
))

# checkpoint witness
# Each torch.utils.checkpoint invocation in a captured forward is witnessed by
# swapping, for the forward only, the module global that names the
# non-reentrant checkpoint's saved-tensor hooks class (looked up at each call)
# for a subclass, and by wrapping the reentrant checkpoint Function's forward.

import torch.utils.checkpoint as _checkpoint_module  # noqa: E402 - grouped with what uses it

_checkpoint_hook_class = getattr(_checkpoint_module, "_checkpoint_hook", None)
_checkpoint_function = getattr(_checkpoint_module, "CheckpointFunction", None)

HAS_CHECKPOINT_HOOK_CLASS = isinstance(_checkpoint_hook_class, type) and issubclass(
    _checkpoint_hook_class, torch.autograd.graph.saved_tensors_hooks)
HAS_REENTRANT_CHECKPOINT_FUNCTION = isinstance(_checkpoint_function, type) and isinstance(
    _checkpoint_function.__dict__.get("forward"), staticmethod)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_CHECKPOINT_HOOK_CLASS",
        HAS_CHECKPOINT_HOOK_CLASS,
        "witnessing non-reentrant torch.utils.checkpoint invocations (cap.checkpoints)",
        "cap.checkpoint_verdict is 'unknown': non-reentrant checkpoints cannot be seen",
    ),
    Capability(
        "HAS_REENTRANT_CHECKPOINT_FUNCTION",
        HAS_REENTRANT_CHECKPOINT_FUNCTION,
        "witnessing reentrant torch.utils.checkpoint invocations (cap.checkpoints)",
        "cap.checkpoint_verdict is 'unknown': reentrant checkpoints cannot be seen",
    ),
)


def checkpoint_hook_class() -> type | None:
    """The non-reentrant checkpoint saved-tensor hooks class checkpoints use now (None when missing)."""
    if not HAS_CHECKPOINT_HOOK_CLASS:
        return None
    current = getattr(_checkpoint_module, "_checkpoint_hook", None)
    return current if isinstance(current, type) and issubclass(current, _checkpoint_hook_class) else None


def set_checkpoint_hook_class(cls: type) -> None:
    """Make non-reentrant checkpoints started from now on use ``cls`` (a subclass, or the original)."""
    _checkpoint_module._checkpoint_hook = cls


def reentrant_checkpoint_forward() -> Any:
    """The reentrant checkpoint Function's forward as it is now (None when missing)."""
    if not HAS_REENTRANT_CHECKPOINT_FUNCTION:
        return None
    current = _checkpoint_function.__dict__.get("forward")
    return current.__func__ if isinstance(current, staticmethod) else None


def set_reentrant_checkpoint_forward(fn: Any) -> None:
    _checkpoint_function.forward = staticmethod(fn)


# What a non-reentrant checkpoint recomputed (memory=True captures): torch keeps
# the recomputed tensors in its frame, per engine run (or GraphExecGroup), each
# beside a handle object that dies when the tensor is unpacked.
_checkpoint_frame_class = getattr(_checkpoint_module, "_CheckpointFrame", None)
_graph_exec_group = getattr(_checkpoint_module, "GraphExecGroup", None)

HAS_CHECKPOINT_RECOMPUTED = isinstance(_checkpoint_frame_class, type) and _current_graph_task_id is not None

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_CHECKPOINT_RECOMPUTED",
        HAS_CHECKPOINT_RECOMPUTED,
        "counting the tensors a non-reentrant checkpoint recomputes (memory=True)",
        "recomputed saves are not counted in pass_.memory",
    ),
)


def checkpoint_recomputed(frame: Any) -> list[tuple[Any, torch.Tensor]] | None:
    """(handle, tensor) for each tensor ``frame`` holds recomputed for the running engine
    run (None when this torch keeps them elsewhere)."""
    recomputed = getattr(frame, "recomputed", None) if HAS_CHECKPOINT_RECOMPUTED else None
    if not isinstance(recomputed, dict):
        return None
    group = _graph_exec_group._get_current_group() if hasattr(_graph_exec_group, "_get_current_group") else None
    found = recomputed.get(group if group is not None else _current_graph_task_id())
    return list(found.items()) if found is not None else []


# compiled models


def compiled_original(module: Any) -> torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (dynamo's ``OptimizedModule``) compiles, else None.

    Read by duck typing, so that ``import backlens`` never imports ``torch._dynamo``.
    """
    original = getattr(module, "_orig_mod", None)
    if isinstance(original, torch.nn.Module) and type(module).__module__.startswith("torch._dynamo"):
        return original
    return None


# torch's mode stacks ---------------------------------------------------------
# Entering a mode is several Python lines in torch (flags, then the push); a
# KeyboardInterrupt between them, or before a `with` statement has registered
# the exit, would leave the mode on torch's global stack for good. These
# contexts record the stack depth before entering and, on the way out, pop
# back to it and restore torch's flags, run to completion (backlens._fence).

from contextlib import contextmanager  # noqa: E402

from backlens._fence import complete  # noqa: E402

try:  # TorchDispatchMode: the FLOP census and the forward's meta replay are dispatch modes
    import torch.utils._python_dispatch as _python_dispatch
except ImportError:
    _python_dispatch = None
_TorchDispatchMode = getattr(_python_dispatch, "TorchDispatchMode", None)
HAS_TORCH_DISPATCH_MODE = isinstance(_TorchDispatchMode, type)

_len_function_stack = _lookup(torch._C, "_len_torch_function_stack")
_pop_function_stack = _lookup(torch._C, "_pop_torch_function_stack")
_function_stack_at = _lookup(torch._C, "_get_function_stack_at")
_len_dispatch_stack = _lookup(torch._C, "_len_torch_dispatch_stack")
_pop_dispatch_stack = _lookup(torch._C, "_pop_torch_dispatch_stack")
_dispatch_stack_at = _lookup(torch._C, "_get_dispatch_stack_at")
_DISPATCH_FLAGS = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                   "_is_in_any_mode_without_ignore_compile_internals")
_DISPATCH_FLAG_DEQUES = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                         "old_without_ignore_compile_internals_dispatch_mode_flags")
_set_compile_internals_flag = getattr(_python_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)

HAS_MODE_STACKS = None not in (_len_function_stack, _pop_function_stack, _function_stack_at,
                               _len_dispatch_stack, _pop_dispatch_stack, _dispatch_stack_at)
HAS_DISPATCH_MODE_FLAGS = _python_dispatch is not None and all(hasattr(_python_dispatch, name)
                                                                for name in _DISPATCH_FLAGS)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_MODE_STACKS",
        HAS_MODE_STACKS,
        "taking backlens's modes off torch's mode stacks also when a Ctrl-C interrupts entering or leaving them",
        "modes are left with `with` alone; a Ctrl-C at the wrong moment can leave one installed",
    ),
    Capability(
        "HAS_TORCH_DISPATCH_MODE",
        HAS_TORCH_DISPATCH_MODE,
        "counting backward FLOPs (the ATen census) and replaying unusual forward ops on meta tensors",
        "no pass is counted (its FLOPs are None and say why); forward FLOPs only for the ops counted from "
        "their shapes (linear, matmuls, attention), None for the rest",
    ),
    Capability(
        "HAS_DISPATCH_MODE_FLAGS",
        HAS_DISPATCH_MODE_FLAGS,
        "restoring torch's in-a-dispatch-mode flags when a census leaves the mode stack, also after a Ctrl-C",
        "dispatch modes are left with `with` alone; a Ctrl-C at the wrong moment can leave one installed",
    ),
)


def mode_stack_depths() -> tuple[int, int]:
    """How many torch function modes and torch dispatch modes are active now."""
    if not HAS_MODE_STACKS:
        return (0, 0)
    return (_len_function_stack(), _len_dispatch_stack())


@contextmanager
def function_mode(mode: Any):
    """Hold a ``TorchFunctionMode`` active; leaving, torch's function mode stack is back where it was."""
    if not HAS_MODE_STACKS:
        with mode:
            yield mode
        return
    depth = _len_function_stack()

    def leave() -> None:
        while _len_function_stack() > depth and _function_stack_at(_len_function_stack() - 1) is mode:
            _pop_function_stack()

    try:
        mode.__enter__()
        yield mode
    finally:
        complete(leave)


class _NoDispatchMode:
    """Stands in for ``TorchDispatchMode`` on a torch without it: entering one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> Any:
        raise RuntimeError("this torch has no TorchDispatchMode (bl.doctor(): HAS_TORCH_DISPATCH_MODE)")

    def __exit__(self, *exc: Any) -> None:
        return None


class EagerDispatchMode(_TorchDispatchMode if HAS_TORCH_DISPATCH_MODE else _NoDispatchMode):  # type: ignore[misc]
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch leaves as written.

    Unless a mode's ``_should_skip_dynamo`` says no, torch wraps its
    ``__torch_dispatch__`` in ``dynamo.disable``, which sets and resets the frame
    evaluator on every ATen call: about 4 µs each, 1.5% of a GPT-2 backward.
    backlens's modes count eager backwards (a compiled region's backward runs as
    one opaque node), where Dynamo traces nothing, so they say no.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


@contextmanager
def dispatch_mode(mode: Any):
    """Hold a ``TorchDispatchMode`` active; leaving, torch's dispatch mode stack and the flags its
    ``__enter__`` sets are back where they were."""
    if not HAS_TORCH_DISPATCH_MODE:
        raise RuntimeError("this torch has no TorchDispatchMode (bl.doctor(): HAS_TORCH_DISPATCH_MODE)")
    if not (HAS_MODE_STACKS and HAS_DISPATCH_MODE_FLAGS):
        with mode:
            yield mode
        return
    depth = _len_dispatch_stack()
    flags = {name: getattr(_python_dispatch, name) for name in _DISPATCH_FLAGS}
    lengths = {name: len(getattr(mode, name, ())) for name in _DISPATCH_FLAG_DEQUES}

    def leave() -> None:
        while _len_dispatch_stack() > depth and _dispatch_stack_at(_len_dispatch_stack() - 1) is mode:
            _pop_dispatch_stack(None)
        for name, value in flags.items():
            setattr(_python_dispatch, name, value)
        if _set_compile_internals_flag is not None:
            _set_compile_internals_flag(flags["_is_in_any_mode_without_ignore_compile_internals"])
        for name, length in lengths.items():
            saved = getattr(mode, name, None)
            while saved is not None and len(saved) > length:
                saved.pop()

    try:
        mode.__enter__()
        yield mode
    finally:
        complete(leave)


def _recompute_dispatch_flags() -> None:
    """torch's in-a-dispatch-mode flags, as the modes left on its stack make them."""
    modes = [_dispatch_stack_at(i) for i in range(_len_dispatch_stack())]
    _python_dispatch._is_in_torch_dispatch_mode = bool(modes)
    _python_dispatch._is_in_non_infra_torch_dispatch_mode = any(
        not getattr(m, "is_infra_mode", lambda: False)() for m in modes)
    without = any(not getattr(m, "ignore_compile_internals", lambda: False)() for m in modes)
    _python_dispatch._is_in_any_mode_without_ignore_compile_internals = without
    if _set_compile_internals_flag is not None:
        _set_compile_internals_flag(without)


def drop_dispatch_modes(stale: Callable[[Any], bool]) -> int:
    """Pop dispatch modes that ``stale(mode)`` says were left behind, from the top of torch's
    stack (a Ctrl-C that cut a cleanup short); returns how many. A mode above them is left alone."""
    if not (HAS_MODE_STACKS and HAS_DISPATCH_MODE_FLAGS) or not _len_dispatch_stack():
        return 0
    dropped = 0
    while _len_dispatch_stack() and stale(_dispatch_stack_at(_len_dispatch_stack() - 1)):
        _pop_dispatch_stack(None)
        dropped += 1
    if dropped:
        _recompute_dispatch_flags()
    return dropped


# the forward recorder's own reads ---------------------------------------------

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_DISABLE_TORCH_FUNCTION",
        HAS_DISABLE_TORCH_FUNCTION,
        "reading module outputs (.grad_fn, .shape) between ops without the forward's function mode seeing it",
        "the function mode passes the recorder's own reads straight through (about a microsecond more per "
        "module call)",
    ),
)


# FLOP formulas -----------------------------------------------------------------
# torch.utils.flop_counter's registry holds shape-level formulas wrapped in
# ``shape_wrapper`` (a pytree walk per call that costs more than the count); the
# unwrapped one is its ``__wrapped__``, read here when asked, never at import.
# The formulas torch lacks (CPU attention) are added with torch's own
# ``register_flop_formula`` the first time backlens counts.

import torch.utils.flop_counter as _flop_counter  # noqa: E402 - grouped with what uses it

_flop_registry = getattr(_flop_counter, "flop_registry", None)
_register_flop_formula = getattr(_flop_counter, "register_flop_formula", None)
_shape_wrapper = getattr(_flop_counter, "shape_wrapper", None)

HAS_FLOP_REGISTRY = isinstance(_flop_registry, dict) and callable(_shape_wrapper)
HAS_SHAPE_LEVEL_FLOP_FORMULAS = HAS_FLOP_REGISTRY and callable(
    getattr(_flop_registry.get(torch.ops.aten.mm), "__wrapped__", None))
HAS_FLOP_FORMULA_REGISTRATION = HAS_FLOP_REGISTRY and callable(_register_flop_formula)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_FLOP_REGISTRY",
        HAS_FLOP_REGISTRY,
        "FLOP formulas: torch.utils.flop_counter's registry (2 x MACs, FlopCounterMode's conventions)",
        "no FLOPs are counted: every pass and forward op reports FLOPs None",
    ),
    Capability(
        "HAS_SHAPE_LEVEL_FLOP_FORMULAS",
        HAS_SHAPE_LEVEL_FLOP_FORMULAS,
        "evaluating the registry's formulas on shapes directly (its shape_wrapper's __wrapped__)",
        "formulas are called through the registry's wrapper: the same counts, a few microseconds more each",
    ),
    Capability(
        "HAS_FLOP_FORMULA_REGISTRATION",
        HAS_FLOP_FORMULA_REGISTRATION,
        "adding the CPU attention formulas torch lacks to its registry (register_flop_formula)",
        "backlens counts them from its own table; FlopCounterMode needs custom_mapping=EXTRA_FORMULAS to agree",
    ),
)

_formula_cache: dict[tuple[Any, bool], Callable[..., int] | None] = {}


def flop_registry() -> dict:
    """torch's FLOP formula registry (OpOverloadPacket -> formula); empty without one."""
    return _flop_registry if HAS_FLOP_REGISTRY else {}


def shape_level_flop_formula(formula: Any) -> Callable[..., int] | None:
    """The shape-level function behind a registered formula (None: call the formula itself)."""
    if not HAS_SHAPE_LEVEL_FLOP_FORMULAS:
        return None
    inner = getattr(formula, "__wrapped__", None)
    return inner if callable(inner) else None


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """The registry's formula for ``packet`` as ``f(*shapes, out_shape=None, **kwargs) -> int``
    (None when it has none): unwrapped where it can be, else through the registry's wrapper."""
    key = (packet, HAS_SHAPE_LEVEL_FLOP_FORMULAS)
    found = _formula_cache.get(key, _formula_cache)
    if found is not _formula_cache:
        return found
    formula = flop_registry().get(packet)
    if formula is None:
        found = None
    else:
        found = shape_level_flop_formula(formula)
        if found is None:
            def found(*shapes: Any, out_shape: Any = None, _formula: Any = formula, **kwargs: Any) -> int:
                return _formula(*shapes, out_val=out_shape, **kwargs)  # shapes pass its walk unchanged
    _formula_cache[key] = found
    return found


def register_flop_formulas(formulas: dict[Any, Callable[..., int]]) -> list[Any]:
    """Register shape-level ``formulas`` (packet -> formula) that torch's registry lacks, with
    torch's own ``register_flop_formula``; returns the packets registered (none without it)."""
    if not HAS_FLOP_FORMULA_REGISTRATION:
        return []
    added = []
    for packet, formula in formulas.items():
        if packet in _flop_registry:
            continue  # torch has its own (a newer torch, or a user's registration): it stays
        try:
            _register_flop_formula(packet)(formula)
        except (RuntimeError, ValueError, TypeError):
            continue
        added.append(packet)
    return added


# saved tensors of built-in nodes ---------------------------------------------------
# Torch's generated nodes expose what they saved as ``_saved_<name>`` attributes
# (the once-only check fingerprints them).

HAS_SAVED_TENSOR_ATTRIBUTES = any(name.startswith("_saved_") for name in dir(
    getattr(getattr(torch._C, "_functions", None), "MulBackward0", None) or object))

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_SAVED_TENSOR_ATTRIBUTES",
        HAS_SAVED_TENSOR_ATTRIBUTES,
        "fingerprinting built-in nodes' saved tensors (node._saved_*), to name a node whose saved tensors "
        "were freed or changed",
        "only custom Functions' saved tensors are fingerprinted",
    ),
)


def saved_tensor_attributes(node: Any) -> dict[str, Any]:
    """``name -> value`` of what a built-in node saved for backward (``self``, ``other``, ...);
    empty without the attributes or for a value torch has already freed."""
    if not HAS_SAVED_TENSOR_ATTRIBUTES:
        return {}
    found = {}
    for name in dir(node):
        if not name.startswith("_saved_") or name.endswith(("_sym_sizes", "_sym_strides")):
            continue
        try:
            found[name[len("_saved_"):]] = getattr(node, name)
        except RuntimeError:
            continue
    return found


# checkpoint recomputation ---------------------------------------------------------
# Non-reentrant checkpoint recomputes under its own saved-tensor hooks, whose pack
# hook is a closure defined in ``torch.utils.checkpoint._recomputation_hook``.

_recomputation_hook_class = getattr(_checkpoint_module, "_recomputation_hook", None)
HAS_RECOMPUTATION_HOOK_CLASS = isinstance(_recomputation_hook_class, type) and issubclass(
    _recomputation_hook_class, torch.autograd.graph.saved_tensors_hooks)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_RECOMPUTATION_HOOK_CLASS",
        HAS_RECOMPUTATION_HOOK_CLASS,
        "telling checkpoint recomputation apart in create_graph=True passes (by its saved-tensor hook)",
        "recompute_flops is None in create_graph=True passes",
    ),
)


def is_checkpoint_recomputation_hook(pack_hook: Any) -> bool:
    """Whether ``pack_hook`` is the pack hook of non-reentrant checkpoint's recomputation."""
    if not HAS_RECOMPUTATION_HOOK_CLASS or pack_hook is None:
        return False
    qualname = getattr(pack_hook, "__qualname__", "") or ""
    module = getattr(pack_hook, "__module__", "") or ""
    return (qualname.startswith(_recomputation_hook_class.__qualname__ + ".")
            and module == _recomputation_hook_class.__module__)


# module internals ---------------------------------------------------------------
# A capture walks the model once per call: the module's own parameter, buffer and
# child dicts are several times faster to read than the public generators.

HAS_MODULE_DICTS = all(isinstance(getattr(torch.nn.Module(), name, None), dict)
                       for name in ("_parameters", "_buffers", "_modules"))

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_MODULE_DICTS",
        HAS_MODULE_DICTS,
        "walking a model's modules, parameters and buffers quickly at each capture",
        "the walk uses the public named_parameters/named_buffers/named_children, a little slower",
    ),
)


def module_parts(module: torch.nn.Module) -> tuple[Any, Any, Any]:
    """A module's own ``(name, parameter)``, ``(name, buffer)`` and ``(name, child)`` pairs
    (entries may be None where the module holds a None)."""
    if HAS_MODULE_DICTS:
        return module._parameters.items(), module._buffers.items(), module._modules.items()
    return (module.named_parameters(recurse=False, remove_duplicate=False),
            module.named_buffers(recurse=False, remove_duplicate=False),
            list(module.named_children()))


def module_children(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own children by name (None where it holds None); read-only."""
    return module._modules if HAS_MODULE_DICTS else dict(module.named_children())


# module_children's dict in one C call, for a lens's fast path (used only where HAS_MODULE_DICTS).
children_dict = operator.attrgetter("_modules")


# A live backward block notices a gradient its body changed in place by its version.
HAS_TENSOR_VERSION = isinstance(getattr(torch.empty(0), "_version", None), int)
CAPABILITIES = (*CAPABILITIES, Capability(
    "HAS_TENSOR_VERSION", HAS_TENSOR_VERSION, "noticing a gradient a backward block changed in place",
    "each served gradient is copied and compared after the body"))


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or None without HAS_TENSOR_VERSION."""
    return tensor._version if HAS_TENSOR_VERSION else None


def tensor_version_reader() -> Callable[[torch.Tensor], int] | None:
    """The raw reader of :func:`tensor_version` for hot paths (no Python frame), or None."""
    return operator.attrgetter("_version") if HAS_TENSOR_VERSION else None


# gradient monitor: torch's multi-tensor kernels, in backlens/_torch_foreach.py (imported only here)

from backlens._torch_foreach import FOREACH_PRESENT  # noqa: E402
from backlens._torch_foreach import foreach_copy_ as foreach_copy_  # noqa: E402
from backlens._torch_foreach import foreach_norm as foreach_norm  # noqa: E402
from backlens._torch_foreach import foreach_sub_ as foreach_sub_  # noqa: E402

HAS_FOREACH_KERNELS = FOREACH_PRESENT

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_FOREACH_KERNELS",
        HAS_FOREACH_KERNELS,
        "the gradient monitor's norms, parameter copies and updates in one multi-tensor call each",
        "the monitor loops over tensors with torch.linalg.vector_norm, copy_ and sub_ (slower, same values)",
    ),
)


# profiler: ranges for a captured backward, in backlens/_torch_profiler.py (imported only here)

from backlens._torch_profiler import RANGES_PRESENT  # noqa: E402
from backlens._torch_profiler import close_profiler_range as close_profiler_range  # noqa: E402
from backlens._torch_profiler import open_profiler_range as open_profiler_range  # noqa: E402
from backlens._torch_profiler import profiler_recording as profiler_recording  # noqa: E402

HAS_PROFILER_RANGES = RANGES_PRESENT

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_PROFILER_RANGES",
        HAS_PROFILER_RANGES,
        "marking a captured backward's node calls with ranges named by module address under torch.profiler",
        "torch.profiler shows a captured backward's ops without their module",
    ),
)


# module calls -----------------------------------------------------------------
# ``nn.Module.__call__`` (``_wrapped_call_impl``) hands every call to the private
# ``nn.Module._call_impl``. Wrapping that one attribute watches every module call
# and leaves modules on torch's fast path (any forward hook, global or not, puts
# every call on the slow hooked path), and setting it is cheap (no type slot to
# update). Without it, ``nn.Module.__call__`` itself is wrapped: the same calls
# are seen, but each install updates the call slot of every module class.

import types as _types  # noqa: E402 - grouped with what uses it


class _CallProbe(torch.nn.Module):
    def _call_impl(self, *args: Any, **kwargs: Any) -> str:
        return "through _call_impl"


def _calls_go_through_call_impl() -> bool:
    """Whether ``nn.Module.__call__`` hands a call to ``self._call_impl`` (asked of a
    probe module that overrides it, not read from bytecode)."""
    try:
        return _CallProbe()() == "through _call_impl"
    except Exception:  # noqa: BLE001 - any failure means: not this torch's way
        return False


HAS_MODULE_CALL_IMPL = (
    isinstance(torch.nn.Module.__dict__.get("_call_impl"), _types.FunctionType)
    and _calls_go_through_call_impl()
)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_MODULE_CALL_IMPL",
        HAS_MODULE_CALL_IMPL,
        "watching module calls (capture's module records, live tracing's module values) while keeping "
        "modules on torch's fast call path",
        "nn.Module.__call__ is wrapped instead: the same calls are seen, and each capture or trace pays "
        "about 0.2 ms to install it",
    ),
)


def module_call_entry() -> tuple[str, Callable[..., Any]]:
    """The ``nn.Module`` attribute that module calls go through (``_call_impl``, else
    ``__call__``) and its current value. Read at each install, so a test can turn the
    capability off."""
    name = "_call_impl" if HAS_MODULE_CALL_IMPL else "__call__"
    return name, torch.nn.Module.__dict__[name]


def module_call_entry_now(name: str) -> Any:
    return torch.nn.Module.__dict__.get(name)


def set_module_call_entry(name: str, fn: Callable[..., Any]) -> None:
    setattr(torch.nn.Module, name, fn)
