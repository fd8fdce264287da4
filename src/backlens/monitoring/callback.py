"""``bl.monitor_callback``: the monitor inside ``transformers.Trainer``.

When training begins the callback monitors the Trainer's model and the
torch optimizer inside its (accelerate-wrapped) optimizer, numbering steps
as the Trainer's ``global_step`` does. Mixed precision: the wrapper's
GradScaler (accelerate keeps it as ``optimizer.scaler``) is handed to the
monitor as ``scaler=``, which sees the steps it skips and unscales output
gradients; any other skipped step shows as ``on_optimizer_step`` without the
optimizer having stepped. The monitor is closed when training ends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from backlens.errors import UnsupportedInputError
from backlens.monitoring import options as _options
from backlens.monitoring.gradient_monitor import Monitor, rank_writes
from backlens.monitoring.sinks import open_sinks

try:
    from transformers import TrainerCallback
except ImportError:  # the callback needs transformers; bl.monitor does not
    TrainerCallback = None  # type: ignore[assignment,misc]

DEFAULTS = {"every": 1, "stats": None, "outputs": False, "sink": None, "keep": _options.DEFAULT_KEEP,
            "spike_factor": _options.DEFAULT_SPIKE_FACTOR, "window": _options.DEFAULT_WINDOW,
            "on_alert": None}


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside wrappers (accelerate's ``AcceleratedOptimizer`` holds it as
    ``.optimizer``)."""
    seen = 0
    while optimizer is not None and seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            optimizer, seen = inner, seen + 1
            continue
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    return optimizer


if TrainerCallback is not None:

    class MonitorCallback(TrainerCallback):
        """Monitors the Trainer's gradients; ``.monitor`` is the :class:`Monitor` once training began."""

        def __init__(self, options: dict[str, Any]):
            where = "bl.monitor_callback"
            unknown = {k: v for k, v in options.items() if k not in DEFAULTS}
            if "scaler" in unknown:
                raise UnsupportedInputError(
                    f"{where}: the Trainer's mixed-precision scaler is its own; the callback notes the "
                    f"steps it skips without scaler=.", code="bad_argument", remedy="Leave scaler= out.")
            _options.refuse_mistyped(unknown, where)
            self.options = {**DEFAULTS, **options}
            opts = self.options
            _options.check(every=opts["every"], stats=opts["stats"], outputs=opts["outputs"],
                                           keep=opts["keep"], spike_factor=opts["spike_factor"],
                                           window=opts["window"], on_alert=opts["on_alert"], scaler=None,
                                           has_optimizer=None, where=where)
            open_sinks(opts["sink"], where, opened=False)  # checked now, opened when training begins
            self.monitor: Monitor | None = None
            self._posts = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           optimizer: Any = None, **kwargs: Any) -> None:
            if self.monitor is not None:
                self.monitor.close()
            inner = torch_optimizer(optimizer)
            if model is None or inner is None:
                raise UnsupportedInputError(
                    "bl.monitor_callback: the Trainer gave no model or no torch optimizer at train begin.",
                    code="monitor_callback_no_optimizer",
                    remedy="Use the callback with transformers.Trainer (its optimizer is made before training).")
            opts = self.options
            checked = _options.check(every=opts["every"], stats=opts["stats"], outputs=opts["outputs"],
                                     keep=opts["keep"], spike_factor=opts["spike_factor"], window=opts["window"],
                                     on_alert=opts["on_alert"], scaler=None, has_optimizer=True,
                                     where="bl.monitor_callback")
            scaler = getattr(optimizer, "scaler", None)
            if scaler is not None and all(hasattr(scaler, n) for n in ("step", "unscale_", "get_scale")):
                checked = replace(checked, scaler=scaler)
            sinks = open_sinks(opts["sink"], "bl.monitor_callback", opened=rank_writes())
            self.monitor = Monitor(model, inner, checked, sinks, start_step=state.global_step)
            self._posts = self.monitor._posts

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            monitor = self.monitor
            if monitor is None or monitor.closed:
                return
            if monitor._posts == self._posts and monitor._options.scaler is None:
                monitor._skipped_elsewhere()  # a step skipped out of the monitor's sight
            self._posts = monitor._posts

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.monitor is not None:
                self.monitor.close()

else:  # pragma: no cover - exercised only without transformers

    class MonitorCallback:  # type: ignore[no-redef]
        def __init__(self, options: dict[str, Any]):
            raise UnsupportedInputError(
                "bl.monitor_callback makes a transformers.TrainerCallback, and transformers is not installed.",
                code="transformers_not_installed",
                remedy="pip install transformers, or use bl.monitor(model, optimizer) in your own loop.")
