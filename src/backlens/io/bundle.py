"""``cap.save(path)`` and ``bl.load(path)``: bundles on disk (API.md §6).

A bundle is a directory: ``manifest.json`` (io/manifest.py: the capture state
under an explicit schema, io/schema.py) and safetensors shards. No pickle
anywhere.

Writing is crash-safe: a new bundle is built in a locked hidden directory
beside ``path`` and put in place at the end (io/replace.py: one rename, or one
atomic exchange with the bundle it replaces), so ``path`` holds the old or the
new bundle whatever moment the process dies; on an error the hidden directory
is removed and ``path`` is left as it was, and the next save to ``path``
removes what an interrupted one left. An existing path is refused unless
``overwrite=True``, and even then only a bundle (or an empty directory) is
replaced, never another directory.

Reading treats the bundle as untrusted input (io/files.py: no link followed,
nothing outside the directory opened, sizes and JSON depth bounded) and checks
everything before the state is built: the manifest's format, version and
checksum, every field of every entry against the schema, every shard's
presence, size, header and sha256 (and each tensor's sha256). Tensors are read
when first used, into memory of their own, and checked against their sha256
again then. Any problem is a :class:`BundleError` naming the file. What it
builds is the same :class:`~backlens.capture.state.CaptureState` a live
capture fills, over read-only storage, so records read through the same code.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backlens._distributed import expand_rank
from backlens._progress import LARGE_BYTES, progress, progress_shown
from backlens.capture.state import CaptureState
from backlens.capture.store import MemoryStore
from backlens.errors import BundleError
from backlens.io import manifest as manifest_io
from backlens.io.consistency import check_state
from backlens.io.disk_store import DiskStore, check_target
from backlens.io.files import BundleDir, damaged
from backlens.io.locks import is_streaming
from backlens.io.names import MANIFEST, STREAM_MARKER
from backlens.io.replace import recover, write_whole
from backlens.io.schema import decode_state, read_tensor_section
from backlens.io.shards import (
    ITEMSIZE,
    SHARD_METADATA,
    ShardReader,
    ShardWriter,
    TensorEntry,
    hash_file,
    read_header,
)

# -- writing -------------------------------------------------------------------------


def save_state(state: CaptureState, path: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Write ``state`` as a bundle at ``path``; returns the bundle's path.

    For a ``storage=bl.to_disk(dir)`` capture, ``path`` may be left out (or be
    ``dir``): the manifest is then written into ``dir`` beside the shards
    already there, which makes it a bundle.
    """
    if path is not None:
        path = expand_rank(path)  # "run/rank{rank}": this process's rank, as bl.to_disk does
    store = state.store
    if isinstance(store, DiskStore) and (path is None or _same_path(path, store.path)):
        store.finish(state)
        return store.path
    if path is None:
        raise BundleError(
            "cap.save() needs a path: this capture keeps its tensors in memory.",
            code="bundle_path_required",
            remedy="Pass a directory path: cap.save('runs/capture1').",
        )
    if isinstance(store, DiskStore):
        store.check_sound()
    target = Path(path)
    recover(target)  # a replacement that died half-way: the old bundle goes back first
    check_target(target, overwrite)
    def write(directory: Path) -> None:
        total = _bytes_to_write(state) if progress_shown() else 0
        # Every tensor handed in is read and hashed, a repeated one written once: a percentage, not sizes.
        with progress("Saving bundle", total, unit="bytes", sizes=False, min_total=LARGE_BYTES) as advance:
            writer = ShardWriter(directory, "tensors", advance=advance)
            body = manifest_io.build(state, manifest_io.Refs(writer, store))
            writer.flush()
        body["tensors"] = manifest_io.tensor_section([writer])
        manifest_io.write(directory, body)

    return write_whole(target, overwrite, write)


def _same_path(a: Any, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one directory, however spelled (``//data/b``, ``data/../data/b``,
    a path through a linked parent): the same device and inode, or the same resolved path while
    either is missing."""
    try:
        first, second = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _bytes_to_write(state: CaptureState) -> int:
    """About how many tensor bytes a save of ``state`` writes (for its progress bar)."""
    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    total = nbytes(op.activation for op in state.journal.ops)
    total += nbytes(p.grad for p in state.params)
    if isinstance(state.store, MemoryStore):
        for call in state.calls:
            total += nbytes(call.grad_inputs or ()) + nbytes(call.grad_outputs or ())
    else:
        writer = getattr(state.store, "writer", None)
        total += sum(info["bytes"] for info in getattr(writer, "files", {}).values())
    return total


# -- reading -------------------------------------------------------------------------

@dataclass(frozen=True)
class BundleInfo:
    """Where a loaded capture came from."""

    path: Path
    format_version: int
    backlens_version: str | None
    torch_version: str | None


class BundleTensors:
    """A loaded state's tensor store: tensor names -> tensors, read from the shards when asked for.

    A handle is a tuple of names (None for a gradient that was not there). Each
    tensor is read into memory of its own and checked against its sha256 when
    first asked for (io/shards.py); one name gives one tensor object while
    anyone holds it, so tensors shared live stay shared.
    """

    def __init__(self, directory: BundleDir, entries: dict[str, TensorEntry], data_starts: dict[str, int]):
        self.entries = entries
        self._reader = ShardReader(directory, data_starts)
        self._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def known(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str) -> torch.Tensor:
        found = self._cache.get(name)
        if found is None:
            entry = self.entries.get(name)
            if entry is None:
                raise ValueError(f"tensor {name!r} is not in the tensor index")
            with self._lock:
                found = self._cache.get(name)
                if found is None:
                    found = self._cache[name] = self._reader.tensor(name, entry)
        return found

    def load(self, handle: tuple) -> tuple:
        return tuple(None if name is None else self.tensor(name) for name in handle)

    def keep(self, tensors: tuple, name: str) -> Any:
        raise BundleError("A loaded bundle is read-only.", code="read_only_bundle")

    def close(self) -> None:
        """Nothing to release: no file is held open."""


class _Sections:
    """What the schema reads tensors and section sizes from."""

    def __init__(self, manifest: dict[str, Any], tensors: BundleTensors):
        self.tensor, self.known = tensors.tensor, tensors.known
        self._sizes = {name: len(value) for name, value in manifest.items() if isinstance(value, list)}
        sources = manifest.get("sources")
        names = sources.get("names") if isinstance(sources, dict) else None
        self._sizes["sources"] = len(names) if isinstance(names, list) else 0

    def size(self, section: str) -> int:
        return self._sizes.get(section, 0)


def read_bundle(path: str | os.PathLike, *, verify: bool = True) -> tuple[CaptureState, BundleInfo]:
    """Read the bundle at ``path`` as a read-only capture state (see the module docstring)."""
    root = Path(path)
    recover(root)  # a save that died between its two renames left the old bundle aside
    directory = BundleDir(root)
    manifest_path = directory.path(MANIFEST)
    if not directory.exists(MANIFEST):
        if directory.exists(STREAM_MARKER):
            if is_streaming(root):
                raise BundleError(
                    f"{manifest_path}: missing: this is an unfinished bl.to_disk directory.",
                    code="bundle_unfinished",
                    remedy="Call cap.save() or cap.close() on the capture that streams here.",
                )
            raise BundleError(
                f"{manifest_path}: missing: this is an unfinished bl.to_disk directory whose capture is gone "
                "(its process ended before cap.save() or cap.close() wrote the manifest).",
                code="bundle_unfinished",
                remedy="Capture again; a save to this path with overwrite=True replaces what is left here.",
            )
        raise BundleError(f"{manifest_path}: missing: {root} is not a backlens bundle.",
                          code="bundle_not_a_bundle",
                          remedy="Point bl.load at a directory cap.save(path) wrote.")
    manifest = manifest_io.read(directory)
    try:
        files, entries = read_tensor_section(manifest["tensors"])
    except ValueError as exc:
        raise damaged(f"{manifest_path}: {exc}.") from None
    tensors = BundleTensors(directory, entries, _check_shards(directory, files, entries, verify))
    try:
        state = decode_state(manifest, _Sections(manifest, tensors), tensors)
        check_state(state, entries)
    except ValueError as exc:
        if isinstance(exc, BundleError):
            raise
        raise damaged(f"{manifest_path}: {exc}.") from None
    info = BundleInfo(root, manifest["format_version"], manifest["backlens_version"], manifest["torch_version"])
    _remove_unreferenced(root, set(files))
    return state, info


# What a bl.to_disk capture writes beside its manifest, and leaves unreferenced when its process dies
# after a save while it streams on.
_STREAM_FILES = re.compile(r"\A(?:(?:grads|extra[0-9]+)-[0-9]{5,}\.safetensors|manifest\.json\.tmp|\.backlens-lock)\Z")


def _remove_unreferenced(root: Path, referenced: set[str]) -> None:
    """Remove the files a killed stream left beside its last manifest (shards it wrote after it).

    Only a directory no live capture streams into, only regular files named as a stream names
    them and not in the manifest; best effort (a read-only bundle keeps them, unharmed)."""
    if is_streaming(root):
        return
    try:
        with os.scandir(root) as entries:
            stale = [entry.name for entry in entries if _STREAM_FILES.match(entry.name)
                     and entry.name not in referenced and entry.is_file(follow_symlinks=False)]
        for name in stale:
            os.unlink(root / name)
    except OSError:
        pass


def _check_shards(directory: BundleDir, files: dict[str, dict[str, Any]], entries: dict[str, TensorEntry],
                  verify: bool) -> dict[str, int]:
    """Check every shard against the tensor index; returns where each one's data starts.

    Sizes, headers and offsets always; the sha256 of each file and each tensor
    with ``verify`` (each tensor is checked again when it is read).
    """
    by_file: dict[str, dict[str, TensorEntry]] = {name: {} for name in files}
    for name, entry in entries.items():
        by_file[entry.file][name] = entry
    starts = {}
    total = sum(info["bytes"] for info in files.values()) if verify else 0
    with progress("Checking bundle", total, unit="bytes", min_total=LARGE_BYTES) as advance:
        for file_name, info in files.items():
            descriptor = directory.open(file_name, expected_size=info["bytes"])
            try:
                starts[file_name] = _check_shard(directory.path(file_name), descriptor, info, by_file[file_name],
                                                 advance if verify else None)
            finally:
                os.close(descriptor)
    return starts


def _check_shard(path: Path, descriptor: int, info: dict[str, Any], entries: dict[str, TensorEntry],
                 advance: Any) -> int:
    expected = {name: {"dtype": e.dtype, "shape": e.shape, "data_offsets": e.offsets} for name, e in entries.items()}
    # The header can be no longer than these entries written out (plus padding): a longer one
    # is refused before it is read, whatever length the file claims.
    needed = len(json.dumps({"__metadata__": SHARD_METADATA, **expected}, separators=(",", ":"))) + 8
    header, header_size = read_header(descriptor, path, limit=needed)
    header.pop("__metadata__", None)
    if header != expected:
        raise damaged(f"{path}: the shard's header does not match the manifest's tensor index.")
    data_start = 8 + header_size
    ranges = []
    for name, entry in entries.items():
        begin, end = entry.offsets
        if data_start + end > info["bytes"] or end - begin != math.prod(entry.shape) * ITEMSIZE[entry.dtype]:
            raise damaged(f"{path}: tensor {name!r} has bad offsets {entry.offsets} for its shape "
                          f"{entry.shape} and dtype {entry.dtype}.")
        ranges.append((name, data_start + begin, data_start + end))
    ranges.sort(key=lambda r: r[1])
    for (first, _b, first_end), (second, second_begin, _e) in zip(ranges, ranges[1:]):
        if second_begin < first_end:
            raise damaged(f"{path}: tensors {first!r} and {second!r} overlap.")
    if advance is None:
        return data_start
    whole, parts = hash_file(descriptor, path, ranges, advance)
    if whole != info["sha256"]:
        raise damaged(f"{path}: sha256 mismatch: the file is corrupt.")
    for name, entry in entries.items():
        if parts.get(name) != entry.sha256:
            raise damaged(f"{path}: sha256 mismatch for tensor {name!r}.")
    return data_start
