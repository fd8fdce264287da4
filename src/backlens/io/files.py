"""Reading a bundle directory as untrusted input: its files, never anything outside it.

Every file is named by a plain name inside the directory, looked at with
``lstat`` before it is opened (a symbolic link, a directory, a FIFO or a
device is refused, not followed or opened), opened with ``O_NOFOLLOW`` and
checked again on the open descriptor (a regular file, the same one ``lstat``
saw). Sizes are bounded before anything is read, and reads are exact: a file
that is shorter than it should be is a :class:`BundleError`, never a crash.
The directory itself must be a real directory, not a link to one.

JSON is parsed only after its nesting depth is checked on the raw bytes
(:func:`parse_json`), so no file can drive the parser into deep recursion.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from backlens.errors import BundleError

MAX_JSON_DEPTH = 64
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_PLAIN_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
# A JSON string: quotes around anything but quotes and backslashes, or escapes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DAMAGED = "The bundle is damaged or was not written by backlens; save it again."


def damaged(message: str, code: str = "bundle_corrupt") -> BundleError:
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


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (strings skipped)."""
    outside = _JSON_STRING.sub(b'""', raw)
    codes = np.frombuffer(outside, dtype=np.uint8)
    opening = (codes == ord("[")) | (codes == ord("{"))
    closing = (codes == ord("]")) | (codes == ord("}"))
    steps = opening.astype(np.int8)[opening | closing] - closing.astype(np.int8)[opening | closing]
    if not steps.size:
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())


def parse_json(raw: bytes, path: Path, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON: the depth is checked before the parser runs; any failure is a BundleError."""
    try:
        depth = json_depth(raw)
    except (ValueError, MemoryError) as exc:
        raise damaged(f"{path}: malformed JSON in the {what} ({exc}).") from exc
    if depth > max_depth:
        raise damaged(f"{path}: malformed JSON in the {what}: nested {depth} deep (at most {max_depth}).")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise damaged(f"{path}: malformed JSON in the {what} ({type(exc).__name__}: {str(exc)[:200]}).") from exc
