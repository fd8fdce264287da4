"""Traces in different threads at the same time: each sees only its own values.

Every thread runs its traces to the end or to the join timeout; a thread still
alive then is a hang, and fails the test instead of blocking the suite.
"""

from __future__ import annotations

import threading

import torch
import transformers
from live_helpers import MLP, assert_clean, reference

import backlens.live as bl

JOIN_TIMEOUT = 120.0


def run_threads(work, count: int) -> list[BaseException]:
    """Run ``work(k)`` in ``count`` threads at once; returns what they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def target(k: int) -> None:
        try:
            start.wait()
            work(k)
        except BaseException as exc:  # reported by the test, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    hung = [thread for thread in threads if thread.is_alive()]
    assert not hung, f"{len(hung)} tracing thread(s) still running after {JOIN_TIMEOUT} s"
    return errors


def test_four_threads_each_running_two_hundred_traces_get_their_own_gradients():
    torch.manual_seed(0)
    mlp = MLP()
    lens = bl.wrap(mlp)
    inputs = [torch.randn(3, 4) for _ in range(8)]
    expected = [reference(mlp, x, ["fc1"])["fc1"] for x in inputs]
    wrong: list[tuple[int, int]] = []

    def work(k: int) -> None:
        for i in range(200):
            which = (k * 3 + i) % len(inputs)
            with lens.trace(inputs[which]):
                h = lens.fc1.output.save()
                with lens.output.sum().backward():
                    g = h.grad.save()
            out_h, out_g = expected[which]
            if not (torch.equal(h, out_h) and torch.equal(g, out_g)):
                wrong.append((k, i))

    errors = run_threads(work, 4)
    assert not errors, errors[0]
    assert wrong == []
    assert_clean(mlp)


def test_two_threads_each_running_fifty_gpt2_traces_get_their_own_gradients():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    lens = bl.wrap(model)
    prompts = [torch.randint(0, 64, (2, 6)) for _ in range(4)]

    def stock(ids):
        kept = []
        handles = [
            block.register_forward_hook(lambda mod, args, out: (out.retain_grad(), kept.append(out)) and None)
            for block in model.transformer.h
        ]
        try:
            model(ids).logits[:, -1].logsumexp(-1).sum().backward()
        finally:
            for handle in handles:
                handle.remove()
        return [out.grad for out in kept]

    expected = [stock(ids) for ids in prompts]
    wrong: list[tuple[int, int]] = []

    def work(k: int) -> None:
        for i in range(50):
            which = (k + i) % len(prompts)
            with lens.trace(prompts[which]):
                first = lens.transformer.h[0].output
                second = lens.transformer.h[1].output
                with lens.output.logits[:, -1].logsumexp(-1).sum().backward():
                    g1 = second.grad.save()
                    g0 = first.grad.save()
            if not (torch.equal(g0, expected[which][0]) and torch.equal(g1, expected[which][1])):
                wrong.append((k, i))

    errors = run_threads(work, 2)
    assert not errors, errors[0]
    assert wrong == []
    for _, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_a_trace_that_raises_in_one_thread_leaves_a_trace_in_another_untouched():
    torch.manual_seed(0)
    mlp = MLP()
    lens = bl.wrap(mlp)
    x = torch.randn(4, 4)
    expected_h, expected_g = reference(mlp, x, ["fc2"])["fc2"]
    raised: list[int] = []
    wrong: list[int] = []

    def work(k: int) -> None:
        for i in range(100):
            if k == 0:
                try:
                    with lens.trace(x):
                        h = lens.fc2.output
                        with lens.output.sum().backward():
                            g = h.grad
                            raise KeyError(f"failing trace {i}")
                except KeyError:
                    raised.append(i)
            else:
                with lens.trace(x):
                    h = lens.fc2.output.save()
                    with lens.output.sum().backward():
                        g = h.grad.save()
                if not (torch.equal(h, expected_h) and torch.equal(g, expected_g)):
                    wrong.append(i)

    errors = run_threads(work, 2)
    assert not errors, errors[0]
    assert raised == list(range(100))
    assert wrong == []
    assert_clean(mlp)
