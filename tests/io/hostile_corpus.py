"""A corpus of hostile bundles, each made by code from one sound bundle, and a runner.

Run as a script (``python hostile_corpus.py WORKDIR [after_load]``), so the
audit hook it installs dies with it. It builds the sound bundle and every
case under WORKDIR, then loads each case with an audit hook watching every
``open`` and prints one JSON line per case: the error's type and code, its
message, every path opened outside the case's bundle directory, the seconds
the load took and its peak memory growth (VmHWM, reset before each case).

``after_load``: bundles changed after they were loaded (truncated, written in
place, swapped, replaced by a link). The process must exit normally (a shard
truncated under a memory map would kill it with SIGBUS).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch

import backlens as bl
from backlens.io import manifest as manifest_io
from backlens.io.shards import ShardWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, loss_of  # noqa: E402

MiB = 1 << 20


def build_sound(root: Path) -> Path:
    """A streamed bundle with several shards, kept activations, two passes and a cost journal."""
    torch.manual_seed(0)
    with bl.capture(MLP(), torch.randn(4, 6), save_grads=True, save_activations=True,
                    storage=bl.to_disk(root / "sound", shard_bytes=2048)) as cap:
        loss = loss_of(cap.output)
        loss.backward(retain_graph=True)
        cap.backward(loss * 2, save_grads=bl.func("relu") & bl.in_pass(2) | ~bl.grad_output())
    return root / "sound"


# -- how cases damage a copy -----------------------------------------------------------------

def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def reseal(path: Path, change) -> None:
    """Edit the manifest and seal it with a correct checksum again, as an attacker would."""
    body = manifest_of(path)
    body.pop("checksum")
    change(body)
    body["checksum"] = manifest_io.checksum(body)
    (path / "manifest.json").write_text(json.dumps(body))


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def first_index(manifest: dict) -> dict:
    return next(iter(manifest["tensors"]["index"].values()))


def symlink_out(path: Path, name: str, outside: Path) -> None:
    target = outside / f"{path.name}-{name}"
    shutil.move(path / name, target)
    os.symlink(target, path / name)


def link_to_dev_zero(path: Path) -> None:
    shard = shards(path)[0]
    shard.unlink()
    os.symlink("/dev/zero", shard)


def replace_with_fifo(path: Path, name: str) -> None:
    (path / name).unlink()
    os.mkfifo(path / name)


def replace_with_dir(path: Path, name: str) -> None:
    (path / name).unlink()
    (path / name).mkdir()


def truncate(path: Path, keep) -> None:
    shard = shards(path)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:keep(len(data))])


def set_header_length(path: Path, length: int, sparse_size: int | None = None) -> None:
    """Claim a header of ``length`` bytes; with ``sparse_size`` the file really is that long (a hole)."""
    shard = shards(path)[0]
    with open(shard, "r+b") as handle:
        handle.write(struct.pack("<Q", length))
        if sparse_size is not None:
            handle.truncate(sparse_size)
    if sparse_size is not None:
        reseal(path, lambda m: m["tensors"]["files"][shard.name].update(bytes=sparse_size))


def rewrite_header(path: Path, make) -> None:
    """Replace the first shard's header by ``make(length)`` bytes of the same length."""
    shard = shards(path)[0]
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8:8 + length] = make(length)
    shard.write_bytes(bytes(data))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def big_manifest(path: Path) -> None:
    with open(path / "manifest.json", "r+b") as handle:
        handle.truncate(300 * MiB)  # sparse: the size is what matters


def stream_marker_only(path: Path) -> None:
    (path / "manifest.json").unlink()
    (path / ".backlens-stream").write_text("{}")


def not_nested(depth: int) -> dict:
    selector = {"kind": "without_op"}
    for _ in range(depth):
        selector = {"kind": "not", "item": selector}
    return selector


def set_policy(m: dict, spec) -> None:
    m["passes"][0]["policy"] = [spec, "save_grads=x"]


def reseal_repeating(path: Path, locate, key: str, first_value) -> None:
    """Write the manifest with ``key`` twice in the object ``locate(body)`` finds: first holding
    ``first_value``, then its real value. The checksum is over the last-key-wins reading, so it
    matches; a reader keeping the first value would see something else."""
    body = manifest_of(path)
    body.pop("checksum")
    body["checksum"] = manifest_io.checksum(body)
    target = locate(body)
    items = list(target.items())
    target.clear()
    target["@@repeated@@"] = first_value
    target.update(items)
    (path / "manifest.json").write_text(json.dumps(body).replace('"@@repeated@@"', json.dumps(key), 1))


def forge(path: Path, m: dict, tensor: torch.Tensor) -> str:
    """Add ``tensor`` to the bundle in a shard of its own (sound in itself) and return its name."""
    writer = ShardWriter(path, "forged")
    name = writer.add(tensor)
    writer.flush()
    m["tensors"]["files"].update(writer.files)
    m["tensors"]["index"].update({key: entry.to_json() for key, entry in writer.index.items()})
    return name


def forge_empty(path: Path, m: dict, shape: list) -> str:
    """A shard whose one tensor has no bytes and ``shape`` (an empty shape may still overflow)."""
    header = json.dumps({"forged/1": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(header)) + header
    (path / "forged-00001.safetensors").write_bytes(data)
    m["tensors"]["files"]["forged-00001.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    m["tensors"]["index"]["forged/1"] = {"file": "forged-00001.safetensors", "dtype": "F32", "shape": shape,
                                         "offsets": [0, 0], "sha256": hashlib.sha256(b"").hexdigest()}
    return "forged/1"


def node_calls(m: dict, node: int) -> list[dict]:
    return [call for call in m["calls"] if call["node"] == node]


def op_grad_call(m: dict) -> dict:
    """A call that kept the gradient op 0 reads (through its gradient slot)."""
    node = dict(m["grad_slots"]["ops"])[0]
    return next(call for call in node_calls(m, node) if call["grad_outputs"] is not None)


def first_pass_aten(m: dict) -> dict:
    return m["cost"]["passes"][0]["aten_ops"]


def counted_rows(m: dict) -> list[int]:
    """Positions of the first pass's ATen rows that counted FLOPs under a node call."""
    aten = first_pass_aten(m)
    return [i for i, (call, flops) in enumerate(zip(aten["call"], aten["flops"])) if call is not None and flops]


def aten_row_cut(m: dict) -> None:
    aten = first_pass_aten(m)
    aten["flops"][counted_rows(m)[0]] = 1


def flops_moved_between_calls(m: dict) -> None:
    aten = first_pass_aten(m)
    first, second = sorted({aten["call"][i] for i in counted_rows(m)})[:2]
    m["calls"][first]["flops"] -= 10
    m["calls"][second]["flops"] += 10


def aten_row_under_another_call(m: dict) -> None:
    aten = first_pass_aten(m)
    row = counted_rows(m)[0]
    aten["call"][row] = next(aten["call"][i] for i in counted_rows(m) if aten["call"][i] != aten["call"][row])


def rank_set_of_one(path: Path, world_size: int) -> None:
    """Make ``path`` a directory of rank bundles holding rank 0 of a run of ``world_size``."""
    inner = path.with_name(path.name + "-rank0")
    shutil.move(path, inner)
    path.mkdir()
    shutil.move(inner, path / "rank0")
    reseal(path / "rank0", lambda m: m["capture"].update(rank=0, world_size=world_size))


def unending_string(path: Path) -> None:
    """A string that never ends, of escaped quotes: a pattern that fails and retries at every
    quote would take hours over it."""
    (path / "manifest.json").write_bytes(b'{"format": "' + b'\\"' * 2_000_000)


def unknown_fields(m: dict, count: int) -> None:
    m["ops"][0].update({f"field{k}": k for k in range(count)})


CASES = {
    # links and files that are not regular files
    "symlinked_manifest": lambda p, out: symlink_out(p, "manifest.json", out),
    "symlinked_shard": lambda p, out: symlink_out(p, shards(p)[0].name, out),
    "shard_linked_to_dev_zero": lambda p, out: link_to_dev_zero(p),
    "manifest_is_a_fifo": lambda p, out: replace_with_fifo(p, "manifest.json"),
    "shard_is_a_fifo": lambda p, out: replace_with_fifo(p, shards(p)[0].name),
    "manifest_is_a_directory": lambda p, out: replace_with_dir(p, "manifest.json"),
    "shard_is_a_directory": lambda p, out: replace_with_dir(p, shards(p)[0].name),
    "stream_marker_is_a_symlink": lambda p, out: ((p / "manifest.json").unlink(),
                                                  os.symlink(out / "nothing", p / ".backlens-stream")),
    # sizes, truncation, bounds
    "shard_truncated_in_its_length": lambda p, out: truncate(p, lambda n: 4),
    "shard_truncated_in_its_header": lambda p, out: truncate(p, lambda n: 20),
    "shard_truncated_in_its_data": lambda p, out: truncate(p, lambda n: n - 7),
    "shard_with_extra_bytes": lambda p, out: shards(p)[0].write_bytes(shards(p)[0].read_bytes() + b"\0" * 9),
    "shard_header_claims_99_MiB": lambda p, out: set_header_length(p, 99 * MiB, sparse_size=99 * MiB + 64),
    "shard_header_claims_2_to_the_63": lambda p, out: set_header_length(p, 2**63 - 1),
    "shard_header_not_json": lambda p, out: rewrite_header(p, lambda n: b"\xff" * n),
    "shard_header_nested_deep": lambda p, out: rewrite_header(p, lambda n: nested(n // 2).encode().ljust(n)),
    "manifest_of_300_MiB": lambda p, out: big_manifest(p),
    "manifest_nested_100000_deep": lambda p, out: (p / "manifest.json").write_text(nested(100_000)),
    "manifest_not_utf8": lambda p, out: (p / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}'),
    "manifest_empty": lambda p, out: (p / "manifest.json").write_bytes(b""),
    "manifest_with_a_5000_digit_integer": lambda p, out: (p / "manifest.json").write_text(
        (p / "manifest.json").read_text().replace('"format_version": 3', '"format_version": 1' + "0" * 4999)),
    "manifest_checksum_mismatch": lambda p, out: (p / "manifest.json").write_text(
        (p / "manifest.json").read_text().replace('"ReLU"', '"ReLV"', 1)),
    "stream_marker_and_no_manifest": lambda p, out: stream_marker_only(p),
    # the schema: types, ranges, indices (each sealed with a correct checksum)
    "negative_tensor_shape": lambda p, out: reseal(p, lambda m: first_index(m).update(shape=[-1])),
    "negative_op_shape": lambda p, out: reseal(p, lambda m: m["ops"][0].update(shape=[-3, 2])),
    "negative_parent_index": lambda p, out: reseal(p, lambda m: m["ops"][1].update(parents=[-1])),
    "negative_call_node": lambda p, out: reseal(p, lambda m: m["calls"][0].update(node=-1)),
    "negative_output_nr": lambda p, out: reseal(p, lambda m: m["ops"][0].update(output_nr=-1)),
    "negative_slot_output_nr": lambda p, out: reseal(p, lambda m: m["grad_slots"]["inputs"].append([0, 0, -1])),
    "out_of_range_call_node": lambda p, out: reseal(p, lambda m: m["calls"][0].update(node=10**6)),
    "out_of_range_slot": lambda p, out: reseal(p, lambda m: m["grad_slots"]["ops"].append([0, 10**6])),
    "out_of_range_pass_number": lambda p, out: reseal(p, lambda m: m["calls"][0].update(pass_number=3)),
    "zero_pass_number": lambda p, out: reseal(p, lambda m: m["calls"][0].update(pass_number=0)),
    "section_of_the_wrong_type": lambda p, out: reseal(p, lambda m: m.update(ops={"0": 1})),
    "section_that_is_a_string": lambda p, out: reseal(p, lambda m: m.update(passes="x")),
    "tensor_index_of_the_wrong_type": lambda p, out: reseal(p, lambda m: m["tensors"].update(index=[1, 2])),
    "true_for_an_integer": lambda p, out: reseal(p, lambda m: m["calls"][0].update(ordinal=True)),
    "float_for_an_integer": lambda p, out: reseal(p, lambda m: m["calls"][0].update(end_ns=1.5)),
    "string_for_a_shape": lambda p, out: reseal(p, lambda m: first_index(m).update(shape="3")),
    "unknown_field": lambda p, out: reseal(p, lambda m: m["ops"][0].update(evil=1)),
    "missing_field": lambda p, out: reseal(p, lambda m: m["ops"][0].pop("label")),
    "unknown_torch_dtype": lambda p, out: reseal(p, lambda m: m["ops"][0].update(dtype="float33")),
    "unknown_shard_dtype": lambda p, out: reseal(p, lambda m: first_index(m).update(dtype="Q7")),
    "bogus_device": lambda p, out: reseal(p, lambda m: first_index(m).update(device="cuda:99")),
    "offsets_reversed": lambda p, out: reseal(p, lambda m: first_index(m).update(
        offsets=first_index(m)["offsets"][::-1] if first_index(m)["offsets"][0] != first_index(m)["offsets"][1]
        else [5, 0])),
    "shape_larger_than_its_bytes": lambda p, out: reseal(p, lambda m: first_index(m).update(shape=[2**40, 2**20])),
    "shard_name_escapes_the_directory": lambda p, out: reseal(p, lambda m: m["tensors"]["files"].update(
        {"../escape.safetensors": {"bytes": 1, "sha256": "0" * 64}})),
    "shard_name_absolute": lambda p, out: reseal(p, lambda m: m["tensors"]["files"].update(
        {"/etc/passwd": {"bytes": 1, "sha256": "0" * 64}})),
    "shard_name_hidden": lambda p, out: reseal(p, lambda m: m["tensors"]["files"].update(
        {".hidden.safetensors": {"bytes": 1, "sha256": "0" * 64}})),
    "tensor_in_an_unlisted_file": lambda p, out: reseal(p, lambda m: first_index(m).update(file="other.safetensors")),
    "sha256_not_hex": lambda p, out: reseal(p, lambda m: first_index(m).update(sha256="z" * 64)),
    "unknown_tensor_name": lambda p, out: reseal(p, lambda m: m["calls"][0].update(grad_outputs=["no/such"])),
    "module_call_its_own_parent": lambda p, out: reseal(p, lambda m: m["modules"][1].update(parent=1)),
    "module_call_parent_after_it": lambda p, out: reseal(p, lambda m: m["modules"][0].update(parent=1)),
    "op_its_own_parent": lambda p, out: reseal(p, lambda m: m["ops"][0].update(parents=[0])),
    "op_range_backwards": lambda p, out: reseal(p, lambda m: m["modules"][0].update(op_start=3, op_end=1)),
    "pass_number_out_of_order": lambda p, out: reseal(p, lambda m: m["passes"][0].update(number=2)),
    "unknown_pass_status": lambda p, out: reseal(p, lambda m: m["passes"][0].update(status="exploded")),
    "order_coverage_above_one": lambda p, out: reseal(p, lambda m: m["passes"][0].update(order_coverage=2.0)),
    "unknown_selector_kind": lambda p, out: reseal(p, lambda m: set_policy(m, {"kind": "os.system"})),
    "selector_nested_40_deep": lambda p, out: reseal(p, lambda m: set_policy(m, not_nested(40))),
    "selector_names_not_strings": lambda p, out: reseal(p, lambda m: set_policy(m, {"kind": "func", "names": [1]})),
    "selector_grad_fn_type_not_a_string": lambda p, out: reseal(
        p, lambda m: set_policy(m, {"kind": "grad_fn", "type": 7, "label": None})),
    "error_type_naming_a_module": lambda p, out: reseal(
        p, lambda m: m["passes"][0].update(status="failed", error=["os.system", "boom"])),
    "negative_cost": lambda p, out: reseal(p, lambda m: m["cost"]["passes"][0].update(executed_flops=-5)),
    "cost_of_a_pass_that_never_ran": lambda p, out: reseal(p, lambda m: m["cost"]["passes"][0].update(**{"pass": 99})),
    "cost_of_the_wrong_shape": lambda p, out: reseal(p, lambda m: m["cost"].update(passes={"1": {}})),
    "unknown_source_kind": lambda p, out: reseal(p, lambda m: m["sources"]["kinds"].__setitem__(0, "module")),
    "sources_of_unequal_lengths": lambda p, out: reseal(p, lambda m: m["sources"]["names"].append("x")),
    "format_version_too_new": lambda p, out: reseal(p, lambda m: m.update(format_version=4)),
    "format_version_a_string": lambda p, out: reseal(p, lambda m: m.update(format_version="2")),
    "extra_section": lambda p, out: reseal(p, lambda m: m.update(plugins=["os"])),
    "version_field_not_a_string": lambda p, out: reseal(p, lambda m: m.update(torch_version={"a": [1]})),
    # repeated keys (the checksum is over the last-key-wins reading: it matches)
    "repeated_top_level_key": lambda p, out: reseal_repeating(p, lambda b: b, "format", "evil"),
    "repeated_section": lambda p, out: reseal_repeating(p, lambda b: b, "ops", []),
    "repeated_key_in_an_op": lambda p, out: reseal_repeating(p, lambda b: b["ops"][0], "label", "relu_1"),
    "repeated_tensor_name_in_the_index": lambda p, out: reseal_repeating(
        p, lambda b: b["tensors"]["index"], next(iter(b_index(p))), {**first_index(manifest_of(p)), "shape": [7]}),
    "repeated_key_in_a_selector": lambda p, out: reseal_repeating(p, lambda b: b["passes"][1]["policy"][0], "kind",
                                                                   "func"),
    # tensors that disagree with their records
    "param_grad_int64_for_a_float_param": lambda p, out: reseal(
        p, lambda m: m["params"][0].update(grad=forge(p, m, torch.arange(3)))),
    "param_grad_of_another_shape": lambda p, out: reseal(
        p, lambda m: m["params"][0].update(grad=forge(p, m, torch.zeros(3)))),
    "activation_of_the_wrong_shape": lambda p, out: reseal(
        p, lambda m: m["ops"][1].update(activation=forge(p, m, torch.zeros(4, 3)))),
    "activation_of_the_wrong_dtype": lambda p, out: reseal(
        p, lambda m: m["ops"][1].update(activation=forge(p, m, torch.zeros(4, 16, dtype=torch.float64)))),
    "op_gradient_of_the_wrong_shape": lambda p, out: reseal(
        p, lambda m: op_grad_call(m).update(grad_outputs=[forge(p, m, torch.zeros(5))])),
    "input_gradient_of_the_wrong_shape": lambda p, out: reseal(
        p, lambda m: m["grad_slots"]["extra_input_grads"].append([0, forge(p, m, torch.zeros(2)), 1])),
    "tensor_shape_overflowing_torch": lambda p, out: reseal(
        p, lambda m: m["ops"][1].update(activation=forge_empty(p, m, [0, 2**62, 2**62]))),
    "op_shape_overflowing_torch": lambda p, out: reseal(p, lambda m: m["ops"][1].update(shape=[0, 2**62, 2**62])),
    # records that disagree with each other
    "call_ending_before_it_starts": lambda p, out: reseal(
        p, lambda m: m["calls"][0].update(end_ns=m["calls"][0]["start_ns"] - 1)),
    "call_hooks_longer_than_the_call": lambda p, out: reseal(
        p, lambda m: m["calls"][0].update(hook_ns=m["calls"][0]["end_ns"] - m["calls"][0]["start_ns"] + 1)),
    "pass_ending_before_it_starts": lambda p, out: reseal(
        p, lambda m: m["passes"][0].update(end_ns=m["passes"][0]["start_ns"] - 1)),
    "repeated_op_label": lambda p, out: reseal(p, lambda m: m["ops"][2].update(label=m["ops"][1]["label"])),
    "repeated_param_name": lambda p, out: reseal(p, lambda m: m["params"][1].update(name=m["params"][0]["name"])),
    "repeated_node_label": lambda p, out: reseal(
        p, lambda m: m["grad_fns"][1].update(label=m["grad_fns"][0]["label"])),
    "repeated_module_call": lambda p, out: reseal(p, lambda m: m["modules"][3].update(address="net.0")),
    "repeated_call_ordinal": lambda p, out: reseal(p, lambda m: node_calls(m, 15)[1].update(ordinal=1)),
    "unknown_slot_param": lambda p, out: reseal(p, lambda m: m["grad_slots"]["params"][0].__setitem__(0, "no.such")),
    "unknown_node_param": lambda p, out: reseal(p, lambda m: m["grad_fns"][8].update(param="no.such")),
    "output_nr_beyond_the_outputs": lambda p, out: reseal(p, lambda m: m["ops"][0].update(output_nr=5)),
    "forward_flops_cut_short": lambda p, out: reseal(p, lambda m: m["cost"]["forward"].update(op_flops=[1])),
    "pass_flops_not_adding_up": lambda p, out: reseal(
        p, lambda m: m["cost"]["passes"][0].update(executed_flops=m["cost"]["passes"][0]["executed_flops"] + 1000)),
    "unattributed_flops_not_their_ops": lambda p, out: reseal(p, lambda m: m["cost"]["passes"][0].update(
        unattributed_flops=7, executed_flops=m["cost"]["passes"][0]["executed_flops"] + 7)),
    "aten_row_flops_not_adding_up": lambda p, out: reseal(p, aten_row_cut),
    "call_flops_not_their_aten_rows": lambda p, out: reseal(p, flops_moved_between_calls),
    "aten_row_moved_to_another_call": lambda p, out: reseal(p, aten_row_under_another_call),
    "two_costs_for_one_pass": lambda p, out: reseal(p, lambda m: m["cost"]["passes"].append(m["cost"]["passes"][0])),
    "call_flops_in_an_uncounted_pass": lambda p, out: reseal(p, lambda m: m["cost"]["passes"][1].update(
        counted=False, reason="x", executed_flops=None, unattributed_flops=None, recompute_known=False,
        recompute_flops=None, attributed=False, aten_calls=None, aten_ops=None)),
    # sizes bounded before anything is built in proportion to them
    "world_size_2_to_the_62": lambda p, out: reseal(p, lambda m: m["capture"].update(rank=0, world_size=2**62)),
    "rank_set_of_a_million_ranks": lambda p, out: rank_set_of_one(p, 10**6),
    "string_that_never_ends": lambda p, out: unending_string(p),
    "op_with_100000_unknown_fields": lambda p, out: reseal(p, lambda m: unknown_fields(m, 100_000)),
}


def b_index(path: Path) -> dict:
    return manifest_of(path)["tensors"]["index"]


def make_cases(workdir: Path) -> tuple[Path, dict[str, Path], Path]:
    """The sound bundle, each case's bundle directory, and the directory outside them all."""
    sound = build_sound(workdir)
    outside = workdir / "outside"
    outside.mkdir()
    cases = {}
    for name, damage in CASES.items():
        path = workdir / "cases" / name
        shutil.copytree(sound, path)
        damage(path, outside)
        cases[name] = path
    # The bundle path itself is a link to a sound bundle elsewhere.
    elsewhere = outside / "a_sound_bundle"
    shutil.copytree(sound, elsewhere)
    os.symlink(elsewhere, workdir / "cases" / "bundle_directory_is_a_symlink")
    cases["bundle_directory_is_a_symlink"] = workdir / "cases" / "bundle_directory_is_a_symlink"
    return sound, cases, outside


# -- measuring ------------------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status("VmRSS:")


OPENED: list[str] = []
WATCHING = [False]


def _audit(event: str, args: tuple) -> None:
    if WATCHING[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


def outside_of(directory: Path, opened: list[str]) -> list[str]:
    """Paths opened that are not inside ``directory`` (by path, links not resolved)."""
    root = os.path.abspath(directory)
    return [p for p in opened if os.path.commonpath([root, os.path.abspath(p)]) != root]


def run_corpus(workdir: Path) -> None:
    _sound, cases, _outside = make_cases(workdir)
    bl.load(_sound)  # imports and first-use costs are paid before anything is measured
    sys.addaudithook(_audit)
    gc.collect()
    gc.freeze()  # what exists now is never collected again: a collection mid-case costs less
    for name, path in cases.items():
        base = _reset_peak()
        OPENED.clear()
        WATCHING[0] = True
        began = time.perf_counter()
        error = None
        try:
            bl.load(path)
        except BaseException as exc:  # noqa: BLE001 - every outcome is reported
            error = exc
        seconds = time.perf_counter() - began
        WATCHING[0] = False
        print(json.dumps({
            "case": name,
            "path": str(path),
            "error_type": type(error).__name__ if error is not None else None,
            "is_bundle_error": isinstance(error, bl.BundleError),
            "code": getattr(error, "code", None),
            "message": str(error),
            "opened_outside": outside_of(path, OPENED),
            "seconds": seconds,
            "extra_bytes": _status("VmHWM:") - base,
        }), flush=True)


# -- changes after loading --------------------------------------------------------------------

def _grads(loaded) -> list:
    """Every saved gradient's record (reading one reads its tensor)."""
    return [call for call in loaded.grad_fn_calls if call._entry.grad_outputs is not None]


def after_load(workdir: Path) -> None:
    sound = build_sound(workdir)
    outside = workdir / "outside"
    outside.mkdir()
    results = {}

    def attempt(name: str, change, verify: bool = True) -> None:
        path = workdir / name
        shutil.copytree(sound, path)
        loaded = bl.load(path, verify=verify)
        calls = _grads(loaded)
        first = calls[0].grad_outputs[0]
        kept = first.clone()
        change(path)
        outcome = {"first_unchanged": None, "later": None, "code": None}
        try:
            for call in calls[1:]:
                call.grad_outputs  # noqa: B018 - reading it reads the tensors
            outcome["later"] = "read"
        except bl.BundleError as exc:
            outcome["later"] = "BundleError"
            outcome["code"] = exc.code
            outcome["names_the_file"] = str(path) in str(exc)
        except BaseException as exc:  # noqa: BLE001
            outcome["later"] = f"{type(exc).__name__}: {exc}"
        outcome["first_unchanged"] = bool(torch.equal(first, kept))
        results[name] = outcome

    def truncate_all(path: Path) -> None:
        for shard in shards(path):
            os.truncate(shard, 0)

    def zero_in_place(path: Path) -> None:
        for shard in shards(path):
            size = shard.stat().st_size
            (length,) = struct.unpack("<Q", shard.read_bytes()[:8])
            with open(shard, "r+b") as handle:  # same inode: a map of it would see this
                handle.seek(8 + length)
                handle.write(b"\x7f" * (size - 8 - length))

    def swap(path: Path) -> None:
        for shard in shards(path):
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            replacement = shard.with_suffix(".new")
            replacement.write_bytes(bytes(data))
            os.replace(replacement, shard)

    def link_out(path: Path) -> None:
        for shard in shards(path):
            target = outside / f"{path.name}-{shard.name}"
            shutil.move(shard, target)
            os.symlink(target, shard)

    sys.addaudithook(_audit)
    for verify in (True, False):
        suffix = "" if verify else "_unverified"
        attempt("truncated" + suffix, truncate_all, verify)
        attempt("written_in_place" + suffix, zero_in_place, verify)
        attempt("swapped" + suffix, swap, verify)
        OPENED.clear()
        WATCHING[0] = True
        attempt("replaced_by_links" + suffix, link_out, verify)
        WATCHING[0] = False
        results["replaced_by_links" + suffix]["opened_outside"] = [p for p in OPENED if str(outside) in p]
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    where = Path(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2] == "after_load":
        after_load(where)
    else:
        run_corpus(where)
