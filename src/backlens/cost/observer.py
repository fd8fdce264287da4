"""Wires FLOP counting into a capture's backward recorder (one of its observers).

For each explicit engine run over the capture's graph the recorder asks
:meth:`FlopObserver.run_context` for a context to hold open around the real
engine run: a fresh :class:`BackwardCensus`. When the pass closes the census
is settled onto the pass's call entries and the pass dict is appended to the
capture's :class:`CostJournal`. Implicit runs never get a census: their pass
dict says so.
"""

from __future__ import annotations

import weakref
from typing import Any

from backlens.cost.census import BackwardCensus
from backlens.cost.journal import CostJournal
from backlens.cost.settle import no_count_reason, settle, uncounted

_dispatch_modes_warm = False


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
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Warm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Warm():
        torch.zeros(1).add_(1)


class FlopObserver:
    """Counts backward FLOPs of every explicit pass of one capture."""

    def __init__(self, recorder: Any, journal: CostJournal):
        _warm_dispatch_modes()
        self._recorder_ref = weakref.ref(recorder)  # the recorder holds its observers
        self._journal = journal
        self._census: dict[int, BackwardCensus] = {}

    def on_pass_open(self, state: Any) -> None:
        return None

    def run_context(self, run: Any) -> BackwardCensus | None:
        state = run.passes.get(self._recorder_ref())
        if state is None:
            return None
        census = BackwardCensus(create_graph=run.create_graph)
        self._census[state.record.number] = census
        return census

    def on_pass_close(self, state: Any, error: BaseException | None) -> None:
        number = state.record.number
        census = self._census.pop(number, None)
        recorder = self._recorder_ref()
        calls = [recorder.calls[i] for i in state.call_indices]
        reason = no_count_reason(census, state.run.trigger, state.run.explicit, error)
        if reason is not None:
            for entry in calls:
                entry.flops = entry.recompute_flops = None
            self._journal.passes.append(uncounted(number, reason))
            return
        self._journal.passes.append(settle(census, number, calls, recorder.table))
