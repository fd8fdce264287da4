"""Record field values <-> JSON, with tensors stored by name. No pickle.

JSON has no tuples, dtypes or tensors, so such values are tagged objects
with one ``$``-key. Decoding is the exact inverse for every type a record
holds; values of other types are written as their ``repr`` and read back as
that string (lossy but never failing), and dataclasses come back only when
their class lives in ``backlens`` (nothing else is imported).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from backlens.capture.policy import GradPolicy
from backlens.graph.engine import CallSite
from backlens.select import Selector, _Opaque, selector_from_json

TensorRef = Callable[[torch.Tensor], str]
TensorGet = Callable[[str], torch.Tensor]


def encode(value: Any, tensor_ref: TensorRef) -> Any:
    """A JSON-able form of ``value``; tensors become ``{"$tensor": name}``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"$tensor": tensor_ref(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, CallSite):
        return {"$call_site": [value.file, value.line, value.function]}
    if isinstance(value, BaseException):
        return {"$error": str(value), "type": type(value).__name__}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$tuple": [encode(v, tensor_ref) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensor_ref) for v in value]
    if isinstance(value, dict):
        return {"$map": [[encode(k, tensor_ref), encode(v, tensor_ref)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [encode(v, tensor_ref) for v in sorted(value, key=repr)]}
    if isinstance(value, GradPolicy):
        return {"$policy": encode_policy_spec(value.spec), "repr": repr(value)}
    if isinstance(value, Selector):
        return {"$selector": value.to_json()}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return encode(value.item(), tensor_ref)  # numpy scalar
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {
            f.name: encode(getattr(value, f.name), tensor_ref)
            for f in dataclasses.fields(value)
            if not f.name.startswith("_")
        }
        return {"$dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    return {"$repr": repr(value)}


def encode_policy_spec(spec: Any) -> Any:
    if spec is True or spec is False or spec is None:
        return spec
    to_json = getattr(spec, "to_json", None)
    return to_json() if to_json is not None else {"kind": "opaque", "repr": repr(spec)}


def decode(value: Any, tensor_get: TensorGet) -> Any:
    """The inverse of :func:`encode` (raises ValueError/KeyError/TypeError on bad data)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode(v, tensor_get) for v in value]
    if not isinstance(value, dict) or not value:
        raise ValueError(f"unexpected value {value!r}")
    tag = next(iter(value))
    body = value[tag]
    if tag == "$tensor":
        return tensor_get(body)
    if tag == "$tuple":
        return tuple(decode(v, tensor_get) for v in body)
    if tag == "$map":
        return {_hashable(decode(k, tensor_get)): decode(v, tensor_get) for k, v in body}
    if tag == "$set":
        return {_hashable(decode(v, tensor_get)) for v in body}
    if tag == "$float":
        return float(body)
    if tag == "$dtype":
        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {body!r}")
        return dtype
    if tag == "$device":
        return torch.device(body)
    if tag == "$call_site":
        file, line, function = body
        return CallSite(str(file), int(line), str(function))
    if tag == "$error":
        return str(body)
    if tag == "$policy":
        return decode_policy(body, value.get("repr"))
    if tag == "$selector":
        return selector_from_json(body)
    if tag == "$dataclass":
        return _decode_dataclass(body, value.get("fields", {}), tensor_get)
    if tag == "$repr":
        return str(body)
    raise ValueError(f"unknown tag {tag!r}")


def decode_policy(spec: Any, text: Any) -> GradPolicy:
    if spec is True or spec is False or spec is None:
        return GradPolicy(spec)
    selector = selector_from_json(spec)
    if isinstance(selector, _Opaque) and isinstance(text, str) and text.startswith("save_grads="):
        selector = _Opaque(text[len("save_grads="):])
    return GradPolicy(selector)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _decode_dataclass(qualified: str, fields: dict[str, Any], tensor_get: TensorGet) -> Any:
    decoded = {name: decode(v, tensor_get) for name, v in fields.items()}
    module_name, _, qualname = str(qualified).partition(":")
    if module_name == "backlens" or module_name.startswith("backlens."):
        try:
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if dataclasses.is_dataclass(cls):
                known = {f.name for f in dataclasses.fields(cls) if f.init}
                return cls(**{k: v for k, v in decoded.items() if k in known})
        except (ImportError, AttributeError, TypeError):
            pass
    return decoded  # a class backlens does not own (or no longer has): its fields as a dict
