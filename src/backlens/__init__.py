"""backlens: see, edit and measure the backward pass of any PyTorch model.

Two faces over one core: :func:`capture` records a forward and every backward
pass over its graph; :func:`wrap` gives a lens whose ``trace()`` block runs
your code during the real forward and backward.
"""

from backlens import bench, report
from backlens._version import __version__
from backlens.capturing import Capture, capture, load
from backlens.derive.dispatch import derive
from backlens.derive.record import DerivedGrads
from backlens.distributed.rankset import RankSet
from backlens.edits import add_noise, clamp, clip_norm, grad, keep_grad, scale, when, zero_ablate
from backlens.errors import (
    AmbiguousGradError,
    AmbiguousLabelError,
    BacklensError,
    BacklensWarning,
    BackwardUnavailableError,
    BundleError,
    CaptureClosedError,
    DeriveError,
    FreedGraphError,
    LabelNotFoundError,
    NoGradForwardError,
    NoGradientPathError,
    NonFiniteGradError,
    OnceOnlyNodeError,
    OutOfOrderError,
    OutputPathError,
    ReplayError,
    SavedTensorModifiedError,
    TraceError,
    UnsupportedFrameworkError,
    UnsupportedInputError,
)
from backlens.graph.engine import CallSite
from backlens.io.disk_store import to_disk
from backlens.live import Batcher, Lens, Tracer, save, wrap
from backlens.monitoring import monitor, monitor_callback
from backlens.records.backward import BackwardPass, GradFn, GradFnCall
from backlens.records.grads import GradRecord
from backlens.report.doctor import doctor
from backlens.report.explain import Explanation, explain
from backlens.select import (
    Selector,
    func,
    grad_fn,
    grad_input,
    grad_output,
    in_pass,
    label,
    module,
    without_op,
)
from backlens.validate import ValidationResult, validate

__all__ = [
    # errors and warnings
    "AmbiguousGradError",
    "AmbiguousLabelError",
    "BacklensError",
    "BacklensWarning",
    "BackwardUnavailableError",
    "BundleError",
    "CaptureClosedError",
    "DeriveError",
    "FreedGraphError",
    "LabelNotFoundError",
    "NoGradForwardError",
    "NoGradientPathError",
    "NonFiniteGradError",
    "OnceOnlyNodeError",
    "OutOfOrderError",
    "OutputPathError",
    "ReplayError",
    "SavedTensorModifiedError",
    "TraceError",
    "UnsupportedFrameworkError",
    "UnsupportedInputError",
    # capture and its records
    "BackwardPass",
    "CallSite",
    "Capture",
    "GradFn",
    "GradFnCall",
    "GradRecord",
    "capture",
    # other frameworks
    "DerivedGrads",
    "derive",
    # selectors
    "Selector",
    "func",
    "grad_fn",
    "grad_input",
    "grad_output",
    "in_pass",
    "label",
    "module",
    "without_op",
    # edits
    "add_noise",
    "clamp",
    "clip_norm",
    "grad",
    "keep_grad",
    "scale",
    "when",
    "zero_ablate",
    # storage and bundles
    "RankSet",
    "load",
    "to_disk",
    # live tracing
    "Batcher",
    "Lens",
    "Tracer",
    "save",
    "wrap",
    # across training steps
    "monitor",
    "monitor_callback",
    # reports and tools
    "Explanation",
    "ValidationResult",
    "bench",
    "doctor",
    "explain",
    "report",
    "validate",
    "__version__",
]
