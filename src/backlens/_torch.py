"""The one place backlens touches private torch APIs.

Each private entry point is looked up once, behind a capability flag that
``bl.doctor()`` prints. A missing one degrades the feature that needs it and
says why (see ``CAPABILITIES``), instead of failing at import.
"""

from __future__ import annotations

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
        "nodes are paired only through each op's output grad_fn; inner nodes get module 'inferred'",
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


def torch_function_disabled():
    """A context in which torch function modes do not see calls (our own bookkeeping
    reads of ``.grad_fn``, ``.shape`` between ops would otherwise go through them)."""
    if _disable_torch_function is None:
        from contextlib import nullcontext

        return nullcontext()
    return _disable_torch_function()


def sequence_nr_function() -> Callable[[], int]:
    """The raw sequence-number reader, for hot paths (returns 0 when unavailable)."""
    return _get_sequence_nr if _get_sequence_nr is not None else (lambda: 0)


def sequence_nr() -> int | None:
    """The calling thread's next autograd sequence number (None if unknown)."""
    return _get_sequence_nr() if _get_sequence_nr is not None else None


def graph_task_id_function() -> Callable[[], int]:
    """The raw reader of the id of the engine run executing on this thread, for hot
    paths (-1 outside the engine, and always when unavailable)."""
    return _current_graph_task_id if _current_graph_task_id is not None else (lambda: -1)


def engine_will_run(node: Any) -> bool | None:
    """Whether the engine run executing on this thread runs ``node`` (None when it cannot tell:
    no run on this thread, or a torch without the query). Answered from the run's own node set,
    so no graph walk; with ``inputs=`` it is the nodes on the way to those inputs."""
    if _will_engine_execute_node is None:
        return None
    try:
        return bool(_will_engine_execute_node(node))
    except (RuntimeError, TypeError):
        return None


def current_keep_graph() -> bool | None:
    """Whether the running engine task retains its graph (None if unknown)."""
    if _keep_graph is None:
        return None
    try:
        return bool(_keep_graph())
    except RuntimeError:
        return None


def queue_engine_callback(fn: Callable[[], None]) -> bool:
    """Run ``fn`` when the current engine run drains. False when unavailable."""
    if _queue_callback is None:
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
    fn = getattr(node, "_sequence_nr", None)
    return fn() if fn is not None else None


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
    return _current_autograd_node if _current_autograd_node is not None else (lambda: None)


def top_saved_tensors_pack_hook() -> Callable[..., Any] | None:
    """The pack hook of the innermost ``saved_tensors_hooks`` context, if any."""
    if _top_saved_tensors_hooks is None:
        return None
    hooks = _top_saved_tensors_hooks(False)
    return hooks[0] if hooks else None


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
    if _has_kernel_for_key is None:
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
    if _raw_set_grad_enabled is not None:
        return _raw_set_grad_enabled
    return lambda mode: torch.set_grad_enabled(mode)


def inference_mode_guard(enabled: bool) -> Any:
    """An object whose ``__enter__``/``__exit__`` switch inference mode (and restore it wholesale)."""
    if _raw_inference_guard is not None:
        return _raw_inference_guard(enabled)
    return torch.inference_mode(enabled)


def any_autocast_enabled_function() -> Callable[[], bool] | None:
    """A cheap 'is autocast on for any device' check, or None (then check each device)."""
    return _raw_any_autocast


# distributed
# FSDP2 keeps, per unit (a module given to ``fully_shard``), private param
# groups holding the unit's communication objects (the all-gather and the
# reduce-scatter that ``FSDPModule.set_custom_all_gather`` replaces) and the
# unsharded parameters its forward computes with. Capture swaps recording
# wrappers in for one backward run and puts the originals back. The FSDP
# package costs half a second to import, so it is looked at only when the
# user's program imported it.


def fsdp_param_groups(module: Any) -> list[Any]:
    """The param groups of an FSDP2 unit that carry communication objects (none when
    ``module`` is not a unit or torch keeps them elsewhere)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    try:
        state = get_state()
    except (AssertionError, AttributeError, RuntimeError):
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return [g for g in groups if g is not None and hasattr(g, "_all_gather_comm")
            and hasattr(g, "_reduce_scatter_comm")]


def fsdp_comms(group: Any) -> tuple[Any, Any]:
    """A param group's (all-gather, reduce-scatter) communication objects."""
    return group._all_gather_comm, group._reduce_scatter_comm


def set_fsdp_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    group._all_gather_comm = all_gather
    group._reduce_scatter_comm = reduce_scatter


def fsdp_unsharded_params(group: Any) -> list[tuple[Any, Any]]:
    """``(sharded parameter, unsharded parameter)`` of each parameter of a param group:
    the forward computes with (and AccumulateGrad accumulates into) the unsharded one."""
    pairs = []
    for fsdp_param in getattr(group, "fsdp_params", ()):
        sharded = getattr(fsdp_param, "sharded_param", None)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if sharded is not None and unsharded is not None:
            pairs.append((sharded, unsharded))
    return pairs


class _FsdpCapability:
    """Like :class:`Capability`, with ``present`` read when first asked (importing FSDP)."""

    name = "HAS_FSDP_COMM_OBJECTS"
    used_for = "recording FSDP2's all-gathers and reduce-scatters in a backward (pass_.collectives)"
    without_it = "FSDP2 collectives are not recorded (pass_.collectives stays empty under FSDP2)"

    @property
    def present(self) -> bool:
        try:
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group
        except ImportError:
            return False
        source = getattr(_fsdp_param_group.FSDPParamGroup, "__init__", None)
        names = getattr(getattr(source, "__code__", None), "co_names", ())
        return (hasattr(FSDPModule, "_get_fsdp_state") and "_all_gather_comm" in names
                and "_reduce_scatter_comm" in names)


CAPABILITIES = (*CAPABILITIES, _FsdpCapability())


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

import torch.utils._python_dispatch as _python_dispatch  # noqa: E402

from backlens._fence import complete  # noqa: E402

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
HAS_DISPATCH_MODE_FLAGS = all(hasattr(_python_dispatch, name) for name in _DISPATCH_FLAGS)

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_MODE_STACKS",
        HAS_MODE_STACKS,
        "taking backlens's modes off torch's mode stacks also when a Ctrl-C interrupts entering or leaving them",
        "modes are left with `with` alone; a Ctrl-C at the wrong moment can leave one installed",
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


class EagerDispatchMode(_python_dispatch.TorchDispatchMode):
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


# module calls -----------------------------------------------------------------
# ``nn.Module.__call__`` (``_wrapped_call_impl``) hands every call to the private
# ``nn.Module._call_impl``. Wrapping that one attribute watches every module call
# and leaves modules on torch's fast path (any forward hook, global or not, puts
# every call on the slow hooked path), and setting it is cheap (no type slot to
# update). Without it, ``nn.Module.__call__`` itself is wrapped: the same calls
# are seen, but each install updates the call slot of every module class.

import types as _types  # noqa: E402 - grouped with what uses it

_module_wrapped_call = torch.nn.Module.__dict__.get("_wrapped_call_impl")
HAS_MODULE_CALL_IMPL = (
    isinstance(torch.nn.Module.__dict__.get("_call_impl"), _types.FunctionType)
    and isinstance(_module_wrapped_call, _types.FunctionType)
    and "_call_impl" in _module_wrapped_call.__code__.co_names
    and torch.nn.Module.__dict__.get("__call__") is _module_wrapped_call
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
