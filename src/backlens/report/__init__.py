"""Reports built from records: doctor (and, as they land, backward_status, cost_tree)."""

from backlens.report.doctor import doctor

__all__ = ["doctor"]
