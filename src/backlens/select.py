"""Selectors: which ops, nodes, sides and passes a policy or an edit applies to (API.md §3).

A selector answers ``matches(obj) -> bool`` for the objects backlens asks
about:

* forward ops: the view a ``save_activations`` policy sees during the
  forward (``kind == "op"``: ``label``, ``func``, ``module``) and ``OpRecord``;
* backward sites: the ``GradSite`` a ``save_grads`` policy sees when a pass
  opens (one node, one side, one pass), a ``GradFn`` record and a
  ``GradFnCall`` record.

Forward selectors (``func``, ``label``, ``module``) match a backward site when
its node is paired with a matching op; ``module`` also matches nodes whose own
module is in the subtree (the AccumulateGrad nodes of its parameters,
inferred nodes). Backward selectors (``grad_fn``, ``without_op``,
``grad_input``, ``grad_output``, ``in_pass``) never match a forward op.
Selectors compose with ``&``, ``|`` and ``~``; ``repr`` reads as the code that
builds them (``bl.func('relu') & bl.in_pass(2)``), and that is what a pass
shows as its ``save_grads_policy``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from backlens.errors import UnsupportedInputError
from backlens.graph.labels import op_name, owning_module, split_call

__all__ = [
    "Selector",
    "func",
    "grad_fn",
    "grad_input",
    "grad_output",
    "in_pass",
    "label",
    "module",
    "selector_from_json",
    "without_op",
]


class Selector:
    """Base of every selector: ``matches(obj)`` plus ``&``, ``|``, ``~``.

    Subclass and implement ``matches`` for a custom rule; it composes with the
    built-in ones. Selectors are immutable and compare equal when their
    ``repr`` is equal.
    """

    def matches(self, obj: Any) -> bool:
        raise NotImplementedError

    def __and__(self, other: Any) -> Selector:
        return _All(_flatten(_All, (self, _selector(other, "&"))))

    def __or__(self, other: Any) -> Selector:
        return _Any(_flatten(_Any, (self, _selector(other, "|"))))

    def __invert__(self) -> Selector:
        if isinstance(self, _Not):
            return self.item
        return _Not(self)

    def pass_scope(self, pass_number: int) -> bool | None:
        """Whether this selector can match anything in pass ``pass_number``.

        ``False`` when its ``in_pass`` terms rule the pass out whatever the
        node, ``True`` when they alone make it match, ``None`` when that
        depends on nodes (three-valued logic over the ``in_pass`` leaves).
        """
        return None

    def to_json(self) -> dict[str, Any]:
        """A plain-data form ``selector_from_json`` rebuilds (for bundles)."""
        return {"kind": "opaque", "repr": repr(self)}

    def terms(self) -> list[tuple[str, bool]]:
        """Its leaf selectors as ``(kind, positive)``: ``kind`` as in ``to_json`` (``"custom"``
        for a user's subclass), ``positive`` False under an odd number of ``~``.

        Says what a selector can match without asking it about any object: an edit
        site is resolved to forward ops or to node calls from its terms.
        """
        return [("custom", True)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selector) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


def _selector(other: Any, operator: str) -> Selector:
    if not isinstance(other, Selector):
        raise UnsupportedInputError(
            f"Selectors combine with other selectors: cannot {operator} a selector with {other!r} "
            f"({type(other).__name__}).", code="bad_selector",
            remedy="Combine selectors such as bl.func('relu') & bl.in_pass(2); a label needs bl.label('...').")
    return other


# -- what an object stands for --------------------------------------------------

def _is_forward_op(obj: Any) -> bool:
    return getattr(obj, "kind", None) == "op"


def _is_call(obj: Any) -> bool:
    """A GradFnCall record (it has no ``kind`` of its own)."""
    return getattr(obj, "kind", "grad_fn_call") == "grad_fn_call" and hasattr(obj, "grad_fn") \
        and hasattr(obj, "pass_number")


def _node_of(obj: Any) -> Any:
    """The GradFn record behind a backward object, or None for forward ops."""
    kind = getattr(obj, "kind", None)
    if kind == "grad_site":
        return obj.grad_fn
    if kind == "grad_fn":
        return obj
    if _is_call(obj):
        return obj.grad_fn
    return None


def _op_of(obj: Any) -> Any:
    if _is_forward_op(obj):
        return obj
    node = _node_of(obj)
    return node.op if node is not None else None


def _pass_of(obj: Any) -> int | None:
    if _is_forward_op(obj) or getattr(obj, "kind", None) == "grad_fn":
        return None
    return getattr(obj, "pass_number", None)


def _names(kind: str, names: tuple[Any, ...], convert: Callable[[Any], Any] = lambda n: n) -> tuple[str, ...]:
    if not names:
        raise UnsupportedInputError(
            f"bl.{kind}() needs at least one name.",
            remedy=f"Pass one or more names, e.g. bl.{kind}({_EXAMPLES[kind]!r}).",
        )
    out = []
    for name in names:
        text = convert(name)
        if not isinstance(text, str) or (not text and kind != "module"):
            raise UnsupportedInputError(
                f"bl.{kind}() takes names as strings, got {name!r}.",
                remedy=f"Pass a string such as {_EXAMPLES[kind]!r}.",
            )
        out.append(text)
    return tuple(out)


_EXAMPLES = {"func": "relu", "label": "linear_2", "module": "encoder.layer.0"}


def _args_repr(values: tuple[Any, ...]) -> str:
    return ", ".join(repr(v) for v in values)


# -- forward selectors ----------------------------------------------------------

class _Func(Selector):
    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def matches(self, obj: Any) -> bool:
        op = _op_of(obj)
        return op is not None and op.func in self.names

    def to_json(self) -> dict[str, Any]:
        return {"kind": "func", "names": list(self.names)}

    def terms(self) -> list[tuple[str, bool]]:
        return [("func", True)]

    def __repr__(self) -> str:
        return f"bl.func({_args_repr(self.names)})"


def func(*names: str | Callable[..., Any]) -> Selector:
    """Ops of these torch functions (``"relu"`` or ``torch.relu``) and their paired nodes."""
    def convert(name: Any) -> str:
        return name if isinstance(name, str) else op_name(name) if callable(name) else name

    return _Func(_names("func", names, convert))


_CALL_LABEL = re.compile(r"^(?P<node>.+):(?P<call>\d+)$")


class _Label(Selector):
    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._plain = frozenset(n for n in names if not _CALL_LABEL.match(n))
        calls: dict[str, set[int]] = {}
        for name in names:
            found = _CALL_LABEL.match(name)
            if found:
                calls.setdefault(found["node"], set()).add(int(found["call"]))
        self._calls = calls

    def matches(self, obj: Any) -> bool:
        if _is_forward_op(obj):
            return obj.label in self._plain
        node = _node_of(obj)
        if node is None:
            return False
        if node.label in self._plain or (node.op is not None and node.op.label in self._plain):
            return True
        wanted = self._calls.get(node.label)
        if not wanted:
            return False
        if getattr(obj, "kind", None) == "grad_site":
            # A node fires at most once per pass, so its call in this pass is
            # the one after every call of the earlier passes.
            earlier = sum(1 for c in node.calls if c.pass_number < obj.pass_number)
            return earlier + 1 in wanted
        return _is_call(obj) and obj.index in wanted

    def to_json(self) -> dict[str, Any]:
        return {"kind": "label", "names": list(self.names)}

    def terms(self) -> list[tuple[str, bool]]:
        return [("label", True)]

    def __repr__(self) -> str:
        return f"bl.label({_args_repr(self.names)})"


def label(*names: str) -> Selector:
    """One op by label (``"linear_2"``), a node (``"addmm_back_1_4"``) or a node call (``"addmm_back_1_4:2"``).

    An op label also matches the nodes paired with that op.
    """
    return _Label(_names("label", names))


def _in_path(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _scope(target: Any) -> tuple[str, list[int] | None, Any] | None:
    """(module address, the module calls it belongs to, journal) of an op or node.

    An op, or a node paired with one or inferred, belongs to one call; an
    AccumulateGrad node to every call of its parameter's module (or, for a
    module never called itself, of its nearest called ancestor). An object
    without a capture state answers from its ``module`` text (calls None).
    """
    state = getattr(target, "_state", None)
    if state is None:
        module = getattr(target, "module", None)
        return None if module is None else (split_call(module)[0], None, None)
    journal = state.journal
    entry = target._entry
    param = getattr(entry, "param", None)
    if param is not None:
        address = owning_module(param)
        calls = journal.calls_of(address)
        if not calls:
            placed = journal.placement(address)
            calls = [placed] if placed is not None else []
        return address, calls, journal
    if entry.module_call is None:
        return None
    return journal.module_calls[entry.module_call].address, [entry.module_call], journal


class _Module(Selector):
    def __init__(self, addresses: tuple[str, ...]):
        self.addresses = addresses
        self._parsed = [split_call(a) for a in addresses]

    def matches(self, obj: Any) -> bool:
        target = obj if _is_forward_op(obj) else _node_of(obj)
        scope = _scope(target) if target is not None else None
        if scope is None:
            return False
        address, calls, journal = scope
        for root, number in self._parsed:
            if not _in_path(address, root):
                continue
            if number is None:
                return True
            if calls is None:
                # No capture state, no call tree: the object's own call number decides.
                if (split_call(target.module)[1] or 1) == number:
                    return True
                continue
            # "lin:2": only what runs inside lin's second call (every call it belongs to).
            wanted = journal.resolve(f"{root}:{number}")
            if wanted and calls and all(journal.within(call, wanted[0]) for call in calls):
                return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {"kind": "module", "names": list(self.addresses)}

    def terms(self) -> list[tuple[str, bool]]:
        return [("module", True)]

    def __repr__(self) -> str:
        return f"bl.module({_args_repr(self.addresses)})"


def module(*addresses: str) -> Selector:
    """Ops inside these modules' subtrees (``"encoder.layer.0"``; ``""`` is the whole model).

    Matches the nodes paired with those ops and every node whose module is in
    the subtree (its parameters' AccumulateGrad nodes, also of submodules never
    called themselves; inferred nodes). An address covers every call of the
    module; ``"encoder.layer.0:2"`` only the second, ``"encoder.layer.0:1"``
    only the first (a parameter's AccumulateGrad serves every call of its
    module, so it matches a call only when the module has that one call).
    """
    return _Module(_names("module", addresses))


# -- backward selectors ---------------------------------------------------------

class _GradFn(Selector):
    def __init__(self, type_name: str | None, label_part: str | None):
        self.type_name = type_name
        self.label_part = label_part
        # "AddmmBackward" (no version digit) matches every version.
        self._any_version = type_name is not None and not type_name[-1:].isdigit()

    def matches(self, obj: Any) -> bool:
        node = _node_of(obj)
        if node is None:
            return False
        if self.type_name is not None:
            node_type = node.type
            if self._any_version:
                node_type = node_type.rstrip("0123456789")
            if node_type != self.type_name:
                return False
        return self.label_part is None or self.label_part in node.label

    def to_json(self) -> dict[str, Any]:
        return {"kind": "grad_fn", "type": self.type_name, "label": self.label_part}

    def terms(self) -> list[tuple[str, bool]]:
        return [("grad_fn", True)]

    def __repr__(self) -> str:
        parts = [repr(self.type_name)] if self.type_name is not None else []
        if self.label_part is not None:
            parts.append(f"label={self.label_part!r}")
        return f"bl.grad_fn({', '.join(parts)})"


def grad_fn(type: str | None = None, *, label: str | None = None) -> Selector:  # noqa: A002 - API name
    """Autograd nodes by class name (``"AddmmBackward0"``) and/or label substring (``label="addmm"``)."""
    if type is None and label is None:
        raise UnsupportedInputError(
            "bl.grad_fn() needs a node class name or label=.",
            remedy="Pass e.g. bl.grad_fn('AddmmBackward0') or bl.grad_fn(label='addmm').",
        )
    for value, what in ((type, "class name"), (label, "label")):
        if value is not None and (not isinstance(value, str) or not value):
            raise UnsupportedInputError(
                f"bl.grad_fn() takes the node {what} as a non-empty string, got {value!r}.",
                remedy="Pass e.g. bl.grad_fn('AddmmBackward0') or bl.grad_fn(label='addmm').",
            )
    return _GradFn(type, label)


class _WithoutOp(Selector):
    def matches(self, obj: Any) -> bool:
        node = _node_of(obj)
        return node is not None and node.op is None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "without_op"}

    def terms(self) -> list[tuple[str, bool]]:
        return [("without_op", True)]

    def __repr__(self) -> str:
        return "bl.without_op()"


def without_op() -> Selector:
    """Nodes paired with no forward op: the loss, AccumulateGrad, inferred and higher-order nodes."""
    return _WithoutOp()


class _Side(Selector):
    def __init__(self, side: str):
        self.side = side

    def matches(self, obj: Any) -> bool:
        return getattr(obj, "kind", None) == "grad_site" and obj.side == self.side

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.side}

    def terms(self) -> list[tuple[str, bool]]:
        return [(self.side, True)]

    def __repr__(self) -> str:
        return f"bl.{self.side}()"


def grad_input() -> Selector:
    """The gradients a node call returns (w.r.t. its forward inputs, leaving the node)."""
    return _Side("grad_input")


def grad_output() -> Selector:
    """The gradients a node call receives (w.r.t. its forward outputs); what ``op.grads`` reads."""
    return _Side("grad_output")


class _InPass(Selector):
    def __init__(self, numbers: tuple[int, ...]):
        self.numbers = numbers

    def matches(self, obj: Any) -> bool:
        return _pass_of(obj) in self.numbers

    def pass_scope(self, pass_number: int) -> bool | None:
        return pass_number in self.numbers

    def to_json(self) -> dict[str, Any]:
        return {"kind": "in_pass", "numbers": list(self.numbers)}

    def terms(self) -> list[tuple[str, bool]]:
        return [("in_pass", True)]

    def __repr__(self) -> str:
        return f"bl.in_pass({_args_repr(self.numbers)})"


def in_pass(*numbers: int) -> Selector:
    """Backward pass number k (1-based; several numbers match any of them)."""
    if not numbers or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in numbers):
        raise UnsupportedInputError(
            f"bl.in_pass() takes 1-based pass numbers, got {numbers!r}.",
            remedy="Pass numbers start at 1: bl.in_pass(1) is the first backward pass.",
        )
    return _InPass(tuple(numbers))


#: Term kinds that match backward objects only (nodes, node calls, passes, sides), never a forward op.
BACKWARD_TERMS = frozenset({"grad_fn", "without_op", "grad_input", "grad_output", "in_pass"})


# -- composition ------------------------------------------------------------------

def _flatten(kind: type, items: tuple[Selector, ...]) -> tuple[Selector, ...]:
    out: list[Selector] = []
    for item in items:
        out.extend(item.items if isinstance(item, kind) else (item,))
    return tuple(out)


class _All(Selector):
    def __init__(self, items: tuple[Selector, ...]):
        self.items = items

    def matches(self, obj: Any) -> bool:
        return all(item.matches(obj) for item in self.items)

    def pass_scope(self, pass_number: int) -> bool | None:
        scopes = [item.pass_scope(pass_number) for item in self.items]
        if False in scopes:
            return False
        return True if all(s is True for s in scopes) else None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "all", "items": [item.to_json() for item in self.items]}

    def terms(self) -> list[tuple[str, bool]]:
        return [term for item in self.items for term in item.terms()]

    def __repr__(self) -> str:
        return " & ".join(f"({item!r})" if isinstance(item, _Any) else repr(item) for item in self.items)


class _Any(Selector):
    def __init__(self, items: tuple[Selector, ...]):
        self.items = items

    def matches(self, obj: Any) -> bool:
        return any(item.matches(obj) for item in self.items)

    def pass_scope(self, pass_number: int) -> bool | None:
        scopes = [item.pass_scope(pass_number) for item in self.items]
        if True in scopes:
            return True
        return False if all(s is False for s in scopes) else None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "any", "items": [item.to_json() for item in self.items]}

    def terms(self) -> list[tuple[str, bool]]:
        return [term for item in self.items for term in item.terms()]

    def __repr__(self) -> str:
        return " | ".join(repr(item) for item in self.items)


class _Not(Selector):
    def __init__(self, item: Selector):
        self.item = item

    def matches(self, obj: Any) -> bool:
        return not self.item.matches(obj)

    def pass_scope(self, pass_number: int) -> bool | None:
        scope = self.item.pass_scope(pass_number)
        return None if scope is None else not scope

    def to_json(self) -> dict[str, Any]:
        return {"kind": "not", "item": self.item.to_json()}

    def terms(self) -> list[tuple[str, bool]]:
        return [(kind, not positive) for kind, positive in self.item.terms()]

    def __repr__(self) -> str:
        inner = repr(self.item)
        return f"~({inner})" if isinstance(self.item, (_All, _Any)) else f"~{inner}"


class _Opaque(Selector):
    """A selector read back from a bundle that could not be rebuilt: it keeps its
    repr and matches nothing."""

    def __init__(self, text: str):
        self.text = text

    def matches(self, obj: Any) -> bool:
        return False

    def to_json(self) -> dict[str, Any]:
        return {"kind": "opaque", "repr": self.text}

    def terms(self) -> list[tuple[str, bool]]:
        return [("opaque", True)]

    def __repr__(self) -> str:
        return self.text


_MAX_SELECTOR_DEPTH = 32
_JSON_KEYS = {
    "func": {"kind", "names"}, "label": {"kind", "names"}, "module": {"kind", "names"},
    "grad_fn": {"kind", "type", "label"}, "without_op": {"kind"}, "grad_input": {"kind"},
    "grad_output": {"kind"}, "in_pass": {"kind", "numbers"}, "all": {"kind", "items"},
    "any": {"kind", "items"}, "not": {"kind", "item"}, "opaque": {"kind", "repr"},
}


def selector_from_json(data: dict[str, Any], _depth: int = 0) -> Selector:
    """Rebuild a selector from ``Selector.to_json()``: a closed set of kinds, every field
    checked (ValueError on anything else, also on nesting deeper than 32)."""
    if _depth > _MAX_SELECTOR_DEPTH:
        raise ValueError(f"a selector nested more than {_MAX_SELECTOR_DEPTH} deep")
    if not isinstance(data, dict):
        raise ValueError(f"a selector must be an object, got {type(data).__name__}")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in _JSON_KEYS:
        raise ValueError(f"unknown selector kind {str(kind)[:80]!r}")
    if set(data) != _JSON_KEYS[kind]:
        raise ValueError(f"a {kind} selector has fields {sorted(_JSON_KEYS[kind])}, got {sorted(data)[:10]}")
    if kind == "func":
        return _Func(tuple(_strings(data["names"])))
    if kind == "label":
        return _Label(tuple(_strings(data["names"])))
    if kind == "module":
        return _Module(tuple(_strings(data["names"], empty_ok=True)))
    if kind == "grad_fn":
        type_name, part = data["type"], data["label"]
        if (type_name is None and part is None) or not all(v is None or (isinstance(v, str) and v)
                                                           for v in (type_name, part)):
            raise ValueError("a grad_fn selector needs a non-empty type or label string")
        return _GradFn(type_name, part)
    if kind == "without_op":
        return _WithoutOp()
    if kind in ("grad_input", "grad_output"):
        return _Side(kind)
    if kind == "in_pass":
        numbers = data["numbers"]
        if not isinstance(numbers, list) or not numbers or not all(
                type(k) is int and 1 <= k < 2**63 for k in numbers):
            raise ValueError("in_pass numbers must be a non-empty list of integers >= 1")
        return _InPass(tuple(numbers))
    if kind in ("all", "any"):
        items = data["items"]
        if not isinstance(items, list) or not items:
            raise ValueError(f"an {kind} selector needs a non-empty list of items")
        rebuilt = tuple(selector_from_json(item, _depth + 1) for item in items)
        return _All(rebuilt) if kind == "all" else _Any(rebuilt)
    if kind == "not":
        return _Not(selector_from_json(data["item"], _depth + 1))
    if not isinstance(data["repr"], str):
        raise ValueError("an opaque selector's repr must be a string")
    return _Opaque(data["repr"])


def _strings(values: Any, empty_ok: bool = False) -> list[str]:
    if not isinstance(values, list) or not values or not all(
            isinstance(v, str) and (v or empty_ok) for v in values):
        raise ValueError("selector names must be a non-empty list of strings")
    return values
