"""One distributed world for every test here: 2 ranks, gloo over loopback, started once.

The ranks run every scenario in one process group (rank_worker.py) and leave
their bundles, gradients and results in a temporary directory; the tests read
them. Starting a world costs seconds (each rank imports torch), so it is
started once per session, under a timeout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from rank_launch import WORLD_SIZE, run_ranks
from safetensors.torch import load_file

TIMEOUT = 240  # seconds for the whole world, on a loaded two-core machine


@dataclass
class World:
    path: Path
    results: list[dict]  # per rank: scenario -> what it returned (or {"error": traceback})
    grads: list[dict]  # per rank: "scenario/kind/param" -> tensor

    def result(self, scenario: str, rank: int) -> dict:
        found = self.results[rank][scenario]
        assert "error" not in found, f"rank {rank}, scenario {scenario}:\n{found['error']}"
        return found

    def grads_of(self, scenario: str, kind: str, rank: int) -> dict:
        self.result(scenario, rank)
        prefix = f"{scenario}/{kind}/"
        return {key[len(prefix):]: value for key, value in self.grads[rank].items() if key.startswith(prefix)}


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    out = tmp_path_factory.mktemp("world")
    run_ranks(Path(__file__).parent / "rank_worker.py", [str(out)], WORLD_SIZE, TIMEOUT)
    results = [json.loads((out / f"results_rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    grads = [load_file(str(out / f"grads_rank{rank}.safetensors")) for rank in range(WORLD_SIZE)]
    return World(out, results, grads)
