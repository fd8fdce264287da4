"""Putting a finished bundle in place so that its path always holds a whole bundle.

A bundle is built in a hidden *staging* directory beside its path
(``.NAME.partial-TOKEN``, io/names.py), locked (``flock``) while it is
written. When it is finished:

* a path that does not exist, or is an empty directory, is taken by one
  ``rename`` (atomic);
* a bundle already at the path is swapped with the staging directory by one
  atomic exchange (``renameat2(RENAME_EXCHANGE)`` on Linux, ``renamex_np(RENAME_SWAP)``
  on macOS) and the old bundle, now under the staging name, is removed;
* where the OS or file system has no exchange, the old bundle is renamed aside
  (``.NAME.old-TOKEN``) and the new one renamed in. A process that dies between
  those two renames leaves no bundle at the path; :func:`recover` (run by
  ``bl.load`` and by the next save to that path) puts the old one back.

Whatever moment the process dies, the path holds the old or the new bundle
(or, in the fallback, the old one aside, restored on the next load or save).
Leftovers of interrupted saves (staging directories, old bundles) are removed
by the next save to the same path (:func:`clean_leftovers`) when they are
provably backlens's (io/markers.py); a directory another live process holds
locked is left alone.

A directory a ``bl.to_disk`` capture streams into is locked for as long as it
streams (io/locks.py), and is never replaced meanwhile: a second writer, in
this process or another, is refused with ``bundle_locked``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import os
import platform
import shutil
import stat
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from backlens.errors import BundleError
from backlens.io.locks import refuse_if_streaming
from backlens.io.markers import (
    holds_manifest,
    holds_stream_marker,
    is_own_leftover,
    refuse_unless_replaceable,
)
from backlens.io.names import sibling

try:
    import fcntl
except ImportError:  # not on POSIX: no locks, every leftover counts as stale
    fcntl = None  # type: ignore[assignment]

_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", -1), getattr(errno, "EOPNOTSUPP", -1)}
# renameat2's system call number where the C library may lack the wrapper (glibc < 2.28).
_RENAMEAT2_SYSCALL = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def _exchange_function():
    """A function swapping two paths atomically, or None where the OS has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    if sys.platform.startswith("linux"):
        at_fdcwd, rename_exchange = -100, 2
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is not None:
            renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            return lambda a, b: renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange)
        number = _RENAMEAT2_SYSCALL.get(platform.machine())
        if number is None:
            return None
        syscall = libc.syscall
        return lambda a, b: syscall(number, at_fdcwd, a, at_fdcwd, b, rename_exchange)
    if sys.platform == "darwin":
        renamex_np = getattr(libc, "renamex_np", None)
        if renamex_np is not None:
            renamex_np.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            return lambda a, b: renamex_np(a, b, 0x2)  # RENAME_SWAP
    return None


_EXCHANGE = _exchange_function()


def exchange(a: Path, b: Path) -> bool:
    """Swap the directories at ``a`` and ``b`` in one atomic step; False where that is not possible."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


# -- locks -----------------------------------------------------------------------------

def _lock(path: Path, wait: bool) -> int | None:
    """An open descriptor of directory ``path`` holding its exclusive lock; None when another
    process holds it (or the directory is gone)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
                             | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    if fcntl is None:
        return descriptor
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def _unlock(descriptor: int | None) -> None:
    if descriptor is not None:
        os.close(descriptor)  # closing drops the lock


class Staging:
    """A locked hidden directory beside ``target`` in which a bundle is built."""

    def __init__(self, target: Path):
        self.target = target
        self.path = sibling(target, "partial", uuid.uuid4().hex[:12])
        os.mkdir(self.path)
        self._lock = _lock(self.path, wait=True)

    def release(self) -> None:
        _unlock(self._lock)
        self._lock = None

    def discard(self) -> None:
        """Remove the staging directory (after a failed save); never raises."""
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)


# -- placing -------------------------------------------------------------------------

def _is_empty_directory(path: Path) -> bool:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        return False
    with os.scandir(path) as entries:
        return not any(entries)


def put_in_place(staging: Staging, target: Path, overwrite: bool) -> Path | None:
    """Make the finished bundle in ``staging`` the bundle at ``target`` (see the module docstring).

    Returns where the bundle it replaced now is (for :func:`remove_old`), or None.
    Raises BundleError when ``target`` holds something and ``overwrite`` is false,
    OSError when the file system refuses; ``target`` then still holds what it held.
    """
    if not os.path.lexists(target) or _is_empty_directory(target):
        try:
            os.rename(staging.path, target)  # also replaces an empty directory, atomically
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        else:
            staging.release()
            return None
    if not overwrite:  # it appeared while the bundle was being written
        raise BundleError(f"{target}: already exists.", code="bundle_exists",
                          remedy="Choose a new path, or pass overwrite=True.")
    refuse_unless_replaceable(target)  # checked when the save began; what is there now is what goes
    refuse_if_streaming(target)  # never swap a directory out from under a capture streaming into it
    if exchange(staging.path, target):
        staging.release()
        return staging.path
    old = sibling(target, "old", uuid.uuid4().hex[:12])
    held = _lock(target, wait=True)  # the old bundle: recover() leaves it alone while we move it
    try:
        os.rename(target, old)
        try:
            os.rename(staging.path, target)
        except OSError:
            os.rename(old, target)
            raise
    finally:
        _unlock(held)
    staging.release()
    return old


def write_whole(target: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Write a bundle at ``target`` all or nothing and return ``target``.

    ``write(directory)`` fills a staging directory beside the target, which
    then takes its place (with ``overwrite``, the old bundle stays until the new
    one is whole). A failure leaves no staging behind; an ``OSError`` becomes a
    :class:`BundleError` naming the target.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(target)
        staging = Staging(target)
    except OSError as exc:
        raise BundleError(f"{target}: cannot write here ({exc.strerror or exc}).",
                          code="bundle_write_failed", remedy="Choose a writable location.") from exc
    try:
        write(staging.path)
        replaced = put_in_place(staging, target, overwrite)
    except BaseException as exc:
        staging.discard()
        if isinstance(exc, OSError):
            raise BundleError(f"{target}: writing the bundle failed ({exc.strerror or exc}).",
                              code="bundle_write_failed",
                              remedy="Choose a writable location with enough free space.") from exc
        raise
    remove_old(replaced, target)
    return target


def remove_old(old: Path | None, target: Path) -> None:
    """Delete the bundle a save replaced (BundleError when that fails; the new one is in place)."""
    if old is not None:
        remove_tree(old, f"the bundle it replaced (the new one is at {target})")


def remove_tree(path: Path, what: str) -> None:
    """Delete a directory tree of ours; a failure is a BundleError naming what was left."""
    failures: list[str] = []

    def note(_function, failed_path, info) -> None:
        if not failures:
            failures.append(f"{failed_path}: {info[1].strerror if isinstance(info[1], OSError) else info[1]}")

    shutil.rmtree(path, onerror=note)
    if failures and os.path.lexists(path):
        raise BundleError(
            f"{path}: could not remove {what} ({failures[0]}).",
            code="bundle_cleanup_failed",
            remedy=f"Remove {path} by hand (check its permissions); the next save to this path retries.",
        )


# -- recovering and cleaning ------------------------------------------------------------

def _siblings(target: Path, role: str) -> list[Path]:
    pattern = str(sibling(target, role, ""))
    return sorted(Path(p) for p in glob.glob(glob.escape(pattern) + "*"))


def _holds_a_bundle(path: Path) -> bool:
    return holds_manifest(path) and not holds_stream_marker(path)


def recover(target: Path) -> bool:
    """Finish a replacement that died between its two renames: with nothing at ``target``,
    put the old bundle set aside there back. True when it did."""
    if os.path.lexists(target):
        return False
    for old in _siblings(target, "old"):
        if os.path.islink(old) or not os.path.isdir(old):
            continue
        held = _lock(old, wait=False)
        if held is None:
            continue  # a live save is moving it
        try:
            if _holds_a_bundle(old) and not os.path.lexists(target):
                os.rename(old, target)
                return True
        except OSError:
            continue
        finally:
            _unlock(held)
    return False


def clean_leftovers(target: Path) -> None:
    """Before a save to ``target``: finish an interrupted replacement, then remove what
    interrupted saves left beside it (never a directory a live save holds locked)."""
    recover(target)
    for role in ("partial", "old"):
        for leftover in _siblings(target, role):
            if os.path.islink(leftover) or not os.path.isdir(leftover) or not is_own_leftover(leftover, target):
                continue
            held = _lock(leftover, wait=False)
            if held is None:
                continue  # in use by a save that is still running
            try:
                remove_tree(leftover, "what an interrupted save left")
            finally:
                _unlock(held)
