"""``bl.report.backward_status(cap)``: executed backward FLOPs per pass, attributed.

See :mod:`backlens.cost.attribution` for the records it returns.
"""

from backlens.cost.attribution import (
    AttributionRow,
    BackwardStatus,
    FlopsAttribution,
    PassFlops,
    UnattributedOp,
    backward_status,
)

__all__ = [
    "AttributionRow", "BackwardStatus", "FlopsAttribution", "PassFlops", "UnattributedOp",
    "backward_status",
]
