"""Capture overhead against plain PyTorch, in the same process.

Model: a 4-layer GPT-2 config (n_embd 256, 4 heads, vocab 1000), batch 4 x seq 64,
one thread. Variants run in interleaved rounds (shuffled each round); the median
ratio to plain is printed.

    python bench/overhead.py [--rounds 30]

Targets: captured forward <= 1.05x plain forward; fwd+bwd with timing, no FLOPs,
no saved grads <= 1.10x; default capture (FLOPs and timing on) <= 1.25x;
capture_memory (default capture with memory=True) <= 1.10x of default capture;
save_grads=True <= 1.25x of plain PyTorch keeping the same gradients by hand
(a hook on every node keeping what it receives and sends on), with peak memory
above plain no more than the saved gradients' bytes + 10% (peak RSS, one fresh
process per variant).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

import backlens as bl


def make_model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, ids


def saved_grad_bytes(cap) -> int:
    storages = {}
    for call in cap.grad_fn_calls:
        for side in (call.grad_inputs, call.grad_outputs):
            for tensor in side or ():
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def variants(model, ids):
    def plain_forward():
        return model(ids).logits

    def captured_forward():
        bl.capture(model, ids, backward=False, flops=False, timing=False).close()

    def plain_step():
        model(ids).logits.sum().backward()
        model.zero_grad(set_to_none=True)

    def plain_step_keeping_grads():
        """What save_grads=True keeps, kept by hand: both sides of every node call
        (a copy of what reaches AccumulateGrad, which may adopt it as .grad)."""
        loss = model(ids).logits.sum()
        kept, seen, stack = [], set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            copy = type(node).__name__ == "AccumulateGrad"
            node.register_hook(lambda gi, go, copy=copy: kept.append(
                (gi, tuple(g.clone() for g in go) if copy else go)))
            stack.extend(next_node for next_node, _ in node.next_functions)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def captured_step(**options):
        def step():
            cap = bl.capture(model, ids, **options)
            cap.output.logits.sum().backward()
            cap.close()
            model.zero_grad(set_to_none=True)
        return step

    return {
        "forward": (plain_forward, {"captured forward": captured_forward}),
        "fwd+bwd": (
            plain_step,
            {
                "capture timing, no flops, no grads": captured_step(flops=False, timing=True),
                "plain keeping the same grads by hand": plain_step_keeping_grads,
                "capture save_grads=True": captured_step(flops=False, save_grads=True),
                "default capture (FLOPs and timing on)": captured_step(),
                "capture_memory (default + memory=True)": captured_step(memory=True),
            },
        ),
    }


def time_rounds(plain, others, rounds: int) -> dict[str, tuple[float, int]]:
    """Median time ratio to plain per variant, and the median page faults of its steps."""
    samples = {"plain": [], **{name: [] for name in others}}
    faults = {name: [] for name in samples}
    for _ in range(3):
        plain()
        for fn in others.values():
            fn()
    order = [("plain", plain), *others.items()]
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)  # no variant always runs right after another
        for name, fn in order:
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    base = statistics.median(samples["plain"])
    return {name: (statistics.median(s) / base, int(statistics.median(faults[name])))
            for name, s in samples.items()} | {"plain_ms": (base * 1e3, 0)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(variant: str) -> None:
    """Runs in a fresh process: one fwd+bwd, prints peak RSS growth over the RSS before it.

    Linux's peak-RSS mark (VmHWM) is reset right before the step (clear_refs 5),
    so imports and model construction do not hide the step's own peak.
    RSS is a coarse measure (the allocator keeps freed pages), so the plain and
    captured steps are each the first step of a fresh process.
    """
    torch.set_num_threads(1)
    model, ids = make_model()

    def step():
        if variant == "plain":
            model(ids).logits.sum().backward()
            return 0, None
        cap = bl.capture(model, ids, flops=False, save_grads=True)
        cap.output.logits.sum().backward()
        return saved_grad_bytes(cap), cap

    # Warm imports and lazy inits on a tiny capture only: a warm step would leave its
    # freed memory resident and hide the measured step's growth.
    tiny = bl.capture(torch.nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), save_grads=True)
    tiny.output.sum().backward()
    tiny.close()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base = _status_kib("VmRSS") * 1024
    saved, cap = step()
    peak = _status_kib("VmHWM") * 1024
    print(json.dumps({"growth": peak - base, "saved": saved}))


def peak_memory() -> dict[str, int]:
    result = {}
    for variant in ("plain", "save_grads"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", variant],
            check=True, capture_output=True, text=True,
        ).stdout
        result[variant] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--memory-child")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    if args.memory_child:
        peak_memory_child(args.memory_child)
        return
    torch.set_num_threads(1)
    model, ids = make_model()
    print(f"GPT-2 4 layers, n_embd 256, batch 4 x seq 64, torch {torch.__version__}, 1 thread")
    for group, (plain, others) in variants(model, ids).items():
        ratios = time_rounds(plain, others, args.rounds)
        plain_ms = ratios.pop("plain_ms")[0]
        print(f"[{group}] plain median {plain_ms:.1f} ms ({ratios.pop('plain')[1]} page faults)")
        for name, (ratio, faults) in ratios.items():
            print(f"  {name:<40} {ratio:.3f}x plain   ({faults} page faults)")
        if "capture_memory (default + memory=True)" in ratios:
            default = ratios["default capture (FLOPs and timing on)"][0]
            print(f"  {'capture_memory vs default capture':<40} "
                  f"{ratios['capture_memory (default + memory=True)'][0] / default:.3f}x (target <= 1.10x)")
        if "plain keeping the same grads by hand" in ratios:
            by_hand = ratios["plain keeping the same grads by hand"][0]
            print(f"  {'capture save_grads=True vs by hand':<40} "
                  f"{ratios['capture save_grads=True'][0] / by_hand:.3f}x (target <= 1.25x)")
    print(
        "  (page faults: pages the step had to take back from the OS. A step that keeps\n"
        "   gradients and frees them at its end can lose those pages to glibc's heap trimming\n"
        "   and fault them in again next step; plain PyTorch keeping the same tensors does too.)"
    )
    if not args.no_memory:
        memory = peak_memory()
        plain, saved = memory["plain"], memory["save_grads"]
        extra = saved["growth"] - plain["growth"]
        allowed = saved["saved"] * 1.10
        print(
            f"[memory] peak RSS growth plain {plain['growth'] / 2**20:.1f} MiB, "
            f"save_grads=True {saved['growth'] / 2**20:.1f} MiB; extra {extra / 2**20:.1f} MiB "
            f"vs saved gradients {saved['saved'] / 2**20:.1f} MiB "
            f"(budget saved + 10% = {allowed / 2**20:.1f} MiB): "
            f"{'within' if extra <= allowed else 'OVER'}"
        )


if __name__ == "__main__":
    main()
