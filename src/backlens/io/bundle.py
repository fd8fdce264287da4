"""``cap.save(path)`` and ``bl.load(path)``: bundles on disk (API.md §6).

A bundle is a directory: ``manifest.json`` (io/manifest.py: the capture state
under an explicit schema, io/schema.py) and safetensors shards. No pickle
anywhere.

Writing is all-or-nothing: a new bundle is built in a hidden temporary
directory beside ``path`` and renamed into place at the end; on any error the
temporary directory is removed and ``path`` is left as it was. An existing
path is refused unless ``overwrite=True``, and even then only a bundle (or an
empty directory) is replaced, never another directory.

Reading checks everything before the state is built: the manifest's format,
version and checksum, every shard's presence, size, header and sha256 (and
each tensor's sha256), every field of every entry. Any problem is a
:class:`BundleError` naming the file. What it builds is the same
:class:`~backlens.capture.state.CaptureState` a live capture fills, over
read-only storage, so records read through the same code.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backlens._distributed import expand_rank
from backlens.capture.state import CaptureState
from backlens.errors import BundleError
from backlens.io import manifest as manifest_io
from backlens.io.disk_store import DiskStore, check_target
from backlens.io.names import MANIFEST, STREAM_MARKER, sibling
from backlens.io.schema import decode_state
from backlens.io.shards import (
    DTYPES,
    ITEMSIZE,
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
    target = Path(path)
    check_target(target, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = sibling(target, "partial", uuid.uuid4().hex[:12])
        temporary.mkdir()
    except OSError as exc:
        raise BundleError(f"{target}: cannot write here ({exc.strerror or exc}).",
                          code="bundle_write_failed", remedy="Choose a writable location.") from exc
    try:
        writer = ShardWriter(temporary, "tensors")
        body = manifest_io.build(state, manifest_io.Refs(writer, store))
        writer.flush()
        body["tensors"] = manifest_io.tensor_section([writer])
        manifest_io.write(temporary, body)
        _move_into_place(temporary, target, overwrite)
    except BaseException as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(exc, OSError):
            raise BundleError(f"{target}: writing the bundle failed ({exc.strerror or exc}).",
                              code="bundle_write_failed",
                              remedy="Choose a writable location with enough free space.") from exc
        raise
    return target


def _same_path(a: Any, b: Path) -> bool:
    return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))


def _move_into_place(temporary: Path, target: Path, overwrite: bool) -> None:
    old = None
    if target.exists() and any(target.iterdir()):
        if not overwrite:  # appeared while we were writing
            raise BundleError(f"{target}: already exists.", code="bundle_exists",
                              remedy="Choose a new path, or pass overwrite=True.")
        old = sibling(target, "old", uuid.uuid4().hex[:12])
        os.rename(target, old)
    try:
        os.rename(temporary, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- reading -------------------------------------------------------------------------

@dataclass(frozen=True)
class BundleInfo:
    """Where a loaded capture came from."""

    path: Path
    format_version: int
    backlens_version: str | None
    torch_version: str | None


class BundleTensors:
    """A loaded state's tensor store: tensor names -> tensors, mapped lazily from the shards.

    A handle is a tuple of names (None for a gradient that was not there). One
    name gives one tensor object, so tensors shared live stay shared.
    """

    def __init__(self, directory: Path, entries: dict[str, TensorEntry]):
        self.entries = entries
        self._reader = ShardReader(directory)
        self._cache: dict[str, torch.Tensor] = {}

    def known(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str) -> torch.Tensor:
        found = self._cache.get(name)
        if found is None:
            entry = self.entries.get(name)
            if entry is None:
                raise ValueError(f"tensor {name!r} is not in the tensor index")
            found = self._cache[name] = self._reader.tensor(entry)
        return found

    def load(self, handle: tuple) -> tuple:
        return tuple(None if name is None else self.tensor(name) for name in handle)

    def keep(self, tensors: tuple, name: str) -> Any:
        raise BundleError("A loaded bundle is read-only.", code="read_only_bundle")

    def close(self) -> None:
        """Nothing to release: tensors handed out keep their own maps."""


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
    if not root.exists():
        raise BundleError(f"{root}: no such bundle (the path does not exist).", code="bundle_missing",
                          remedy="Check the path; cap.save(path) writes a bundle there.")
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle (it is a file; a bundle is a directory).",
                          code="bundle_not_a_bundle",
                          remedy="Point bl.load at the directory cap.save(path) wrote.")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        if (root / STREAM_MARKER).exists():
            raise BundleError(
                f"{manifest_path}: missing: this is an unfinished bl.to_disk directory.",
                code="bundle_unfinished",
                remedy="Call cap.save() or cap.close() on the capture that streams here.",
            )
        raise BundleError(f"{manifest_path}: missing: {root} is not a backlens bundle.",
                          code="bundle_not_a_bundle",
                          remedy="Point bl.load at a directory cap.save(path) wrote.")
    manifest = manifest_io.read(manifest_path)
    tensors = BundleTensors(root, _check_tensors(root, manifest["tensors"], verify))
    try:
        state = decode_state(manifest, _Sections(manifest, tensors), tensors)
    except (ValueError, TypeError, KeyError) as exc:
        raise BundleError(f"{manifest_path}: {exc}.", code="bundle_corrupt",
                          remedy="The bundle is damaged or not of this format; save it again.") from exc
    info = BundleInfo(root, manifest["format_version"], manifest.get("backlens_version"),
                      manifest.get("torch_version"))
    return state, info


def _check_tensors(root: Path, section: Any, verify: bool) -> dict[str, TensorEntry]:
    manifest_path = root / MANIFEST
    try:
        files = dict(section["files"])
        entries = {
            str(name): TensorEntry(str(e["file"]), str(e["dtype"]), [int(n) for n in e["shape"]],
                                   [int(o) for o in e["offsets"]], str(e["sha256"]))
            for name, e in section["index"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BundleError(f"{manifest_path}: malformed tensor index ({exc}).", code="bundle_corrupt") from exc
    by_file: dict[str, dict[str, TensorEntry]] = {name: {} for name in files}
    for name, entry in entries.items():
        if entry.file not in by_file:
            raise BundleError(f"{manifest_path}: tensor {name!r} is in unlisted file {entry.file!r}.",
                              code="bundle_corrupt")
        if entry.dtype not in DTYPES:
            raise BundleError(f"{manifest_path}: tensor {name!r} has unknown dtype {entry.dtype!r}.",
                              code="bundle_corrupt")
        by_file[entry.file][name] = entry
    for file_name, info in files.items():
        if os.path.basename(file_name) != file_name or file_name.startswith(".") or not file_name:
            raise BundleError(f"{manifest_path}: bad shard file name {file_name!r}.", code="bundle_corrupt")
        _check_shard(root / file_name, info, by_file[file_name], verify)
    return entries


def _check_shard(path: Path, info: Any, entries: dict[str, TensorEntry], verify: bool) -> None:
    if not path.is_file():
        raise BundleError(f"{path}: missing tensor shard.", code="bundle_missing_file",
                          remedy="The bundle is incomplete; save it again.")
    try:
        size, digest = int(info["bytes"]), str(info["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{path}: malformed entry in the manifest ({exc}).", code="bundle_corrupt") from exc
    actual = path.stat().st_size
    if actual != size:
        what = "truncated" if actual < size else "has extra bytes"
        raise BundleError(f"{path}: {what} ({actual} bytes, the manifest says {size}).",
                          code="bundle_corrupt", remedy="The bundle is damaged; save it again.")
    header, header_size = read_header(path)
    header.pop("__metadata__", None)
    expected = {name: {"dtype": e.dtype, "shape": e.shape, "data_offsets": e.offsets}
                for name, e in entries.items()}
    if header != expected:
        raise BundleError(f"{path}: the shard's header does not match the manifest's tensor index.",
                          code="bundle_corrupt", remedy="The bundle is damaged; save it again.")
    data_start = 8 + header_size
    for name, entry in entries.items():
        begin, end = entry.offsets
        numel = 1
        for n in entry.shape:
            numel *= n
        if not (0 <= begin <= end and data_start + end <= size and end - begin == numel * ITEMSIZE[entry.dtype]):
            raise BundleError(f"{path}: tensor {name!r} has bad offsets {entry.offsets}.", code="bundle_corrupt")
    if not verify:
        return
    ranges = [(name, data_start + e.offsets[0], data_start + e.offsets[1]) for name, e in entries.items()]
    whole, _read, parts = hash_file(path, ranges)
    if whole != digest:
        raise BundleError(f"{path}: sha256 mismatch: the file is corrupt.", code="bundle_corrupt",
                          remedy="The bundle is damaged; save it again.")
    for name, entry in entries.items():
        if parts.get(name) != entry.sha256:
            raise BundleError(f"{path}: sha256 mismatch for tensor {name!r}.", code="bundle_corrupt",
                              remedy="The bundle is damaged; save it again.")
