"""Live traces under tracers, debuggers and profilers: the body runs in the trace, gradients as stock.

A body is skipped in the caller's frame by a trace function; these check that
no other tracer of the thread keeps that from working (or, where one does,
that the trace says so instead of running the body in place).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pdb
import profile
import pstats
import subprocess
import sys

import coverage
import pytest
import torch
from live_helpers import assert_clean, reference

from backlens.errors import TraceError


def traced(mlp, lens, x):
    """Output and gradient of fc2 and fc1's weight gradient, read in a trace."""
    mlp.zero_grad()
    with lens.trace(x):
        h = lens.fc2.output
        out = h.save()
        with lens.output.sum().backward():
            g = h.grad.save()
    return out, g, mlp.fc1.weight.grad.clone()


def assert_stock(mlp, x, found):
    mlp.zero_grad()
    ref = reference(mlp, x, ["fc2"])
    out, g, weight_grad = found
    assert torch.equal(out, ref["fc2"][0])
    assert torch.equal(g, ref["fc2"][1])
    assert torch.equal(weight_grad, mlp.fc1.weight.grad)


@contextlib.contextmanager
def trace_function(tracer):
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def test_a_trace_under_a_users_settrace_tracer_gives_stock_gradients_and_the_tracer_sees_the_body(mlp, lens, x):
    lines = set()

    def tracer(frame, event, arg):
        if event == "line" and frame.f_code.co_filename == __file__:
            lines.add(frame.f_lineno)
        return tracer

    with trace_function(tracer):
        found = traced(mlp, lens, x)
        still = sys.gettrace()
    assert still is tracer
    assert_stock(mlp, x, found)
    body_line = traced.__code__.co_firstlineno + 6  # g = h.grad.save()
    assert body_line in lines
    assert_clean(mlp)


def test_a_trace_under_cprofile_gives_stock_gradients(mlp, lens, x):
    profiler = cProfile.Profile()
    found = profiler.runcall(traced, mlp, lens, x)
    assert_stock(mlp, x, found)
    assert pstats.Stats(profiler).total_calls > 0


def test_a_trace_under_the_pure_python_profile_module_gives_stock_gradients_and_its_statistics(mlp, lens, x):
    profiler = profile.Profile()
    found = profiler.runcall(traced, mlp, lens, x)
    assert_stock(mlp, x, found)
    stats = pstats.Stats(profiler)
    assert any(name == "traced" for _, _, name in stats.stats)


def measured(core, fn, *args):
    cov = coverage.Coverage(data_file=None, config_file=False, include=[__file__])
    cov.set_option("run:core", core)
    cov.start()
    try:
        result = fn(*args)
    finally:
        cov.stop()
    return result, cov


def traced_then_more(mlp, lens, x):
    found = traced(mlp, lens, x)
    after = 1  # a line of the caller after the trace: still measured
    return found, after


def test_a_trace_under_coverages_c_tracer_gives_stock_gradients_and_the_caller_stays_measured(mlp, lens, x):
    (found, _), cov = measured("ctrace", traced_then_more, mlp, lens, x)
    assert type(cov._collector.tracers[0]).__name__ == "CTracer"
    assert_stock(mlp, x, found)
    measured_lines = cov.get_data().lines(__file__)
    assert traced_then_more.__code__.co_firstlineno + 2 in measured_lines


@pytest.mark.skipif(sys.version_info < (3, 12), reason="coverage's sys.monitoring core needs Python 3.12")
def test_a_trace_under_coverages_sys_monitoring_core_gives_stock_gradients_and_measures_the_body(mlp, lens, x):
    (found, _), cov = measured("sysmon", traced_then_more, mlp, lens, x)
    assert_stock(mlp, x, found)
    measured_lines = cov.get_data().lines(__file__)
    assert traced.__code__.co_firstlineno + 6 in measured_lines  # g = h.grad.save(), in the body
    assert traced_then_more.__code__.co_firstlineno + 2 in measured_lines


def test_a_debugger_stopped_in_a_body_continues_the_trace_with_stock_gradients(mlp, lens, x):
    shown = io.StringIO()
    mlp.zero_grad()
    with lens.trace(x):
        h = lens.fc2.output
        out = h.save()
        pdb.Pdb(stdin=io.StringIO("p tuple(h.shape)\nc\n"), stdout=shown, nosigint=True).set_trace()
        with lens.output.sum().backward():
            pdb.Pdb(stdin=io.StringIO("p 6 * 7\nc\n"), stdout=shown, nosigint=True).set_trace()
            g = h.grad.save()
    found = (out, g, mlp.fc1.weight.grad.clone())
    sys.settrace(None)
    assert f"({x.shape[0]}, 8)" in shown.getvalue()
    assert "42" in shown.getvalue()
    assert_stock(mlp, x, found)


def test_a_tracer_started_between_the_with_and_the_body_is_named_by_the_error_not_run_in_place(mlp, lens, x):
    cov = coverage.Coverage(data_file=None, config_file=False, include=[__file__])
    cov.set_option("run:core", "ctrace")

    @contextlib.contextmanager
    def start_measuring():
        cov.start()  # installed from C after the skip was armed: it never calls the frame's trace
        yield

    ran = []
    try:
        with pytest.raises(TraceError) as info:
            with lens.trace(x), start_measuring():
                ran.append("in place")
                lens.fc2.output.save()
        assert type(sys.gettrace()).__name__ == "CTracer"  # left running
    finally:
        cov.stop()
    assert info.value.code == "body_ran_in_place"
    assert "CTracer" in str(info.value)
    assert ran == ["in place"]
    assert_clean(mlp)


def test_a_script_run_as_python_m_profile_runs_it_traces_with_stock_gradients(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import torch\n"
        "import backlens as bl\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "x = torch.randn(2, 3)\n"
        "lens = bl.wrap(model)\n"
        "for _ in range(3):\n"
        "    with lens.trace(x):\n"
        "        hidden = lens[0].output\n"
        "        with lens.output.sum().backward():\n"
        "            grad = hidden.grad.save()\n"
        "stock_hidden = model[0](x)\n"
        "stock_hidden.retain_grad()\n"
        "model[2](model[1](stock_hidden)).sum().backward()\n"
        "assert torch.equal(grad, stock_hidden.grad), (grad, stock_hidden.grad)\n"
        "print('stock gradients')\n"
    )
    # As `python -m profile script.py` runs it (the profiler's class is then `__main__.Profile`),
    # with torch imported before the profiler starts: profiling its import alone takes seconds.
    launch = (
        "import runpy, sys, torch, backlens\n"
        f"sys.argv = ['profile', {str(script)!r}]\n"
        "runpy.run_module('profile', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "stock gradients" in done.stdout
    assert "function calls" in done.stdout  # the profile's own statistics
