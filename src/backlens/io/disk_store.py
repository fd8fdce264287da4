"""``storage=bl.to_disk(path)``: saved gradients stream into a bundle directory.

:class:`DiskStore` implements the capture's ``TensorStore`` protocol. Each
saved node-call side is copied and hashed as it arrives and written out in
safetensors shards of at most ``shard_bytes``, so memory stays flat however
many gradients a capture saves. Records read them back lazily: a loaded
tensor is memory-mapped from its shard and costs nothing until read.

The directory becomes a loadable bundle when the capture writes its manifest:
``cap.save()`` (no path, or the same directory under any spelling) and
``cap.close()`` (also on leaving ``with bl.capture(...)``) do. Until then it
holds shards and no ``manifest.json``, which ``bl.load`` refuses. Saved
activations stay in memory during the capture and are written with the
manifest. The directory is locked while the capture streams (io/locks.py): a
second writer there is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backlens._distributed import expand_rank
from backlens._warn import warn
from backlens.capture.store import MemoryStore
from backlens.errors import BundleError, UnsupportedInputError
from backlens.io import manifest as manifest_io
from backlens.io.locks import StreamLock, refuse_if_streaming
from backlens.io.markers import STREAM_MARKER_TEXT, refuse_unless_replaceable
from backlens.io.names import EXTRA_SHARDS, STREAM_LOCK, STREAM_MARKER
from backlens.io.replace import Staging, clean_leftovers, put_in_place, recover, remove_old
from backlens.io.shards import DEFAULT_SHARD_BYTES, ShardReader, ShardWriter, storable


@dataclass(frozen=True)
class DiskSpec:
    """What ``bl.to_disk`` returns; ``bl.capture`` turns it into a :class:`DiskStore`."""

    path: Path
    shard_bytes: int = DEFAULT_SHARD_BYTES
    overwrite: bool = False


def to_disk(path: str | os.PathLike, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
            overwrite: bool = False) -> DiskSpec:
    """Stream saved tensors into a bundle at ``path`` instead of keeping them in memory.

    A literal ``{rank}`` in ``path`` becomes the capturing process's rank under
    ``torch.distributed`` (``"run/rank{rank}"``: one bundle per rank; 0 outside it).
    ``path`` must not exist, or be an empty directory; ``overwrite=True`` also
    replaces an earlier bundle there (never any other directory), once the new
    one is finished. At most ``shard_bytes`` of gradients wait in memory before
    a shard is written.
    """
    if not isinstance(path, (str, os.PathLike)) or os.fspath(path) in ("", b""):
        raise UnsupportedInputError(f"bl.to_disk needs a directory path, got {path!r}.", code="bad_path",
                                    remedy="Pass a path such as bl.to_disk('runs/grads').")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise UnsupportedInputError(f"bl.to_disk: shard_bytes must be a positive integer (bytes), got "
                                    f"{shard_bytes!r}.", code="bad_option",
                                    remedy="Leave shard_bytes at its default (16 MiB) or pass e.g. 64 * 2**20.")
    if not isinstance(overwrite, bool):
        raise UnsupportedInputError(f"bl.to_disk: overwrite must be True or False, got {overwrite!r}.",
                                    code="bad_option", remedy="Pass overwrite=True or overwrite=False.")
    return DiskSpec(Path(os.fspath(path)), shard_bytes, overwrite)


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
    """Whether writing a bundle at ``path`` replaces a bundle there.

    Raises BundleError when ``path`` is a file or a link, a non-empty directory
    without ``overwrite``, a directory that is not a bundle (never replaced), or
    one a ``bl.to_disk`` capture is streaming into.
    """
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_dir():
        raise BundleError(f"{path}: exists and is not a directory; a bundle is a directory.",
                          code="bundle_not_a_directory", remedy="Choose a path that does not exist yet.")
    if _is_empty(path):
        return False  # an empty directory is as good as none
    if not overwrite:
        raise BundleError(f"{path}: already exists and is not empty.", code="bundle_exists",
                          remedy="Choose a new path, or pass overwrite=True to replace the bundle there.")
    refuse_unless_replaceable(path)
    refuse_if_streaming(path)
    return True


def _is_empty(path: Path, but: tuple[str, ...] = ()) -> bool:
    with os.scandir(path) as entries:
        return all(entry.name in but for entry in entries)


class DiskStore:
    """A ``TensorStore`` writing safetensors shards into ``spec.path`` (see module doc).

    A handle is a tuple with one entry per tensor: its name in the shards,
    ``None`` for a missing gradient (or one dropped after a storage failure),
    or the tensor itself for the rare layout safetensors cannot hold (sparse),
    which stays in memory.

    Replacing a bundle (``overwrite=True`` over one), the shards go to a locked
    staging directory beside ``path`` that takes its place when the manifest is
    first written (io/replace.py); otherwise they go to ``path`` itself, marked
    unfinished until then.

    A write that fails (disk full, file too large) never reaches the user's
    backward: the store warns once (``storage_failed``), drops what it holds
    and keeps nothing more, and ``finish``/``check_sound`` raise BundleError
    with the cause.
    """

    def __init__(self, spec: DiskSpec):
        # Absolute, so the manifest lands beside the shards even if the cwd changes.
        self.path = Path(os.path.abspath(expand_rank(spec.path)))
        self.staging: Staging | None = None
        self.failure: BaseException | None = None
        self.finished_manifests = 0
        self._created: set[str] = set()  # shard files this store wrote since its last manifest
        self.lock: StreamLock | None = None
        recover(self.path)
        replacing = check_target(self.path, spec.overwrite)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.path)
            if replacing:
                self.staging = Staging(self.path)
                directory = self.staging.path
            else:
                self.path.mkdir(exist_ok=True)
                directory = self.path
            self.lock = StreamLock(directory)
            if not replacing and not _is_empty(directory, but=(STREAM_LOCK,)):
                # Another writer filled it between the check and the lock.
                raise BundleError(f"{self.path}: already exists and is not empty.", code="bundle_exists",
                                  remedy="Choose a new path, or pass overwrite=True to replace the bundle there.")
            (directory / STREAM_MARKER).write_text(STREAM_MARKER_TEXT)
        except BaseException as exc:
            if self.lock is not None:
                self.lock.release()
            if self.staging is not None:
                self.staging.discard()
            if not isinstance(exc, OSError):
                raise
            raise BundleError(f"{self.path}: cannot create the bundle directory ({exc.strerror or exc}).",
                              code="bundle_write_failed", remedy="Choose a writable location.") from exc
        self.writer = ShardWriter(directory, "grads", spec.shard_bytes)
        self.reader = ShardReader(directory, self.writer.data_starts)

    @property
    def directory(self) -> Path:
        """Where the shards are written now (the staging directory until it takes ``path``'s place)."""
        return self.writer.directory

    # -- the TensorStore protocol (keep runs inside the user's backward) -------------
    def keep(self, tensors: tuple[torch.Tensor | None, ...], name: str) -> tuple | None:
        if self.failure is not None:
            return None  # nothing more is kept: memory stays bounded
        try:
            return tuple(
                None if t is None else self._add(t) if storable(t) else t.detach()
                for t in tensors
            )
        except (OSError, BundleError) as exc:
            self._fail(exc)
            return None

    def _add(self, tensor: torch.Tensor) -> str:
        before = set(self.writer.files)
        name = self.writer.add(tensor)
        self._created.update(set(self.writer.files) - before)
        return name

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        self.writer.drop_pending()
        warn(f"Storage for bl.to_disk({str(self.path)!r}) failed ({exc}): gradients from now on are not "
             "saved; the backward runs on and parameters get their .grad as usual. cap.close() and "
             "cap.save() will raise BundleError.", "storage_failed", in_hook=True)

    def load(self, handle: tuple) -> tuple:
        return tuple(self._tensor(item) for item in handle)

    def _tensor(self, item: Any) -> torch.Tensor | None:
        if not isinstance(item, str):
            return item
        entry = self.writer.index.get(item)
        if entry is None:
            return None  # dropped after a storage failure
        if self.writer.is_pending(item):
            # Write it out rather than hand out the pending copy, so records
            # never pin shard-sized buffers in memory.
            self.flush()
            entry = self.writer.index.get(item)
            if entry is None or self.writer.is_pending(item):
                return None
        return self.reader.tensor(item, entry)

    def flush(self) -> None:
        if self.failure is not None:
            return
        before = set(self.writer.files)
        try:
            self.writer.flush()
        except (OSError, BundleError) as exc:
            self._fail(exc)
        self._created.update(set(self.writer.files) - before)

    # -- making the bundle -------------------------------------------------------------
    def check_sound(self) -> None:
        """Raise BundleError when a write failed during the capture (its bundle would be incomplete)."""
        if self.failure is not None:
            raise BundleError(
                f"{self.path}: the bundle is incomplete: writing to it failed during the capture "
                f"({self.failure}); gradients from then on were not saved.",
                code="storage_failed",
                remedy="Free disk space (or raise the file size limit) and capture again.",
            ) from self.failure

    def finish(self, state: Any) -> None:
        """Write the manifest that makes the directory a loadable bundle (``state``: the capture's)."""
        self.flush()
        self.check_sound()
        directory = self.directory
        self.finished_manifests += 1
        extras = ShardWriter(directory, f"extra{self.finished_manifests}")
        try:
            body = manifest_io.build(state, manifest_io.Refs(extras, self, streamed=True))
            extras.flush()
            body["tensors"] = manifest_io.tensor_section([self.writer, extras])
            manifest_io.write(directory, body)
            replaced = None
            if self.staging is not None:
                replaced = put_in_place(self.staging, self.path, overwrite=True)
                self.staging = None
                if self.lock is not None:
                    self.lock.moved_to(self.path)
                self.writer.directory = self.path
                self.reader = ShardReader(self.path, self.writer.data_starts)
        except OSError as exc:
            raise BundleError(f"{self.path}: writing the bundle manifest failed ({exc.strerror or exc}).",
                              code="bundle_write_failed",
                              remedy="Free disk space or choose a writable location.") from exc
        self._created.clear()
        referenced = set(body["tensors"]["files"])
        for leftover in self.path.glob(EXTRA_SHARDS):
            if leftover.name not in referenced:  # the extras of an earlier save
                leftover.unlink(missing_ok=True)
        (self.path / STREAM_MARKER).unlink(missing_ok=True)
        remove_old(replaced, self.path)

    def close(self) -> None:
        """Flush and let go of the directory; after a storage failure, remove what cannot become a
        bundle (it only takes space)."""
        try:
            self.flush()
            self.reader.close()
        finally:
            if self.lock is not None:
                self.lock.release()
        if self.failure is None:
            return
        if self.staging is not None:
            self.staging.discard()
            self.staging = None
            return
        for name in self._created:
            (self.directory / name).unlink(missing_ok=True)
        self._created.clear()
        if self.finished_manifests == 0:  # never a bundle: take the directory back to how it was
            (self.directory / STREAM_MARKER).unlink(missing_ok=True)
            try:
                self.directory.rmdir()
            except OSError:
                pass  # not empty: it held something before
