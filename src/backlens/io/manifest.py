"""The bundle manifest: a capture state as JSON, sealed with a checksum, and reading it back safely.

Layout (``FORMAT_VERSION`` 3; the sections and their fields are io/schema.py's)::

    format, format_version, backlens_version, torch_version, created
    capture, sources, module_types        flags of the capture (rank and world_size under
                                          torch.distributed, else null); the tensors that existed
                                          before the forward; module types by address
    ops, modules, params, inputs,         one object per entry of the state, with exactly
    grad_fns, calls, passes,              the fields its schema names; relations by position
    collectives
    grad_slots                            which node output holds each op's, module call's,
                                          parameter's and input's gradient
    forward_edits                         the activation edits applied in the forward
    cost                                  the cost journal (FLOPs per op and per pass), or null
    checkpoints                           each torch.utils.checkpoint invocation and its
                                          recomputations, with the verdict's reasons, or null
    memory                                what a memory=True capture saw autograd hold (storages,
                                          saves, releases, node fires), or null
    tensors                               files: {name: {bytes, sha256}}; index: {tensor name:
                                          {file, dtype, shape, offsets, sha256}}
    checksum                              sha256 of the canonical JSON of everything above

A change that a reader of this version would misread bumps ``FORMAT_VERSION``
and adds a migration from the version before (``MIGRATIONS``); a bundle of a
version with no migration is refused with the version it needs.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backlens._version import __version__
from backlens.errors import BundleError
from backlens.io.files import BundleDir, parse_json
from backlens.io.names import MANIFEST
from backlens.io.schema import SECTIONS, encode_state
from backlens.io.shards import ShardWriter

FORMAT = "backlens.bundle"
FORMAT_VERSION = 3
MAX_MANIFEST_BYTES = 256 << 20  # a bound on what a manifest may cost before it is checked
# A bound on the memory reading a manifest may take (its bytes, their text and the parsed objects,
# estimated from the bytes before parsing; io/files.parse_json also bounds it at 16 times the size):
# a manifest backlens writes costs 5 to 7 times its size (under 2 GiB at the size bound); a file of
# tiny objects would cost 30 times.
MAX_MANIFEST_MEMORY = 2 << 30
HEADER = ("format", "format_version", "backlens_version", "torch_version", "created")

# Upgrades from an older format version to the next one: version -> fn(manifest) -> manifest.
# Version 1 (records by dataclass field, values tagged by type) has none: it is refused.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def _times_unknown(manifest: dict[str, Any]) -> dict[str, Any]:
    """Version 2 -> 3: version 3 adds when each forward op and module call ran, each op's
    call site, each ATen call's start and end and the clock offsets that put all times on
    torch.profiler's clock; a version 2 bundle knows none of them (null). The memory section
    came late in version 2 (a bundle written before it has none: nothing was recorded)."""
    def each(section: Any) -> list:
        return section if isinstance(section, list) else []

    for op in each(manifest.get("ops")):
        if isinstance(op, dict):
            op.update(start_ns=None, end_ns=None, call_site=None)
    for call in each(manifest.get("modules")):
        if isinstance(call, dict):
            call.update(start_ns=None, end_ns=None)
    for entry in each(manifest.get("passes")):
        if isinstance(entry, dict):
            entry["clock_offset_ns"] = None
    if isinstance(manifest.get("capture"), dict):
        manifest["capture"]["forward_clock_offset_ns"] = None
    cost = manifest.get("cost")
    for pass_cost in each(cost.get("passes") if isinstance(cost, dict) else None):
        if isinstance(pass_cost, dict) and isinstance(pass_cost.get("aten_ops"), dict):
            pass_cost["aten_ops"].update(start_ns=None, end_ns=None)
    manifest.setdefault("memory", None)
    manifest["format_version"] = 3
    return manifest


MIGRATIONS[2] = _times_unknown


class Refs:
    """How a manifest refers to tensors: each goes into ``writer`` (deduplicated by
    content) and is named there. Call gradients are read through ``store``; those a
    ``to_disk`` capture streamed into this very directory (``streamed``) are named as they are."""

    def __init__(self, writer: ShardWriter, store: Any, streamed: bool = False):
        self.writer = writer
        self.store = store
        self.streamed = streamed

    def tensor(self, tensor: torch.Tensor) -> str:
        return self.writer.add(tensor)

    def side(self, handle: tuple) -> list[str | None]:
        if self.streamed:
            return [item if item is None or isinstance(item, str) else self.tensor(item) for item in handle]
        return [None if t is None else self.tensor(t) for t in self.store.load(handle)]


def tensor_section(writers: list[ShardWriter]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    index: dict[str, Any] = {}
    for writer in writers:
        files.update(writer.files)
        index.update({name: entry.to_json() for name, entry in writer.index.items()})
    return {"files": files, "index": index}


def build(state: Any, refs: Any) -> dict[str, Any]:
    """The manifest body of ``state`` (no ``tensors``/``checksum`` yet)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "backlens_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **encode_state(state, refs),
    }


def checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def write(directory: Path, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename)."""
    manifest = dict(body)
    manifest["checksum"] = checksum(body)
    temporary = directory / (MANIFEST + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(directory / MANIFEST)


def read(directory: BundleDir) -> dict[str, Any]:
    """Read, parse, check and migrate a bundle directory's manifest.json; BundleError on any problem.

    The file is refused before it is read when larger than ``MAX_MANIFEST_BYTES``, and before it is
    parsed when parsing it would take more than ``MAX_MANIFEST_MEMORY``.
    """
    path = directory.path(MANIFEST)
    raw = directory.read(MANIFEST, MAX_MANIFEST_BYTES, "bundle manifest")
    manifest = parse_json(raw, path, "manifest", max_memory=MAX_MANIFEST_MEMORY)
    del raw
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: not a backlens bundle manifest (no \"format\": \"{FORMAT}\").",
                          code="bundle_not_a_bundle")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BundleError(f"{path}: bad format_version {str(version)[:40]!r}.", code="bundle_corrupt")
    for field in ("backlens_version", "torch_version", "created"):
        if not isinstance(manifest.get(field), str):
            raise BundleError(f"{path}: field {field}: expected a string, got {str(manifest.get(field))[:40]!r}.",
                              code="bundle_corrupt", remedy="The bundle is damaged; save it again.")
    written_by = manifest["backlens_version"][:40]
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{path}: written in bundle format version {version} (by backlens {written_by}); this backlens "
            f"({__version__}) reads versions up to {FORMAT_VERSION}.",
            code="bundle_too_new",
            remedy="Upgrade backlens to load this bundle.",
        )
    stated = manifest.pop("checksum", None)
    if not isinstance(stated, str):
        raise BundleError(f"{path}: the manifest has no checksum.", code="bundle_corrupt")
    if checksum(manifest) != stated:
        raise BundleError(f"{path}: checksum mismatch: the manifest was changed or corrupted.",
                          code="bundle_corrupt")
    while manifest["format_version"] < FORMAT_VERSION:
        before = manifest["format_version"]
        step = MIGRATIONS.get(before)
        if step is None:
            raise BundleError(
                f"{path}: written in bundle format version {before} (by backlens {written_by}); this backlens "
                f"({__version__}) reads format version {FORMAT_VERSION} and cannot migrate version {before}.",
                code="bundle_too_old",
                remedy=f"Load it with a backlens that reads format version {before} (backlens {written_by} "
                "wrote it) and capture again with this one.",
            )
        manifest = step(dict(manifest))
        if manifest.get("format_version") != before + 1:
            raise BundleError(f"{path}: migration from format version {before} failed.", code="bundle_too_old")
    expected = {*HEADER, *SECTIONS, "tensors"}
    if manifest.keys() != expected:
        unknown, missing = sorted(set(manifest) - expected)[:10], sorted(expected - set(manifest))
        raise BundleError(f"{path}: the manifest's sections differ from format version {FORMAT_VERSION}'s "
                          f"(unknown: {unknown}, missing: {missing}).", code="bundle_corrupt")
    return manifest
