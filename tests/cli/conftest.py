"""The backlens command run in-process, through ``cli.main(argv)`` as the console script runs it."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from backlens import cli

HERE = Path(__file__).parent


class Done(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys, monkeypatch):
    """``run(*argv)``: the command's exit code and what it printed, as a user at a wide terminal
    sees it, from this folder (where tiny_factories is importable)."""
    monkeypatch.chdir(HERE)
    monkeypatch.setenv("COLUMNS", "160")
    threads = torch.get_num_threads()

    def run(*args: str) -> Done:
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        finally:
            torch.set_num_threads(threads)  # --threads changes the process's torch
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run
