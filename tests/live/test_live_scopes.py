"""Which values leave a block, and in which scope the body runs."""

from __future__ import annotations

import runpy
import subprocess
import sys
import textwrap

import pytest
import torch
from live_helpers import assert_clean, reference

import backlens.live as bl
from backlens.errors import BacklensWarning, TraceError


def test_only_saved_values_reach_the_caller(lens, x):
    before = "untouched"
    with lens.trace(x):
        kept = lens.fc1.output.save()
        dropped = lens.fc2.output  # noqa: F841
        before = "rebound inside"
    assert kept.shape == (5, 8)
    assert before == "untouched"
    assert "dropped" not in locals()


def test_mutating_an_outer_object_works_as_in_plain_python(lens, x):
    store = {}
    with lens.trace(x):
        store["h"] = lens.fc1.output
    assert store["h"].shape == (5, 8)


def test_save_outside_a_trace_raises(x):
    with pytest.raises(TraceError) as info:
        bl.save(x)
    assert info.value.code == "save_outside_trace"
    with pytest.raises(TraceError):
        x.save()
    leaf = torch.ones(2, requires_grad=True)
    assert (leaf * 2).sum().backward() is None and leaf.grad is not None


def test_values_saved_in_a_backward_block_reach_the_trace_body_and_the_caller(lens, x):
    with lens.trace(x):
        h = lens.fc2.output
        with lens.output.sum().backward():
            g = h.grad.save()
        doubled = (g * 2).save()
    assert torch.equal(doubled, g * 2)


def test_values_saved_in_invokes_reach_the_caller(lens, x):
    with lens.trace() as tracer:
        with tracer.invoke(x[:2]):
            first = lens.fc1.output.save()
        with tracer.invoke(x[2:]):
            second = lens.fc1.output.save()
    assert first.shape == (2, 8) and second.shape == (3, 8)


def test_a_trace_in_a_loop_writes_back_every_iteration(lens, x):
    seen = []
    for i in range(3):
        with lens.trace(x[i : i + 1]):
            row = lens.fc1.output.save()
        seen.append(row)
    assert [tuple(r.shape) for r in seen] == [(1, 8)] * 3
    assert not torch.equal(seen[0], seen[1])


def test_a_trace_in_a_nested_function_reads_closure_variables(lens, x):
    scale = 3.0

    def inner():
        with lens.trace(x):
            scaled = (lens.fc1.output * scale).save()
        return scaled

    assert inner().shape == (5, 8)


def test_a_trace_at_module_level_of_a_script_writes_back_saved_globals(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            import backlens.live as bl

            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
            lens = bl.wrap(model)
            x = torch.randn(2, 3)
            with lens.trace(x):
                h = lens[0].output.save()
                unsaved = 5
                with lens.output.sum().backward():
                    g = h.grad.save()
            """
        )
    )
    namespace = runpy.run_path(str(script))
    assert namespace["h"].shape == (2, 3) and namespace["g"].shape == (2, 3)
    assert "unsaved" not in namespace


def test_the_callers_grad_mode_applies_inside_the_body(lens, x):
    with torch.no_grad():
        with lens.trace(x):
            enabled = bl.save(torch.is_grad_enabled())
            needs_grad = bl.save(lens.fc1.output.requires_grad)
    assert enabled is False and needs_grad is False


def test_the_callers_inference_mode_applies_inside_the_body(lens, x):
    with torch.inference_mode():
        with lens.trace(x):
            inference = bl.save(torch.is_inference_mode_enabled())
            made = bl.save((lens.fc1.output * 2).is_inference())
    assert inference is True and made is True


def test_the_callers_autocast_applies_inside_the_body(lens, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with lens.trace(x):
            on = bl.save(torch.is_autocast_enabled("cpu"))
            product = (lens.fc1.output @ torch.ones(8, 2)).save()
    assert on is True and product.dtype == torch.bfloat16


def test_inference_mode_and_autocast_a_body_turns_on_do_not_reach_the_model_while_it_waits(lens, x):
    seen = []
    lens._lens_module.fc2.register_forward_hook(
        lambda m, i, out: seen.append((torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")))
    )
    with lens.trace(x):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = lens.fc1.output.save()  # waits here with both on
            modes = bl.save((torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")))
        out = lens.output.save()
    assert seen == [(False, False)]
    assert modes == (True, True)
    assert not out.is_inference() and out.dtype == torch.float32
    assert h.dtype == torch.float32


def test_the_tracer_cannot_be_entered_twice(lens, x):
    tracer = lens.trace(x)
    with tracer:
        lens.output  # noqa: B018  (a request, for its effect)
    with pytest.raises(TraceError) as info:
        with tracer:
            pass
    assert info.value.code == "tracer_reused"
    assert_clean(lens._lens_module)


counter = 0


def test_a_name_declared_global_in_the_enclosing_function_is_written_to_the_module(lens, x):
    global counter
    counter = 0
    with lens.trace(x):
        counter = 5  # noqa: F841  (a global: no save needed, as in place)
        h = lens.fc1.output  # noqa: F841
    assert globals()["counter"] == 5


def test_a_name_declared_nonlocal_in_the_enclosing_function_is_written_to_its_cell(lens, x):
    total = 1

    def add():
        nonlocal total
        with lens.trace(x):
            total = total + 6
            h = lens.fc1.output  # noqa: F841

    add()
    assert total == 7


class _Base:
    def describe(self) -> str:
        return "base"


class _Probe(_Base):
    def __init__(self, lens, x):
        self.__secret = 3
        self.lens, self.x = lens, x

    def describe(self) -> str:
        return "probe"

    def look(self):
        with self.lens.trace(self.x):
            secret = bl.save(self.__secret)
            parent = bl.save(super().describe())
            h = self.lens.fc1.output  # noqa: F841
        return secret, parent


def test_private_names_and_zero_argument_super_work_in_a_method(lens, x):
    assert _Probe(lens, x).look() == (3, "base")


def test_grad_mode_is_read_where_the_body_starts_so_no_grad_on_the_same_line_applies(lens, x):
    with lens.trace(x), torch.no_grad():
        enabled = bl.save(torch.is_grad_enabled())
        needs_grad = bl.save(lens.fc1.output.requires_grad)
    assert enabled is False and needs_grad is False


def test_a_mode_a_body_sets_around_a_request_does_not_leak_into_the_model(mlp, lens, x):
    with lens.trace(x):
        with torch.no_grad():
            h = lens.fc1.output  # noqa: F841  (the model runs on while this body waits here)
            inside = bl.save(torch.is_grad_enabled())
        out = lens.output.save()
    assert out.requires_grad and out.grad_fn is not None
    assert inside is False


def test_a_script_run_with_python_dash_c_reads_its_source_from_the_command_line(tmp_path):
    program = textwrap.dedent(
        """
        import torch
        from torch import nn
        import backlens as bl
        model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
        lens = bl.wrap(model)
        x = torch.randn(2, 3)
        with lens.trace(x):
            h = lens[0].output.save()
            with lens.output.sum().backward():
                g = h.grad.save()
        print(tuple(h.shape), tuple(g.shape))
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "(2, 3) (2, 3)"


def test_a_backward_block_is_recognised_from_the_source_however_it_is_written(lens, x):
    with pytest.warns(BacklensWarning):  # (for the plain call, below)
        with lens.trace(x):
            h = lens.fc1.output
            with (
                lens.output.sum()
                * 2
            ).backward(
                retain_graph=True,
            ):
                g = h.grad.save()
            twice = (lens.output.sum() * 2).backward(retain_graph=True)  # not a with: runs at once
            ran = bl.save(twice is None)
    assert g.shape == (5, 8) and ran is True


def test_a_body_that_begins_with_try_runs_in_place(mlp, lens, x):
    ref = reference(mlp, x, ["fc1"])
    seen = {}
    with lens.trace(x):
        try:
            h = lens.fc1.output.save()
        except KeyError:
            h = None
        with lens.output.sum().backward():
            try:
                g = h.grad.save()
                seen["missing"]
            except KeyError:
                seen["caught"] = True
    assert torch.equal(h, ref["fc1"][0]) and torch.equal(g, ref["fc1"][1])
    assert seen == {"caught": True}
    assert_clean(mlp)


def test_a_body_that_begins_with_while_true_runs_in_place(lens, x):
    with lens.trace(x):
        while True:
            kept = lens.fc1.output.save()
            break
    assert kept.shape == (5, 8)


def test_a_body_that_begins_with_try_finally_is_refused_before_the_model_runs(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            try:
                lens.output.save()
            finally:
                ran_finally = True  # noqa: F841
    assert info.value.code == "unsupported_statement"
    assert "begins with a `try` whose `finally:`" in str(info.value) and __file__ in str(info.value)
    assert_clean(mlp)


def test_a_backward_body_that_begins_with_a_catch_all_try_is_refused(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            h = lens.fc1.output
            with lens.output.sum().backward():
                try:
                    h.grad.save()
                except BaseException:
                    raise
    assert info.value.code == "unsupported_statement"
    assert "`except BaseException:`" in str(info.value)
    assert_clean(mlp)
