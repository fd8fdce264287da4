"""Gradient health across a training run: ``bl.monitor`` and ``bl.monitor_callback`` (API.md §12)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backlens import _torch
from backlens.derive.frameworks import refuse_other_framework
from backlens.errors import UnsupportedInputError
from backlens.monitoring import options as _options
from backlens.monitoring.alerts import Alert
from backlens.monitoring.gradient_monitor import Monitor, rank_writes
from backlens.monitoring.series import Row
from backlens.monitoring.sinks import open_sinks

__all__ = ["Alert", "Monitor", "Row", "monitor", "monitor_callback"]


def monitor(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    every: int = 1,
    stats: str | tuple[str, ...] | list[str] | None = None,
    outputs: bool = False,
    sink: Any = None,
    keep: int = _options.DEFAULT_KEEP,
    spike_factor: float = _options.DEFAULT_SPIKE_FACTOR,
    window: int = _options.DEFAULT_WINDOW,
    on_alert: Callable[[Alert], Any] | None = None,
    scaler: Any = None,
    **mistyped: Any,
) -> Monitor:
    """Watch the gradients of ``model`` across training steps.

    With an ``optimizer``, every ``every``-th optimizer step is recorded (at
    the optimizer's own step hooks); without one, call ``mon.step()`` after
    each backward. ``stats``: some of "norm", "absmax", "nonfinite",
    "update_ratio" (default: all that apply). ``outputs=True`` adds the norm
    of the gradient reaching each module's output. ``sink``: a TensorBoard
    directory, a ``.csv`` path, a callable ``(step, rows)``, or a list of
    those; memory keeps the latest ``keep`` recorded steps either way. A value
    above ``spike_factor`` times its median over the last ``window`` recorded
    steps is a spike; ``on_alert(alert)`` hears of every alert. ``scaler``:
    the ``torch.amp.GradScaler`` stepping the optimizer, so the steps it skips
    are recorded and marked. See docs/monitor.md.
    """
    _options.refuse_mistyped(mistyped, "bl.monitor")
    where = "bl.monitor"
    if not isinstance(model, torch.nn.Module):
        refuse_other_framework(model, (), {}, where)
        raise UnsupportedInputError(f"{where} needs a torch.nn.Module, got {type(model).__name__}.",
                                    code="not_a_module", remedy="Pass the model you train (an nn.Module).")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedInputError(
            f"{where}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.",
            code="not_an_optimizer",
            remedy="Pass the torch optimizer (for a wrapper such as accelerate's, its .optimizer), or none "
                   "and call mon.step() after each backward.")
    checked = _options.check(every=every, stats=stats, outputs=outputs, keep=keep, spike_factor=spike_factor,
                             window=window, on_alert=on_alert, scaler=scaler,
                             has_optimizer=optimizer is not None, where=where)
    if outputs and _torch.compiled_original(model) is not None:
        raise UnsupportedInputError(
            f"{where}: outputs=True hooks module calls, which a torch.compile'd model would recompile for.",
            code="monitor_outputs_compiled", remedy="Monitor the compiled model with outputs=False.")
    sinks = open_sinks(sink, where, opened=rank_writes())
    try:
        return Monitor(model, optimizer, checked, sinks)
    except BaseException:
        for opened in sinks:
            opened.close()
        raise


def monitor_callback(**options: Any) -> Any:
    """A ``transformers.TrainerCallback`` that monitors the Trainer's model and optimizer with
    ``options`` (those of :func:`monitor`); ``callback.monitor`` is the monitor once training began."""
    from backlens.monitoring.callback import MonitorCallback

    return MonitorCallback(options)
