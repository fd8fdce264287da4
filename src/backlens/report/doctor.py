"""``bl.doctor()``: the torch version and every capability backlens relies on."""

from __future__ import annotations

import platform
import sys

import torch

from backlens import _torch
from backlens._version import __version__


def _version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def doctor_text() -> str:
    lines = [
        f"backlens {__version__}",
        f"torch {torch.__version__} (python {platform.python_version()}, {sys.platform})",
        f"CUDA available: {torch.cuda.is_available()}",
        f"numpy {_version_of('numpy')}, pandas {_version_of('pandas')}, safetensors {_version_of('safetensors')}, "
        f"rich {_version_of('rich')}",
        "",
        "capabilities:",
    ]
    width = max(len(c.name) for c in _torch.CAPABILITIES)
    for cap in _torch.CAPABILITIES:
        mark = "yes" if cap.present else "NO "
        lines.append(f"  {cap.name:<{width}}  {mark}  used for {cap.used_for}")
        prefix = "DEGRADED:" if not cap.present else "without it:"
        lines.append(f"  {'':<{width}}       {prefix} {cap.without_it}")
    lines.append(f"  engine wrapper installed: {_torch.engine_wrapper_installed()}")
    return "\n".join(lines)


def doctor() -> dict[str, bool]:
    """Print the torch version and every capability flag; return the flags."""
    print(doctor_text())
    return {cap.name: cap.present for cap in _torch.CAPABILITIES}
