"""DDP's and FSDP2's private parts, for backlens._torch (which alone imports this module and
re-exports its names: the rest of backlens reaches them as ``_torch.fsdp_...``, ``_torch.ddp_...``).

DDP keeps the communication hooks registered from Python in a private list;
it accepts one hook per model, so capture registers its pass-through hook only
on a model with none, and puts the list back when DDP refuses it.

FSDP2 keeps, per unit (a module given to ``fully_shard``), private param
groups holding the unit's communication objects (the all-gather and the
reduce-scatter that ``FSDPModule.set_custom_all_gather`` replaces) and the
unsharded parameters its forward computes with. Capture swaps recording
wrappers in for one backward run and puts the originals back. The FSDP
package costs half a second to import, so it is looked at only when the
user's program imported it.
"""

from __future__ import annotations

from typing import Any


def fsdp_param_groups(module: Any) -> list[Any]:
    """The param groups of an FSDP2 unit that carry communication objects (none when
    ``module`` is not a unit or torch keeps them elsewhere)."""
    if not FSDP_COMM_OBJECTS.present:
        return []
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    try:
        state = get_state()
    except (AssertionError, AttributeError, RuntimeError):
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return [g for g in groups if g is not None and hasattr(g, "_all_gather_comm")
            and hasattr(g, "_reduce_scatter_comm")]


def fsdp_comms(group: Any) -> tuple[Any, Any]:
    """A param group's (all-gather, reduce-scatter) communication objects."""
    return group._all_gather_comm, group._reduce_scatter_comm


def set_fsdp_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    group._all_gather_comm = all_gather
    group._reduce_scatter_comm = reduce_scatter


def fsdp_unsharded_params(group: Any) -> list[tuple[Any, Any]]:
    """``(sharded parameter, unsharded parameter)`` of each parameter of a param group:
    the forward computes with (and AccumulateGrad accumulates into) the unsharded one."""
    pairs = []
    for fsdp_param in getattr(group, "fsdp_params", ()):
        sharded = getattr(fsdp_param, "sharded_param", None)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if sharded is not None and unsharded is not None:
            pairs.append((sharded, unsharded))
    return pairs


class _FsdpCapability:
    """Like :class:`Capability`, with ``present`` read when first asked (importing FSDP)."""

    name = "HAS_FSDP_COMM_OBJECTS"
    used_for = "recording FSDP2's all-gathers and reduce-scatters in a backward (pass_.collectives)"
    without_it = "FSDP2 collectives are not recorded (pass_.collectives stays empty under FSDP2)"

    _present: bool | None = None

    @property
    def present(self) -> bool:
        """Read from the API, not from bytecode: the unit's state accessor, and the public
        setters of the communication objects (``set_custom_all_gather`` and
        ``set_custom_reduce_scatter`` replace them, so this FSDP2 keeps them per param
        group). Whether a group holds them is checked on the group itself
        (:func:`fsdp_param_groups`); one that does not is noted on the capture."""
        if self._present is None:
            try:
                from torch.distributed.fsdp import FSDPModule
            except ImportError:
                return False
            self._present = all(hasattr(FSDPModule, name) for name in
                                ("_get_fsdp_state", "set_custom_all_gather", "set_custom_reduce_scatter"))
        return self._present


FSDP_COMM_OBJECTS = _FsdpCapability()


def ddp_comm_hooks(ddp: Any) -> list[Any] | None:
    """The list of communication hooks registered on ``ddp`` from Python (the list itself:
    changed in place to undo a registration), or None where this torch keeps none."""
    hooks = getattr(ddp, "_comm_hooks", None)
    return hooks if isinstance(hooks, list) else None
