"""Module statistics from their parameters' (on the host, after the one read-back).

A module's L2 norm is the norm of all its parameters' values together,
sqrt(sum of their norms squared); its max |g| the largest; its non-finite
count the sum. A NaN or infinite parameter value makes the module's NaN or
infinite, as one reduction over the concatenated values would.
"""

from __future__ import annotations

import numpy as np


def sum_over(members: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per module (rows of the boolean ``members``), the sum of ``values`` over its members."""
    finite = np.isfinite(values)
    total = members.astype(np.float64) @ np.where(finite, values, 0.0)
    if finite.all():
        return total
    has_nan = members @ np.isnan(values)
    signs = np.where(np.isinf(values), np.sign(values), 0.0)
    has_pos, has_neg = members @ (signs > 0), members @ (signs < 0)
    total = np.where(has_pos, np.inf, total)
    total = np.where(has_neg, -np.inf, total)
    return np.where(has_nan | (has_pos & has_neg), np.nan, total)


def norm_over(members: np.ndarray, norms: np.ndarray) -> np.ndarray:
    return np.sqrt(sum_over(members, np.square(norms)))


def max_over(members: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Largest member value (NaN when a member's is NaN); -inf for a module without members."""
    spread = np.where(members, values[None, :], -np.inf)
    return spread.max(axis=1) if spread.size else np.full(len(members), -np.inf)
