"""Safetensors shards: a streaming, content-deduplicating writer and a lazy reader.

The files are plain safetensors (8-byte little-endian header length, a JSON
header padded with spaces to 8 bytes, then the tensors' bytes with no holes),
readable by ``safetensors.torch.load_file``. backlens writes them itself so a
shard is streamed from the tensors' own memory, never built as one ``bytes``.

Contracts:

* :class:`ShardWriter` takes tensors one at a time (``add`` returns the
  tensor's name), keeps at most ``shard_bytes`` of copies in memory, and
  writes a shard whenever that fills. Equal tensors (same bytes, dtype and
  shape) are stored once under one name.
* Inside a shard, tensors are ordered by element size (largest first), so
  every tensor starts at a multiple of its element size and maps without a copy.
* :class:`ShardReader` maps shard files copy-on-write: a tensor it returns
  costs no memory until its pages are read, and writing to it never changes
  the file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backlens.errors import BundleError
from backlens.io.names import shard_file

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _code, _name in (
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
):
    if hasattr(torch, _name):
        DTYPES[_code] = getattr(torch, _name)
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
ITEMSIZE: dict[str, int] = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in DTYPES.items()}

DEFAULT_SHARD_BYTES = 16 << 20
_HEADER_LIMIT = 100 << 20  # a header larger than this is corruption, not data
_METADATA = {"format": "backlens"}


@dataclass
class TensorEntry:
    """Where one stored tensor lives and what it is."""

    file: str
    dtype: str
    shape: list[int]
    offsets: list[int]  # [begin, end) in the shard's data section
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape),
                "offsets": list(self.offsets), "sha256": self.sha256}


def snapshot(tensor: torch.Tensor) -> np.ndarray:
    """A private copy of a tensor's bytes (1-D uint8, C order).

    For a contiguous CPU tensor the bytes are copied straight from its memory,
    with no ATen call, so the copy is invisible to dispatch modes (the backward
    FLOP census) and cheap. Other tensors are made CPU-contiguous first.
    """
    t = tensor
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    if t.is_conj() or t.is_neg():
        t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
    return np.frombuffer(raw, dtype=np.uint8).copy()


def storable(tensor: Any) -> bool:
    """Whether a tensor can go into a shard (dense, of a safetensors dtype)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.layout == torch.strided
        and tensor.dtype in CODES
        and tensor.device.type != "meta"
    )


class ShardWriter:
    """Streams tensors into ``{prefix}-{n:05d}.safetensors`` files in ``directory``.

    Names are ``{prefix}/{k}``. ``index`` maps each name to its
    :class:`TensorEntry`; ``files`` maps each written file to its size and sha256.
    ``add`` copies the tensor's bytes at once (autograd may change a tensor in
    place later, e.g. when accumulating into a buffer); at most ``shard_bytes``
    of such copies wait for ``flush``.
    """

    def __init__(self, directory: Path, prefix: str, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = Path(directory)
        self.prefix = prefix
        self.shard_bytes = max(int(shard_bytes), 1)
        self.index: dict[str, TensorEntry] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self._by_content: dict[tuple, str] = {}
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._count = 0
        self._shard = 0

    def add(self, tensor: torch.Tensor) -> str:
        """Store ``tensor`` (its value now) and return its name."""
        if not storable(tensor):
            raise BundleError(
                f"Cannot store a tensor of dtype {tensor.dtype} and layout {tensor.layout} "
                "in a safetensors shard.",
                code="bundle_unsupported_tensor",
                remedy="Save dense tensors of a standard dtype (convert with .to_dense() / .float()).",
            )
        data = snapshot(tensor)
        digest = hashlib.sha256(data).hexdigest()
        key = (digest, tensor.dtype, tuple(tensor.shape))
        known = self._by_content.get(key)
        if known is not None:
            return known
        self._count += 1
        name = f"{self.prefix}/{self._count}"
        self._by_content[key] = name
        self.index[name] = TensorEntry("", CODES[tensor.dtype], list(tensor.shape), [0, 0], digest)
        self._pending.append((name, data))
        self._pending_bytes += data.nbytes
        if self._pending_bytes >= self.shard_bytes:
            self.flush()
        return name

    def is_pending(self, name: str) -> bool:
        entry = self.index.get(name)
        return entry is not None and entry.file == ""

    def flush(self) -> None:
        """Write every pending tensor as one shard file."""
        if not self._pending:
            return
        self._shard += 1
        file_name = shard_file(self.prefix, self._shard)
        path = self.directory / file_name
        index = self.index
        pending = sorted(self._pending, key=lambda item: -ITEMSIZE[index[item[0]].dtype])
        header: dict[str, Any] = {"__metadata__": _METADATA}
        offset = 0
        for name, data in pending:
            end = offset + data.nbytes
            header[name] = {"dtype": index[name].dtype, "shape": list(index[name].shape),
                            "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        digest = hashlib.sha256()
        try:
            with open(path, "wb") as handle:
                for chunk in (struct.pack("<Q", len(text)), text):
                    handle.write(chunk)
                    digest.update(chunk)
                for _name, data in pending:
                    handle.write(data)
                    digest.update(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise BundleError(
                f"{path}: cannot write tensor shard ({exc.strerror or exc}).",
                code="bundle_write_failed",
                remedy="Choose a writable location with enough free space.",
            ) from exc
        for name, _tensor in pending:
            entry = self.index[name]
            entry.file = file_name
            entry.offsets = list(header[name]["data_offsets"])
        self.files[file_name] = {"bytes": 8 + len(text) + offset, "sha256": digest.hexdigest()}
        self._pending = []
        self._pending_bytes = 0


class ShardReader:
    """Reads tensors out of shard files in ``directory`` lazily (memory-mapped)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._maps: dict[str, tuple[np.memmap, int]] = {}

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor ``entry`` describes, mapped copy-on-write from its shard."""
        mapped, data_start = self._map(entry.file)
        begin, end = entry.offsets
        dtype = DTYPES[entry.dtype]
        if end == begin:
            return torch.empty(entry.shape, dtype=dtype)
        raw = torch.from_numpy(mapped[data_start + begin:data_start + end])
        return raw.view(dtype).reshape(entry.shape)

    def _map(self, file_name: str) -> tuple[np.memmap, int]:
        found = self._maps.get(file_name)
        if found is None:
            path = self.directory / file_name
            try:
                header_size = read_header(path)[1]
                mapped = np.memmap(path, dtype=np.uint8, mode="c")
            except OSError as exc:
                raise BundleError(f"{path}: cannot read tensor shard ({exc.strerror or exc}).",
                                  code="bundle_missing_file") from exc
            found = self._maps[file_name] = (mapped, 8 + header_size)
        return found

    def close(self) -> None:
        """Forget the maps; tensors already returned keep their own."""
        self._maps.clear()


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a shard and its length in bytes."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise BundleError(f"{path}: truncated tensor shard (no header).", code="bundle_corrupt")
        (size,) = struct.unpack("<Q", head)
        if size > _HEADER_LIMIT:
            raise BundleError(f"{path}: corrupt tensor shard (header length {size}).",
                              code="bundle_corrupt")
        text = handle.read(size)
    if len(text) < size:
        raise BundleError(f"{path}: truncated tensor shard (header cut short).", code="bundle_corrupt")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"{path}: corrupt tensor shard header ({exc}).", code="bundle_corrupt") from exc
    if not isinstance(header, dict):
        raise BundleError(f"{path}: corrupt tensor shard header (not an object).", code="bundle_corrupt")
    return header, size


def hash_file(path: Path, ranges: list[tuple[str, int, int]]) -> tuple[str, int, dict[str, str]]:
    """One read of ``path``: its sha256, its size, and the sha256 of each named byte range.

    Ranges are ``(name, begin, end)`` in file offsets and must not overlap.
    """
    whole = hashlib.sha256()
    parts: dict[str, str] = {}
    ordered = sorted(ranges, key=lambda r: r[1])
    position = 0
    with open(path, "rb") as handle:
        def read_to(stop: int, part: Any = None) -> None:
            nonlocal position
            while position < stop:
                chunk = handle.read(min(1 << 20, stop - position))
                if not chunk:
                    return
                whole.update(chunk)
                if part is not None:
                    part.update(chunk)
                position += len(chunk)

        for name, begin, end in ordered:
            read_to(begin)
            part = hashlib.sha256()
            read_to(end, part)
            parts[name] = part.hexdigest()
        while True:
            chunk = handle.read(1 << 20)
            if not chunk:
                break
            whole.update(chunk)
            position += len(chunk)
    return whole.hexdigest(), position, parts
