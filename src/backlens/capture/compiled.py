"""Capturing a ``torch.compile`` model: eagerly (the default) or as opaque compiled regions.

By default ``bl.capture`` records the original module, eagerly, and warns once
(``compiled_model_captured_eager``): the function mode and module-call wrapper
that record a forward would otherwise be traced by dynamo, which breaks the
graph at every op. With ``compiled="opaque"`` the compiled model runs exactly
as compiled, with nothing of backlens active in the forward; the capture
records one module call (the model) and, in the backward, each compiled
region's backward as the one node it is (``CompiledFunctionBackward``), with
its module and time. Its kernels are inductor's own and never reach the ATen
dispatcher, so passes through it are not counted, with that reason.
"""

from __future__ import annotations

import warnings
from typing import Any

from backlens import _torch
from backlens._nested import first_tensor
from backlens.capture.forward import ForwardJournal, ModuleCallEntry
from backlens.errors import BacklensWarning, UnsupportedInputError

MODES = ("eager", "opaque")
COMPILED_NODE = "CompiledFunctionBackward"
NOT_COUNTED = ("the backward ran compiled regions (compiled='opaque'): their kernels are the compiler's "
               "generated code, which does not go through the ATen dispatcher, so their FLOPs cannot be counted")


def check_mode(compiled: Any) -> None:
    if compiled not in MODES:
        raise UnsupportedInputError(
            f"compiled={compiled!r} is not a way to capture a torch.compile model.",
            code="bad_compiled_mode",
            remedy="Pass compiled='eager' (record the original module eagerly, the default) or "
            "compiled='opaque' (keep the compiled graphs; one node per compiled region).",
        )


def original_module(model: Any, compiled: str) -> Any:
    """The module whose calls and parameters a capture records: a compiled model's original.

    Captured eagerly (not ``opaque``), it warns once that the compiled graphs do not run.
    """
    original = _torch.compiled_original(model)
    if original is None:
        return model
    if compiled == "opaque":
        return original
    warnings.warn(BacklensWarning(
        f"bl.capture recorded the original {type(original).__name__} of this torch.compile model eagerly: "
        "recording inside compiled code would break its graph at every op. Gradients are the eager "
        "model's; pass compiled='opaque' to run the compiled graphs and record each compiled region's "
        "backward as one node.",
        code="compiled_model_captured_eager",
    ), stacklevel=3)
    return original


def is_opaque(model: Any, compiled: str) -> bool:
    return compiled == "opaque" and _torch.compiled_original(model) is not None


def run_opaque(journal: ForwardJournal, model: Any, args: tuple, kwargs: dict) -> Any:
    """Run the compiled ``model`` untouched, journalled as one module call (the root)."""
    original = _torch.compiled_original(model)
    journal.module_types = {"": type(original).__name__}
    call = ModuleCallEntry(0, "", 1, None, op_start=0, seq_start=_torch.sequence_nr())
    journal.module_calls.append(call)
    output = model(*args, **kwargs)
    call.seq_end = _torch.sequence_nr()
    call.op_end = 0
    first = first_tensor(output)
    if first is not None:
        call.output_shape = tuple(first.shape)
        if first.grad_fn is not None:
            call.output_node, call.output_nr = first.grad_fn, first.output_nr
    return output
