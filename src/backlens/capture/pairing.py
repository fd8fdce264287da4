"""How an autograd node relates to the forward: its op, its module call, its order.

Read once per node, when its entry is first built (graph/table.py), from what
the state recorded:

* AccumulateGrad belongs to its parameter's module, also when that module was
  never called itself (``MultiheadAttention.out_proj``); reports show it under
  the module's first call, or its nearest called ancestor's;
* a node made inside the forward is paired with the op whose sequence-number
  bracket holds its own (a custom Function's node with the last op its forward
  ran: the op made its output), else inferred from the innermost module call
  around it; on a torch without sequence numbers, with the first op whose
  output it made (by identity), else with nothing;
* a node a pass made (``create_graph=True``) has its creator's order + 1 and
  module: the creator is the fire whose bracket holds the node's number.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from backlens import _torch
from backlens.graph.labels import owning_module
from backlens.graph.table import Pairing


def describe_node(state: Any, type_name: str, seq: int | None, is_custom: bool, source: int | None,
                  index: int | None = None) -> Pairing:
    """The pairing of one node (at ``index``) of ``state`` (a CaptureState)."""
    journal = state.journal
    if type_name == "AccumulateGrad":
        if source is None:
            return Pairing()
        if journal.source_kinds[source] == "param":
            name = journal.source_names[source]
            return Pairing(module_call=journal.placement(owning_module(name)), module_source="paired",
                           param=name, source=source)
        return Pairing(source=source)
    if seq is not None and journal.in_forward(seq):
        op_index = journal.op_index_for_sequence_nr(seq)
        if op_index is not None:
            module_call = journal.module_call_of_op(op_index)
            return Pairing(op=op_index, module_call=module_call,
                           module_source="paired" if module_call is not None else None)
        op = journal.op_run_by_custom_node(seq) if is_custom else None
        if op is not None:
            # A custom Function's apply is invisible to the mode; its node lands
            # on the output of the last op its forward ran: paired with that op.
            return Pairing(op=op.index, module_call=op.module_call,
                           module_source="paired" if op.module_call is not None else None)
        call = journal.module_call_for_sequence_nr(seq)
        if call is not None:
            return Pairing(module_call=call.index, module_source="inferred")
        return Pairing()
    if seq is None and index is not None:
        op_index = state.slots.op_of_node.get(index)
        if op_index is not None:
            module_call = journal.module_call_of_op(op_index)
            return Pairing(op=op_index, module_call=module_call,
                           module_source="paired" if module_call is not None else None)
    order, creator = _created_by(state, seq)
    if creator is not None:
        module_call = state.table.built()[creator].module_call
        return Pairing(module_call=module_call, order=order,
                       module_source="inferred" if module_call is not None else None)
    return Pairing(order=order)


def _created_by(state: Any, seq: int | None) -> tuple[int | None, int | None]:
    """(order, creator node) of a node made after the forward; order 1 outside every
    graph-building pass, None when the pass that made it cannot say which fire did."""
    if seq is None:
        return 1, None
    for pass_ in state.passes:
        if not pass_.create_graph or pass_.seq_start is None:
            continue
        end = pass_.seq_end if pass_.seq_end is not None else _torch.sequence_nr()
        if not (pass_.seq_start <= seq < end):
            continue
        calls = [state.calls[i] for i in pass_.calls if state.calls[i].seq_start is not None]
        pos = bisect_right([c.seq_start for c in calls], seq) - 1
        if pos >= 0 and calls[pos].seq_end is not None and seq < calls[pos].seq_end:
            creator = calls[pos].node
            creator_order = state.table.built()[creator].order
            return (creator_order + 1 if creator_order is not None else None), creator
        return None, None
    return 1, None
