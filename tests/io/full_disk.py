"""Run as a script: a bl.to_disk capture whose storage fills up, and what the user sees.

``python full_disk.py PATH [FSIZE_LIMIT]``: streams into PATH (on a small
file system, or with RLIMIT_FSIZE set to FSIZE_LIMIT bytes and SIGXFSZ
ignored, so writes past it fail with EFBIG). Prints one JSON line: the
warning codes raised, whether every parameter's .grad equals a plain PyTorch
run's, the bytes left waiting in memory, the passes' statuses, and the code
and cause of the error close() raised.
"""

from __future__ import annotations

import copy
import json
import resource
import signal
import sys
import warnings
from pathlib import Path

import torch

import backlens as bl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, loss_of  # noqa: E402


def main(path: str, limit: int | None) -> None:
    torch.manual_seed(0)
    model = MLP((6, 64, 64, 3))
    stock = copy.deepcopy(model)
    x = torch.randn(32, 6)
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cap = bl.capture(model, x, save_grads=True, storage=bl.to_disk(path, shard_bytes=4096))
        loss = loss_of(cap.output)
        for k in range(1, 7):
            (loss * k).backward(retain_graph=True)
    for k in range(1, 7):
        (loss_of(stock(x)) * k).backward()
    result = {
        "warnings": [getattr(w.message, "code", None) for w in record],
        "grads_equal": all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), stock.parameters())),
        "pending_bytes": cap._state.store.writer._pending_bytes,
        "statuses": [p.status for p in cap.passes],
    }
    try:
        cap.close()
        result["close"] = None
    except bl.BundleError as exc:
        result["close"] = exc.code
        result["close_message"] = str(exc).splitlines()[0]
        result["cause"] = repr(exc.__cause__)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
