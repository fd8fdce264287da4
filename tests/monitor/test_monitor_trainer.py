"""bl.monitor_callback inside a tiny transformers.Trainer run (random weights, no download, no saving)."""

from __future__ import annotations

import pytest
import torch

import backlens as bl

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class KeepGrads(transformers.TrainerCallback):
    """The gradients the optimizer is about to step with, kept by hand at each step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def trainer(tmp_path, callbacks, **arguments):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **arguments)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def test_the_callback_records_the_gradients_the_trainers_optimizer_steps_with(tmp_path):
    callback = bl.monitor_callback(every=2, outputs=True)
    kept = KeepGrads()
    trainer(tmp_path, [kept, callback], gradient_accumulation_steps=2).train()
    mon = callback.monitor
    assert mon is not None and mon.closed  # closed when training ended
    frame = mon.to_pandas()
    assert sorted(set(frame.step)) == [0, 2]  # the Trainer's global_step before each recorded step
    assert {"param", "module", "output"} <= set(frame.kind)
    for step in (0, 2):
        for name, grad in kept.grads[step].items():
            row = frame[(frame.step == step) & (frame.kind == "param") & (frame.name == name) & (frame.stat == "norm")]
            assert row.value.tolist() == [float(torch.linalg.vector_norm(grad))], (step, name)
    assert "update_ratio" in set(frame.stat)


def test_a_mistyped_callback_option_is_refused_when_the_callback_is_made():
    with pytest.raises(bl.UnsupportedInputError, match="spike_factor="):
        bl.monitor_callback(spike_facter=3.0)


class Wrapped:
    """What accelerate hands a callback under fp16: the torch optimizer and the scaler, wrapped."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


def test_the_callback_takes_the_wrapped_scaler_and_marks_each_skipped_step_once():
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = Wrapped(torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu"))
    callback = bl.monitor_callback(outputs=True)
    state = SimpleNamespace(global_step=0)
    callback.on_train_begin(None, state, None, model=model, optimizer=wrapped)
    for step in range(3):
        wrapped.scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        if step == 1:
            model[0].bias.grad[0] = float("inf")
        wrapped.step()
        callback.on_optimizer_step(None, state, None)
        model.zero_grad()
    callback.on_train_end(None, state, None)
    frame = callback.monitor.to_pandas()
    assert sorted(set(frame.step)) == [0, 1, 2]
    assert frame[frame.kind == "step"].step.tolist() == [1]
    assert "step" not in wrapped.scaler.__dict__
