"""Start a world of ranks on this machine: gloo over loopback, each under a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORLD_SIZE = 2  # the tests' world: two ranks


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_env(port: int) -> dict[str, str]:
    """The environment of a rank: the rendezvous and gloo's traffic on 127.0.0.1 only."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def run_ranks(script: Path, args: list[str], world_size: int, timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``script`` once per rank (RANK, WORLD_SIZE in the environment); kill them all
    when one fails or the time runs out, and raise with every rank's output."""
    env = loopback_env(free_port())
    processes = []
    for rank in range(world_size):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        processes.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in processes):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
            timed_out = time.monotonic() > deadline
            break
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            process.kill()
    outputs = [process.communicate()[0] for process in processes]
    done = [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(processes, outputs)]
    if timed_out or any(p.returncode != 0 for p in done):
        shown = "\n".join(f"--- rank {rank} (exit {p.returncode}) ---\n{p.stdout[-4000:]}" for rank, p in enumerate(done))
        why = f"timed out after {timeout:.0f} s" if timed_out else "a rank failed"
        raise AssertionError(f"{script.name}: {why}\n{shown}")
    return done
