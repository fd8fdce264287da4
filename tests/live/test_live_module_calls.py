"""Which module calls a trace watches: its model's classes, and any other class a body asks for."""

from __future__ import annotations

import pytest
import torch
from live_helpers import MLP, assert_clean
from torch import nn

import backlens.live as bl
from backlens.errors import TraceError

STOCK_CALL_IMPL = nn.Module.__dict__["_call_impl"]


class Side(nn.Module):
    """A module class no model here registers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class WithHelper(nn.Module):
    """Calls a module it keeps out of its registered children (``__dict__``, not ``_modules``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.__dict__["helper"] = Side()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.helper(x))


def test_a_trace_wraps_its_models_classes_and_leaves_nn_module_as_it_was(mlp, lens, x):
    seen = {}
    with lens.trace(x):
        seen["nn.Module"] = nn.Module.__dict__["_call_impl"]
        seen["Linear"] = "_call_impl" in vars(nn.Linear)
        seen["MLP"] = "_call_impl" in vars(MLP)
        out = lens.output.save()
    assert seen == {"nn.Module": STOCK_CALL_IMPL, "Linear": True, "MLP": True}
    assert torch.equal(out, mlp(x))
    assert_clean(mlp)


def test_a_module_kept_out_of_the_registered_children_is_served_from_its_request():
    model = WithHelper()
    lens = bl.wrap(model)
    x = torch.randn(3, 4)
    with lens.trace(x):
        helped = lens.helper.output.save()
        out = lens.output.save()
    assert torch.equal(helped, x * 2)
    assert torch.equal(out, model(x))
    assert_clean(model)


def test_a_module_watched_only_from_its_request_says_it_cannot_tell_whether_it_ran_before():
    model = WithHelper()
    lens = bl.wrap(model)
    with pytest.raises(TraceError) as info:
        with lens.trace(torch.randn(3, 4)):
            lens.fc.output  # noqa: B018  (the helper runs before fc)
            lens.helper.output  # noqa: B018
    assert info.value.code == "module_not_run"
    assert "helper.output" in str(info.value) and "was never served" in str(info.value)
    assert "whether it ran before cannot be told" in str(info.value)
    assert "Side" in str(info.value)
    assert_clean(model)


def test_a_module_of_a_new_class_added_between_traces_is_served(mlp, lens, x):
    with lens.trace(x):
        lens.output.save()
    mlp.act = Side()
    with lens.trace(x):
        doubled = lens.act.output.save()
        out = lens.output.save()
    assert torch.equal(doubled, mlp.fc1(x) * 2)
    assert torch.equal(out, mlp(x))
    assert_clean(mlp)


def test_the_trace_after_a_new_class_was_asked_for_knows_it_already_ran(mlp, lens, x):
    mlp.act = Side()
    with lens.trace(x):
        lens.act.output.save()
    with pytest.raises(TraceError) as info:
        with lens.trace(x):
            lens.fc2.output  # noqa: B018
            lens.act.output  # noqa: B018  (it ran before fc2)
    assert info.value.code == "module_already_ran"
    assert_clean(mlp)


def test_two_lenses_tracing_one_after_the_other_leave_no_wrapper(mlp, x):
    first, second = bl.wrap(mlp), bl.wrap(mlp)
    with first.trace(x):
        a = first.fc2.output.save()
    with second.trace(x):
        b = second.fc2.output.save()
    assert torch.equal(a, b)
    assert_clean(mlp)


class Wrapped(nn.Module):
    """A new class put around a layer between traces (as an edit or a probe would be)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


def test_a_new_class_put_around_a_layer_serves_its_output_after_its_childs(mlp, lens, x):
    with lens.trace(x):
        lens.output.save()
    mlp.fc2 = Wrapped(mlp.fc2)
    with lens.trace(x):
        inner = lens.fc2.inner.output.save()
        outer = lens.fc2.output.save()  # served when the running wrapper returns
    assert torch.equal(inner, mlp.fc2.inner(mlp.act(mlp.fc1(x))))
    assert torch.equal(outer, inner + 1)
    assert_clean(mlp)


def test_a_module_whose_class_changed_after_its_lens_was_made_is_served(mlp, lens, x):
    with lens.trace(x):
        lens.act.output.save()
    mlp.act.__class__ = Side
    with lens.trace(x):
        doubled = lens.act.output.save()
    assert torch.equal(doubled, mlp.fc1(x) * 2)
    assert_clean(mlp)
