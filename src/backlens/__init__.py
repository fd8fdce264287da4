"""backlens: see, edit and measure the backward pass of any PyTorch model.

Two faces over one core: :func:`capture` records a forward and every backward
pass over its graph; :func:`wrap` gives a lens whose ``trace()`` block runs
your code during the real forward and backward.
"""

from backlens._version import __version__
from backlens.errors import (
    AmbiguousGradError,
    BacklensError,
    BacklensWarning,
    BackwardUnavailableError,
    BundleError,
    FreedGraphError,
    NoGradForwardError,
    NoGradientPathError,
    OutOfOrderError,
)

__all__ = [
    "AmbiguousGradError",
    "BacklensError",
    "BacklensWarning",
    "BackwardUnavailableError",
    "BundleError",
    "FreedGraphError",
    "NoGradForwardError",
    "NoGradientPathError",
    "OutOfOrderError",
    "__version__",
]
