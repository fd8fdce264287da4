"""Many ranks' captures together (API.md §10, docs/distributed.md).

* ``rankset``: ``bl.load("run/")`` on a directory of rank bundles: a
  :class:`~backlens.distributed.rankset.RankSet`, and ``check_grads``.
* ``rank_table``: ``rankset.cost_tree()``, per module the backward time on each
  rank, the slowest rank and the skew.

What one rank records under ``torch.distributed`` (its collectives, its rank)
is capture/collectives.py's.
"""
