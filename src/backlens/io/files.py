"""Reading a bundle directory as untrusted input: its files, never anything outside it.

Every file is named by a plain name inside the directory, looked at with
``lstat`` before it is opened (a symbolic link, a directory, a FIFO or a
device is refused, not followed or opened), opened with ``O_NOFOLLOW`` and
checked again on the open descriptor (a regular file, the same one ``lstat``
saw). Sizes are bounded before anything is read, and reads are exact: a file
that is shorter than it should be is a :class:`BundleError`, never a crash.
The directory itself must be a real directory, not a link to one.

JSON is parsed only after its nesting depth and the memory its objects would
take are estimated from the raw bytes (:func:`parse_json`), so no file can
drive the parser into deep recursion or build gigabytes of small objects from
a file of megabytes; an object that repeats a key is refused (a reader keeping
the last value would see what a checksum over the first did not).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from backlens.errors import BundleError

MAX_JSON_DEPTH = 64
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_PLAIN_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
_SCAN_CHUNK = 1 << 19  # bytes of JSON scanned at a time (bounds the scan's own temporaries)
# What parsed JSON costs in memory, per element (CPython, 64-bit; a little above the real sizes).
_OBJECT_BYTES, _ARRAY_BYTES, _MEMBER_BYTES, _ITEM_BYTES, _STRING_BYTES = 64, 56, 40, 32, 56
MAX_JSON_MEMORY = 256 << 20  # the default bound on what reading one small JSON file (a header) may take
# And in proportion to its size: what backlens writes costs 5 to 9 times its bytes once read; a file
# of tiny objects, 30 times and more. (Small files may cost more: a floor.)
MAX_JSON_RATIO, JSON_RATIO_FLOOR = 16, 64 << 20
_DAMAGED = "The bundle is damaged or was not written by backlens; save it again."


MAX_MESSAGE = 2000  # characters of an error message about a bundle (a hostile one can name a lot)


def damaged(message: str, code: str = "bundle_corrupt") -> BundleError:
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 20] + " ... (cut short)"
    return BundleError(message, code=code, remedy=_DAMAGED)


def is_plain_name(name: Any) -> bool:
    """A file name a bundle may use: no directory part, not hidden, no odd characters."""
    return isinstance(name, str) and len(name) <= 255 and _PLAIN_NAME.match(name) is not None


class BundleDir:
    """One bundle directory, read through checked file names only (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        try:
            info = os.lstat(self.root)
        except FileNotFoundError:
            raise BundleError(f"{self.root}: no such bundle (the path does not exist).", code="bundle_missing",
                              remedy="Check the path; cap.save(path) writes a bundle there.") from None
        except OSError as exc:
            raise BundleError(f"{self.root}: cannot read ({exc.strerror or exc}).", code="bundle_missing",
                              remedy="Check the path and its permissions.") from exc
        if stat.S_ISLNK(info.st_mode):
            raise BundleError(f"{self.root}: is a symlink; bundles are read from real directories only.",
                              code="bundle_symlink",
                              remedy="Pass the directory the link points to (os.path.realpath(path)).")
        if not stat.S_ISDIR(info.st_mode):
            raise BundleError(f"{self.root}: not a bundle (it is a file; a bundle is a directory).",
                              code="bundle_not_a_bundle",
                              remedy="Point bl.load at the directory cap.save(path) wrote.")

    def path(self, name: str) -> Path:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name \
                or (os.altsep is not None and os.altsep in name):
            raise damaged(f"{self.root}: bad file name {str(name)[:80]!r} (a bundle's files are plain names "
                          "inside its directory).")
        return self.root / name

    def lstat(self, name: str) -> os.stat_result | None:
        """The file's own status (None when it does not exist); refuses anything but a regular file."""
        path = self.path(name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BundleError(f"{path}: cannot read ({exc.strerror or exc}).", code="bundle_missing_file",
                              remedy="Check the bundle's permissions.") from exc
        if stat.S_ISLNK(info.st_mode):
            raise BundleError(f"{path}: is a symlink; bundles never follow links.", code="bundle_symlink",
                              remedy="Replace the link with the file itself (cp --dereference).")
        if not stat.S_ISREG(info.st_mode):
            raise damaged(f"{path}: not a regular file.", code="bundle_not_regular_file")
        return info

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def open(self, name: str, expected_size: int | None = None) -> int:
        """A read-only descriptor of the regular file ``name``; its size must be ``expected_size`` when given."""
        path = self.path(name)
        seen = self.lstat(name)
        if seen is None:
            raise BundleError(f"{path}: missing.", code="bundle_missing_file",
                              remedy="The bundle is incomplete; save it again.")
        try:
            descriptor = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise BundleError(f"{path}: is a symlink; bundles never follow links.",
                                  code="bundle_symlink", remedy="Replace the link with the file itself.") from exc
            raise BundleError(f"{path}: cannot open ({exc.strerror or exc}).", code="bundle_missing_file",
                              remedy="The bundle is incomplete or unreadable; save it again.") from exc
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
                raise damaged(f"{path}: changed while being opened (not the regular file it was).")
            if expected_size is not None and info.st_size != expected_size:
                what = "truncated" if info.st_size < expected_size else "has extra bytes"
                raise damaged(f"{path}: {what} ({info.st_size} bytes, the manifest says {expected_size}).")
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def read(self, name: str, limit: int, what: str) -> bytearray:
        """The whole file, refused before reading when it is larger than ``limit`` bytes."""
        path = self.path(name)
        descriptor = self.open(name)
        try:
            size = os.fstat(descriptor).st_size
            if size > limit:
                raise damaged(f"{path}: {size} bytes, more than a {what} may have ({limit}).",
                              code="bundle_too_large")
            data = read_exact(descriptor, size, 0, path)
            if os.pread(descriptor, 1, size):
                raise damaged(f"{path}: grew while being read.")
        finally:
            os.close(descriptor)
        return data


def read_exact(descriptor: int, length: int, offset: int, path: Path, into: Any = None) -> Any:
    """``length`` bytes at ``offset`` (into the writable buffer ``into`` when given); a short file raises."""
    buffer = into if into is not None else bytearray(length)
    view = memoryview(buffer).cast("B")
    done = 0
    while done < length:
        try:
            got = os.preadv(descriptor, [view[done:length]], offset + done)
        except OSError as exc:
            raise damaged(f"{path}: cannot read ({exc.strerror or exc}).", code="bundle_missing_file") from exc
        if got == 0:
            raise damaged(f"{path}: truncated (it ends at byte {offset + done}, {length - done} bytes before "
                          "the data it should hold); was it changed after the bundle was loaded?")
        done += got
    return buffer


class JsonShape:
    """What the JSON text ``raw`` holds, counted on its bytes without parsing it: its nesting
    ``depth`` and about how much ``memory`` reading it takes (the bytes, their text, the objects).

    One pass over fixed-size chunks, in linear time and with memory of the chunk's size whatever
    the bytes. In each chunk escapes are blanked first, left to right as JSON reads them (an
    escaped backslash, then an escaped quote; an escape cut by the chunk's end is finished in the
    next), so every quote left delimits a string, and what lies between an odd quote and the next
    is string content (its brackets are text). Outside strings a backslash is not JSON at all: the
    parser stops there, so what the count makes of the rest does not matter.
    """

    def __init__(self, raw: bytes | bytearray):
        self.depth = 0
        counts = dict.fromkeys(b"{[:,", 0)
        quotes = content = level = 0
        inside = escaped = False
        view = memoryview(raw)
        for start in range(0, len(raw), _SCAN_CHUNK):
            data = bytearray(view[start:start + _SCAN_CHUNK])
            if escaped:
                data[0] = ord("_")  # the character an escape cut at the chunk's end applies to
            if b"\\" in data:
                data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
            escaped = data.endswith(b"\\")
            codes = np.frombuffer(data, dtype=np.uint8)
            quote = codes == ord('"')
            # Inside a string: after an odd number of quotes (the opening quote in, the closing out).
            within = (np.cumsum(quote, dtype=np.uint8) + inside) & 1 == 1  # uint8 wraps: parity kept
            inside = bool(within[-1])
            outside = ~within
            quotes += int(np.count_nonzero(quote))
            content += int(np.count_nonzero(within & ~quote))
            for code in counts:
                counts[code] += int(np.count_nonzero((codes == code) & outside))
            opening = ((codes == ord("[")) | (codes == ord("{"))) & outside
            closing = ((codes == ord("]")) | (codes == ord("}"))) & outside
            levels = np.cumsum(opening.view(np.int8) - closing.view(np.int8), dtype=np.int32) + level
            self.depth = max(self.depth, int(levels.max()))
            level = int(levels[-1])
        del view
        strings = (quotes + 1) // 2
        members = counts[ord(":")]  # one key each (keys are shared between objects: not counted)
        self.memory = (2 * len(raw) + content + _OBJECT_BYTES * counts[ord("{")] + _ARRAY_BYTES * counts[ord("[")]
                       + _MEMBER_BYTES * members + _ITEM_BYTES * counts[ord(",")]
                       + _STRING_BYTES * max(strings - members, 0))


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _RepeatedKey(f"the key {key[:80]!r} appears twice in one object")
            seen.add(key)
    return found


def parse_json(raw: bytes, path: Path, what: str, max_depth: int = MAX_JSON_DEPTH,
               max_memory: int = MAX_JSON_MEMORY) -> Any:
    """Parse untrusted JSON: depth and memory (at most ``max_memory``, and ``MAX_JSON_RATIO`` times
    the size above a floor) are checked before the parser runs, a repeated key in an object is
    refused; any failure is a BundleError."""
    try:
        shape = JsonShape(raw)
    except (ValueError, MemoryError) as exc:
        raise damaged(f"{path}: malformed JSON in the {what} ({exc}).") from exc
    if shape.depth > max_depth:
        raise damaged(f"{path}: malformed JSON in the {what}: nested {shape.depth} deep (at most {max_depth}).")
    bound = min(max_memory, MAX_JSON_RATIO * len(raw) + JSON_RATIO_FLOOR)
    if shape.memory > bound:
        raise damaged(f"{path}: the {what} would take about {shape.memory >> 20} MiB of memory to read "
                      f"(at most {bound >> 20} MiB for {len(raw) >> 10} KiB): it holds far more elements "
                      f"than a backlens {what} of its size.", code="bundle_too_large")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        raise damaged(f"{path}: malformed JSON in the {what}: {exc}.", code="bundle_duplicate_key") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise damaged(f"{path}: malformed JSON in the {what} ({type(exc).__name__}: {str(exc)[:200]}).") from exc


PEEK_WHOLE_BELOW = 1 << 20  # a manifest up to this size is parsed by peek_manifest; a larger one only opened


def peek_manifest(root: str | os.PathLike, name: str = "manifest.json") -> tuple[Any, bytes] | None:
    """A cheap look at a bundle directory's manifest that never raises: ``(parsed, b"")`` for a
    manifest of up to ``PEEK_WHOLE_BELOW`` bytes, ``(None, opening)`` (its first
    ``PEEK_WHOLE_BELOW`` bytes) for a larger one, None where there is no readable manifest.
    A full, checked read is the loader's job."""
    try:
        directory = BundleDir(root)
        info = directory.lstat(name)
        if info is None:
            return None
        descriptor = directory.open(name)
        try:
            head = bytes(read_exact(descriptor, min(info.st_size, PEEK_WHOLE_BELOW), 0, directory.path(name)))
        finally:
            os.close(descriptor)
        if info.st_size > PEEK_WHOLE_BELOW:
            return None, head
        return parse_json(head, directory.path(name), "manifest"), b""
    except BundleError:
        return None


def manifest_is(root: str | os.PathLike, name: str, opening: re.Pattern[bytes],
                accept: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether ``root`` holds a manifest ``name`` of one kind, by :func:`peek_manifest` (never
    raises): a small one parsed and passed to ``accept``, a large one by its ``opening``."""
    found = peek_manifest(root, name)
    if found is None:
        return False
    manifest, head = found
    if manifest is None:
        return opening.match(head) is not None
    return isinstance(manifest, dict) and accept(manifest)
