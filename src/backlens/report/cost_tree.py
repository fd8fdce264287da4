"""``bl.report.cost_tree(cap)``: forward and backward FLOPs and time per module call.

See :mod:`backlens.cost.tree` for the rows it returns.
"""

from backlens.cost.tree import NO_FORWARD_OP, UNATTRIBUTED, CostRow, CostTree, cost_tree

__all__ = ["NO_FORWARD_OP", "UNATTRIBUTED", "CostRow", "CostTree", "cost_tree"]
