"""Wires FLOP counting into a capture's backward recorder (one of its observers).

For each explicit engine run over the capture's graph the recorder asks
:meth:`FlopObserver.run_context` for a context to hold open around the real
engine run: a fresh :class:`BackwardCensus`, shared by every capture the run
belongs to. When the pass closes the census
is settled onto the pass's call entries and the pass dict is appended to the
state's :class:`~backlens.cost.journal.CostJournal`. Implicit runs never get a
census: their pass dict says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from backlens import _torch
from backlens.cost.census import BackwardCensus
from backlens.cost.settle import no_count_reason, settle, uncounted

_dispatch_modes_warm = False
# Why a pass opened inside ``without_census`` has no count (also in bundles: reports tell
# passes timed this way apart by it).
TIMED_WITHOUT_CENSUS = "timed without the FLOP census (its FLOPs are counted in other passes)"


def _warm_dispatch_modes() -> None:
    """Torch imports torch._dynamo (about a second) the first time any dispatch
    mode is entered; pay it here, once, rather than inside a timed pass.

    It runs on a short-lived thread because that first entry keeps its calling
    frames alive for good; on the user's thread those would pin the capture
    being built (and its graph) for the life of the process.
    """
    global _dispatch_modes_warm
    if _dispatch_modes_warm:
        return
    import threading

    worker = threading.Thread(target=_enter_a_dispatch_mode, name="backlens-warm-dispatch")
    worker.start()
    worker.join()
    _dispatch_modes_warm = True


def _enter_a_dispatch_mode() -> None:
    import torch

    class _Warm(_torch.EagerDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Warm():
        torch.zeros(1).add_(1)


def torch_cannot_count() -> str | None:
    """Why this torch cannot count a backward's FLOPs (a capability it lacks), or None."""
    if not _torch.HAS_TORCH_DISPATCH_MODE:
        return ("this torch has no TorchDispatchMode (bl.doctor(): HAS_TORCH_DISPATCH_MODE), so the backward's "
                "ATen calls cannot be seen")
    if not _torch.HAS_FLOP_REGISTRY:
        return "this torch has no FLOP formula registry (bl.doctor(): HAS_FLOP_REGISTRY)"
    return None


def census_left_behind(mode: Any) -> bool:
    """A backward census whose pass has closed (it should be off torch's mode stack)."""
    return isinstance(mode, BackwardCensus) and mode.closed


class FlopObserver:
    """Counts backward FLOPs of every explicit pass of one capture.

    One census counts a run, whichever captures take part (the first of them
    that counts FLOPs holds it open); each capture settles its own nodes' share,
    and the census's holder also the calls under no capture's node.

    ``cannot_count``: why no pass of this capture can be counted (then no census
    runs, and each pass says so), or None.
    """

    def __init__(self, cannot_count: str | None = None) -> None:
        self._cannot_count = cannot_count or torch_cannot_count()
        if self._cannot_count is None:
            _warm_dispatch_modes()
        self._runs: dict[int, Any] = {}
        self.paused = 0  # > 0: passes open without a census (``without_census``)
        self._timed_only: set[int] = set()

    def run_context(self, run: Any, pass_: Any) -> Any:
        if self._cannot_count is not None:
            return None
        if self.paused:
            self._timed_only.add(pass_.number)
            return None
        self._runs[pass_.number] = run
        if "census" in run.shared:
            return None  # another capture's observer counts this run
        census = run.shared["census"] = BackwardCensus(create_graph=run.create_graph)
        run.shared["census_pass"] = pass_
        return _torch.dispatch_mode(census)  # off torch's mode stack on the way out, also on Ctrl-C

    def census_of(self, number: int) -> BackwardCensus | None:
        """The census counting pass ``number``'s run while it runs (maybe another capture's)."""
        run = self._runs.get(number)
        return run.shared.get("census") if run is not None else None

    def on_pass_close(self, state: Any, pass_: Any, error: BaseException | None) -> None:
        self._runs.pop(pass_.number, None)
        run = pass_.run
        census = run.shared.get("census") if run is not None else None
        if census is not None:
            # Off torch's mode stack even if a Ctrl-C cut its own cleanup short (the run
            # is over: the engine wrapper leaves the census before closing the passes).
            census.closed = True
            _torch.drop_dispatch_modes(census_left_behind)
        calls = [state.calls[i] for i in pass_.calls]
        timed_only = pass_.number in self._timed_only and census is None
        self._timed_only.discard(pass_.number)
        reason = self._cannot_count or (TIMED_WITHOUT_CENSUS if timed_only else None) or no_count_reason(census, pass_.trigger, run is not None and run.explicit,
                                                       error)
        if reason is not None:
            for entry in calls:
                entry.flops = entry.recompute_flops = None
            state.cost.passes.append(uncounted(pass_.number, reason))
            return
        recorder = state.recorder
        state.cost.passes.append(settle(
            census, pass_.number, calls, state,
            elsewhere=lambda node: run.recorded_elsewhere(node, recorder),
            holder=run.shared.get("census_pass") is pass_,
        ))


@contextmanager
def without_census(state: Any) -> Iterator[None]:
    """Explicit passes over ``state``'s graph opened inside run without the FLOP census, so
    their times are those of the backward and backlens's per-node timing alone; their
    count says why it is missing (``TIMED_WITHOUT_CENSUS``)."""
    recorder = getattr(state, "recorder", None)
    observers = [o for o in (recorder.observers if recorder is not None else ()) if isinstance(o, FlopObserver)]
    for observer in observers:
        observer.paused += 1
    try:
        yield
    finally:
        for observer in observers:
            observer.paused -= 1
