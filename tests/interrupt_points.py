"""Run as a script: KeyboardInterrupt at many points of a captured forward and backward.

``python interrupt_points.py [COUNT]`` prints one JSON line per point. A point
is either the N-th line run in backlens (or in torch's mode enter/exit code)
during a captured forward and two captured backwards, where a trace function
raises KeyboardInterrupt, or a named place: a user's tensor hook, a custom
Function's backward (a node), the FLOP census, a backlens hook, the user's
forward. After each, it reports what is left installed in torch, whether the
capture is consistent (a later backward records or raises a named error, with
stock gradients), and, once the capture is closed and dropped, whether a plain
backward runs any backlens code and gives stock gradients.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint

import backlens as bl
from backlens import _torch
from backlens._frames import PACKAGE_DIR
from backlens.capture.backward import BackwardRecorder
from backlens.cost.census import BackwardCensus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import loss_of  # noqa: E402

STOCK_CALL_IMPL = torch.nn.Module._call_impl
STOCK_CHECKPOINT_HOOK = torch.utils.checkpoint._checkpoint_hook
STOCK_CHECKPOINT_FORWARD = torch.utils.checkpoint.CheckpointFunction.__dict__["forward"].__func__
STOCK_ENGINE = torch.autograd.graph._engine_run_backward
WATCHED = (PACKAGE_DIR, os.path.join(os.path.dirname(torch.__file__), "utils", "_python_dispatch.py"),
           os.path.join(os.path.dirname(torch.__file__), "overrides.py"))


class Stop(torch.autograd.Function):
    """Identity forward; its backward raises KeyboardInterrupt when ``armed`` (a node)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Stop.armed:
            raise KeyboardInterrupt("in a node")
        return grad


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)
        self.raise_in_forward = False
        self.hidden = None

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.raise_in_forward:
            raise KeyboardInterrupt("in the user's forward")
        self.hidden = Stop.apply(h)
        return self.fc2(self.hidden)


class Interrupter:
    """A trace function raising KeyboardInterrupt at the ``at``-th watched line (counting only when None)."""

    def __init__(self, at: int | None):
        self.at = at
        self.count = 0
        self.forward_lines = 0

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(WATCHED):
            return self.line
        return None

    def line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt(f"at watched line {self.count}")
        return self.line


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


# The tracer of the run under way (so the counting run can note where the forward ends).
ACTIVE: list = []


def run_scenario(model, x, held: dict) -> None:
    cap = held["cap"] = bl.capture(model, x, save_grads=True, save_activations=bl.func("relu"))
    if ACTIVE:
        ACTIVE[-1].forward_lines = ACTIVE[-1].count
    loss = held["loss"] = loss_of(cap.output)
    loss.backward(retain_graph=True)
    cap.backward(loss * 2, save_grads=bl.func("linear"), retain_graph=True)


def check(point: str, interrupt) -> dict:
    """Run the scenario with ``interrupt`` armed (a context manager), then inspect everything."""
    torch.manual_seed(0)
    model = Model()
    stock_model = copy.deepcopy(model)
    x = torch.randn(4, 6)
    held: dict = {}
    outcome: dict = {"point": point}
    try:
        with interrupt(model, held):
            run_scenario(model, x, held)
        outcome["interrupted"] = False
    except KeyboardInterrupt as exc:
        outcome["interrupted"] = str(exc)
    sys.settrace(None)
    Stop.armed = False
    model.raise_in_forward = False
    outcome["mode_stacks"] = list(_torch.mode_stack_depths())
    outcome["call_impl_stock"] = torch.nn.Module._call_impl is STOCK_CALL_IMPL
    outcome["checkpoint_stock"] = (
        torch.utils.checkpoint._checkpoint_hook is STOCK_CHECKPOINT_HOOK
        and torch.utils.checkpoint.CheckpointFunction.__dict__["forward"].__func__ is STOCK_CHECKPOINT_FORWARD)
    cap = held.get("cap")
    if cap is not None:
        # The capture is consistent or refuses with a named error; gradients are stock either way.
        model.zero_grad(set_to_none=True)
        loss_of(stock_model(x)).backward()
        try:
            held["loss"].backward(retain_graph=True)
            outcome["later_backward"] = "ok"
        except bl.BacklensError as exc:
            outcome["later_backward"] = f"BacklensError: {exc.code}"
        except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
            outcome["later_backward"] = f"{type(exc).__name__}: {exc}"
        if outcome["later_backward"] == "ok":
            outcome["later_grads_stock"] = all(torch.equal(a, b) for a, b in zip(grads(model), grads(stock_model)))
        try:
            for name in ("ops", "modules", "params", "grad_fns", "grad_fn_calls", "passes"):
                getattr(cap, name).to_pandas()
            outcome["statuses"] = [p.status for p in cap.passes]
            outcome["records_readable"] = True
        except Exception as exc:  # noqa: BLE001
            outcome["records_readable"] = f"{type(exc).__name__}: {exc}"
        try:
            cap.close()
        except Exception as exc:  # noqa: BLE001
            outcome["close"] = f"{type(exc).__name__}: {exc}"
    held.clear()
    del cap  # freed by reference counting: a capture leaves no cycle to wait for
    outcome["engine_stock_after_close"] = torch.autograd.graph._engine_run_backward is STOCK_ENGINE
    # A plain training step afterwards: no backlens code runs, gradients are stock.
    model.zero_grad(set_to_none=True)
    stock_model.zero_grad(set_to_none=True)
    called, entered = [], []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE_DIR):
            name = f"{os.path.relpath(frame.f_code.co_filename, PACKAGE_DIR)}:{frame.f_code.co_name}"
            called.append(name)
            caller = frame.f_back
            if caller is None or not caller.f_code.co_filename.startswith(PACKAGE_DIR):
                entered.append(name)  # where torch or the user called into backlens

    sys.setprofile(profiler)
    try:
        loss_of(model(x)).backward()
    finally:
        sys.setprofile(None)
    loss_of(stock_model(x)).backward()
    outcome["backlens_calls_in_plain_step"] = sorted(set(called))
    outcome["backlens_entries_in_plain_step"] = sorted(set(entered))
    outcome["plain_grads_stock"] = all(torch.equal(a, b) for a, b in zip(grads(model), grads(stock_model)))
    return outcome


class traced:
    def __init__(self, at: int | None, counter: list | None = None):
        self.at, self.counter = at, counter

    def __call__(self, model, held):
        self.tracer = Interrupter(self.at)
        return self

    def __enter__(self):
        ACTIVE.append(self.tracer)
        sys.settrace(self.tracer)

    def __exit__(self, *exc):
        sys.settrace(None)
        ACTIVE.remove(self.tracer)
        if self.counter is not None:
            self.counter.extend([self.tracer.forward_lines, self.tracer.count])


class patched:
    """Raise KeyboardInterrupt from the ``nth`` call of ``owner.name``."""

    def __init__(self, owner, name: str, nth: int):
        self.owner, self.name, self.nth = owner, name, nth

    def __call__(self, model, held):
        return self

    def __enter__(self):
        real = self.real = getattr(self.owner, self.name)
        calls = [0]

        def interrupted(*args, **kwargs):
            calls[0] += 1
            if calls[0] == self.nth:
                raise KeyboardInterrupt(f"in {self.name}")
            return real(*args, **kwargs)

        setattr(self.owner, self.name, interrupted)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.real)


class user_hook:
    def __call__(self, model, held):
        self.model = model
        return self

    def __enter__(self):
        model = self.model
        real_forward = model.forward

        fired = []

        def interrupt_once(grad):
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt("in a tensor hook")

        def forward(x):
            out = real_forward(x)
            model.hidden.register_hook(interrupt_once)
            return out

        model.forward = forward

    def __exit__(self, *exc):
        del self.model.forward


class flag:
    def __init__(self, setter):
        self.setter = setter

    def __call__(self, model, held):
        self.model = model
        return self

    def __enter__(self):
        self.setter(self.model, True)

    def __exit__(self, *exc):
        self.setter(self.model, False)


def main(count: int) -> None:
    lines: list[int] = []
    check("warm", traced(None))  # first-use work (imports, caches) is not counted
    check("count", traced(None, lines))
    forward, total = lines
    # Half the points in the captured forward, half in the two backwards (many more lines).
    half = max(1, count // 2)
    points = sorted(set(range(1, forward + 1, max(1, forward // half)))
                    | set(range(forward + 1, total + 1, max(1, (total - forward) // half))) | {total - 1, total})
    for at in points:
        print(json.dumps(check(f"line {at} of {total}", traced(at))), flush=True)
    named = {
        "a user's tensor hook": user_hook(),
        "a node's backward": flag(lambda m, on: setattr(Stop, "armed", on)),
        "the user's forward": flag(lambda m, on: setattr(m, "raise_in_forward", on)),
        "the FLOP census": patched(BackwardCensus, "seen", 5),
        "a backlens pre-hook": patched(BackwardRecorder, "_finish", 3),
        "discovering nodes": patched(BackwardRecorder, "_add_nodes", 1),
        "opening a pass": patched(BackwardRecorder, "open_pass", 2),
        "closing a pass": patched(BackwardRecorder, "close_pass", 1),
        # between swapping torch's checkpoint hooks class and its reentrant forward
        "installing the checkpoint witness": patched(_torch, "set_reentrant_checkpoint_forward", 1),
        "removing the checkpoint witness": patched(_torch, "set_checkpoint_hook_class", 2),
    }
    for name, interrupt in named.items():
        print(json.dumps(check(name, interrupt)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
