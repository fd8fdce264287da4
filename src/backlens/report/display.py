"""Number formatting shared by the cost reports' rich tables."""

from __future__ import annotations


def flops_text(value: int | None) -> str:
    """``1.79M`` for 1_785_856; ``-`` for unknown (None), ``0`` for zero."""
    if value is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return str(value)


def seconds_text(value: float | None) -> str:
    """``1.23 ms`` / ``45.6 us``; ``-`` for unknown."""
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def bytes_text(value: int | None) -> str:
    """``1.50 MiB`` for 1_572_864; ``-`` for unknown (None), ``0 B`` for zero."""
    if value is None:
        return "-"
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value} B"
