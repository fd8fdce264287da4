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

HAS_SEQUENCE_NR = _get_sequence_nr is not None
HAS_CURRENT_AUTOGRAD_NODE = _current_autograd_node is not None
HAS_CURRENT_GRAPH_TASK_ID = _current_graph_task_id is not None
HAS_GRAPH_TASK_KEEP_GRAPH = _keep_graph is not None
HAS_ENGINE_QUEUE_CALLBACK = _queue_callback is not None
HAS_ENGINE_RUN_BACKWARD = _engine_in_graph is not None and _engine_in_autograd is not None
HAS_NODE_PREHOOK = hasattr(torch.autograd.graph.Node, "register_prehook")

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


def _find_tensor_grad_descriptor() -> Any:
    """torch's own ``Tensor.grad`` descriptor (defined on the C base class)."""
    for klass in torch.Tensor.__mro__[1:]:
        found = klass.__dict__.get("grad")
        if found is not None and hasattr(found, "__get__") and hasattr(found, "__set__"):
            return found
    return None


_tensor_grad_descriptor = _find_tensor_grad_descriptor()
HAS_TENSOR_GRAD_DESCRIPTOR = _tensor_grad_descriptor is not None

CAPABILITIES = (
    *CAPABILITIES,
    Capability(
        "HAS_TENSOR_GRAD_DESCRIPTOR",
        HAS_TENSOR_GRAD_DESCRIPTOR,
        "serving h.grad inside `with loss.backward():` blocks of live tracing",
        "reading or setting .grad inside a backward block raises TraceError",
    ),
)


def tensor_grad_descriptor() -> Any:
    """The descriptor behind ``Tensor.grad`` (None if torch moved it)."""
    return _tensor_grad_descriptor


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
