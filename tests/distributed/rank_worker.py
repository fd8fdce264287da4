"""One rank of the distributed test world (started by launch.run_ranks): every scenario in one
process group, its results written under OUT for the tests to read.

    python rank_worker.py OUT        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Per rank it writes ``results_rank{r}.json`` (per scenario: what the tests need, or the error),
``grads_rank{r}.safetensors`` (stock and captured gradients, side by side) and, per scenario,
the capture's bundle at ``OUT/{scenario}/rank{r}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import backlens as bl

sys.path.insert(0, str(Path(__file__).parent))
import monitor_scenarios  # noqa: E402

SLEEP = 0.3  # seconds rank 1 sleeps in the slow module's backward


class SleepOnBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds`` (a slow kernel on one rank)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Slow(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seconds = seconds

    def forward(self, x):
        return SleepOnBackward.apply(self.lin(x), self.seconds)


class SlowNet(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.slow = Slow(seconds)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.slow(torch.relu(self.encoder(x))))


def _rows(records) -> list:
    frame = records.to_pandas()
    return [{k: (v if not isinstance(v, float) or v == v else None) for k, v in row.items()}
            for row in frame.to_dict("records")]


def _saved_rows(cap) -> list:
    """(function, saved bytes, parameter bytes, tensors) of each op that saved something."""
    return [[row.label.rsplit("_", 1)[0], row.saved_bytes, row.saved_param_bytes, row.saved_tensors]
            for row in cap.memory.ops if row.saved_tensors]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def mlp_batch(rank: int) -> tuple:
    return (torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank)),)


def gpt2_batch(rank: int) -> tuple:
    return (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 + rank)),)


def mlp_loss(output):
    return output.pow(2).mean()


def gpt2_loss(output):
    return output.logits.pow(2).mean()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as this rank holds it (its shard under FSDP)."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            out[name] = (grad.to_local() if hasattr(grad, "to_local") else grad).detach().clone().contiguous()
    return out


def step(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model(*batch)).backward()


class Rank:
    def __init__(self, out: Path):
        self.out = out
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.results: dict[str, dict] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def bundle(self, scenario: str):
        return bl.to_disk(self.out / scenario / "rank{rank}")

    def scenario(self, name, fn) -> None:
        try:
            self.results[name] = fn() or {}
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            self.results[name] = {"error": traceback.format_exc()}
        dist.barrier()

    # -- DDP ---------------------------------------------------------------------------
    def ddp(self, name, build, batch, loss_fn, bucket_cap_mb):
        """Stock DDP, DDP with torch's own all-reduce hook (the bucket reference) and captured DDP,
        from the same weights and batches; the second step of each is compared."""
        data = batch(self.rank)
        stock = DDP(build(), bucket_cap_mb=bucket_cap_mb)
        step(stock, data, loss_fn)
        step(stock, data, loss_fn)

        reference = DDP(build(), bucket_cap_mb=bucket_cap_mb)
        names = {id(p): n for n, p in reference.named_parameters()}
        buckets = []

        def recording_allreduce(state, bucket):
            buffer = bucket.buffer()
            buckets.append([buffer.numel() * buffer.element_size(), [names[id(p)] for p in bucket.parameters()]])
            return default_hooks.allreduce_hook(state, bucket)

        reference.register_comm_hook(None, recording_allreduce)
        step(reference, data, loss_fn)
        buckets.clear()
        step(reference, data, loss_fn)

        captured = DDP(build(), bucket_cap_mb=bucket_cap_mb)
        step(captured, data, loss_fn)
        captured.zero_grad(set_to_none=True)
        cap = bl.capture(captured, *data, storage=self.bundle(name))
        loss_fn(cap.output).backward()
        cap.close()
        self._keep(name, stock, "stock")
        self._keep(name, captured, "captured")
        step(captured, data, loss_fn)  # a plain step once the capture is closed
        self._keep(name, captured, "after_close")
        return {"buckets": buckets, "collectives": _rows(cap.collectives),
                "call_durations": [call.duration for call in cap.grad_fn_calls]}

    def hooks(self, name):
        """A hook the user registers after a capture runs inside backlens's; a model that had a
        hook of its own before its first capture keeps it, unrecorded, with a warning."""
        data = mlp_batch(self.rank)
        model = DDP(mlp())
        with bl.capture(model, *data) as cap:
            mlp_loss(cap.output).backward()
        calls = []

        def counting(state, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting)
        with bl.capture(model, *data) as cap:
            mlp_loss(cap.output).backward()
        recorded = len(cap.collectives)
        own = DDP(mlp())
        own.register_comm_hook(None, default_hooks.allreduce_hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with bl.capture(own, *data) as other:
                mlp_loss(other.output).backward()
        return {"user_hook_calls": len(calls), "recorded_with_user_hook": recorded,
                "warned": [getattr(w.message, "code", None) for w in caught],
                "recorded_with_own_hook": len(other.collectives)}

    def _keep(self, scenario, model, kind):
        for param, grad in grads_of(model).items():
            self.grads[f"{scenario}/{kind}/{param}"] = grad

    # -- FSDP2 -------------------------------------------------------------------------
    def fsdp(self, name, build, units, batch, loss_fn):
        data = batch(self.rank)

        def sharded():
            model = build()
            for unit in units(model):
                fully_shard(unit)
            fully_shard(model)
            return model

        stock = sharded()
        step(stock, data, loss_fn)
        captured = sharded()
        cap = bl.capture(captured, *data, storage=self.bundle(name))
        loss_fn(cap.output).backward()
        self._keep(name, stock, "stock")
        self._keep(name, captured, "captured")
        cap.close()
        return {"units": self._unit_bytes(captured), "collectives": _rows(cap.collectives),
                "call_durations": [call.duration for call in cap.grad_fn_calls]}

    def _unit_bytes(self, model) -> list:
        """Per FSDP unit: the parameters it manages and the bytes of its gathered shards
        (world size x this rank's shard), from the sharded parameters themselves."""
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        out = []
        for unit in units:
            nested = [m for m in units if m is not unit and any(m is s for s in unit.modules())]
            inside = {id(p) for m in nested for p in m.parameters()}
            owned = [p for p in unit.parameters() if id(p) not in inside]
            names = {id(p): n for n, p in model.named_parameters()}
            if owned:
                shard = sum(p.to_local().numel() * p.element_size() for p in owned)
                out.append([sorted(names[id(p)] for p in owned), shard * self.world_size])
        return out

    # -- skew, desync, live ------------------------------------------------------------
    def slow_rank(self, name, parallel):
        seconds = SLEEP if self.rank == 1 else 0.0
        torch.manual_seed(0)
        model = SlowNet(seconds)
        if parallel == "ddp":
            model = DDP(model)
        else:
            for unit in (model.encoder, model.slow, model.head):
                fully_shard(unit)
            fully_shard(model)
        data = mlp_batch(self.rank)
        step(model, data, mlp_loss)  # a warm step: lazy inits and bucket rebuilds are not timed
        model.zero_grad(set_to_none=True)
        with bl.capture(model, *data, storage=self.bundle(name)) as cap:
            mlp_loss(cap.output).backward()

    def desync(self, name):
        """DDP whose rank 1 scales one gradient after the all-reduce: replicas disagree."""
        model = DDP(mlp())
        data = mlp_batch(self.rank)
        with bl.capture(model, *data, storage=self.bundle(name)) as cap:
            mlp_loss(cap.output).backward()
            if self.rank == 1:
                model.module[2].weight.grad.mul_(1.5)

    def live(self, name, parallel):
        """bl.wrap over the wrapped model: a module output's gradient and the parameter
        gradients, against a stock run that keeps the same gradient with retain_grad."""
        data = mlp_batch(self.rank)

        def wrapped():
            model = mlp()
            if parallel == "ddp":
                return DDP(model), model
            for unit in (model[0], model[2], model[4]):
                fully_shard(unit)
            fully_shard(model)
            return model, model

        stock, inner = wrapped()
        kept = {}

        def keep(module, args, output):
            output.retain_grad()
            kept["h"] = output

        handle = inner[2].register_forward_hook(keep)
        mlp_loss(stock(*data)).backward()
        handle.remove()
        self.grads[f"{name}/stock/h.grad"] = kept["h"].grad.detach().clone()
        self._keep(name, stock, "stock")

        traced, _inner = wrapped()
        lens = bl.wrap(traced)
        layer = lens.module[2] if parallel == "ddp" else lens[2]
        with lens.trace(*data):
            hidden = layer.output.save()
            with mlp_loss(lens.output).backward():
                grad = hidden.grad.save()
        self.grads[f"{name}/traced/h.grad"] = grad.detach().clone()
        self._keep(name, traced, "traced")

    # -- memory ------------------------------------------------------------------------
    def memory(self, name, parallel, build, batch, loss_fn):
        """memory=True over DDP or FSDP2: what each op saved, beside a capture of the bare
        module with the same weights and batch; gradients beside a stock run's."""
        data = batch(self.rank)
        bare = bl.capture(build(), *data, memory=True)

        def wrapped():
            model = build()
            if parallel == "ddp":
                return DDP(model)
            for unit in [m for m in model.modules() if isinstance(m, nn.Linear)]:
                fully_shard(unit)
            fully_shard(model)
            return model

        stock = wrapped()
        step(stock, data, loss_fn)
        step(stock, data, loss_fn)
        captured = wrapped()
        step(captured, data, loss_fn)
        captured.zero_grad(set_to_none=True)
        cap = bl.capture(captured, *data, memory=True, storage=self.bundle(name))
        loss_fn(cap.output).backward()
        self._keep(name, stock, "stock")
        self._keep(name, captured, "captured")
        (backward,) = cap.passes
        result = {"bare": _saved_rows(bare), "captured": _saved_rows(cap),
                  "peak": backward.memory.peak_bytes, "samples": len(backward.memory.samples),
                  "calls": len(backward.calls), "all_freed": cap.memory.all_freed}
        cap.close()
        return result

    def save(self) -> None:
        save_file(self.grads, str(self.out / f"grads_rank{self.rank}.safetensors"))
        (self.out / f"results_rank{self.rank}.json").write_text(json.dumps(self.results, indent=1))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = Rank(out)
        gpt2_units = lambda m: list(m.transformer.h)  # noqa: E731
        mlp_units = lambda m: [m[0], m[2], m[4]]  # noqa: E731
        rank.scenario("ddp_mlp", lambda: rank.ddp("ddp_mlp", mlp, mlp_batch, mlp_loss, 0.0002))
        rank.scenario("ddp_gpt2", lambda: rank.ddp("ddp_gpt2", gpt2, gpt2_batch, gpt2_loss, 0.02))
        rank.scenario("hooks", lambda: rank.hooks("hooks"))
        rank.scenario("fsdp_mlp", lambda: rank.fsdp("fsdp_mlp", mlp, mlp_units, mlp_batch, mlp_loss))
        rank.scenario("fsdp_gpt2", lambda: rank.fsdp("fsdp_gpt2", gpt2, gpt2_units, gpt2_batch, gpt2_loss))
        rank.scenario("slow_ddp", lambda: rank.slow_rank("slow_ddp", "ddp"))
        rank.scenario("slow_fsdp", lambda: rank.slow_rank("slow_fsdp", "fsdp"))
        rank.scenario("desync", lambda: rank.desync("desync"))
        rank.scenario("live_ddp", lambda: rank.live("live_ddp", "ddp"))
        rank.scenario("live_fsdp", lambda: rank.live("live_fsdp", "fsdp"))
        rank.scenario("memory_ddp", lambda: rank.memory("memory_ddp", "ddp", gpt2, gpt2_batch, gpt2_loss))
        rank.scenario("memory_fsdp", lambda: rank.memory("memory_fsdp", "fsdp", mlp, mlp_batch, mlp_loss))
        rank.scenario("monitor_ddp", lambda: monitor_scenarios.ddp(out, rank.rank))
        rank.scenario("monitor_fsdp", lambda: monitor_scenarios.fsdp(out, rank.rank))
        rank.save()
    finally:
        dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} done")


if __name__ == "__main__":
    main()
