"""The one module-call mechanism (backlens._module_calls) that capture, live tracing and the monitor share."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_modules

import backlens as bl
from backlens import _module_calls, _torch

STOCK_CALL_IMPL = nn.Module.__dict__["_call_impl"]
STOCK_CALL = nn.Module.__dict__["__call__"]


class Recorder:
    """Writes down what it is told, in order."""

    def __init__(self, name="r", log=None):
        self.name = name
        self.log = [] if log is None else log

    def module_called(self, module, args, kwargs):
        self.log.append((self.name, "called", module, args, kwargs))
        return ("token", module)

    def module_returned(self, module, token, output):
        assert token == ("token", module)
        self.log.append((self.name, "returned", module, output))
        return output

    def module_raised(self, module, token):
        self.log.append((self.name, "raised", module))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU())


def test_a_subscriber_sees_each_module_call_of_its_thread_with_inputs_and_output(model):
    x = torch.randn(2, 3)
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        out = model(x)
    finally:
        subscription.cancel()
    called = [(entry[2], entry[3]) for entry in recorder.log if entry[1] == "called"]
    returned = [(entry[2], entry[3]) for entry in recorder.log if entry[1] == "returned"]
    assert [m for m, _ in called] == [model, model[0], model[1]]
    assert called[0][1][0] is x
    assert [m for m, _ in returned] == [model[0], model[1], model]
    assert returned[-1][1] is out
    assert torch.equal(out, torch.relu(model[0](x)))


def test_keyword_inputs_reach_the_subscriber(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        model[0](input=torch.ones(1, 3))
    finally:
        subscription.cancel()
    assert list(recorder.log[0][4]) == ["input"]


def test_module_calls_in_another_thread_are_not_seen(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        worker = threading.Thread(target=model, args=(torch.randn(2, 3),))
        worker.start()
        worker.join()
    finally:
        subscription.cancel()
    assert recorder.log == []


class Replacer(Recorder):
    def module_called(self, module, args, kwargs):
        if isinstance(module, nn.ReLU):
            return _module_calls.NewInputs((args[0] * -1,), kwargs, "flipped")
        return "kept"

    def module_returned(self, module, token, output):
        return output * 10 if isinstance(module, nn.Linear) else output


def test_a_subscriber_may_replace_a_calls_inputs_and_output(model):
    x = torch.randn(2, 3)
    replacer = Replacer()  # held: the mechanism holds subscribers weakly
    subscription = _module_calls.subscribe(replacer)
    try:
        out = model(x)
    finally:
        subscription.cancel()
    assert torch.equal(out, torch.relu(-(model[0](x) * 10)))


def test_a_call_that_raises_is_reported_and_its_error_goes_on():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("broken forward")

    broken = Broken()
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        with pytest.raises(ValueError, match="broken forward"):
            broken(torch.ones(1))
    finally:
        subscription.cancel()
    assert [entry[1] for entry in recorder.log] == ["called", "raised"]


def test_subscribers_of_one_thread_nest_in_the_order_they_subscribed(model):
    log = []
    first = _module_calls.subscribe(outer := Recorder("outer", log))
    second = _module_calls.subscribe(inner := Recorder("inner", log))
    try:
        model[1](torch.ones(2))
    finally:
        second.cancel()
        first.cancel()
    assert [(entry[0], entry[1]) for entry in log] == [
        ("outer", "called"), ("inner", "called"), ("inner", "returned"), ("outer", "returned"),
    ]
    assert outer is not inner


def test_torchs_own_entry_is_back_when_the_last_subscriber_leaves(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    assert nn.Module.__dict__["_call_impl"] is not STOCK_CALL_IMPL
    subscription.cancel()
    subscription.cancel()  # idempotent
    assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL
    assert nn.Module.__dict__["__call__"] is STOCK_CALL


def test_a_subscriber_freed_without_cancelling_takes_the_wrapper_with_it(model):
    _module_calls.subscribe(Recorder())
    gc.collect()
    assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL
    assert not _module_calls.watching()


def test_watching_module_calls_adds_no_forward_hook(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        assert not torch_modules._global_forward_hooks and not torch_modules._global_forward_pre_hooks
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    finally:
        subscription.cancel()


def test_a_trace_adds_no_forward_hook_to_any_module(model):
    lens = bl.wrap(model)
    seen = {}
    with lens.trace(torch.randn(2, 3)):
        lens[0].input  # noqa: B018  (asks for a module's inputs too)
        lens.output  # noqa: B018  (served once the model returned, inside the run)
        seen["global"] = len(torch_modules._global_forward_hooks) + len(torch_modules._global_forward_pre_hooks)
        seen["local"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert seen == {"global": 0, "local": 0}


# -- subscriptions with classes ---------------------------------------------------


def _called(recorder):
    return [entry[2] for entry in recorder.log if entry[1] == "called"]


def _own_entry(cls):
    return vars(cls).get("_call_impl")


def test_a_subscription_with_classes_sees_their_calls_and_leaves_nn_module_as_it_was(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder, {nn.Sequential, nn.Linear})
    try:
        assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL
        assert _own_entry(nn.Linear) is not None and _own_entry(nn.ReLU) is None
        out = model(torch.randn(2, 3))
    finally:
        subscription.cancel()
    assert _called(recorder) == [model, model[0]]
    assert [entry[3] for entry in recorder.log if entry[1] == "returned"][-1] is out
    assert _own_entry(nn.Linear) is None and _own_entry(nn.Sequential) is None
    assert not _module_calls.watching()


def test_module_classes_lists_the_model_and_every_module_under_it():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), None), nn.Identity())
    assert _module_calls.module_classes(model) == {nn.Sequential, nn.Linear, nn.ReLU, nn.Identity}


def test_widening_a_subscription_watches_another_class_from_then_on(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder, {nn.Linear})
    try:
        model(torch.randn(2, 3))
        subscription.widen({nn.ReLU})
        model(torch.randn(2, 3))
    finally:
        subscription.cancel()
    assert _called(recorder) == [model[0], model[0], model[1]]
    assert _own_entry(nn.ReLU) is None and _own_entry(nn.Linear) is None


def test_widening_a_cancelled_subscription_installs_nothing():
    subscription = _module_calls.subscribe(Recorder(), {nn.Linear})
    subscription.cancel()
    subscription.widen({nn.ReLU})
    assert _own_entry(nn.ReLU) is None and not _module_calls.watching()


def test_a_class_with_an_entry_of_its_own_is_left_alone():
    own_calls = []

    class Own(nn.Module):
        def _call_impl(self, *args, **kwargs):
            own_calls.append(self)
            return nn.Module._call_impl(self, *args, **kwargs)

        def forward(self, x):
            return x + 1

    module, recorder = Own(), Recorder()
    entry = _own_entry(Own)
    subscription = _module_calls.subscribe(recorder, {Own})
    try:
        assert _own_entry(Own) is entry
        module(torch.zeros(1))
    finally:
        subscription.cancel()
    assert own_calls == [module] and recorder.log == []
    assert _own_entry(Own) is entry


def test_a_subclass_of_a_watched_class_is_watched_through_its_own_entry():
    class Wider(nn.Linear):
        pass

    module, recorder = Wider(3, 4), Recorder()
    subscription = _module_calls.subscribe(recorder, {nn.Linear, Wider})
    try:
        module(torch.randn(2, 3))
    finally:
        subscription.cancel()
    assert _called(recorder) == [module]
    assert _own_entry(Wider) is None and _own_entry(nn.Linear) is None


def test_a_class_two_subscriptions_hold_keeps_the_wrapper_until_the_last_one_leaves(model):
    first, second = Recorder("first"), Recorder("second")
    one = _module_calls.subscribe(first, {nn.Linear})
    two = _module_calls.subscribe(second, {nn.Linear, nn.ReLU})
    try:
        one.cancel()
        one.cancel()  # idempotent: it takes only its own hold off
        assert _own_entry(nn.Linear) is not None
        model(torch.randn(2, 3))
    finally:
        two.cancel()
    assert first.log == [] and _called(second) == [model[0], model[1]]
    assert _own_entry(nn.Linear) is None and _own_entry(nn.ReLU) is None


def test_a_subscriber_with_classes_freed_without_cancelling_takes_its_wrappers_with_it(model):
    _module_calls.subscribe(Recorder(), {nn.Linear})
    gc.collect()
    assert _own_entry(nn.Linear) is None and not _module_calls.watching()


def test_subscriptions_with_and_without_classes_nest_in_the_order_they_subscribed(model):
    log = []
    everything = _module_calls.subscribe(outer := Recorder("everything", log))
    linear_only = _module_calls.subscribe(inner := Recorder("linear", log), {nn.Linear})
    try:
        model[0](torch.randn(2, 3))
        everything.cancel()
        assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL
        model(torch.randn(2, 3))
    finally:
        linear_only.cancel()
        everything.cancel()
    assert [(entry[0], entry[1], entry[2]) for entry in log] == [
        ("everything", "called", model[0]), ("linear", "called", model[0]),
        ("linear", "returned", model[0]), ("everything", "returned", model[0]),
        ("linear", "called", model[0]), ("linear", "returned", model[0]),
    ]
    assert outer is not inner


def test_a_class_under_nn_modules_wrapper_is_wrapped_the_same_way(model):
    seeing_all, recorder = Recorder("everything"), Recorder("linear")
    everything = _module_calls.subscribe(seeing_all)
    linear_only = _module_calls.subscribe(recorder, {nn.Linear})
    try:
        assert _own_entry(nn.Linear) is nn.Module.__dict__["_call_impl"]  # one wrapper for both
    finally:
        everything.cancel()
        linear_only.cancel()
    assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL and _own_entry(nn.Linear) is None


def test_a_wrapper_someone_set_over_ours_on_a_class_is_left_in_place(model):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder, {nn.Linear})
    ours = _own_entry(nn.Linear)

    def theirs(module, *args, **kwargs):
        return ours(module, *args, **kwargs)

    nn.Linear._call_impl = theirs
    try:
        subscription.cancel()
        assert _own_entry(nn.Linear) is theirs
        assert torch.equal(model(torch.ones(1, 3)), torch.relu(model[0](torch.ones(1, 3))))
    finally:
        del nn.Linear._call_impl


def test_without_the_private_entry_a_subscription_with_classes_wraps_their_call(model, monkeypatch):
    monkeypatch.setattr(_torch, "HAS_MODULE_CALL_IMPL", False)
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder, {nn.Linear})
    try:
        assert "__call__" in vars(nn.Linear) and nn.Module.__dict__["__call__"] is STOCK_CALL
        model(torch.randn(2, 3))
    finally:
        subscription.cancel()
    assert "__call__" not in vars(nn.Linear)
    assert _called(recorder) == [model[0]]


def test_the_capability_is_listed_by_doctor():
    assert "HAS_MODULE_CALL_IMPL" in bl.doctor()


# -- without the private entry (the capability turned off) -----------------------------


@pytest.fixture
def without_call_impl(monkeypatch):
    monkeypatch.setattr(_torch, "HAS_MODULE_CALL_IMPL", False)


def test_without_the_private_entry_module_call_is_wrapped_instead(model, without_call_impl):
    recorder = Recorder()
    subscription = _module_calls.subscribe(recorder)
    try:
        assert nn.Module.__dict__["__call__"] is not STOCK_CALL
        assert nn.Module.__dict__["_call_impl"] is STOCK_CALL_IMPL
        model(torch.randn(2, 3))
    finally:
        subscription.cancel()
    assert nn.Module.__dict__["__call__"] is STOCK_CALL
    assert [entry[2] for entry in recorder.log if entry[1] == "called"] == [model, model[0], model[1]]


def _capture_summary(model, x):
    cap = bl.capture(model, x, save_grads=True)
    cap.output.sum().backward()
    summary = (
        [(m.label, m.output_grad) for m in cap.modules],
        {name: p.grad.clone() for name, p in model.named_parameters()},
    )
    cap.close()
    model.zero_grad(set_to_none=True)
    return summary


def test_a_capture_records_the_same_without_the_private_entry(model, monkeypatch):
    x = torch.randn(2, 3)
    with_entry = _capture_summary(model, x)
    monkeypatch.setattr(_torch, "HAS_MODULE_CALL_IMPL", False)
    without = _capture_summary(model, x)
    assert [label for label, _ in with_entry[0]] == [label for label, _ in without[0]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(with_entry[0], without[0]))
    assert all(torch.equal(with_entry[1][name], without[1][name]) for name in with_entry[1])


def test_a_trace_serves_and_edits_the_same_without_the_private_entry(model, without_call_impl):
    x = torch.randn(2, 3)
    lens = bl.wrap(model)
    with lens.trace(x):
        hidden = lens[0].output.save()
        lens[0].output = hidden * 2
        out = lens.output.save()
        with out.sum().backward():
            grad = hidden.grad.save()
    assert nn.Module.__dict__["__call__"] is STOCK_CALL
    stock_hidden = model[0](x)
    stock_hidden.retain_grad()
    stock_out = model[1](stock_hidden * 2)
    stock_out.sum().backward()
    assert torch.equal(hidden, stock_hidden) and torch.equal(out, stock_out)
    assert torch.equal(grad, stock_hidden.grad)
