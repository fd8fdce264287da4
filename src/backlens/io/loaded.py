"""``LoadedCapture``: a bundle read back as the same records a live capture has.

Records are the same classes (``OpRecord``, ``GradFn``, ``GradFnCall``,
``BackwardPass``, ...), reading through a
:class:`~backlens.records.source.RecordSource` to this object: it answers the
same ``_source`` questions a live :class:`~backlens.capture.capture.Capture`
does, from the manifest's journal slots instead of hooks. So
``loaded.ops["linear_2"].grads``, ``loaded.grad_fns[...]``, ``loaded.passes``
and every ``to_pandas()`` read as they did live.

Read-only: ``backward()`` raises; there is no model and no graph. ``output``
is ``None`` (the model output is not a record; keep what you need as an
activation). Tensors come back on the CPU, memory-mapped from the bundle's
shards (no memory is used until they are read; writing to one never changes
the files). One tensor name gives one tensor object, so values shared live
(an op's gradient and its node call's ``grad_outputs``) are shared here too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from backlens.cost.journal import CostJournal
from backlens.errors import BackwardUnavailableError, BundleError
from backlens.io.codec import decode
from backlens.io.shards import ShardReader, TensorEntry
from backlens.records.backward import BackwardPass, GradFn, GradFnCall
from backlens.records.forward import (
    InputRecord,
    ModuleCallRecord,
    OpRecord,
    ParamRecord,
)
from backlens.records.grads import GradRecord
from backlens.records.source import RecordSource
from backlens.records.view import RecordView


class TensorIndex:
    """Tensor names -> tensors, mapped lazily from the bundle's shards."""

    def __init__(self, directory: Path, entries: dict[str, TensorEntry]):
        self.entries = entries
        self._reader = ShardReader(directory)
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        found = self._cache.get(name)
        if found is None:
            entry = self.entries.get(name)
            if entry is None:
                raise KeyError(f"tensor {name!r} is not in the tensor index")
            found = self._cache[name] = self._reader.tensor(entry)
        return found


class LoadedCapture(RecordView):
    """A capture read from a bundle (``bl.load(path)``); see the module docstring."""

    def __init__(self, path: Path, manifest: dict[str, Any], tensors: TensorIndex):
        self.path = Path(path)
        self.output = None
        self.format_version: int = manifest["format_version"]
        self.backlens_version: str | None = manifest.get("backlens_version")
        self.torch_version: str | None = manifest.get("torch_version")
        self._manifest = manifest
        self._tensors = tensors
        self._closed = False
        self._source = _LoadedRecordSource(self)
        try:
            self._build(manifest, tensors.get)
        except BundleError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise BundleError(
                f"{self.path / 'manifest.json'}: malformed records ({type(exc).__name__}: {exc}).",
                code="bundle_corrupt",
            ) from exc

    # -- building records --------------------------------------------------
    def _build(self, manifest: dict[str, Any], get: Any) -> None:
        flags = manifest["capture"]
        self.inference_only = bool(flags["inference_only"])
        self.backward_requested = bool(flags["backward_requested"])
        self.flops_enabled = bool(flags["flops_enabled"])
        self._inference_cause = flags.get("inference_cause")

        def make(cls: type, data: dict[str, Any], **relations: Any) -> Any:
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            values = {k: decode(v, get) for k, v in data.items() if k in names and k not in relations}
            if "_source" in names:
                values["_source"] = self._source
            return cls(**values, **relations)

        self._ops = [make(OpRecord, d) for d in manifest["ops"]]
        self._modules = [make(ModuleCallRecord, d) for d in manifest["modules"]]
        self._params = [make(ParamRecord, d) for d in manifest["params"]]
        self._live_grads = {
            d["name"]: (get(d["live_grad"]) if d.get("live_grad") is not None else None)
            for d in manifest["params"]
        }
        self._inputs = [make(InputRecord, d) for d in manifest["inputs"]]
        self._grad_fns = [
            make(GradFn, d, op=self._ops[d["op"]] if d["op"] is not None else None)
            for d in manifest["grad_fns"]
        ]
        self._calls = [make(GradFnCall, d, grad_fn=self._grad_fns[d["grad_fn"]]) for d in manifest["calls"]]
        self._passes = [make(BackwardPass, d) for d in manifest["passes"]]
        self._forward_edits = [decode(a, get) for a in manifest.get("forward_edits", [])]
        self._calls_of_node: list[list[int]] = [[] for _ in self._grad_fns]
        self._calls_of_pass: dict[int, list[int]] = {p.number: [] for p in self._passes}
        for position, call in enumerate(self._calls):
            self._calls_of_node[call.grad_fn.index].append(position)
            self._calls_of_pass.setdefault(call.pass_number, []).append(position)
        slots = manifest["grad_slots"]
        self._op_slot = {int(op): (int(node), int(nr)) for op, node, nr in slots["ops"]}
        self._module_slot = {int(c): (int(node), int(nr)) for c, node, nr in slots["modules"]}
        self._param_node = {str(name): int(node) for name, node in slots["params"]}
        self._input_slot = {int(i): (int(node), int(nr)) for i, node, nr in slots["inputs"]}
        self._extra_input_grads = [(int(i), GradRecord(get(name), int(number)))
                                   for i, name, number in slots["extra_input_grads"]]
        cost = manifest.get("cost")
        # The cost journal reports read (FLOPs per pass and per op), as it was live.
        self._cost = CostJournal.from_dict(decode(cost, get)) if cost is not None else None

    # -- the _source protocol records read through ---------------------------
    def _grads_at(self, slot: tuple[int, int] | None) -> list[GradRecord]:
        if slot is None:
            return []
        node, output_nr = slot
        grads = []
        for position in self._calls_of_node[node]:
            call = self._calls[position]
            saved = call.grad_outputs
            if saved is not None and output_nr < len(saved) and saved[output_nr] is not None:
                grads.append(GradRecord(saved[output_nr], call.pass_number))
        return grads

    def _op_grads(self, op_index: int) -> list[GradRecord]:
        return self._grads_at(self._op_slot.get(op_index))

    def _op_grad_fn(self, op_index: int) -> GradFn | None:
        slot = self._op_slot.get(op_index)
        return self._grad_fns[slot[0]] if slot is not None else None

    def _module_output_grads(self, call_index: int) -> list[GradRecord]:
        return self._grads_at(self._module_slot.get(call_index))

    def _param_increments(self, name: str) -> list[GradRecord]:
        node = self._param_node.get(name)
        return self._grads_at((node, 0)) if node is not None else []

    def _param_live_grad(self, name: str) -> torch.Tensor | None:
        return self._live_grads.get(name)

    def _input_grads(self, index: int) -> list[GradRecord]:
        grads = self._grads_at(self._input_slot.get(index))
        grads += [g for i, g in self._extra_input_grads if i == index]
        return sorted(grads, key=lambda g: g.pass_number)

    def _node_calls(self, node_index: int) -> list[GradFnCall]:
        return [self._calls[i] for i in self._calls_of_node[node_index]]

    def _pass_calls(self, number: int) -> list[GradFnCall]:
        return [self._calls[i] for i in self._calls_of_pass.get(number, ())]

    # -- record lists (RecordView turns them into the public lists) ------------
    def _op_list(self) -> list[OpRecord]:
        return self._ops

    def _module_list(self) -> list[ModuleCallRecord]:
        return self._modules

    def _param_list(self) -> list[ParamRecord]:
        return self._params

    def _input_list(self) -> list[InputRecord]:
        return self._inputs

    def _grad_fn_list(self) -> list[GradFn]:
        return self._grad_fns

    def _call_list(self) -> list[GradFnCall]:
        return self._calls

    def _pass_list(self) -> list[BackwardPass]:
        return self._passes

    @property
    def forward_edits(self) -> list:
        """The activation edits applied in the captured forward (as on the live capture)."""
        return list(self._forward_edits)

    # -- read-only -----------------------------------------------------------
    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise BackwardUnavailableError(
            f"This capture was loaded from the bundle {str(self.path)!r}; it is read-only: "
            "there is no model or autograd graph to run a backward over.",
            code="read_only_bundle",
            remedy="Capture the model again with bl.capture(...) to record new passes.",
        )

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Copy this bundle to ``path`` (same refusal rules as ``Capture.save``)."""
        from backlens.io.bundle import save

        return save(self, path, overwrite=overwrite)

    def disarm(self) -> None:
        """Nothing to disarm: a loaded capture records nothing."""

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Mark closed; records stay readable (their tensors keep their own maps)."""
        self._closed = True

    def __enter__(self) -> LoadedCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<LoadedCapture {str(self.path)!r}: {len(self._ops)} ops, {len(self._modules)} module calls, "
            f"{len(self._passes)} backward passes>"
        )


class _LoadedRecordSource(RecordSource):
    """A loaded capture's: once it is dropped, kept records read a fresh load of the same bundle."""

    __slots__ = ("_path", "_manifest", "_tensors")

    def __init__(self, capture: LoadedCapture):
        super().__init__(capture)
        self._path, self._manifest, self._tensors = capture.path, capture._manifest, capture._tensors

    def _make_successor(self) -> LoadedCapture:
        return LoadedCapture(self._path, self._manifest, self._tensors)
