"""Writing a derived-gradients bundle: its own small schema, defined here and read by derive/bundle.py.

Layout of the directory::

    manifest.json          the fields below, then "checksum"
    tensors.safetensors    every array, by the names the manifest gives

Manifest (``kind`` ``"derived"``, ``format_version`` 1)::

    format            "backlens.derived"
    kind              "derived"
    format_version    1
    backlens_version  str
    created           ISO time, UTC
    framework         str              framework_version  str
    output            {tensor, dtype, shape}
    leaf_grads        [{name, tensor, dtype, shape}]     in the record's order
    intermediates     null | {records: [{label, op, output_index, status,
                      tensor, dtype, shape}], withheld: {reason: count}, notes: [str]}
    notes             [str]
    file              {name: "tensors.safetensors", bytes, sha256}
    checksum          sha256 of the canonical JSON of every field above

Writing is crash-safe as for capture bundles (io/replace.py): the bundle
appears at its path whole, or not at all.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from backlens._version import __version__
from backlens.errors import BundleError
from backlens.io.disk_store import check_target
from backlens.io.replace import recover, write_whole

FORMAT = "backlens.derived"
KIND = "derived"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "float32", "float64")


def save(grads: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``grads`` (a :class:`~backlens.derive.record.DerivedGrads`) as a bundle at ``path`` (all or nothing); returns the path."""
    target = Path(path)
    check_target(target, overwrite)
    arrays: dict[str, np.ndarray] = {}

    def entry(key: str, array: np.ndarray) -> dict[str, Any]:
        array = np.require(array, requirements='C')  # (ascontiguousarray would make a 0-d array 1-d)
        if array.dtype.name not in DTYPES:
            raise BundleError(f"{target}: cannot store an array of dtype {array.dtype} ({key}).",
                              code="bundle_unsupported_dtype", remedy="Cast the gradients to float32.")
        arrays[key] = array
        return {"tensor": key, "dtype": array.dtype.name, "shape": list(array.shape)}

    body: dict[str, Any] = {
        "format": FORMAT,
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "backlens_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "framework": grads.framework,
        "framework_version": grads.version,
        "output": entry("output", grads.output),
        "leaf_grads": [{"name": name, **entry(f"leaf.{i}", g)}
                       for i, (name, g) in enumerate(grads.leaf_grads.items())],
        "intermediates": None,
        "notes": list(grads.notes),
    }
    if grads.intermediates is not None:
        body["intermediates"] = {
            "records": [{"label": r.label, "op": r.op, "output_index": r.output_index, "status": r.status,
                         **entry(f"intermediate.{i}", r.grad)}
                        for i, r in enumerate(grads.intermediates)],
            "withheld": dict(grads.intermediates.withheld),
            "notes": list(grads.intermediates.notes),
        }
    payload = safetensors.numpy.save(arrays)
    body["file"] = {"name": TENSORS, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    body["checksum"] = checksum(body)

    recover(target)
    def write(directory: Path) -> None:
        _write_file(directory / TENSORS, payload)
        _write_file(directory / MANIFEST, json.dumps(body, indent=1).encode("utf-8"))

    return write_whole(target, overwrite, write)


def checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
