"""Safetensors shards: a streaming, content-deduplicating writer and a checking reader.

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
  every tensor starts at a multiple of its element size.
* :class:`ShardReader` reads each tensor into memory of its own when it is
  asked for and checks its sha256 first: a shard changed or truncated later
  raises :class:`BundleError` and never changes a tensor already returned.
  (Shards are not memory-mapped: a mapped file truncated under a reader kills
  the process with SIGBUS.)
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backlens.errors import BundleError
from backlens.io.files import MAX_JSON_MEMORY, BundleDir, damaged, parse_json, read_exact
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
SHARD_METADATA = {"format": "backlens"}


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

    def __init__(self, directory: Path, prefix: str, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 advance: Callable[[float], None] | None = None):
        self.directory = Path(directory)
        self.advance = advance  # told of the bytes of every tensor stored (a progress bar)
        self.prefix = prefix
        self.shard_bytes = max(int(shard_bytes), 1)
        self.index: dict[str, TensorEntry] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.data_starts: dict[str, int] = {}  # file -> offset of its data section
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
        if self.advance is not None:  # every tensor handed in counts, also one stored before (a bar's total)
            self.advance(data.nbytes)
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

    def drop_pending(self) -> None:
        """Forget the tensors not written yet (after a write failed: memory stays bounded)."""
        for name, _data in self._pending:
            self.index.pop(name, None)
        self._by_content = {key: name for key, name in self._by_content.items() if name in self.index}
        self._pending = []
        self._pending_bytes = 0

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
        header: dict[str, Any] = {"__metadata__": SHARD_METADATA}
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
            try:
                path.unlink()  # a partial shard only takes space
            except OSError:
                pass
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
        self.data_starts[file_name] = 8 + len(text)
        self._pending = []
        self._pending_bytes = 0


class ShardReader:
    """Reads tensors out of the shard files of a bundle directory, one checked copy at a time.

    ``data_starts`` maps a file name to where its data section starts (8 bytes
    plus its header); a file not in it has its header length read first. Each
    tensor is read into memory of its own and its sha256 checked against its
    entry before it is returned, so a shard changed, replaced or truncated
    after the bundle was written or loaded raises :class:`BundleError` and
    never changes a tensor already handed out.
    """

    def __init__(self, directory: BundleDir | Path, data_starts: dict[str, int] | None = None):
        self.directory = directory if isinstance(directory, BundleDir) else BundleDir(directory)
        self.data_starts = data_starts if data_starts is not None else {}

    def tensor(self, name: str, entry: TensorEntry) -> torch.Tensor:
        """The tensor ``entry`` describes, read from its shard and checked."""
        begin, end = entry.offsets
        dtype = DTYPES[entry.dtype]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        path = self.directory.path(entry.file)
        if end > begin:
            descriptor = self.directory.open(entry.file)
            try:
                start = self.data_starts.get(entry.file)
                if start is None:
                    start = self.data_starts[entry.file] = 8 + read_header(descriptor, path)[1]
                read_exact(descriptor, end - begin, start + begin, path, into=raw.numpy())
            finally:
                os.close(descriptor)
        if hashlib.sha256(raw.numpy()).hexdigest() != entry.sha256:
            raise damaged(f"{path}: tensor {name!r} does not match its sha256 (the shard was changed after "
                          "the bundle was written).")
        return raw.view(dtype).reshape(entry.shape)

    def close(self) -> None:
        """Nothing is held open between reads."""


def read_header(descriptor: int, path: Path, limit: int = _HEADER_LIMIT) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of the shard open at ``descriptor`` and its length in bytes.

    A header longer than ``limit`` (or than the file) is refused before it is read.
    """
    size_of_file = os.fstat(descriptor).st_size
    if size_of_file < 8:
        raise damaged(f"{path}: truncated tensor shard (no header).")
    (size,) = struct.unpack("<Q", read_exact(descriptor, 8, 0, path))
    if size > min(limit, size_of_file - 8):
        raise damaged(f"{path}: corrupt tensor shard (header length {size}; its tensors need at most "
                      f"{min(limit, size_of_file - 8)}).")
    # A header backlens writes costs about 7 times its size once parsed; its size is bounded above.
    header = parse_json(read_exact(descriptor, size, 8, path), path, "tensor shard header", max_depth=4,
                        max_memory=max(MAX_JSON_MEMORY, 16 * size))
    if not isinstance(header, dict):
        raise damaged(f"{path}: corrupt tensor shard header (not an object).")
    return header, size


def hash_file(descriptor: int, path: Path, ranges: list[tuple[str, int, int]],
              advance: Callable[[float], None] | None = None) -> tuple[str, dict[str, str]]:
    """One read of the file open at ``descriptor``: its sha256 and the sha256 of each named byte range.

    Ranges are ``(name, begin, end)`` in file offsets and must not overlap.
    ``advance(n)`` is told of every ``n`` bytes read (a progress bar).
    """
    whole = hashlib.sha256()
    parts: dict[str, str] = {}
    ordered = sorted(ranges, key=lambda r: r[1])
    size = os.fstat(descriptor).st_size
    chunk = bytearray(1 << 20)
    position = 0

    def read_to(stop: int, part: Any = None) -> None:
        nonlocal position
        while position < stop:
            length = min(len(chunk), stop - position)
            view = memoryview(chunk)[:length]
            read_exact(descriptor, length, position, path, into=view)
            whole.update(view)
            if part is not None:
                part.update(view)
            position += length
            if advance is not None:
                advance(length)

    for name, begin, end in ordered:
        read_to(begin)
        part = hashlib.sha256()
        read_to(end, part)
        parts[name] = part.hexdigest()
    read_to(size)
    return whole.hexdigest(), parts
