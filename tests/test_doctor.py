"""bl.doctor and the error hierarchy."""

from __future__ import annotations

import pytest

import backlens as bl
from backlens import _torch, errors


def test_doctor_prints_torch_version_and_every_capability_flag(capsys):
    flags = bl.doctor()
    out = capsys.readouterr().out
    assert "torch 2." in out
    for capability in _torch.CAPABILITIES:
        assert capability.name in out
        assert capability.without_it in out
    assert {"HAS_CURRENT_AUTOGRAD_NODE", "HAS_ENGINE_QUEUE_CALLBACK"} <= set(flags)
    assert all(flags.values())


def test_the_doctor_command_runs(capsys):
    from backlens import cli

    assert cli.main(["doctor"]) == 0 and "HAS_SEQUENCE_NR" in capsys.readouterr().out


BUILTINS = {
    "AmbiguousGradError": RuntimeError,
    "BackwardUnavailableError": RuntimeError,
    "BundleError": ValueError,
    "OutOfOrderError": RuntimeError,
    "FreedGraphError": RuntimeError,
    "NoGradForwardError": NotImplementedError,
    "NoGradientPathError": RuntimeError,
    "LabelNotFoundError": KeyError,
    "OutputPathError": OSError,
}


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_has_a_code_a_remedy_and_a_builtin_base(name):
    cls = getattr(errors, name)
    if name == "BacklensWarning":
        warning = cls("w", code="some_code")
        assert warning.code == "some_code" and isinstance(warning, UserWarning)
        return
    err = cls("something went wrong")
    assert isinstance(err, bl.BacklensError)
    assert err.code and err.code == err.code.lower() and " " not in err.code
    assert err.remedy.endswith(".")
    if name != "BacklensError":
        assert isinstance(err, (RuntimeError, KeyError, ValueError, NotImplementedError))
    if name in BUILTINS:
        assert isinstance(err, BUILTINS[name])
    assert "something went wrong" in str(err) and err.remedy in str(err)
