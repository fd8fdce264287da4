"""The options of ``bl.monitor`` and ``bl.monitor_callback``, checked before anything is installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backlens import _args
from backlens.errors import UnsupportedInputError

GRAD_STATS = ("norm", "absmax", "nonfinite")
STATS = (*GRAD_STATS, "update_ratio")
# Every keyword of bl.monitor after the model and optimizer: a keyword close to one is a typo.
OPTIONS = ("every", "stats", "outputs", "sink", "keep", "spike_factor", "window", "on_alert", "scaler")

DEFAULT_KEEP = 1000  # recorded steps kept in memory
DEFAULT_SPIKE_FACTOR = 10.0
DEFAULT_WINDOW = 20  # recorded steps in a spike's rolling median


@dataclass(frozen=True)
class Options:
    every: int
    stats: tuple[str, ...]
    outputs: bool
    keep: int
    spike_factor: float
    window: int
    on_alert: Any
    scaler: Any


def refuse_mistyped(unknown: dict[str, Any], where: str) -> None:
    """An unknown keyword: name the option it is close to, or list them all."""
    if not unknown:
        return
    key = next(iter(unknown))
    option = _args.close_option(key, OPTIONS)
    hint = f"did you mean {option}=?" if option else f"the options are {', '.join(OPTIONS)}."
    raise UnsupportedInputError(f"{where}: unknown option {key}=; {hint}", code="mistyped_option",
                                remedy=f"Spell it {option}=." if option else f"Pass one of {', '.join(OPTIONS)}.")


def check(*, every: Any, stats: Any, outputs: Any, keep: Any, spike_factor: Any, window: Any,
          on_alert: Any, scaler: Any, has_optimizer: bool | None, where: str) -> Options:
    """The options as the monitor uses them. ``has_optimizer`` None: not known yet (the
    Trainer callback gets its optimizer when training begins)."""
    every = _args.integer(every, "every", where, low=1, example="10")
    keep = _args.integer(keep, "keep", where, low=1, example="1000")
    window = _args.integer(window, "window", where, low=1, example="20")
    spike_factor = _args.number(spike_factor, "spike_factor", where, low=1.0, above=True, finite=True,
                                example="spike_factor=10.0")
    _args.flag(outputs, "outputs", where)
    if on_alert is not None:
        _args.callable_(on_alert, "on_alert", where, "on_alert=lambda alert: print(alert.message)")
    if scaler is not None and not all(hasattr(scaler, name) for name in ("step", "unscale_", "get_scale")):
        raise UnsupportedInputError(
            f"{where}: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.",
            code="bad_argument", remedy="Pass the GradScaler whose scaler.step(optimizer) your loop calls.")
    return Options(every, _stats(stats, has_optimizer, where), outputs, keep, spike_factor, window,
                   on_alert, scaler)


def _stats(stats: Any, has_optimizer: bool | None, where: str) -> tuple[str, ...]:
    if stats is None:
        return STATS if has_optimizer is not False else GRAD_STATS
    chosen = (stats,) if isinstance(stats, str) else stats
    try:
        chosen = tuple(chosen)
    except TypeError:
        chosen = (stats,)
    if not chosen or not all(isinstance(name, str) for name in chosen):
        raise UnsupportedInputError(
            f"{where}: stats must name some of {', '.join(map(repr, STATS))}, got {stats!r}.",
            code="bad_argument", remedy='Pass e.g. stats=("norm", "absmax").')
    for name in chosen:
        if name not in STATS:
            close = _args.close_option(name, STATS)
            raise UnsupportedInputError(
                f"{where}: unknown stat {name!r}" + (f"; did you mean {close!r}?" if close else "."),
                code="unknown_stat", remedy=f"Choose among {', '.join(map(repr, STATS))}.")
    if "update_ratio" in chosen and has_optimizer is False:
        raise UnsupportedInputError(
            f"{where}: the update ratio needs the optimizer's step (the parameters before and after it).",
            code="update_ratio_needs_optimizer",
            remedy="Pass the optimizer: bl.monitor(model, optimizer, ...), or leave 'update_ratio' out of stats.")
    return tuple(name for name in STATS if name in chosen)  # one order, whatever order was given
