"""Where this process stands in ``torch.distributed``: its rank and the world size.

Read through torch's public API only (``is_available``, ``is_initialized``,
``get_rank``, ``get_world_size``), never at import: a process group may be
created after ``import backlens``.
"""

from __future__ import annotations

import os

import torch

RANK_FIELD = "{rank}"


def rank_and_world_size() -> tuple[int | None, int | None]:
    """``(rank, world_size)`` in the default process group; ``(None, None)`` outside one."""
    distributed = torch.distributed
    if not distributed.is_available() or not distributed.is_initialized():
        return None, None
    return distributed.get_rank(), distributed.get_world_size()


def expand_rank(path: str | os.PathLike) -> str:
    """``path`` with the literal ``{rank}`` replaced by this process's rank (0 outside
    ``torch.distributed``, where the one process is rank 0 of one)."""
    text = os.fspath(path)
    if RANK_FIELD not in text:
        return text
    rank, _world_size = rank_and_world_size()
    return text.replace(RANK_FIELD, str(rank if rank is not None else 0))
