"""``bl.bench``: time the backward pass alone, per pass, node type and module call.

See :mod:`backlens.cost.bench`.
"""

from backlens.cost.bench import BackwardBench, ModuleTiming, Stats, backward

__all__ = ["BackwardBench", "ModuleTiming", "Stats", "backward"]
