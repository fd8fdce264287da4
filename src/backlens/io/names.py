"""The names of a bundle's files, and of what a save leaves beside one while it runs."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
STREAM_MARKER = ".backlens-stream"  # in a bl.to_disk directory until its manifest is written
STREAM_LOCK = ".backlens-lock"  # locked by the bl.to_disk capture streaming into its directory (io/locks.py)
EXTRA_SHARDS = "extra*-*.safetensors"  # what a to_disk capture's manifest adds beside its gradients


def shard_file(prefix: str, number: int) -> str:
    """``grads-00001.safetensors``: the ``number``-th shard a writer named ``prefix`` wrote."""
    return f"{prefix}-{number:05d}.safetensors"


def sibling(target: Path, role: str, token: str) -> Path:
    """A hidden directory beside ``target`` for a save under way (``role``: ``partial`` or ``old``)."""
    return target.parent / f".{target.name}.{role}-{token}"
