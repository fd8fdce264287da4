"""Capture overhead under DDP (2 ranks, gloo on CPU) against stock DDP, in the same run.

Model and batch are bench/overhead.py's (a 4-layer GPT-2, n_embd 256, batch 4 x seq 64 per
rank), one thread per rank. Each rank holds two DDP replicas of the same weights: one never
captured (stock DDP: its reducer has no hook), one captured every step with the default
options (FLOPs and timing on; its bucket all-reduces go through backlens's hook and are
recorded). A third copy without DDP gives, in the same rounds, the single-process ratio of
the default capture to plain PyTorch (bench/overhead.py's ``capture_default``). Steps run in
rounds shuffled the same way on both ranks, each step after a barrier; medians per rank.

Two clocks: wall time, and the main thread's CPU time (``time.thread_time``). On a machine
with spare cores they agree; on an oversubscribed one (two ranks on two busy cores) a rank's
wall time is mostly waiting for a core or for the other rank, and only the CPU time shows
what capture adds.

    python bench/distributed.py [--rounds 20]

Target: the DDP ratio is at most the single-process ratio + 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from overhead import make_model  # noqa: E402

import backlens as bl  # noqa: E402

WORLD_SIZE = 2


def rank_main(rank: int, port: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if Path("/sys/class/net/lo").exists():
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        stock_model, ids = make_model()
        captured_model, _ = make_model()
        plain_model, _ = make_model()
        ids = ids.roll(rank, 0)  # each rank its own batch
        stock, captured = DDP(stock_model), DDP(captured_model)
        collectives = []

        def stock_step():
            stock(ids).logits.sum().backward()
            stock.zero_grad(set_to_none=True)

        def captured_step():
            cap = bl.capture(captured, ids)
            cap.output.logits.sum().backward()
            collectives.append(len(cap.passes[0].collectives))
            cap.close()
            captured.zero_grad(set_to_none=True)

        def plain_step():
            plain_model(ids).logits.sum().backward()
            plain_model.zero_grad(set_to_none=True)

        def captured_plain_step():
            cap = bl.capture(plain_model, ids)
            cap.output.logits.sum().backward()
            cap.close()
            plain_model.zero_grad(set_to_none=True)

        variants = {"stock DDP": stock_step, "captured DDP": captured_step, "plain": plain_step,
                    "captured plain": captured_plain_step}
        times = time_rounds(variants, rounds)

        def ratio(clock: str, of: str, to: str) -> float:
            return times[clock][of] / times[clock][to]

        result = {clock: {"ddp": ratio(clock, "captured DDP", "stock DDP"),
                          "single": ratio(clock, "captured plain", "plain")} for clock in times}
        result["stock_ms"] = times["wall"]["stock DDP"] * 1e3
        result["collectives_per_pass"] = max(collectives)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def time_rounds(variants: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Median wall and main-thread CPU seconds per variant; the same shuffled order on every rank."""
    for step in variants.values():
        step()
        step()
    samples = {clock: {name: [] for name in variants} for clock in ("wall", "cpu")}
    order = list(variants.items())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, step in order:
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            step()
            samples["cpu"][name].append(time.thread_time() - cpu)
            samples["wall"][name].append(time.perf_counter() - wall)
    return {clock: {name: statistics.median(s) for name, s in by_name.items()}
            for clock, by_name in samples.items()}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(f"GPT-2 4 layers, n_embd 256, batch 4 x seq 64 per rank, torch {torch.__version__}, "
          f"{WORLD_SIZE} ranks (gloo, CPU), 1 thread each")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(free_port(), args.rounds, out), nprocs=WORLD_SIZE)
        results = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        print(f"[rank {rank}] stock DDP median {result['stock_ms']:.1f} ms, {result['collectives_per_pass']} "
              "collectives per pass")
        for clock in ("wall", "cpu"):
            r = result[clock]
            print(f"  {clock:4}: default capture {r['ddp']:.3f}x stock DDP; single process (same rounds) "
                  f"{r['single']:.3f}x plain; difference {r['ddp'] - r['single']:+.3f}")
    for clock in ("wall", "cpu"):
        worst = max(r[clock]["ddp"] - r[clock]["single"] for r in results)
        verdict = "meets" if worst <= 0.05 else "misses"
        print(f"{clock}: DDP minus single-process overhead, worst rank {worst:+.3f}: {verdict} the target (<= +0.05)")


if __name__ == "__main__":
    main()
