"""``storage=bl.to_disk(path)``: saved gradients stream into a bundle directory.

:class:`DiskStore` implements the capture's ``TensorStore`` protocol. Each
saved node-call side is copied and hashed as it arrives and written out in
safetensors shards of at most ``shard_bytes``, so memory stays flat however
many gradients a capture saves. Records read them back lazily: a loaded
tensor is memory-mapped from its shard and costs nothing until read.

The directory becomes a loadable bundle when the capture writes its manifest:
``cap.save()`` (no path, or the same path) and ``cap.close()`` (also on leaving
``with bl.capture(...)``) do. Until then it holds shards and no
``manifest.json``, which ``bl.load`` refuses. Saved activations stay in memory
during the capture and are written with the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backlens._distributed import expand_rank
from backlens.capture.store import MemoryStore
from backlens.errors import BundleError, UnsupportedInputError
from backlens.io import manifest as manifest_io
from backlens.io.names import EXTRA_SHARDS, MANIFEST, STREAM_MARKER
from backlens.io.shards import DEFAULT_SHARD_BYTES, ShardReader, ShardWriter, storable


@dataclass(frozen=True)
class DiskSpec:
    """What ``bl.to_disk`` returns; ``bl.capture`` turns it into a :class:`DiskStore`."""

    path: Path
    shard_bytes: int = DEFAULT_SHARD_BYTES
    overwrite: bool = False


def to_disk(path: str | Path, *, shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> DiskSpec:
    """Stream saved tensors into a bundle at ``path`` instead of keeping them in memory.

    A literal ``{rank}`` in ``path`` becomes the capturing process's rank under
    ``torch.distributed`` (``"run/rank{rank}"``: one bundle per rank; 0 outside it).
    ``path`` must not exist, or be an empty directory; ``overwrite=True`` also
    replaces an earlier bundle there (never any other directory). At most
    ``shard_bytes`` of gradients wait in memory before a shard is written.
    """
    if not isinstance(path, (str, Path)) or str(path) == "":
        raise UnsupportedInputError(f"bl.to_disk needs a directory path, got {path!r}.",
                                    remedy="Pass a path such as bl.to_disk('runs/grads').")
    if int(shard_bytes) < 1:
        raise UnsupportedInputError(f"shard_bytes must be positive, got {shard_bytes!r}.",
                                    remedy="Leave shard_bytes at its default (16 MiB).")
    return DiskSpec(Path(path), int(shard_bytes), bool(overwrite))


def make_store(storage: Any) -> Any:
    """The tensor store for ``bl.capture(storage=...)``."""
    if storage is None:
        return MemoryStore()
    if isinstance(storage, DiskSpec):
        return DiskStore(storage)
    if all(callable(getattr(storage, name, None)) for name in ("keep", "load", "close")):
        return storage  # a user TensorStore
    raise UnsupportedInputError(
        f"storage= takes bl.to_disk(path), not {type(storage).__name__}.",
        remedy="Pass storage=bl.to_disk('some/dir'), or leave it out to keep tensors in memory.",
    )


def check_target(path: Path, overwrite: bool) -> bool:
    """Whether writing a bundle at ``path`` must first remove the bundle there.

    Raises BundleError when ``path`` is a file, a non-empty directory without
    ``overwrite``, or a directory that is not a bundle (never replaced).
    """
    if not (path.exists() or path.is_symlink()):
        return False
    if not path.is_dir():
        raise BundleError(f"{path}: exists and is not a directory; a bundle is a directory.",
                          code="bundle_not_a_directory", remedy="Choose a path that does not exist yet.")
    if not any(path.iterdir()):
        return False  # an empty directory is as good as none
    if not overwrite:
        raise BundleError(f"{path}: already exists and is not empty.", code="bundle_exists",
                          remedy="Choose a new path, or pass overwrite=True to replace the bundle there.")
    if not is_bundle_dir(path):
        raise BundleError(f"{path}: exists and is not a backlens bundle; refusing to replace it.",
                          code="bundle_not_a_bundle",
                          remedy="Choose a new path; overwrite=True only replaces bundles.")
    return True


def is_bundle_dir(path: Path) -> bool:
    """Whether ``path`` holds a backlens bundle or an unfinished ``to_disk`` stream."""
    if (path / STREAM_MARKER).is_file():
        return True
    try:
        with open(path / MANIFEST, encoding="utf-8") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return '"backlens.bundle"' in head


def prepare_directory(path: Path, overwrite: bool) -> None:
    """Make ``path`` an empty directory, or raise BundleError saying why not."""
    if check_target(path, overwrite):
        shutil.rmtree(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / STREAM_MARKER).write_text(json.dumps({"format": "backlens.bundle-stream"}))
    except OSError as exc:
        raise BundleError(f"{path}: cannot create the bundle directory ({exc.strerror or exc}).",
                          code="bundle_write_failed",
                          remedy="Choose a writable location.") from exc


class DiskStore:
    """A ``TensorStore`` writing safetensors shards into ``spec.path`` (see module doc).

    A handle is a tuple with one entry per tensor: its name in the shards,
    ``None`` for a missing gradient, or the tensor itself for the rare layout
    safetensors cannot hold (sparse), which stays in memory.
    """

    def __init__(self, spec: DiskSpec):
        # Absolute, so the manifest lands beside the shards even if the cwd changes.
        self.path = Path(os.path.abspath(expand_rank(spec.path)))
        prepare_directory(self.path, spec.overwrite)
        self.writer = ShardWriter(self.path, "grads", spec.shard_bytes)
        self.reader = ShardReader(self.path)
        self.finished_manifests = 0

    def keep(self, tensors: tuple[torch.Tensor | None, ...], name: str) -> tuple:
        return tuple(
            None if t is None else self.writer.add(t) if storable(t) else t.detach()
            for t in tensors
        )

    def load(self, handle: tuple) -> tuple:
        return tuple(self._tensor(item) for item in handle)

    def _tensor(self, item: Any) -> torch.Tensor | None:
        if not isinstance(item, str):
            return item
        if self.writer.is_pending(item):
            # Write it out rather than hand out the pending copy, so records
            # never pin shard-sized buffers in memory.
            self.writer.flush()
        return self.reader.tensor(self.writer.index[item])

    def flush(self) -> None:
        self.writer.flush()

    def finish(self, state: Any) -> None:
        """Write the manifest that makes the directory a loadable bundle (``state``: the capture's)."""
        directory = self.path
        self.flush()
        self.finished_manifests += 1
        extras = ShardWriter(directory, f"extra{self.finished_manifests}")
        try:
            body = manifest_io.build(state, manifest_io.Refs(extras, self, streamed=True))
            extras.flush()
            body["tensors"] = manifest_io.tensor_section([self.writer, extras])
            manifest_io.write(directory, body)
        except OSError as exc:
            raise BundleError(f"{directory}: writing the bundle manifest failed ({exc.strerror or exc}).",
                              code="bundle_write_failed",
                              remedy="Free disk space or choose a writable location.") from exc
        referenced = set(body["tensors"]["files"])
        for leftover in directory.glob(EXTRA_SHARDS):
            if leftover.name not in referenced:  # the extras of an earlier save
                leftover.unlink(missing_ok=True)
        (directory / STREAM_MARKER).unlink(missing_ok=True)

    def close(self) -> None:
        self.writer.flush()
        self.reader.close()
