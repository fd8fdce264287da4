"""Reading a derived-gradients bundle (its layout: derive/saving.py).

Reading trusts nothing in the directory and shares capture bundles' file
access (io/files.py: nothing outside the directory opened, no link followed,
sizes and JSON depth bounded): every field is checked against this schema
(exact key sets, types, ranges); the one tensor file has a fixed name and its
bytes are hashed before they are parsed, from the same bytes in memory; every
array's name, dtype and shape must be the manifest's. Nothing the manifest
names is imported or instantiated. Any problem is a :class:`BundleError`
naming the file.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from backlens._version import __version__
from backlens.derive.record import EXACT, DerivedGrads, IntermediateGrad, IntermediateGrads
from backlens.derive.saving import DTYPES, FORMAT, FORMAT_VERSION, KIND, MANIFEST, TENSORS, checksum
from backlens.errors import BundleError
from backlens.io.files import BundleDir, manifest_is, parse_json, read_exact

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_MEMORY = 384 * 1024 * 1024  # what reading the manifest may take (io/files.parse_json)
MAX_SHAPE_PRODUCT = 2**62  # sizes multiplying past this overflow numpy's and torch's 64-bit sizes
_OPENING = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"backlens\.derived"\s*,\s*"kind"\s*:\s*"derived"')


def is_derived(root: str | os.PathLike) -> bool:
    """Whether the bundle directory ``root`` holds a derived-gradients manifest (top-level
    ``"kind": "derived"``). A cheap test that never raises; a full, checked read is :func:`load`'s job.

    A small manifest is parsed; a large one is recognised by its opening, which
    derive/saving.py always writes ``{"format": "backlens.derived", "kind": "derived"``.
    """
    return manifest_is(root, MANIFEST, _OPENING, lambda manifest: manifest.get("kind") == KIND)


def load(root: str | os.PathLike, *, verify: bool = True) -> DerivedGrads:
    """Read the derived-gradients bundle at ``root``, checking it all first.

    ``verify`` is accepted for symmetry with capture bundles: the one tensor
    file is always hashed, since it is read whole anyway.
    """
    directory = BundleDir(root)
    manifest_path = directory.path(MANIFEST)
    manifest = _read_manifest(directory)
    arrays = _read_tensors(directory, manifest["file"])
    return _build(manifest, arrays, manifest_path)


def _read_manifest(directory: BundleDir) -> dict[str, Any]:
    path = directory.path(MANIFEST)
    manifest = parse_json(directory.read(MANIFEST, MAX_MANIFEST_BYTES, "derived bundle manifest"), path,
                          "manifest", max_memory=MAX_MANIFEST_MEMORY)
    fail = _Checker(path)
    fail.keys(manifest, "manifest", {"format", "kind", "format_version", "backlens_version", "created",
                                     "framework", "framework_version", "output", "leaf_grads",
                                     "intermediates", "notes", "file", "checksum"})
    if manifest["format"] != FORMAT or manifest["kind"] != KIND:
        raise BundleError(f"{path}: not a derived-gradients manifest (format {manifest['format']!r}, "
                          f"kind {manifest['kind']!r}).", code="bundle_not_a_bundle")
    version = manifest["format_version"]
    fail.integer(version, "format_version", minimum=1)
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{path}: written in derived bundle format version {version} (by backlens "
            f"{manifest['backlens_version']!r}); this backlens ({__version__}) reads up to {FORMAT_VERSION}.",
            code="bundle_too_new", remedy="Upgrade backlens to load this bundle.")
    if manifest["checksum"] != checksum(manifest):
        raise BundleError(f"{path}: checksum mismatch: the manifest was changed or corrupted.",
                          code="bundle_corrupt", remedy="The bundle is damaged; save it again.")
    for name in ("backlens_version", "created", "framework", "framework_version"):
        fail.string(manifest[name], name)
    fail.tensor_ref(manifest["output"], "output", set())
    fail.keys(manifest["file"], "file", {"name", "bytes", "sha256"})
    if manifest["file"]["name"] != TENSORS:
        fail.wrong("file.name", f"must be {TENSORS!r}")
    fail.integer(manifest["file"]["bytes"], "file.bytes", minimum=8)
    fail.string(manifest["file"]["sha256"], "file.sha256")
    fail.strings(manifest["notes"], "notes")
    fail.list(manifest["leaf_grads"], "leaf_grads")
    names = set()
    for i, leaf in enumerate(manifest["leaf_grads"]):
        fail.tensor_ref(leaf, f"leaf_grads[{i}]", {"name"})
        fail.string(leaf["name"], f"leaf_grads[{i}].name")
        if leaf["name"] in names:
            fail.wrong(f"leaf_grads[{i}].name", f"repeats {leaf['name'][:80]!r}")
        names.add(leaf["name"])
    inter = manifest["intermediates"]
    if inter is not None:
        fail.keys(inter, "intermediates", {"records", "withheld", "notes"})
        fail.list(inter["records"], "intermediates.records")
        labels: set[str] = set()
        for i, record in enumerate(inter["records"]):
            where = f"intermediates.records[{i}]"
            fail.tensor_ref(record, where, {"label", "op", "output_index", "status"})
            fail.string(record["label"], f"{where}.label")
            fail.string(record["op"], f"{where}.op")
            fail.integer(record["output_index"], f"{where}.output_index", minimum=0)
            if record["status"] != EXACT:
                fail.wrong(f"{where}.status", f"must be {EXACT!r}")
            if record["label"] in labels:
                fail.wrong(f"{where}.label", f"repeats {record['label'][:80]!r}")
            labels.add(record["label"])
        if not isinstance(inter["withheld"], dict):
            fail.wrong("intermediates.withheld", "must be an object")
        for reason, count in inter["withheld"].items():
            fail.string(reason, "intermediates.withheld key")
            fail.integer(count, f"intermediates.withheld[{reason!r}]", minimum=0)
        fail.strings(inter["notes"], "intermediates.notes")
    tensors = [manifest["output"]["tensor"], *(leaf["tensor"] for leaf in manifest["leaf_grads"]),
               *(r["tensor"] for r in (inter or {}).get("records", []))]
    if len(set(tensors)) != len(tensors):
        fail.wrong("tensor names", "two fields name the same tensor")
    return manifest


class _Checker:
    """Schema checks that raise BundleError naming the manifest and the field."""

    def __init__(self, path: Path):
        self.path = path

    def wrong(self, field: str, what: str) -> None:
        raise BundleError(f"{self.path}: field {field[:200]} {what[:400]}.", code="bundle_corrupt",
                          remedy="The bundle is damaged or was not written by backlens; save it again.")

    def keys(self, value: Any, field: str, expected: set[str]) -> None:
        if not isinstance(value, dict):
            self.wrong(field, "must be an object")
        if set(value) != expected:
            missing, extra = sorted(expected - set(value)), sorted(set(value) - expected)[:10]
            self.wrong(field, f"has the wrong keys (missing {missing}, unexpected {extra})")

    def string(self, value: Any, field: str) -> None:
        if not isinstance(value, str):
            self.wrong(field, "must be a string")

    def strings(self, value: Any, field: str) -> None:
        self.list(value, field)
        for i, item in enumerate(value):
            self.string(item, f"{field}[{i}]")

    def list(self, value: Any, field: str) -> None:
        if not isinstance(value, list):
            self.wrong(field, "must be a list")

    def integer(self, value: Any, field: str, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.wrong(field, f"must be an integer >= {minimum}")

    def tensor_ref(self, value: Any, field: str, other_keys: set[str]) -> None:
        self.keys(value, field, {"tensor", "dtype", "shape"} | other_keys)
        self.string(value["tensor"], f"{field}.tensor")
        if value["dtype"] not in DTYPES:
            self.wrong(f"{field}.dtype", f"is not one of {', '.join(DTYPES)}")
        self.list(value["shape"], f"{field}.shape")
        for n in value["shape"]:
            self.integer(n, f"{field}.shape", minimum=0)
        if len(value["shape"]) > 64 or math.prod(max(n, 1) for n in value["shape"]) > MAX_SHAPE_PRODUCT:
            self.wrong(f"{field}.shape", "has more than 64 sizes or sizes that multiply past 2**62")


def _read_tensors(directory: BundleDir, info: dict[str, Any]) -> dict[str, np.ndarray]:
    path = directory.path(TENSORS)
    descriptor = directory.open(TENSORS, expected_size=info["bytes"])
    try:
        data = bytes(read_exact(descriptor, info["bytes"], 0, path))
    finally:
        os.close(descriptor)
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise BundleError(f"{path}: sha256 mismatch: the file is corrupt.", code="bundle_corrupt",
                          remedy="The bundle is damaged; save it again.")
    try:
        return safetensors.numpy.load(data)
    except Exception as exc:  # the parser's own error types vary by version
        raise BundleError(f"{path}: not a readable safetensors file ({exc}).", code="bundle_corrupt",
                          remedy="The bundle is damaged; save it again.") from exc


def _build(manifest: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> DerivedGrads:
    inter = manifest["intermediates"]
    refs = [manifest["output"], *manifest["leaf_grads"], *((inter or {}).get("records", []))]
    if set(arrays) != {ref["tensor"] for ref in refs}:
        raise BundleError(f"{path.parent / TENSORS}: holds arrays {sorted(arrays)[:10]}, not the ones the "
                          "manifest lists.", code="bundle_corrupt", remedy="The bundle is damaged; save it again.")

    def array(ref: dict[str, Any]) -> np.ndarray:
        value = arrays[ref["tensor"]]
        if value.dtype.name != ref["dtype"] or list(value.shape) != ref["shape"]:
            raise BundleError(f"{path.parent / TENSORS}: array {ref['tensor']!r} is {value.dtype}{list(value.shape)}, "
                              f"the manifest says {ref['dtype']}{ref['shape']}.", code="bundle_corrupt",
                              remedy="The bundle is damaged; save it again.")
        return value

    intermediates = None
    if inter is not None:
        intermediates = IntermediateGrads(
            [IntermediateGrad(r["label"], r["op"], r["output_index"], array(r), r["status"])
             for r in inter["records"]],
            inter["withheld"], inter["notes"])
    return DerivedGrads(
        framework=manifest["framework"],
        version=manifest["framework_version"],
        output=array(manifest["output"]),
        leaf_grads={leaf["name"]: array(leaf) for leaf in manifest["leaf_grads"]},
        intermediates=intermediates,
        notes=tuple(manifest["notes"]),
    )
