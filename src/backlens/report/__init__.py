"""Reports built from records: doctor, backward_status, cost_tree, timeline, memory_plan."""

from backlens.report.backward_status import backward_status
from backlens.report.cost_tree import cost_tree
from backlens.report.doctor import doctor
from backlens.report.memory_plan import memory_plan
from backlens.report.timeline import timeline

__all__ = ["backward_status", "cost_tree", "doctor", "memory_plan", "timeline"]
