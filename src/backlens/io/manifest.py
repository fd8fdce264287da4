"""The bundle manifest: every record of a capture as JSON, and reading it back safely.

Layout (``FORMAT_VERSION`` 1)::

    format, format_version, backlens_version, torch_version, created
    capture        flags of the capture (inference_only, backward_requested, ...)
    ops, modules, params, inputs, grad_fns, passes, calls
                   one object per record: every dataclass field not starting
                   with "_" (see docs/records.md), relations by position
                   (a node's "op", a call's "grad_fn"), values through io/codec.py
    grad_slots     where each op / module call / parameter / input reads its
                   gradients: (node, output_nr) into the calls' grad_outputs,
                   plus gradients torch.autograd.grad returned for inputs
    cost           the capture's cost journal (``cap._cost.to_dict()``: forward
                   FLOPs per op and one dict per counted pass: executed and
                   unattributed FLOPs, recompute, ATen calls), or null
    tensors        files: {name: {bytes, sha256}}; index: {tensor name:
                   {file, dtype, shape, offsets, sha256}}
    checksum       sha256 of the canonical JSON of everything above

Call FLOPs (``flops``, ``recompute_flops``) are fields of each call record.
New record fields round-trip without a format change; a change that older
readers would misread bumps ``FORMAT_VERSION`` and adds a migration.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backlens._version import __version__
from backlens.errors import BundleError
from backlens.io.codec import encode

FORMAT = "backlens.bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# Upgrades from an older format version to the next one: version -> fn(manifest) -> manifest.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


class Refs:
    """How a manifest refers to tensors: ``tensor(t)`` stores one and returns its name;
    ``call_side(position, side, tensors)`` does a call's saved side (None when not saved)
    and returns it as codec JSON."""

    def tensor(self, tensor: torch.Tensor) -> str:
        raise NotImplementedError

    def call_side(self, position: int, side: str, tensors: tuple | None) -> Any:
        if tensors is None:
            return None
        return side_json([None if t is None else self.tensor(t) for t in tensors])


def side_json(names: list[str | None]) -> dict[str, Any]:
    """A call's saved side as codec JSON: a tuple of tensor refs and Nones."""
    return {"$tuple": [None if n is None else {"$tensor": n} for n in names]}


def record_fields(record: Any, refs: Refs, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every public dataclass field of ``record`` except ``skip``, encoded."""
    return {
        f.name: encode(getattr(record, f.name), refs.tensor)
        for f in dataclasses.fields(record)
        if not f.name.startswith("_") and f.name != "kind" and f.name not in skip
    }


def build(capture: Any, refs: Refs) -> dict[str, Any]:
    """The manifest body (no ``tensors``/``checksum`` yet) of a live capture."""
    grad_fns = list(capture.grad_fns)  # discovers the forward graph first
    passes = list(capture.passes)      # closes drained implicit passes
    calls = list(capture.grad_fn_calls)
    ops, modules = list(capture.ops), list(capture.modules)
    params, inputs = list(capture.params), list(capture.inputs)
    encoded_calls = []
    for position, call in enumerate(calls):
        data = record_fields(call, refs, skip=("grad_fn", "grad_inputs", "grad_outputs"))
        data["grad_fn"] = call.grad_fn.index
        data["grad_inputs"] = refs.call_side(position, "grad_inputs", call.grad_inputs)
        data["grad_outputs"] = refs.call_side(position, "grad_outputs", call.grad_outputs)
        encoded_calls.append(data)
    encoded_params = []
    for param in params:
        data = record_fields(param, refs)
        live = param.grad
        data["live_grad"] = None if live is None else refs.tensor(live)
        encoded_params.append(data)
    encoded_nodes = []
    for node in grad_fns:
        data = record_fields(node, refs, skip=("op",))
        data["op"] = node.op.index if node.op is not None else None
        encoded_nodes.append(data)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "backlens_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "capture": {
            "inference_only": bool(capture.inference_only),
            "backward_requested": bool(capture.backward_requested),
            "flops_enabled": bool(capture.flops_enabled),
            "inference_cause": getattr(capture, "_inference_cause", None),
        },
        "ops": [record_fields(op, refs) for op in ops],
        "modules": [record_fields(m, refs) for m in modules],
        "params": encoded_params,
        "inputs": [record_fields(i, refs) for i in inputs],
        "grad_fns": encoded_nodes,
        "passes": [record_fields(p, refs) for p in passes],
        "forward_edits": [encode(a, refs.tensor) for a in getattr(capture, "forward_edits", [])],
        "calls": encoded_calls,
        "grad_slots": grad_slots(capture, refs),
        "cost": cost_section(capture, refs),
    }


def grad_slots(capture: Any, refs: Refs) -> dict[str, Any]:
    """Where records read gradients from, taken from the live capture's journal.

    Reads the capture's core (its journal and node maps): they are the one
    source of truth for which node output each record's gradient is.
    """
    core = capture._core
    journal = core.journal
    return {
        "ops": [[op, node, journal.ops[op].output_nr]
                for op, node in sorted(core.output_node_of_op.items())],
        "modules": [[call, node, journal.module_calls[call].output_nr]
                    for call, node in sorted(core.output_node_of_module.items())],
        "params": [[name, node] for name, node in core.node_of_param.items()],
        "inputs": [[i, node, nr] for i, (node, nr) in sorted(core.node_of_input.items())],
        "extra_input_grads": [[i, refs.tensor(g.tensor), g.pass_number]
                              for i, g in core.extra_input_grads],
    }


def cost_section(capture: Any, refs: Refs) -> Any:
    """The cost journal as data (None when the capture keeps none)."""
    journal = getattr(capture, "_cost", None)
    return None if journal is None else encode(journal.to_dict(), refs.tensor)


def checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def write(directory: Path, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename)."""
    manifest = dict(body)
    manifest["checksum"] = checksum(body)
    temporary = directory / (MANIFEST + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(directory / MANIFEST)


def read(path: Path) -> dict[str, Any]:
    """Parse, check and migrate ``path`` (a manifest.json); BundleError on any problem."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BundleError(f"{path}: cannot read the manifest ({exc.strerror or exc}).",
                          code="bundle_missing_file") from exc
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"{path}: malformed JSON ({exc}).", code="bundle_corrupt") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: not a backlens bundle manifest (no \"format\": \"{FORMAT}\").",
                          code="bundle_not_a_bundle")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BundleError(f"{path}: bad format_version {version!r}.", code="bundle_corrupt")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{path}: written in bundle format version {version} "
            f"(by backlens {manifest.get('backlens_version', '?')}); this backlens "
            f"({__version__}) reads versions up to {FORMAT_VERSION}.",
            code="bundle_too_new",
            remedy="Upgrade backlens to load this bundle.",
        )
    stated = manifest.pop("checksum", None)
    if not isinstance(stated, str):
        raise BundleError(f"{path}: the manifest has no checksum.", code="bundle_corrupt")
    if checksum(manifest) != stated:
        raise BundleError(f"{path}: checksum mismatch: the manifest was changed or corrupted.",
                          code="bundle_corrupt")
    while manifest["format_version"] < FORMAT_VERSION:
        step = MIGRATIONS.get(manifest["format_version"])
        if step is None:
            raise BundleError(f"{path}: no migration from format version {manifest['format_version']}.",
                              code="bundle_too_old")
        before = manifest["format_version"]
        manifest = step(dict(manifest))
        if manifest.get("format_version") != before + 1:
            raise BundleError(f"{path}: migration from format version {before} failed.",
                              code="bundle_too_old")
    for key in ("capture", "ops", "modules", "params", "inputs", "grad_fns", "passes", "calls",
                "grad_slots", "tensors"):
        if key not in manifest:
            raise BundleError(f"{path}: the manifest has no {key!r} section.", code="bundle_corrupt")
    return manifest
