"""Run as a script: many live traces, each checking the native stack it runs on.

``python native_stack_probe.py [ROUNDS]`` prints one JSON line: how many native
backtraces taken inside bodies, the model and the engine walked a sound chain
of frames (one that ends where the thread began) and how many did not.

Torch records a native backtrace for every error it raises, with glibc's
``backtrace()``. Inside a coroutine that walk continues past the coroutine's
base into whatever lies above it; where that is stale memory it can read a
wild address and crash the process (a freed graph or a torch error in a body,
after many traces, on Python 3.13). Here the same walk is taken, in full,
at every step of the traces (``backtrace()`` through ctypes) and judged by
where it ends (sound: with the frames a walk from outside any trace ends with); and torch's own errors are raised in the same places, from
native stacks of varying depth, in the main thread and in another.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading

import torch
from torch import nn

import backlens as bl
from backlens.errors import FreedGraphError

_libc = ctypes.CDLL(None)
_libc.backtrace.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
_libc.backtrace.restype = ctypes.c_int
_counts = {"sound": 0, "unsound": 0}
_lock = threading.Lock()
_thread = threading.local()


def _outermost() -> tuple[int, ...]:
    """The last return addresses of a full native walk from here: the thread's first frames."""
    frames = (ctypes.c_void_p * 4096)()
    n = _libc.backtrace(frames, 4096)
    return tuple(address or 0 for address in frames[max(0, n - 3) : n])


def check_stack() -> None:
    """Walk the whole native stack from here; count whether it ends where this thread began."""
    sound = _outermost() == _thread.start
    with _lock:
        _counts["sound" if sound else "unsound"] += 1


def torch_error() -> None:
    """A c10::Error (it records a native backtrace), caught."""
    try:
        torch.ones(2) @ torch.ones(3)
    except RuntimeError:
        pass


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_stack()
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def one_trace(lens: bl.Lens, x: torch.Tensor) -> None:
    with lens.trace(x):
        check_stack()
        h1 = lens.fc1.output
        check_stack()
        torch_error()
        h2 = lens.fc2.output
        with lens.output.sum().backward():
            check_stack()
            _ = h2.grad
            check_stack()
            torch_error()
            _ = h1.grad
            check_stack()
        check_stack()


def freed_graph(lens: bl.Lens, x: torch.Tensor) -> None:
    try:
        with lens.trace() as tracer:
            with tracer.invoke(x):
                with lens.output.sum().backward():
                    pass
            with tracer.invoke(x):
                h = lens.fc2.output
                with lens.output.sum().backward():  # the graph is freed: torch raises in the engine
                    h.grad.save()
    except FreedGraphError:
        pass


def raised_in_backward(lens: bl.Lens, x: torch.Tensor) -> None:
    try:
        with lens.trace(x):
            h = lens.fc2.output
            with lens.output.sum().backward():
                _ = h.grad
                raise KeyError("from the body")
    except KeyError:
        pass


def at_depth(levels: int, fn, *args) -> None:  # noqa: ANN001
    """Call ``fn`` under ``levels`` more native frames (each level goes through C)."""
    if levels == 0:
        fn(*args)
    else:
        list(map(lambda _: at_depth(levels - 1, fn, *args), [0]))


def rounds(count: int) -> None:
    _thread.start = _outermost()  # outside any trace: the chain every sound walk ends with
    torch.manual_seed(0)
    lens = bl.wrap(MLP())
    x = torch.randn(2, 4)
    for i in range(count):
        for case in (one_trace, freed_graph, raised_in_backward):
            at_depth(i % 4, case, lens, x)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    rounds(count)
    other = threading.Thread(target=rounds, args=(count // 2,))
    other.start()
    other.join()
    print(json.dumps(_counts))


if __name__ == "__main__":
    main()
