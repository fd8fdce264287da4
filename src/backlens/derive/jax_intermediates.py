"""Per-op gradients of a JAX function, from its jaxpr, each checked by a second computation.

The function is traced to a jaxpr (``jax.make_jaxpr``); jitted sub-functions
are inlined, so each step is one primitive. A step's output cotangent is
derived twice:

* perturbed: every recorded output ``v`` becomes ``v + e`` with ``e = -0.0``
  (adding negative zero changes no float, not even the sign of a zero), and
  one ``jax.grad`` over all the ``e`` gives every cotangent at once;
* suffix: the ops after the step are replayed as a function of ``v`` alone,
  from the recorded forward values, and ``jax.grad`` of that is the oracle.

A record is exposed (status ``"exact"``) only when both agree exactly, and
only when replaying the steps reproduced the function's own loss exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from backlens.derive.record import IntermediateGrad, IntermediateGrads

try:  # the public home of these names since jax 0.4.3x
    from jax.extend.core import ClosedJaxpr, Literal
except ImportError:  # pragma: no cover - older jax
    from jax.core import ClosedJaxpr, Literal

_INLINED = ("jit", "pjit", "closed_call", "core_call")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


class Slot:
    """One value of the flattened program (a jaxpr variable after inlining)."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any):
        self.aval = aval


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass
class Step:
    primitive: Any
    subfuns: list
    params: dict
    context: Any
    ins: list
    outs: list
    name: str


@dataclass
class Program:
    inputs: list = field(default_factory=list)
    consts: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


def _bind_params(eqn: Any) -> tuple[list, dict]:
    bound = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bound, tuple):  # older jax: (subfuns, params)
        subfuns, params = bound
        return list(subfuns), params
    return [], bound


def _op_name(eqn: Any) -> str:
    name = eqn.primitive.name
    if name in _CUSTOM:
        for key in ("call_jaxpr", "fun_jaxpr"):
            inner = eqn.params.get(key)
            info = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
            source = getattr(info, "func_src_info", None) or ""
            function = getattr(info, "func_name", None) or source.split(" ")[0]
            if function and function.isidentifier():
                return function
    return name


def flatten(jaxpr: Any, consts: list, in_atoms: list, program: Program) -> list:
    """Append ``jaxpr``'s steps to ``program`` (jitted calls inlined); return its output atoms."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return Const(atom.val) if isinstance(atom, Literal) else env[atom]

    for var, value in zip(jaxpr.constvars, consts):
        slot = Slot(var.aval)
        program.consts[slot] = value
        env[var] = slot
    for var, atom in zip(jaxpr.invars, in_atoms):
        env[var] = atom
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
        if inner is not None:
            closed = inner if isinstance(inner, ClosedJaxpr) else None
            outs = flatten(closed.jaxpr if closed else inner, closed.consts if closed else [], ins, program)
        else:
            subfuns, params = _bind_params(eqn)
            outs = [Slot(v.aval) for v in eqn.outvars]
            program.steps.append(Step(eqn.primitive, subfuns, params, getattr(eqn, "ctx", None),
                                      ins, outs, _op_name(eqn)))
        for var, atom in zip(eqn.outvars, outs):
            env[var] = atom  # a dropped output's var is never read again
    return [read(a) for a in jaxpr.outvars]


def _traceable(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def trace(call: Callable[[list], Any], leaves: list) -> tuple[Program, list]:
    """The flattened program of ``call(leaves)``, and the leaves that are its inputs.

    Leaves that are not arrays (a string, an object in a pytree) stay Python values.
    """
    positions = [i for i, leaf in enumerate(leaves) if _traceable(leaf)]

    def of_arrays(*arrays: Any) -> Any:
        merged = list(leaves)
        for i, array in zip(positions, arrays):
            merged[i] = array
        return call(merged)

    traced = [leaves[i] for i in positions]
    closed = jax.make_jaxpr(of_arrays)(*traced)
    program = Program()
    program.inputs = [Slot(v.aval) for v in closed.jaxpr.invars]
    program.outputs = flatten(closed.jaxpr, closed.consts, program.inputs, program)
    return program, traced


def run(program: Program, env: dict, start: int = 0, perturb: dict | None = None) -> Any:
    """Run steps ``start..`` over ``env`` (filled in place); returns the (single) output."""

    def read(atom: Any) -> Any:
        return atom.value if isinstance(atom, Const) else env[atom]

    for step in program.steps[start:]:
        manager = getattr(step.context, "manager", None)
        with manager if manager is not None else nullcontext():
            result = step.primitive.bind(*step.subfuns, *map(read, step.ins), **step.params)
        values = result if step.primitive.multiple_results else [result]
        for slot, value in zip(step.outs, values):
            if perturb is not None and slot in perturb:
                value = jax.lax.add(value, perturb[slot])
            env[slot] = value
    return read(program.outputs[0])


def _is_float(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def intermediate_grads(call: Callable[[list], Any], leaves: list, own: np.ndarray,
                       max_intermediate: int) -> IntermediateGrads:
    program, leaves = trace(call, leaves)
    candidates: list[tuple[int, int, Slot]] = [
        (index, out, slot) for index, step in enumerate(program.steps)
        for out, slot in enumerate(step.outs) if _is_float(slot.aval)
    ]
    labels = _labels(program, candidates)
    withheld: dict[str, int] = {}
    notes: list[str] = []
    if len(candidates) > max_intermediate:
        withheld["not_computed"] = len(candidates) - max_intermediate
        notes.append(f"{withheld['not_computed']} op outputs past max_intermediate={max_intermediate} "
                     "were not derived.")
        candidates = candidates[:max_intermediate]
    base = {**program.consts, **dict(zip(program.inputs, leaves))}
    forward = dict(base)
    replayed = np.asarray(run(program, forward)).reshape(own.shape)
    if len(program.outputs) != 1 or not _same_loss(replayed, own):
        withheld["replay_mismatch"] = len(candidates)
        notes.append(f"replaying the traced ops gave loss {replayed!r}, not fn's own {own!r}: "
                     "no intermediate record describes fn's run.")
        return IntermediateGrads([], withheld, notes)
    if not np.array_equal(replayed, own):
        notes.append(f"replaying the traced ops one by one gave loss {replayed!r}; fn's own run "
                     f"(where jax compiles some library functions whole) gave {own!r}.")

    def perturbed(shifts: list) -> Any:
        shifted = {slot: e for (_, _, slot), e in zip(candidates, shifts)}
        return jnp.reshape(run(program, dict(base), perturb=shifted), ())

    zeros = [jnp.full(slot.aval.shape, -0.0, slot.aval.dtype) for _, _, slot in candidates]
    cotangents = jax.grad(perturbed)(zeros)

    records = []
    for (index, out, slot), cotangent in zip(candidates, cotangents):

        def suffix(value: Any, index: int = index, slot: Slot = slot) -> Any:
            env = dict(forward)
            env[slot] = value
            return jnp.reshape(run(program, env, start=index + 1), ())

        oracle = jax.grad(suffix)(forward[slot])
        got, expected = np.asarray(cotangent), np.asarray(oracle)
        if got.shape == expected.shape and np.array_equal(got, expected, equal_nan=True):
            records.append(IntermediateGrad(labels[slot], program.steps[index].primitive.name, out, got))
        else:
            withheld["mismatch"] = withheld.get("mismatch", 0) + 1
    if withheld.get("mismatch"):
        notes.append(f"{withheld['mismatch']} records disagreed with their check and were withheld.")
    return IntermediateGrads(records, withheld, notes)


def _same_loss(replayed: np.ndarray, own: np.ndarray) -> bool:
    """Equal up to the rounding of a few ops compiled together (16 units in the last place)."""
    if replayed.shape != own.shape:
        return False
    dtype = np.result_type(own.dtype, np.float32)
    limit = 16 * float(np.finfo(dtype).eps) * max(abs(float(own)), 1.0)
    return bool(abs(float(replayed) - float(own)) <= limit) or bool(np.array_equal(replayed, own, equal_nan=True))


def _labels(program: Program, candidates: list) -> dict[Slot, str]:
    counts: dict[str, int] = {}
    numbers: list[int] = []
    for step in program.steps:
        counts[step.name] = counts.get(step.name, 0) + 1
        numbers.append(counts[step.name])
    labels = {}
    for index, out, slot in candidates:
        step = program.steps[index]
        label = f"{step.name}_{numbers[index]}"
        labels[slot] = label if len(step.outs) == 1 else f"{label}[{out}]"
    return labels
