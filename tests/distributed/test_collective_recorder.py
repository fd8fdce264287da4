"""The collective recorder on its own: a failure to record never stops a backward."""

from __future__ import annotations

import warnings

from backlens.capture.collectives import CollectiveRecorder, FsdpGroup
from backlens.capture.state import CaptureState, PassEntry


def test_a_backward_runs_with_a_warning_when_fsdp_comms_cannot_be_swapped():
    state = CaptureState()
    recorder = CollectiveRecorder(state, [], [FsdpGroup(object(), ("w",), ("",))], {}, [])
    pass_ = PassEntry(number=1, trigger="Tensor.backward", call_site=None, retain_graph=False,
                      create_graph=False, policy=None, start_ns=0)
    ran = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.run_context(None, pass_):
            ran.append(True)
    assert ran == [True]
    assert [getattr(w.message, "code", None) for w in caught] == ["collective_recording_failed"]
    assert state.collectives == []
