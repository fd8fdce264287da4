"""Label grammar for forward ops, autograd nodes and node calls (API.md §1).

* op: ``{name}_{k}``, the k-th call of that torch function in the forward.
* node: ``{type}_back_{k}_{n}``, ``type`` the node class without its
  ``Backward<digits>`` suffix, lowercased; ``k`` counts nodes of that type,
  ``n`` counts all nodes.
* call: ``{node label}:{c}``, the c-th fire of that node.
* module: its address (``encoder.layer.0``) names the module and all its calls;
  ``encoder.layer.0:2`` its second call (1-based). A module call's label is its
  address when the module ran once, else ``{address}:{k}``.
* parameter: ``{module address}.{name}``; the root module's address is ``""``.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Sequence

from backlens.errors import LabelNotFoundError

_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")

# The one name of backward work that belongs to no module (nodes with no forward
# op: the loss, built after the forward; a leaf input's AccumulateGrad), in every
# report, table, timeline and profiler range.
NO_FORWARD_OP = "(backward without forward op)"
# The model's own module call (address "") where a name is shown.
ROOT_NAME = "(model)"

# Reflected and in-place dunders name the same torch function as their base.
_DUNDER_ALIASES = {
    "radd": "add",
    "rmul": "mul",
    "truediv": "div",
    "rtruediv": "rdiv",
    "floordiv": "floor_divide",
    "rfloordiv": "rfloor_divide",
    "rmatmul": "matmul",
    "rpow": "rpow",
    "rsub": "rsub",
    "rand": "and",
    "ror": "or",
    "rxor": "xor",
}


def op_name(func: object) -> str:
    """The short torch name of a function seen by a TorchFunctionMode."""
    name = getattr(func, "__name__", None) or type(func).__name__
    owner = getattr(func, "__self__", None)
    if name == "apply" and isinstance(owner, type):
        return owner.__name__  # a custom autograd Function: its class names it
    if name in ("__get__", "__set__"):
        # Property access: the property's own name says what it is (``T``, ``mT``).
        prop = getattr(owner, "__name__", None)
        if prop:
            name = prop if name == "__get__" else f"set_{prop}"
    if name.startswith("__") and name.endswith("__"):
        name = name.strip("_")
        name = _DUNDER_ALIASES.get(name, name)
    return name or "op"


@functools.lru_cache(maxsize=1024)
def node_type_stem(type_name: str) -> str:
    """``AddmmBackward0`` -> ``addmm``; ``AccumulateGrad`` -> ``accumulategrad``."""
    stem = _BACKWARD_SUFFIX.sub("", type_name)
    return (stem or type_name).lower()


def node_label(type_name: str, k: int, n: int) -> str:
    return f"{node_type_stem(type_name)}_back_{k}_{n}"


def call_label(name: str, c: int) -> str:
    """The c-th call of a node or module: ``{name}:{c}``."""
    return f"{name}:{c}"


_CALL_SUFFIX = re.compile(r"^(?P<name>.*):(?P<call>\d+)$")


def split_call(name: str) -> tuple[str, int | None]:
    """``"encoder.layer.0:2"`` -> ``("encoder.layer.0", 2)``; no suffix -> ``(name, None)``."""
    found = _CALL_SUFFIX.match(name)
    if found is None:
        return name, None
    return found["name"], int(found["call"])


def owning_module(param_name: str) -> str:
    """``encoder.layer.0.weight`` -> ``encoder.layer.0`` (the root module is ``""``)."""
    return param_name.rpartition(".")[0]


NODE_LABEL_PATTERN = re.compile(r"^[a-z0-9_]+_back_\d+_\d+$")
CALL_LABEL_PATTERN = re.compile(r"^[a-z0-9_]+_back_\d+_\d+:\d+$")


def close_labels(wanted: str, labels: Sequence[str], limit: int = 5) -> list[str]:
    """Labels that look like ``wanted``, best first (prefix matches count too)."""
    close = difflib.get_close_matches(wanted, labels, n=limit, cutoff=0.5)
    if len(close) < limit:
        stem = wanted.rsplit("_", 1)[0]
        for label in labels:
            if label.startswith(stem) and label not in close:
                close.append(label)
                if len(close) == limit:
                    break
    return close


def label_not_found(kind: str, wanted: str, labels: Sequence[str]) -> LabelNotFoundError:
    close = close_labels(wanted, labels)
    hint = f" Close labels: {', '.join(close)}." if close else ""
    return LabelNotFoundError(
        f"No {kind} labelled {wanted!r}.{hint}",
        remedy=f"Use a label from .labels() of the {kind} list.",
    )
