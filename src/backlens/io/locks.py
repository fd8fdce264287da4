"""The lock a ``bl.to_disk`` capture holds on the directory it streams into.

A streaming capture writes shards into its directory for as long as it lives,
and rewrites the manifest at each ``cap.save()`` and at ``close()``. Another
writer there (a second ``bl.to_disk`` with ``overwrite=True``, a
``cap.save(path, overwrite=True)``) would swap the directory out from under
it and leave both bundles corrupt. So the stream holds an exclusive
``flock`` on a lock file in its directory (``.backlens-lock``) from the
moment it creates the directory until it is closed, and every writer that
would replace or write into a directory first checks that lock
(:func:`refuse_if_streaming`); ``flock`` locks conflict between two open
files also inside one process, so a second capture in the same process is
refused too.

On close the file is removed while still locked; a writer that locked a file
just removed this way sees that the name no longer leads to it and tries
again, so two streams never both believe they hold one directory. A stream
killed outright leaves the file unlocked (the kernel drops the lock), which
counts as free.
"""

from __future__ import annotations

import os
import stat
import weakref
from pathlib import Path

from backlens.errors import BundleError
from backlens.io.names import STREAM_LOCK

try:
    import fcntl
except ImportError:  # not on POSIX: no locks
    fcntl = None  # type: ignore[assignment]

_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def locked_error(path: Path) -> BundleError:
    return BundleError(
        f"{path}: a bl.to_disk capture is streaming into this directory (in this process or another); "
        "refusing to write over it.",
        code="bundle_locked",
        remedy="Close the capture that streams there first (cap.close()), or choose another path.",
    )


def _try_lock(descriptor: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class StreamLock:
    """The lock of one streaming directory, held until :meth:`release` (or the lock is dropped)."""

    def __init__(self, directory: Path):
        path = Path(directory) / STREAM_LOCK
        while True:
            try:
                descriptor = os.open(path, _FLAGS, 0o644)
            except OSError as exc:
                raise BundleError(f"{path}: cannot create the stream's lock file ({exc.strerror or exc}).",
                                  code="bundle_write_failed", remedy="Choose a writable location.") from exc
            if not _try_lock(descriptor):
                os.close(descriptor)
                raise locked_error(Path(directory))
            if _same_file(descriptor, path):
                break
            os.close(descriptor)  # a file its holder removed as it let go: lock the one there now
        self._descriptor: int | None = descriptor
        self._path = path
        self._closer = weakref.finalize(self, os.close, descriptor)  # a dropped store lets go too

    def moved_to(self, directory: Path) -> None:
        """The directory was renamed (a staging directory put in place): its lock file moved with it."""
        self._path = Path(directory) / STREAM_LOCK

    def release(self) -> None:
        """Remove the lock file and let go of it (idempotent)."""
        if self._descriptor is None:
            return
        if _same_file(self._descriptor, self._path):
            try:
                os.unlink(self._path)
            except OSError:
                pass  # a read-only directory keeps an unlocked lock file: it counts as free
        self._descriptor = None
        self._closer()


def is_streaming(directory: Path) -> bool:
    """Whether a live ``bl.to_disk`` capture holds ``directory``'s lock."""
    path = Path(directory) / STREAM_LOCK
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                             | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # no lock file (or not one backlens made): no stream
    try:
        if fcntl is None or not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        return False
    finally:
        os.close(descriptor)  # also drops the shared lock just taken


def refuse_if_streaming(directory: Path) -> None:
    """Raise ``bundle_locked`` when a live ``bl.to_disk`` capture streams into ``directory``."""
    if is_streaming(directory):
        raise locked_error(directory)
