"""backlens: see, edit and measure the backward pass of any PyTorch model.

Two faces over one core: :func:`capture` records a forward and every backward
pass over its graph; :func:`wrap` gives a lens whose ``trace()`` block runs
your code during the real forward and backward.
"""

from backlens import report
from backlens._version import __version__
from backlens.capture.capture import Capture, capture
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
from backlens.graph.engine import CallSite
from backlens.records.backward import BackwardPass, GradFn, GradFnCall
from backlens.records.grads import GradRecord
from backlens.report.doctor import doctor
from backlens.report.explain import Explanation, explain
from backlens.report.validate import ValidationResult, validate

__all__ = [
    "AmbiguousGradError",
    "BacklensError",
    "BacklensWarning",
    "BackwardUnavailableError",
    "BackwardPass",
    "BundleError",
    "CallSite",
    "Capture",
    "GradFn",
    "GradFnCall",
    "GradRecord",
    "capture",
    "doctor",
    "explain",
    "validate",
    "ValidationResult",
    "Explanation",
    "report",
    "FreedGraphError",
    "NoGradForwardError",
    "NoGradientPathError",
    "OutOfOrderError",
    "__version__",
]
