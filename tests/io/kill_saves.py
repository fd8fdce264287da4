"""Kill a save at every step it takes to disk, and check what is left at its path.

Run as a script: ``python kill_saves.py WORKDIR MODE...`` with each MODE one of

* ``save``: ``cap.save(path, overwrite=True)`` over an older bundle (atomic exchange);
* ``save_fallback``: the same where the OS has no atomic exchange (two renames);
* ``to_disk``: a ``storage=bl.to_disk(path, overwrite=True)`` capture over an older bundle.

It imports torch once, then forks one child per kill point of each mode. The child counts
the file system steps the operation takes (creating, syncing, renaming,
exchanging, removing) and SIGKILLs itself right before or right after the
N-th. After each kill the parent loads the path (it must hold the old bundle
or the new one, whole), notes the leftovers beside it, saves again to the
same path (which must remove them) and prints one JSON line per point, naming its mode.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import backlens as bl
from backlens.io import replace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, loss_of  # noqa: E402

STEPS = ("mkdir", "fsync", "rename", "replace", "unlink", "rmdir")


def capture_of(seed: int, storage=None):
    torch.manual_seed(seed)
    model = MLP()
    cap = bl.capture(model, torch.randn(3, 6), save_grads=True, storage=storage)
    loss = loss_of(cap.output)
    loss.backward(retain_graph=True)
    (loss * 2).backward()
    return cap


def grads_of(cap) -> dict[str, torch.Tensor]:
    return {p.name: p.grad.clone() for p in cap.params}


def which(path: Path, old: dict, new: dict) -> str:
    try:
        loaded = bl.load(path)
    except bl.BundleError as exc:
        return f"BundleError: {exc.code}: {str(exc).splitlines()[0]}"
    grads = grads_of(loaded)
    for name, expected in (("old", old), ("new", new)):
        if grads.keys() == expected.keys() and all(torch.equal(grads[k], expected[k]) for k in grads):
            return name
    return "neither"


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def instrument(kill_at: int | None, after: bool, counter: list[int]) -> None:
    """Count file system steps; SIGKILL this process before/after step ``kill_at``."""
    def wrap(owner, name):
        real = getattr(owner, name)

        def step(*args, **kwargs):
            counter[0] += 1
            if kill_at == counter[0] and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if kill_at == counter[0] and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(owner, name, step)

    for name in STEPS:
        wrap(os, name)
    wrap(replace, "exchange")


def operation(mode: str, path: Path):
    if mode == "to_disk":
        capture_of(1, storage=bl.to_disk(path, overwrite=True, shard_bytes=1024)).close()
    else:
        capture_of(1).save(path, overwrite=True)


def in_child(mode: str, path: Path, kill_at: int | None, after: bool) -> int:
    """Run the operation in a forked child; returns its step count, or -1 when it was killed."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        code = 0
        try:
            counter = [0]
            instrument(kill_at, after, counter)
            operation(mode, path)
            os.write(writer, str(counter[0]).encode())
        except BaseException:  # noqa: BLE001 - reported through the exit code
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(writer)
    _pid, status = os.waitpid(pid, 0)
    told = os.read(reader, 64)
    os.close(reader)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return -1
    if os.WEXITSTATUS(status) != 0:
        raise RuntimeError(f"the child failed (exit {os.WEXITSTATUS(status)})")
    return int(told)


def main(workdir: Path, modes: list[str]) -> None:
    torch.set_num_threads(1)  # forked children run no thread pool of the parent's
    exchange = replace._EXCHANGE
    for mode in modes:
        replace._EXCHANGE = None if mode == "save_fallback" else exchange
        kill_at_every_step(workdir / mode, mode)


def kill_at_every_step(workdir: Path, mode: str) -> None:
    workdir.mkdir()
    path = workdir / "bundle"
    old_cap = capture_of(0)
    old, new = grads_of(old_cap), grads_of(capture_of(1))

    def reset() -> None:
        old_cap.save(path, overwrite=True)

    reset()
    steps = in_child(mode, path, None, False)
    assert which(path, old, new) == "new", which(path, old, new)
    points = [(n, after) for n in range(1, steps + 1) for after in (False, True)]
    if len(points) > 24:  # many shard writes: every step at both ends, a sample of those between
        points = points[:6] + points[6:-14:max(1, (len(points) - 20) // 4)] + points[-14:]
    for kill_at, after in points:
        reset()
        killed = in_child(mode, path, kill_at, after) == -1
        found = which(path, old, new)
        left = leftovers(path)
        reset()  # the next save to the path
        print(json.dumps({"mode": mode, "step": kill_at, "after": after, "killed": killed, "found": found, "leftovers": left,
                          "leftovers_after_next_save": leftovers(path),
                          "after_next_save": which(path, old, new)}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
