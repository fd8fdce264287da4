"""Reading and replacing module values while the real forward runs."""

from __future__ import annotations

import linecache
import traceback
import weakref

import pytest
import torch
from live_helpers import MLP, assert_clean
from torch import nn

import backlens.live as bl
from backlens.errors import TraceError


def test_output_read_in_a_trace_is_the_real_tensor(mlp, lens, x):
    with lens.trace(x):
        h = lens.fc1.output.save()
        out = lens.output.save()
    assert torch.equal(h, mlp.fc1(x))
    assert torch.equal(out, mlp(x))
    assert h.grad_fn is not None
    assert_clean(mlp)


def test_a_forward_edit_changes_the_models_output(mlp, lens, x):
    with lens.trace(x):
        lens.fc2.output = lens.fc2.output * 0
        out = lens.output.save()
    expected = mlp.fc3(torch.tanh(mlp.fc2(mlp.act(mlp.fc1(x))) * 0))
    assert torch.equal(out, expected)
    assert not torch.equal(out, mlp(x))
    assert_clean(mlp)


def test_setting_an_output_without_reading_it_waits_for_the_module(mlp, lens, x):
    with lens.trace(x):
        lens.act.output = torch.ones(5, 8)
        out = lens.output.save()
    assert torch.equal(out, mlp.fc3(torch.tanh(mlp.fc2(torch.ones(5, 8)))))


def test_input_is_the_first_positional_input_and_can_be_replaced(mlp, lens, x):
    with lens.trace(x):
        seen = lens.fc2.input.save()
        args, kwargs = lens.fc2.inputs
        same = bl.save(args[0] is seen and kwargs == {})
        lens.fc3.input = torch.zeros(5, 8)
        out = lens.output.save()
    assert torch.equal(seen, mlp.act(mlp.fc1(x)))
    assert same
    assert torch.equal(out, mlp.fc3(torch.zeros(5, 8)))
    assert_clean(mlp)


def test_the_wrapped_models_output_is_lens_output(mlp, lens, x):
    with lens.trace(x):
        out = lens.output.save()
    assert torch.equal(out, mlp(x))


def test_a_module_requested_after_it_ran_raises_naming_it(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            lens.fc2.output  # noqa: B018  (a request, for its effect)
            lens.fc1.output  # noqa: B018  (a request, for its effect)
    assert info.value.code == "module_already_ran"
    assert "fc1.output (invoke 0)" in str(info.value)
    assert_clean(mlp)


def test_a_module_that_never_runs_raises_naming_it(lens, x):
    model = lens._lens_module
    model.unused = nn.Linear(2, 2)
    lens = bl.wrap(model)
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            lens.unused.output  # noqa: B018  (a request, for its effect)
    assert info.value.code == "module_not_run"
    assert "unused.output" in str(info.value) and "did not run" in str(info.value)
    assert_clean(model)


def test_an_exception_in_the_body_stops_the_model_and_removes_every_hook(mlp, lens, x):
    ran = []
    mlp.fc3.register_forward_pre_hook(lambda mod, args: ran.append("fc3"))
    with pytest.raises(ZeroDivisionError):
        with lens.trace(x):
            lens.fc1.output  # noqa: B018  (a request, for its effect)
            1 / 0  # noqa: B018  (a request, for its effect)
    assert ran == []  # fc3 never ran: the model stopped at fc1
    mlp.fc3._forward_pre_hooks.clear()
    assert_clean(mlp)


def test_an_exception_in_the_model_stops_the_bodies_and_removes_every_hook(mlp, lens):
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with lens.trace(torch.randn(2, 7)):
            lens.fc2.output  # noqa: B018  (a request, for its effect)
    assert_clean(mlp)


def test_the_traceback_points_at_the_users_line(mlp, lens, x):
    def run():
        with lens.trace(x):
            h = lens.fc1.output
            h.no_such_method()

    with pytest.raises(AttributeError) as info:
        run()
    frames = traceback.extract_tb(info.value.__traceback__)
    failing_line = run.__code__.co_firstlineno + 3
    assert frames[-1].filename == __file__
    assert frames[-1].lineno == failing_line
    assert "h.no_such_method()" in frames[-1].line
    assert_clean(mlp)


def test_a_trace_typed_into_a_repl_without_source_says_why_and_what_to_do(mlp, lens, x):
    source = "with lens.trace(x):\n    h = lens.fc1.output\n"
    namespace = {"lens": lens, "x": x}
    with pytest.raises(TraceError) as info:
        exec(compile(source, "<stdin>", "exec"), namespace)
    assert info.value.code == "no_source"
    assert "<stdin>" in str(info.value) and "linecache" in info.value.remedy
    assert_clean(mlp)


def test_reading_an_output_outside_any_trace_is_refused(mlp, lens):
    with pytest.raises(TraceError) as info:
        lens.fc1.output  # noqa: B018  (a request, for its effect)
    assert info.value.code == "not_in_trace"
    assert "fc1.output" in str(info.value)
    assert_clean(mlp)


def test_lens_attributes_mirror_the_module_tree():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    lens = bl.wrap(seq)
    assert repr(lens[2]) == "Lens(2: Linear)"
    assert repr(lens[-1]) == "Lens(2: Linear)"
    assert [repr(child) for child in lens] == ["Lens(0: Linear)", "Lens(1: ReLU)", "Lens(2: Linear)"]
    assert lens[0].in_features == 2
    with pytest.raises(AttributeError):
        lens.outptu = 1


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
def test_an_index_into_a_module_list_or_sequential_reaches_the_module_torchs_indexing_does(container):
    modules = [nn.Linear(2, 2), nn.ReLU(), nn.Tanh(), nn.Linear(2, 2)]
    layers = nn.ModuleList(modules) if container is nn.ModuleList else nn.Sequential(*modules)
    del layers[1]  # the list renumbers its children, the sequential keeps their names
    lens = bl.wrap(nn.ModuleDict({"layers": layers}))
    for index in range(-len(layers), len(layers)):
        assert lens.layers[index]._lens_module is layers[index]
    for index in (len(layers), -len(layers) - 1):
        with pytest.raises(IndexError, match=f"index {index} is out of range"):
            lens.layers[index]  # noqa: B018  (an index, for its error)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
@pytest.mark.parametrize("change", ["delete", "insert", "replace", "append"])
def test_an_index_reached_before_the_container_changed_reaches_what_torchs_indexing_does_after(container, change):
    modules = [nn.Linear(2, 2), nn.ReLU(), nn.Tanh(), nn.Linear(2, 2)]
    layers = nn.ModuleList(modules) if container is nn.ModuleList else nn.Sequential(*modules)
    lens = bl.wrap(nn.ModuleDict({"layers": layers}))
    for index in range(-len(layers), len(layers)):
        assert lens.layers[index]._lens_module is layers[index]  # each index reached (and filed) once
    if change == "delete":
        del layers[1]
    elif change == "insert":
        layers.insert(1, nn.Sigmoid())
    elif change == "replace":
        layers[2] = nn.Sigmoid()
    else:
        layers.append(nn.Sigmoid())
    for index in range(-len(layers), len(layers)):
        assert lens.layers[index]._lens_module is layers[index]


def test_a_child_reached_before_it_was_deleted_is_no_longer_reached():
    model = nn.Sequential(nn.Linear(2, 2))
    model.extra = nn.ReLU()
    lens = bl.wrap(model)
    assert lens.extra._lens_module is model.extra
    del model.extra
    with pytest.raises(AttributeError, match="has no attribute 'extra'"):
        lens.extra  # noqa: B018  (an attribute, for its error)


def test_a_submodule_named_like_a_lens_attribute_is_reached_by_name():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.output = nn.Linear(3, 3)

        def forward(self, x):
            return self.output(x) * 2

    model = nn.Sequential(Block())
    lens = bl.wrap(model)
    x = torch.randn(2, 3)
    with lens.trace(x):
        inner = lens[0]["output"].output.save()
        outer = lens[0].output.save()
    assert torch.equal(outer, inner * 2)


def test_tuple_outputs_are_served_whole_and_per_invoke(x):
    class Pair(nn.Module):
        def forward(self, x):
            return x + 1, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            return self.pair(x)[0] * 2

    lens = bl.wrap(Model())
    got = {}
    with lens.trace() as tracer:
        with tracer.invoke(x[:2]):
            got[0] = lens.pair.output
        with tracer.invoke(x[2:]):
            got[1] = lens.pair.output
            lens.pair.output = (got[1][0] * 0, None)
            got["out"] = lens.output
    assert torch.equal(got[0][0], x[:2] + 1) and got[0][1] is None
    assert torch.equal(got[1][0], x[2:] + 1)
    assert torch.equal(got["out"], torch.zeros(3, 4))


def test_a_finished_trace_keeps_nothing_of_the_models_output_alive(mlp, lens, x):
    outputs = []
    handle = mlp.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    try:
        for _ in range(2):  # the second run reuses the parked coroutines of the first
            with lens.trace(x):
                hidden = lens.fc2.output
                with lens.output.sum().backward():
                    hidden.grad.save()
    finally:
        handle.remove()
    assert len(outputs) == 2
    assert [ref() for ref in outputs] == [None, None]  # freed when the trace ended, no collection needed


def test_a_trace_of_one_input_is_served_the_modules_own_output_object(x):
    returned = {}

    class Dict(nn.Module):
        def forward(self, x):
            returned["out"] = {"h": x + 1, "n": 3}
            return returned["out"]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Dict()

        def forward(self, x):
            return self.inner(x)["h"] * 2

    lens = bl.wrap(Model())
    with lens.trace(x):
        served = lens.inner.output
        same = bl.save(served is returned["out"])
        h = served["h"].save()
    assert same
    assert torch.equal(h, x + 1)


def test_a_replacement_of_the_wrong_shape_names_the_site(mlp, lens, x):
    with pytest.raises(TraceError) as info:
        with lens.trace() as tracer:
            with tracer.invoke(x[:2]):
                lens.fc1.output = torch.zeros(3, 8)
            with tracer.invoke(x[2:]):
                pass
    assert info.value.code == "replacement_mismatch"
    assert "fc1.output (invoke 0)" in str(info.value)
    assert_clean(mlp)


def test_a_body_calling_a_module_itself_is_not_served_its_own_call(mlp, lens, x):
    with lens.trace(x):
        h = lens.fc2.output
        logits = lens.fc3(torch.tanh(h))  # a logit lens: runs fc3 in the body
        real = lens.fc3.output
        same = bl.save(torch.equal(logits, real))
    assert same


def test_a_trace_in_registered_notebook_source_runs(mlp, x):
    source = (
        "with lens.trace(x):\n"
        "    h = lens.fc1.output.save()\n"
        "    skipped = 1\n"
    )
    filename = "<notebook-cell-1>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"lens": bl.wrap(mlp), "x": x}
    try:
        exec(compile(source, filename, "exec"), namespace)
    finally:
        linecache.cache.pop(filename, None)
    assert torch.equal(namespace["h"], mlp.fc1(x))
    assert "skipped" not in namespace


def test_an_unused_lens_leaves_the_model_untouched():
    model = MLP()
    bl.wrap(model)
    assert_clean(model)


def test_reads_planned_ahead_see_the_same_values_as_reads_made_one_at_a_time(mlp, lens, x):
    with lens.trace(x):
        a = lens.fc1.output.save()  # leading reads: served without waking the body
        b = lens.fc2.output.save()
        out = lens.output.save()
    with lens.trace(x):
        step = 0  # a statement first: the body wakes for every read
        a2 = lens.fc1.output.save()
        step += 1
        b2 = lens.fc2.output.save()
        step += 1
        out2 = lens.output.save()
    assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(out, out2)
    assert torch.equal(out, mlp(x))


@pytest.mark.parametrize("first", ["planned", "one at a time"])
def test_reads_out_of_forward_order_are_refused_naming_the_module(mlp, lens, x, first):
    with pytest.raises(TraceError) as info:
        if first == "planned":
            with lens.trace(x):
                b = lens.fc2.output  # noqa: F841
                a = lens.fc1.output  # noqa: F841
        else:
            with lens.trace(x):
                step = 0  # noqa: F841
                b = lens.fc2.output  # noqa: F841
                a = lens.fc1.output  # noqa: F841
    assert info.value.code == "module_already_ran"
    assert "fc1.output (invoke 0)" in str(info.value)
    assert_clean(mlp)


@pytest.mark.parametrize("first", ["model output first", "statement first"])
def test_a_value_requested_after_the_models_output_is_refused(mlp, lens, x, first):
    with pytest.raises(TraceError) as info:
        if first == "model output first":
            with lens.trace(x):
                out = lens.output
                late = lens.fc3.output  # noqa: F841
        else:
            with lens.trace(x):
                step = 0  # noqa: F841
                out = lens.output  # noqa: F841
                late = lens.fc3.output  # noqa: F841
    assert info.value.code == "module_already_ran"
    assert "fc3.output (invoke 0)" in str(info.value)
    assert_clean(mlp)


def test_after_the_models_output_the_body_may_call_the_model_again(mlp, lens, x):
    with lens.trace(x):
        out = lens.output.save()
        again = mlp(x * 2).save()  # not part of the traced forward: nothing is served from it
        ones = lens.fc1(torch.ones(1, 4)).save()
    assert torch.equal(out, mlp(x))
    assert torch.equal(again, mlp(x * 2))
    assert torch.equal(ones, mlp.fc1(torch.ones(1, 4)))
    assert_clean(mlp)


def test_code_after_the_models_output_runs_under_the_callers_autocast(lens, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with lens.trace(x):
            out = lens.output
            on = bl.save(torch.is_autocast_enabled("cpu"))
            product = (out @ torch.ones(3, 2)).save()
    assert on is True and product.dtype == torch.bfloat16


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="needs POSIX interval timers")
def test_an_interrupt_while_a_body_runs_leaves_later_traces_working(mlp, lens, x):
    import signal
    import time

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            with lens.trace(x):
                step = 0  # noqa: F841  (a statement first: the body runs on its own thread)
                h = lens.fc1.output  # noqa: F841
                time.sleep(0.3)  # the interrupt lands while the model waits for this body
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert_clean(mlp)
    for _ in range(3):
        with lens.trace(x):
            step = 0  # noqa: F841
            h = lens.fc1.output.save()
            out = lens.output.save()
        assert torch.equal(out, mlp(x)) and torch.equal(h, mlp.fc1(x))


def test_inputs_can_be_replaced_as_args_and_kwargs(mlp, lens, x):
    with lens.trace(x):
        lens.fc3.inputs = ((torch.zeros(5, 8),), {})
        out = lens.output.save()
    assert torch.equal(out, mlp.fc3(torch.zeros(5, 8)))
    assert_clean(mlp)


def test_inputs_set_to_something_else_than_args_and_kwargs_is_refused(mlp, lens, x):
    from backlens.errors import UnsupportedInputError

    with pytest.raises(UnsupportedInputError) as info:
        with lens.trace(x):
            lens.fc3.inputs = torch.zeros(5, 8)
    assert info.value.code == "bad_inputs_value"
    assert "fc3.inputs" in str(info.value)
    assert_clean(mlp)


def test_a_submodule_replaced_after_wrap_is_traced_through_its_own_lens(mlp, lens, x):
    first = lens.fc2
    mlp.fc2 = torch.nn.Linear(8, 8)
    assert lens.fc2 is not first and lens.fc2._lens_module is mlp.fc2
    with lens.trace(x):
        out = lens.fc2.output.save()
    assert torch.equal(out, mlp.fc2(mlp.act(mlp.fc1(x))))
