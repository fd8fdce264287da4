"""Every public entry point checks its arguments at the call: a named BacklensError (code, remedy),
also a ValueError/TypeError (or IndexError for positions), raised before anything runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import backlens as bl
from models import MLP, gpt2, loss_of


@pytest.fixture(scope="module")
def cap():
    torch.manual_seed(0)
    cap = bl.capture(MLP(), torch.randn(2, 6), save_grads=True)
    cap.output.sum().backward(retain_graph=True)
    return cap


def model():
    return MLP()


x = torch.randn(2, 6)

# (case, call, expected code); `cap` is passed to every call.
CASES = [
    ("capture_save_activations_all", lambda c: bl.capture(model(), x, save_activations="all"), "bad_argument"),
    ("capture_save_grads_all", lambda c: bl.capture(model(), x, save_grads="all"), "bad_argument"),
    ("capture_mistyped_save_grad", lambda c: bl.capture(model(), x, save_grad=True), "mistyped_option"),
    ("capture_mistyped_save_activation", lambda c: bl.capture(model(), x, save_activation=True), "mistyped_option"),
    ("capture_mistyped_flop", lambda c: bl.capture(model(), x, flop=False), "mistyped_option"),
    ("capture_flops_not_a_bool", lambda c: bl.capture(model(), x, flops="yes"), "bad_argument"),
    ("capture_timing_not_a_bool", lambda c: bl.capture(model(), x, timing=None), "bad_argument"),
    ("capture_backward_not_a_bool", lambda c: bl.capture(model(), x, backward="no"), "bad_argument"),
    ("capture_detect_nonfinite_not_a_bool", lambda c: bl.capture(model(), x, detect_nonfinite=1), "bad_argument"),
    ("capture_intervene_not_an_edit", lambda c: bl.capture(model(), x, intervene=5), "bad_intervention"),
    ("capture_storage_a_string", lambda c: bl.capture(model(), x, storage="runs/x"), "unsupported_input"),
    ("capture_not_a_module", lambda c: bl.capture(None, x), "not_a_module"),
    ("capture_a_module_class", lambda c: bl.capture(MLP, x), "module_class_not_instance"),
    ("timeline_profiler_not_a_profiler", lambda c: bl.report.timeline(c, profiler=5), "not_a_profiler"),
    ("capture_compiled_unknown", lambda c: bl.capture(model(), x, compiled="fast"), "bad_compiled_mode"),
    ("capture_mistyped_compiled", lambda c: bl.capture(model(), x, compile="opaque"), "mistyped_option"),
    ("clip_norm_negative", lambda c: bl.clip_norm(-1.0), "bad_argument"),
    ("clip_norm_a_string", lambda c: bl.clip_norm("a"), "bad_argument"),
    ("clip_norm_nan", lambda c: bl.clip_norm(float("nan")), "bad_argument"),
    ("scale_a_string", lambda c: bl.scale("a"), "bad_argument"),
    ("scale_nan", lambda c: bl.scale(float("nan")), "bad_argument"),
    ("scale_a_bool", lambda c: bl.scale(True), "bad_argument"),
    ("clamp_a_string", lambda c: bl.clamp("a"), "bad_argument"),
    ("clamp_no_bound", lambda c: bl.clamp(), "bad_argument"),
    ("clamp_min_above_max", lambda c: bl.clamp(2.0, 1.0), "bad_argument"),
    ("add_noise_negative_std", lambda c: bl.add_noise(-1.0), "bad_argument"),
    ("add_noise_seed_a_string", lambda c: bl.add_noise(1.0, seed="a"), "bad_argument"),
    ("when_site_a_number", lambda c: bl.when(5, bl.scale(2.0)), "bad_site"),
    ("when_edit_a_number", lambda c: bl.when("relu_1", 5), "bad_edit"),
    ("grad_site_a_number", lambda c: bl.grad(5), "bad_site"),
    ("to_disk_shard_bytes_a_string", lambda c: bl.to_disk("runs/x", shard_bytes="abc"), "bad_option"),
    ("to_disk_shard_bytes_a_float", lambda c: bl.to_disk("runs/x", shard_bytes=1.5), "bad_option"),
    ("to_disk_shard_bytes_zero", lambda c: bl.to_disk("runs/x", shard_bytes=0), "bad_option"),
    ("to_disk_overwrite_a_string", lambda c: bl.to_disk("runs/x", overwrite="no"), "bad_option"),
    ("to_disk_no_path", lambda c: bl.to_disk(None), "bad_path"),
    ("capture_indexed_by_an_int", lambda c: c[3], "bad_index"),
    ("capture_indexed_by_none", lambda c: c[None], "bad_index"),
    ("ops_position_out_of_range", lambda c: c.ops[100], "index_out_of_range"),
    ("ops_position_a_float", lambda c: c.ops[1.5], "bad_index"),
    ("modules_position_out_of_range", lambda c: c.modules[100], "index_out_of_range"),
    ("passes_position_out_of_range", lambda c: c.passes[5], "index_out_of_range"),
    ("grad_fn_calls_position_out_of_range", lambda c: c.grad_fn_calls[10_000], "index_out_of_range"),
    ("passes_for_pass_a_string", lambda c: c.passes.for_pass("a"), "bad_pass_number"),
    ("calls_for_pass_zero", lambda c: c.grad_fns[0].calls.for_pass(0), "bad_pass_number"),
    ("grad_for_pass_a_string", lambda c: c.ops[0].grad_for(pass_="a"), "bad_pass_number"),
    ("grad_for_pass_zero", lambda c: c.ops[0].grad_for(pass_=0), "bad_pass_number"),
    ("backward_loss_a_string", lambda c: c.backward("loss"), "bad_argument"),
    ("backward_mistyped_retain_graph", lambda c: c.backward(c.output.sum(), retain_grap=True), "mistyped_option"),
    ("backward_mistyped_save_grads", lambda c: c.backward(c.output.sum(), save_grad=True), "mistyped_option"),
    ("backward_save_grads_a_string", lambda c: c.backward(c.output.sum(), save_grads="x"), "unsupported_input"),
    ("save_path_a_number", lambda c: c.save(5), "bad_path"),
    ("save_overwrite_a_string", lambda c: c.save("unused", overwrite="x"), "bad_argument"),
    ("do_site_a_number", lambda c: c.do(5, bl.scale(2.0)), "bad_site"),
    ("do_edit_a_number", lambda c: c.do("relu_1", 5), "bad_edit"),
    ("do_loss_not_callable", lambda c: c.do("relu_1", bl.scale(2.0), loss=5), "bad_argument"),
    ("do_differentiable_a_string", lambda c: c.do("relu_1", bl.scale(2.0), differentiable="yes"), "bad_argument"),
    ("keep_grad_a_number", lambda c: bl.keep_grad(5), "bad_edit"),
    ("bind_not_a_module", lambda c: bl.when("relu_1", bl.scale(2.0)).bind(None), "not_a_module"),
    ("bind_of_several_not_a_module", lambda c: (bl.when("relu_1", bl.scale(2.0)) | bl.when("relu_2", bl.scale(2.0)))
     .bind("model"), "not_a_module"),
    ("backward_status_a_string", lambda c: bl.report.backward_status("x"), "not_a_capture"),
    ("cost_tree_a_string", lambda c: bl.report.cost_tree("x"), "not_a_capture"),
    ("cost_tree_pass_zero", lambda c: bl.report.cost_tree(c, pass_=0), "bad_pass_number"),
    ("timeline_a_string", lambda c: bl.report.timeline("x"), "not_a_capture"),
    ("timeline_pass_zero", lambda c: bl.report.timeline(c, pass_=0), "bad_pass_number"),
    ("timeline_pass_a_string", lambda c: bl.report.timeline(c, pass_="1"), "bad_pass_number"),
    ("load_none", lambda c: bl.load(None), "bad_path"),
    ("load_a_number", lambda c: bl.load(5), "bad_path"),
    ("load_verify_a_string", lambda c: bl.load("nowhere", verify="x"), "bad_argument"),
    ("in_pass_zero", lambda c: bl.in_pass(0), "unsupported_input"),
    ("func_a_number", lambda c: bl.func(5), "unsupported_input"),
    ("label_no_name", lambda c: bl.label(), "unsupported_input"),
    ("module_a_number", lambda c: bl.module(5), "unsupported_input"),
    ("grad_fn_a_number", lambda c: bl.grad_fn(5), "unsupported_input"),
    ("selector_and_a_number", lambda c: bl.func("relu") & 5, "bad_selector"),
    ("selector_or_a_string", lambda c: bl.func("relu") | "relu_1", "bad_selector"),
    ("explain_not_an_exception", lambda c: bl.explain(5), "bad_argument"),
    ("validate_not_a_module", lambda c: bl.validate(None, x, lambda o: o.sum()), "not_a_module"),
    ("validate_loss_not_callable", lambda c: bl.validate(model(), x, 5), "bad_argument"),
    ("validate_layer_grads_a_string", lambda c: bl.validate(model(), x, lambda o: o.sum(),
                                                            validate_layer_grads="y"), "bad_argument"),
    ("bench_not_a_module", lambda c: bl.bench.backward(None, x, lambda o: o.sum()), "not_a_module"),
    ("bench_repeats_a_string", lambda c: bl.bench.backward(model(), x, lambda o: o.sum(), repeats="a"),
     "bad_repeats"),
    ("timeline_save_path_a_number", lambda c: bl.report.timeline(c).save(5), "bad_path"),
    ("derive_intermediate_a_string", lambda c: bl.derive(lambda p: 0.0, {}, intermediate="x"), "derive_bad_option"),
    ("derive_framework_a_number", lambda c: bl.derive(lambda p: 0.0, {}, framework=3), "derive_unknown_framework"),
    ("bench_repeats_negative", lambda c: bl.bench.backward(model(), x, lambda o: o.sum(), repeats=-1),
     "bad_repeats"),
]

# Calls a round of adversarial review found accepted silently or failing with torch's raw TypeError; each
# message must name the argument (the last field).
NAMED = [
    ("capture_save_grads_none", lambda c: bl.capture(model(), x, save_grads=None), "bad_argument", "save_grads"),
    ("capture_save_activations_none", lambda c: bl.capture(model(), x, save_activations=None), "bad_argument",
     "save_activations"),
    ("scale_infinite", lambda c: bl.scale(float("inf")), "bad_argument", "factor"),
    ("scale_minus_infinite", lambda c: bl.scale(float("-inf")), "bad_argument", "factor"),
    ("keep_grad_of_the_scale_factory", lambda c: bl.keep_grad(bl.scale), "bad_edit", "bl.scale(...)"),
    ("keep_grad_of_the_zero_ablate_factory", lambda c: bl.keep_grad(bl.zero_ablate), "bad_edit", "bl.zero_ablate"),
    ("when_of_the_clip_norm_factory", lambda c: bl.when("relu_1", bl.clip_norm), "bad_edit", "bl.clip_norm"),
    ("when_edit_without_ctx", lambda c: bl.when("relu_1", lambda v: v * 2), "bad_edit", "ctx"),
    ("when_edit_taking_nothing", lambda c: bl.when("relu_1", lambda: None), "bad_edit", "ctx"),
    ("grad_of_an_empty_name", lambda c: bl.grad(""), "bad_site", "empty name"),
    ("when_at_an_empty_name", lambda c: bl.when(" ", bl.scale(2.0)), "bad_site", "empty name"),
    ("do_at_an_empty_name", lambda c: c.do("", bl.scale(2.0)), "bad_site", "empty name"),
    ("wrap_batcher_a_number", lambda c: bl.wrap(model(), batcher=5), "bad_argument", "batcher"),
    ("wrap_batcher_without_combine", lambda c: bl.wrap(model(), batcher=type("B", (), {"size": len})()),
     "bad_argument", "batcher"),
    ("clip_norm_zero", lambda c: bl.clip_norm(0), "bad_argument", "max_norm"),
    ("validate_non_scalar_loss", lambda c: bl.validate(model(), x, lambda out: out), "loss_required", "loss_fn"),
    ("backward_retain_graph_a_string", lambda c: c.backward(c.output.sum(), retain_graph="yes"), "bad_argument",
     "retain_graph"),
    ("backward_create_graph_a_string", lambda c: c.backward(c.output.sum(), create_graph="no"), "bad_argument",
     "create_graph"),
    ("backward_inputs_a_number", lambda c: c.backward(c.output.sum(), inputs=5), "bad_argument", "inputs"),
    ("backward_inputs_empty", lambda c: c.backward(c.output.sum(), inputs=[]), "bad_argument", "inputs"),
    ("backward_grad_tensors_a_number", lambda c: c.backward(c.output.sum(), grad_tensors=5), "bad_argument",
     "grad_tensors"),
    ("backward_non_scalar_loss", lambda c: c.backward(c.output), "loss_required", "shape (2, 3)"),
]


@pytest.mark.parametrize("call, code", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_bad_argument_is_a_named_error_at_the_call(cap, call, code):
    with pytest.raises(bl.BacklensError) as info:
        call(cap)
    error = info.value
    assert error.code == code, str(error)
    assert error.remedy and error.remedy != bl.BacklensError.remedy
    assert isinstance(error, (ValueError, TypeError, LookupError))


@pytest.mark.parametrize("call, code, named", [case[1:] for case in NAMED], ids=[case[0] for case in NAMED])
def test_a_bad_argument_is_refused_at_the_call_naming_it(cap, call, code, named):
    passes = len(cap.passes)
    with pytest.raises(bl.BacklensError) as info:
        call(cap)
    error = info.value
    assert error.code == code, str(error)
    assert named in str(error).splitlines()[0]
    assert isinstance(error, (ValueError, TypeError))
    assert len(cap.passes) == passes  # nothing ran: no pass recorded, failed or not


def test_a_bad_backward_option_records_no_pass_and_leaves_the_capture_usable():
    model_ = MLP()
    cap = bl.capture(model_, x, save_grads=True)
    with pytest.raises(bl.UnsupportedInputError, match="retain_graph"):
        cap.backward(cap.output.sum(), retain_graph="yes")
    assert len(cap.passes) == 0
    cap.backward(cap.output.sum())
    assert [p.status for p in cap.passes] == ["ok"]
    stock = MLP()
    stock.load_state_dict(model_.state_dict())
    stock(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model_.parameters(), stock.parameters()))


def test_an_edit_without_ctx_is_refused_when_made_and_the_backward_runs_untouched():
    torch.manual_seed(0)
    model_, stock = MLP(), MLP()
    stock.load_state_dict(model_.state_dict())
    with pytest.raises(bl.UnsupportedInputError, match="ctx"):
        bl.capture(model_, x, intervene=bl.when(bl.grad("relu_1"), lambda g: g * 0))
    model_(x).sum().backward()
    stock(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model_.parameters(), stock.parameters()))


def test_an_edit_taking_ctx_by_keyword_or_any_keywords_is_accepted():
    for edit in (lambda value, *, ctx: value, lambda value, ctx: value, lambda value, **kwargs: value):
        assert bl.when("relu_1", edit).edit(torch.ones(2), ctx=None).tolist() == [1.0, 1.0]


def test_a_mistyped_option_names_the_right_one_and_reaches_no_model():
    calls = []

    class Recording(torch.nn.Module):
        def forward(self, x, **kwargs):
            calls.append(kwargs)
            return x * 2

    with pytest.raises(bl.UnsupportedInputError, match="did you mean save_grads="):
        bl.capture(Recording(), x, save_grad=True)
    assert calls == []


def test_a_model_taking_any_keyword_still_gets_the_check():
    model = gpt2()
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.capture(model, torch.randint(0, 64, (1, 5)), save_grad=True)
    assert info.value.code == "mistyped_option" and "save_grads" in str(info.value)


def test_a_keyword_the_model_declares_is_passed_on_even_when_close_to_an_option():
    class Declares(torch.nn.Module):
        def forward(self, x, timings=False):
            return x * (3 if timings else 2)

    cap = bl.capture(Declares(), x, timings=True)
    assert torch.equal(cap.output, x * 3)


def test_a_keyword_far_from_every_option_goes_to_the_model():
    model = gpt2()
    ids = torch.randint(0, 64, (1, 5))
    cap = bl.capture(model, ids, attention_mask=torch.ones(1, 5, dtype=torch.long))
    assert cap.output.logits.shape == (1, 5, 64)


def test_a_bad_argument_leaves_no_to_disk_directory(tmp_path):
    with pytest.raises(bl.UnsupportedInputError):
        bl.capture(model(), x, save_grads="all", storage=bl.to_disk(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_an_out_of_range_position_is_also_an_index_error(cap):
    with pytest.raises(IndexError):
        cap.ops[100]
    assert cap.ops[-1] is cap.ops[len(cap.ops) - 1]


def test_a_pass_selector_beyond_the_passes_run_warns_that_it_matched_nothing():
    cap = bl.capture(model(), x, save_grads=bl.in_pass(5))
    with pytest.warns(bl.BacklensWarning) as record:
        loss_of(cap.output).backward()
    (warning,) = [w for w in record if w.message.code == "selector_matched_nothing"]
    assert "bl.in_pass(5)" in str(warning.message) and "no pass before pass 5" in str(warning.message)


def test_a_pass_selector_for_the_next_pass_does_not_warn():
    cap = bl.capture(model(), x, save_grads=bl.in_pass(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = loss_of(cap.output)
        loss.backward(retain_graph=True)
        loss.backward()
    assert cap.ops[0].grads[0].pass_number == 2


def test_a_pass_selector_whose_passes_are_over_does_not_warn():
    cap = bl.capture(model(), x, save_grads=bl.in_pass(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = loss_of(cap.output)
        for _ in range(3):
            loss.backward(retain_graph=True)
    assert [g.pass_number for g in cap.ops[0].grads] == [1]


def test_capturing_a_module_class_advises_instantiating_it():
    with pytest.raises(bl.UnsupportedInputError) as info:
        bl.capture(MLP, x)
    assert "the class MLP" in str(info.value) and info.value.remedy == "Instantiate it first: bl.capture(MLP(...), x)."
