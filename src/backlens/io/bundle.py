"""``cap.save(path)`` and ``bl.load(path)``: bundles on disk (API.md §6).

A bundle is a directory: ``manifest.json`` (see io/manifest.py) and
safetensors shards. No pickle anywhere.

Writing is all-or-nothing: a new bundle is built in a hidden temporary
directory beside ``path`` and renamed into place at the end; on any error the
temporary directory is removed and ``path`` is left as it was. An existing
path is refused unless ``overwrite=True``, and even then only a bundle (or an
empty directory) is replaced, never another directory.

Reading checks everything before a record is built: the manifest's format,
version and checksum, every shard's presence, size, header and sha256 (and
each tensor's sha256). Any problem is a :class:`BundleError` naming the file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from backlens.derive import bundle as derived_bundle
from backlens.errors import BundleError
from backlens.io import manifest as manifest_io
from backlens.io.disk_store import MANIFEST, STREAM_MARKER, DiskStore, check_target
from backlens.io.loaded import LoadedCapture, TensorIndex
from backlens.io.shards import DTYPES, ITEMSIZE, ShardWriter, TensorEntry, hash_file, read_header

# -- writing -------------------------------------------------------------------------

class _WriterRefs(manifest_io.Refs):
    """Tensors go into a fresh shard writer (deduplicated by content)."""

    def __init__(self, writer: ShardWriter):
        self.writer = writer

    def tensor(self, tensor: torch.Tensor) -> str:
        return self.writer.add(tensor)


class _StreamRefs(_WriterRefs):
    """A ``to_disk`` capture's call gradients are already in its shards: refer to them."""

    def __init__(self, writer: ShardWriter, capture: Any):
        super().__init__(writer)
        # The backward journal's entries hold the store's handles (tensor names).
        self.entries = capture._backward.calls

    def call_side(self, position: int, side: str, tensors: tuple | None) -> Any:
        handle = getattr(self.entries[position], side)
        if handle is None:
            return None
        names = [item if item is None or isinstance(item, str) else self.tensor(item) for item in handle]
        return manifest_io.side_json(names)


def _tensor_section(writers: list[ShardWriter]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    index: dict[str, Any] = {}
    for writer in writers:
        files.update(writer.files)
        index.update({name: entry.to_json() for name, entry in writer.index.items()})
    return {"files": files, "index": index}


def save(capture: Any, path: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Write ``capture`` as a bundle at ``path``; returns the bundle's path.

    For a ``storage=bl.to_disk(dir)`` capture, ``path`` may be left out (or be
    ``dir``): the manifest is then written into ``dir`` beside the shards
    already there, which makes it a bundle.
    """
    store = getattr(capture, "_store", None)
    if isinstance(store, DiskStore) and (path is None or _same_path(path, store.path)):
        finish_stream(capture, store)
        return store.path
    if path is None:
        raise BundleError(
            "cap.save() needs a path: this capture keeps its tensors in memory.",
            code="bundle_path_required",
            remedy="Pass a directory path: cap.save('runs/capture1').",
        )
    target = Path(path)
    check_target(target, overwrite)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        temporary = parent / f".{target.name}.partial-{uuid.uuid4().hex[:12]}"
        temporary.mkdir()
    except OSError as exc:
        raise BundleError(f"{target}: cannot write here ({exc.strerror or exc}).",
                          code="bundle_write_failed", remedy="Choose a writable location.") from exc
    try:
        if isinstance(capture, LoadedCapture):
            _copy_loaded(capture, temporary)
        else:
            writer = ShardWriter(temporary, "tensors")
            body = manifest_io.build(capture, _WriterRefs(writer))
            writer.flush()
            body["tensors"] = _tensor_section([writer])
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


def finish_stream(capture: Any, store: DiskStore) -> None:
    """Write the manifest of a ``to_disk`` capture into its own directory."""
    directory = store.path
    store.flush()
    store.finished_manifests += 1
    extras = ShardWriter(directory, f"extra{store.finished_manifests}")
    try:
        body = manifest_io.build(capture, _StreamRefs(extras, capture))
        extras.flush()
        body["tensors"] = _tensor_section([store.writer, extras])
        manifest_io.write(directory, body)
    except OSError as exc:
        raise BundleError(f"{directory}: writing the bundle manifest failed ({exc.strerror or exc}).",
                          code="bundle_write_failed",
                          remedy="Free disk space or choose a writable location.") from exc
    referenced = set(body["tensors"]["files"])
    for leftover in directory.glob("extra*-*.safetensors"):
        if leftover.name not in referenced:  # the extras of an earlier save
            leftover.unlink(missing_ok=True)
    (directory / STREAM_MARKER).unlink(missing_ok=True)


def _same_path(a: Any, b: Path) -> bool:
    return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))


def _move_into_place(temporary: Path, target: Path, overwrite: bool) -> None:
    old = None
    if target.exists() and any(target.iterdir()):
        if not overwrite:  # appeared while we were writing
            raise BundleError(f"{target}: already exists.", code="bundle_exists",
                              remedy="Choose a new path, or pass overwrite=True.")
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(target, old)
    try:
        os.rename(temporary, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy_loaded(loaded: LoadedCapture, temporary: Path) -> None:
    for name in loaded._manifest["tensors"]["files"]:
        shutil.copyfile(loaded.path / name, temporary / name)
    body = {k: v for k, v in loaded._manifest.items() if k != "checksum"}
    manifest_io.write(temporary, body)


# -- reading -------------------------------------------------------------------------

def load(path: str | os.PathLike, *, verify: bool = True) -> LoadedCapture:
    """Read the bundle at ``path`` as a read-only capture.

    ``verify=False`` skips hashing the shards (faster for very large bundles);
    sizes and headers are still checked.
    """
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
    if derived_bundle.is_derived(root):
        return derived_bundle.load(root, verify=verify)
    manifest = manifest_io.read(manifest_path)
    entries = _check_tensors(root, manifest["tensors"], verify)
    return LoadedCapture(root, manifest, TensorIndex(root, entries))


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
