"""Telling what backlens wrote from what it did not, before a save replaces or removes anything.

A save replaces only a directory that provably is a backlens bundle, or
backlens's own unfinished work:

* a bundle: its ``manifest.json`` is a regular file whose top-level object's
  ``"format"`` is a backlens bundle format (parsed, not searched for a
  substring: ``{"plugins": ["backlens.report"]}`` is not one);
* an unfinished ``bl.to_disk`` stream: its ``.backlens-stream`` marker is a
  regular file holding exactly what the stream writes there;
* and never a bundle directory holding anything backlens does not write there
  (a user's notes or report beside the bundle's files): :func:`refuse_unless_replaceable`;
* what an interrupted save left beside a path (``.NAME.partial-TOKEN``,
  ``.NAME.old-TOKEN``): named as backlens names them and holding only files
  backlens writes (or a bundle).

Every file is looked at through :class:`~backlens.io.files.BundleDir`: never
through a link, and never opened unless it is a regular file, so a FIFO named
``manifest.json`` cannot block a save.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from backlens.errors import BundleError
from backlens.io.files import BundleDir, manifest_is
from backlens.io.names import MANIFEST, STREAM_MARKER

STREAM_MARKER_TEXT = json.dumps({"format": "backlens.bundle-stream"})
BUNDLE_FORMATS = ("backlens.bundle", "backlens.derived")
# How backlens writes a manifest (json.dump of a dict whose first key is "format"): a manifest too
# large to parse here is recognised by this opening.
_OPENING = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"(backlens\.(?:bundle|derived))"\s*,')
# The files a save or a stream writes into a bundle directory.
_OWN_FILES = re.compile(r"\A(?:manifest\.json(?:\.tmp)?|\.backlens-stream|\.backlens-lock|tensors\.safetensors"
                        r"|[a-z]+[0-9]*-[0-9]{5,}\.safetensors)\Z")
_LEFTOVER = re.compile(r"\A\.(?P<name>.+)\.(?:partial|old)-[0-9a-f]{12}\Z")


def holds_manifest(path: Path) -> bool:
    """Whether ``path`` is a directory whose ``manifest.json`` is a backlens bundle manifest."""
    return manifest_is(path, MANIFEST, _OPENING, lambda manifest: manifest.get("format") in BUNDLE_FORMATS)


def holds_stream_marker(path: Path) -> bool:
    """Whether ``path`` is a directory a ``bl.to_disk`` stream marked as its own."""
    try:
        directory = BundleDir(path)
        info = directory.lstat(STREAM_MARKER)
        if info is None or info.st_size > 4096:
            return False
        return bytes(directory.read(STREAM_MARKER, 4096, "stream marker")) == STREAM_MARKER_TEXT.encode()
    except BundleError:
        return False


def is_bundle_dir(path: Path) -> bool:
    """Whether ``path`` holds a backlens bundle or an unfinished ``bl.to_disk`` stream."""
    return holds_stream_marker(path) or holds_manifest(path)


def other_entries(path: Path) -> list[str]:
    """The names in directory ``path`` that backlens does not write there (sorted)."""
    with os.scandir(path) as entries:
        return sorted(entry.name for entry in entries
                      if not (entry.is_file(follow_symlinks=False) and _OWN_FILES.match(entry.name)))


def refuse_unless_replaceable(path: Path) -> None:
    """Raise unless ``path`` is a bundle (or stream) directory holding only what backlens writes:
    ``overwrite=True`` replaces a bundle, never a user's files kept beside one."""
    if not is_bundle_dir(path):
        raise BundleError(f"{path}: exists and is not a backlens bundle; refusing to replace it.",
                          code="bundle_not_a_bundle", remedy="Choose a new path; overwrite=True only replaces bundles.")
    others = other_entries(path)
    if others:
        shown = ", ".join(repr(name) for name in others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise BundleError(f"{path}: is a backlens bundle that also holds {shown}, which backlens did not write; "
                          "refusing to replace it.", code="bundle_holds_other_files",
                          remedy="Move those files out of the bundle directory, or save to a new path.")


def is_own_leftover(path: Path, target: Path) -> bool:
    """Whether ``path`` is what an interrupted save to ``target`` left: named as backlens names
    its staging and set-aside directories, and holding only files backlens writes (or a bundle)."""
    found = _LEFTOVER.match(path.name)
    if found is None or found["name"] != target.name or path.parent != target.parent:
        return False
    try:
        with os.scandir(path) as entries:
            names = [(entry.name, entry.is_file(follow_symlinks=False)) for entry in entries]
    except OSError:
        return False
    if all(is_file and _OWN_FILES.match(name) for name, is_file in names):
        return True
    return is_bundle_dir(path)
