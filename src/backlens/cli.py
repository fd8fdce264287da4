"""The ``backlens`` command: ``demo``, ``profile``, ``show``, ``doctor`` and ``report``.

Bad input gets one clear line on stderr and exit code 2; ``--debug`` (before or
after the subcommand) shows the traceback instead. Output paths are checked
before any pass runs. Output to a pipe or a file is not cut to a terminal's
width. Warnings (``timing_noisy``) are printed as one line on stderr each.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import warnings
from functools import partial
from typing import Any


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit 2."""


# Warm passes after the cold one: stable medians, and `backlens demo` stays
# well under 15 s on 2 CPU cores.
DEFAULT_REPEATS = 10
DEFAULT_DEPTH = 3


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number 0 or more, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number 1 or more, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backlens", description="See, edit and measure the backward pass.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    # --debug after the subcommand too (SUPPRESS: absent there, it leaves the value set before it).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **options: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], **options)

    demo = command("demo", help="profile and explain the backward pass of a real model")
    demo.add_argument("--out", default="backlens-out", help="folder for the bundle and the HTML report")
    demo.add_argument("--repeats", type=_count, default=None,
                      help=f"warm backward passes after the cold first one (default {DEFAULT_REPEATS})")
    demo.add_argument("--threads", type=_positive, default=None,
                      help="torch threads for the run (default: torch's own choice)")

    profile = command("profile", help="profile the backward pass of your model")
    profile.add_argument("factory", help="MODULE:FACTORY, a function returning an nn.Module or "
                                         "(model, inputs, loss_fn)")
    profile.add_argument("--input-shape", default="2,8", help="B,S,... of a random float input (default 2,8)")
    profile.add_argument("--input-ids", action="store_true",
                         help="make the input integer token ids (vocab from the model's config)")
    profile.add_argument("--loss", default="sum", choices=["sum", "mean", "square"],
                         help="loss over the first output tensor (when the factory gives no loss_fn)")
    profile.add_argument("--repeats", type=_count, default=None,
                         help=f"warm backward passes after the cold first one (default {DEFAULT_REPEATS}); "
                              "they run without the FLOP census, beside as many stock passes")
    profile.add_argument("--threads", type=_positive, default=None,
                         help="torch threads for the run (default: torch's own choice)")
    profile.add_argument("--depth", type=_count, default=DEFAULT_DEPTH,
                         help=f"module tree depth of the tables (default {DEFAULT_DEPTH})")
    profile.add_argument("--bench", action="store_true",
                         help="also time the backward alone, without per-node hooks (bl.bench.backward)")
    profile.add_argument("--timeline", help="write the backward as Trace Event JSON (Perfetto, chrome://tracing)")
    profile.add_argument("--html", help="write a self-contained HTML report here")
    profile.add_argument("--save", help="save the capture as a bundle here")
    profile.add_argument("--memory", action="store_true",
                         help="also record what the backward holds and print a checkpointing plan")
    profile.add_argument("--memory-budget", type=_count, default=None, metavar="BYTES",
                         help="the saved bytes the checkpointing plan should fit (turns --memory on)")
    profile.add_argument("--overwrite", action="store_true", help="let --save replace an existing bundle")

    show = command("show", help="print the summary of a saved bundle")
    show.add_argument("bundle")
    show.add_argument("--depth", type=_count, default=DEFAULT_DEPTH,
                      help=f"module tree depth of the tables (default {DEFAULT_DEPTH})")
    show.add_argument("--html", help="write a self-contained HTML report here")
    show.add_argument("--timeline", help="write the backward as Trace Event JSON (Perfetto, chrome://tracing)")

    command("doctor", help="print torch version and capability flags")
    _add_report_command(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            _run(args)
    except UsageError as exc:
        if args.debug:
            raise
        print(f"backlens {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        from backlens._console import printable  # a message may quote a bundle's text

        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"backlens {args.command}: {type(exc).__name__}: {printable(first)}", file=sys.stderr)
        return 2
    finally:
        _print_warnings(args.command, caught)
    return 0


def _print_warnings(command: str, caught: list[warnings.WarningMessage]) -> None:
    """backlens's own warnings as one line each; others as Python shows them."""
    from backlens.errors import BacklensWarning

    for record in caught:
        message = record.message
        if isinstance(message, BacklensWarning):
            print(f"backlens {command}: warning [{message.code}]: {message}", file=sys.stderr)
        else:
            warnings.showwarning(message, record.category, record.filename, record.lineno)


def _console():
    from backlens._console import stdout_console

    return stdout_console()


def _run(args) -> None:
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "demo":
        from backlens.demo import main as demo_main

        demo_main(out_dir=args.out, repeats=DEFAULT_REPEATS if args.repeats is None else args.repeats)
    elif args.command == "profile":
        _profile(args)
    elif args.command == "show":
        _show(args)
    elif args.command == "doctor":
        from backlens.report.doctor import doctor

        doctor()
    elif args.command == "report":
        _report(args)


def check_output_path(path: str | None, option: str, *, bundle: bool = False, overwrite: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work: its folder must exist,
    it must not be a folder (a file output), and an existing bundle needs ``--overwrite``."""
    if path is None:
        return
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: the folder {folder} does not exist; create it first or choose "
                         "another path.")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the folder {folder} is not writable.")
    if bundle:
        if os.path.exists(target) and not overwrite:
            raise UsageError(f"{option} {path}: a file or bundle is already there; pass --overwrite to replace "
                             "it, or choose another path.")
    elif os.path.isdir(target):
        raise UsageError(f"{option} {path}: is a folder; give a file name (e.g. {os.path.join(path, 'out')}).")


# -- profile -----------------------------------------------------------------

ACCEPTED_SHAPES = (
    "an nn.Module, or a tuple (model, inputs, loss_fn) where inputs is a tensor, a tuple of positional "
    "arguments or a dict of keyword arguments (a tokenizer's output) and loss_fn(output) returns a scalar "
    "tensor (or is None to use --loss)"
)


def _load_factory(spec: str):
    if ":" not in spec:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise UsageError(f"module {module_name!r} has no callable {attribute!r}")
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"factory {spec} raised {type(exc).__name__}: {exc}") from exc
    return factory, made


def _unpack(spec: str, made: Any):
    """(model, (args, kwargs) or None, loss_fn or None) from what the factory returned."""
    from collections.abc import Mapping

    import torch

    if isinstance(made, torch.nn.Module):
        return made, None, None
    if isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], torch.nn.Module):
        model, inputs, loss_fn = made
        if loss_fn is not None and not callable(loss_fn):
            what = f"a tuple whose loss_fn is {type(loss_fn).__name__}, not callable"
        elif isinstance(inputs, torch.Tensor):
            return model, ((inputs,), {}), loss_fn
        elif isinstance(inputs, (tuple, list)):
            return model, (tuple(inputs), {}), loss_fn
        elif isinstance(inputs, Mapping):
            return model, ((), dict(inputs)), loss_fn
        else:
            what = f"a tuple whose inputs are {type(inputs).__name__}"
    elif isinstance(made, tuple):
        first = type(made[0]).__name__ if made else "nothing"
        what = (f"a tuple of {len(made)} items" if len(made) != 3
                else f"a tuple whose first item is {first}, not an nn.Module")
    else:
        what = type(made).__name__
    raise UsageError(f"factory {spec} returned {what}; accepted: {ACCEPTED_SHAPES}")


def _make_input(model, shape_text: str, input_ids: bool):
    import torch

    try:
        shape = tuple(int(part) for part in shape_text.split(","))
    except ValueError as exc:
        raise UsageError(f"--input-shape takes integers like 2,8, got {shape_text!r}") from exc
    generator = torch.Generator().manual_seed(0)
    if input_ids:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 100
        return torch.randint(0, vocab, shape, generator=generator)
    return torch.randn(shape, generator=generator)


def _loss_of(kind: str):
    from backlens._nested import iter_tensors

    def loss(output: Any):
        first = next((t for t in iter_tensors(output) if t.is_floating_point()), None)
        if first is None:
            raise UsageError("the model's output has no floating-point tensor to build a loss from")
        if kind == "mean":
            return first.mean()
        if kind == "square":
            return first.pow(2).sum()
        return first.sum()

    return loss


def _scalar_loss(loss_fn, output: Any):
    import torch

    loss = loss_fn(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"loss_fn returned {what}; it must return a scalar tensor")
    if loss.grad_fn is None:
        raise UsageError("the loss has no autograd graph: no parameter or input of the model requires grad")
    return loss


def _signature_of(model) -> str:
    try:
        return f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward(...)"


def _at_line_of(factory):
    """A runner ``run(fn)`` whose own frame sits on the factory's line in the user's file.

    A pass's call site is the innermost frame outside torch and backlens; the
    CLI starts the passes, so without this it would be the ``backlens``
    console script. Running them through a frame compiled under the factory's
    file and line makes the call site name the user's code (``models.py:12
    (build)``), and a traceback through it shows that line too.
    """
    try:
        filename = inspect.getsourcefile(factory)
        _lines, line = inspect.getsourcelines(factory)
    except (TypeError, OSError):
        filename, line = None, 0
    if not filename:
        return lambda fn: fn()
    name = getattr(factory, "__name__", "")
    name = name if name.isidentifier() else "factory"
    namespace: dict[str, Any] = {}
    exec(compile("\n" * (max(line, 1) - 1) + f"def {name}(run): return run()\n", filename, "exec"), namespace)
    return namespace[name]


def _profile(args) -> None:
    import torch

    import backlens as bl
    from backlens.errors import BacklensError
    from backlens.report.profile import (
        build_profile,
        html_report,
        rich_tables,
        run_passes,
        summary_line,
    )

    for path, option in ((args.timeline, "--timeline"), (args.html, "--html")):
        check_output_path(path, option)
    check_output_path(args.save, "--save", bundle=True, overwrite=args.overwrite)
    console = _console()
    factory, made = _load_factory(args.factory)
    model, inputs, loss_fn = _unpack(args.factory, made)
    made_input = inputs is None
    if made_input:
        x = _make_input(model, args.input_shape, args.input_ids)
        positional, keywords = (x,), {}
        described = (f"one tensor of {'token ids' if args.input_ids else 'random floats'} of shape "
                     f"{tuple(x.shape)}")
    else:
        positional, keywords = inputs
        described = "the factory's inputs"
    loss_fn = loss_fn or _loss_of(args.loss)
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    args.memory = args.memory or args.memory_budget is not None  # a budget is only for the memory plan
    with console.status("Capturing the forward..."):
        try:
            cap = bl.capture(model, *positional, memory=args.memory, **keywords)
        except TypeError as exc:
            raise UsageError(
                f"the model's forward did not accept {described} ({exc}); it expects {_signature_of(model)}"
            ) from exc
        except BacklensError:
            raise
        except Exception as exc:  # noqa: BLE001 - the input backlens made did not suit the model
            if not made_input:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UsageError(
                f"the model's forward failed on the input backlens made for it, {described} "
                f"({type(exc).__name__}: {first}); pass --input-shape with the shape it takes (an image "
                "model: --input-shape 2,3,32,32), --input-ids for a model of token ids, or have the factory "
                "return (model, inputs, loss_fn)"
            ) from exc
        loss = _scalar_loss(loss_fn, cap.output)
    leaves = [*model.parameters(), *(t for t in [*positional, *keywords.values()]
                                     if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad)]

    def stock_loss():  # the same model outside any capture: the overhead's reference
        return _scalar_loss(loss_fn, model(*positional, **keywords))

    run = _at_line_of(factory)(partial(run_passes, cap, loss, repeats, leaves, stock_loss))
    with console.status("Building the backward profile..."):
        profile = build_profile(cap, f"backlens profile: {args.factory}", depth=args.depth, run=run)
    for table in rich_tables(profile):
        console.print(table)
    console.print(summary_line(profile))
    if args.memory:
        _print_memory(console, cap, profile, args.memory_budget)
    if args.bench:
        # The factory's inputs are positional or keyword, never both (see _unpack).
        result = bl.bench.backward(model, keywords or positional, lambda out: _scalar_loss(loss_fn, out),
                                   repeats=max(repeats, 1))
        console.print(result)
    if args.timeline:
        bl.report.timeline(cap).save(args.timeline)
        console.print(f"Timeline: {os.path.abspath(args.timeline)}  (open in https://ui.perfetto.dev "
                      f"or chrome://tracing)")
    if args.save:
        cap.save(args.save, overwrite=args.overwrite)
        console.print(f"Bundle: {os.path.abspath(args.save)}")
    if args.html:
        html_report(profile).write(args.html)
        console.print(f"HTML report: {os.path.abspath(args.html)}")


def _print_memory(console, cap, profile, budget: int | None) -> None:
    """What the backward holds and the checkpointing plan; the HTML report gets the memory view."""
    import backlens as bl
    from backlens.report.memory_view import memory_sections, memory_tables

    for table in memory_tables(cap, bl.report.memory_plan(cap, budget_bytes=budget)):
        console.print(table)
    profile.extra.extend(memory_sections(cap))


# -- show ----------------------------------------------------------------------

def _show(args) -> None:
    from rich.text import Text

    import backlens as bl
    from backlens._console import text_console
    from backlens.errors import BundleError
    from backlens.report.profile import build_profile, html_report, rich_tables, summary_line

    check_output_path(args.html, "--html")
    check_output_path(args.timeline, "--timeline")
    console = text_console()  # a bundle's names are untrusted: printed as text, never as markup
    try:
        cap = bl.load(args.bundle)
    except BundleError as exc:
        if exc.code != "bundle_not_a_rank":
            raise
        _show_folder(console, args.bundle)
        return
    if isinstance(cap, bl.DerivedGrads):
        _show_derived(console, args, cap)
        return
    if isinstance(cap, bl.RankSet):
        _show_ranks(console, args, cap)
        return
    console.print(Text.assemble((args.bundle, "bold"), f": {len(cap.ops)} forward ops, {len(cap.modules)} module "
                                f"calls, {len(cap.grad_fns)} autograd nodes, {len(cap.passes)} backward passes"))
    profile = build_profile(cap, f"backlens show: {os.path.basename(os.path.normpath(args.bundle))}",
                            depth=args.depth)
    for table in rich_tables(profile):
        console.print(table)
    console.print(summary_line(profile))
    if args.timeline:
        bl.report.timeline(cap).save(args.timeline)
        console.print(f"Timeline: {os.path.abspath(args.timeline)}")
    if args.html:
        html_report(profile).write(args.html)
        console.print(f"HTML report: {os.path.abspath(args.html)}")


def _show_folder(console, folder: str) -> None:
    """A folder of ordinary bundles (not a distributed run's ranks): which ones, and how to show one."""
    from rich.text import Text

    from backlens.distributed.rankset import rank_bundle_dirs

    bundles = rank_bundle_dirs(folder) or []
    console.print(Text.assemble((folder, "bold"), f" is a folder of {len(bundles)} bundle"
                                f"{'s' if len(bundles) != 1 else ''}, not one bundle nor a distributed run's ranks:"))
    for bundle in bundles:
        console.print(f"  {bundle.name}", markup=False)
    if bundles:
        console.print(f"Show one with: backlens show {os.path.join(folder, bundles[0].name)}", markup=False)


def _show_ranks(console, args, ranks) -> None:
    """A directory of rank bundles: the cross-rank table, and whether replicated gradients agree."""
    import json

    from rich.text import Text

    import backlens as bl

    if args.html:
        raise UsageError(f"{args.bundle} holds {ranks.world_size} ranks' bundles: --html reports one capture; "
                         f"run backlens show on one rank's bundle ({ranks[0].path}).")
    passes = ", ".join(f"rank {cap.rank}: {len(cap.passes)}" for cap in ranks)
    console.print(Text.assemble((args.bundle, "bold"), f": {ranks.world_size} ranks (backward passes {passes})"))
    console.print(ranks.cost_tree())
    check = ranks.check_grads()
    if check:
        console.print(f"Gradients: the {len(check.compared)} all-reduced parameters agree on every rank.")
    elif check.compared:
        shown = ", ".join(f"{name} (max |diff| {check.max_abs_diff[name]:.3g})" for name in check.mismatched[:10])
        console.print(f"Gradients: {len(check.mismatched)} of {len(check.compared)} all-reduced parameters "
                      f"differ across ranks: {shown}.")
    else:
        console.print(f"Gradients: not compared ({check.reason}).")
    if args.timeline:
        events = []
        traces = [(cap.rank, bl.report.timeline(cap).to_trace()) for cap in ranks]
        bases = [trace["baseTimeNanoseconds"] for _rank, trace in traces if "baseTimeNanoseconds" in trace]
        base = min(bases) if len(bases) == len(traces) else None  # every rank on the one clock: aligned
        for rank, trace in traces:
            move = (trace["baseTimeNanoseconds"] - base) / 1e3 if base is not None else 0.0
            # One process per rank in the trace viewer.
            for event in trace["traceEvents"]:
                event = dict(event, pid=rank + 1)
                if "ts" in event:
                    event["ts"] += move
                if event.get("name") == "process_name":
                    event["args"] = {"name": f"rank {rank}"}
                events.append(event)
        document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "backlens"}}
        if base is not None:
            document["baseTimeNanoseconds"] = base
        with open(args.timeline, "w", encoding="utf-8") as handle:
            json.dump(document, handle)
        console.print(f"Timeline: {os.path.abspath(args.timeline)}")


def _show_derived(console, args, derived) -> None:
    """A derived-gradients bundle has no backward to profile: print its leaf gradients."""
    from rich.table import Table
    from rich.text import Text

    if args.html or args.timeline:
        raise UsageError(f"{args.bundle} holds derived gradients ({derived.framework}), which have no "
                          "backward pass to report: --html and --timeline need a capture bundle.")
    console.print(Text.assemble((args.bundle, "bold"), f": derived gradients from {derived.framework} "
                                f"{derived.version}, output {derived.output.tolist()}, "
                                f"{len(derived.leaf_grads)} leaf gradients"))
    table = Table(title="Leaf gradients")
    for column in ("kind", "name", "shape", "dtype", "grad_norm"):
        table.add_column(column)
    for row in derived.to_pandas().itertuples():
        norm = "" if row.grad_norm is None else f"{row.grad_norm:.4g}"
        table.add_row(row.kind, row.name, str(row.shape), row.dtype, norm)
    console.print(table)


# -- report: the gradient monitor's page from what its sink wrote ----------------------------

def _add_report_command(command) -> None:
    report = command(
        "report", help="draw the HTML page of a gradient monitor's run (bl.monitor with a sink)")
    report.add_argument("run", help="the monitor's TensorBoard directory, or its .csv file")
    report.add_argument("--html", help="where to write the page (default: RUN/grads.html for a directory, "
                                       "RUN with .html for a CSV file)")


def _report(args) -> None:
    from rich.text import Text

    from backlens._console import text_console
    from backlens.monitoring.sinks import read
    from backlens.report.grads import grads_report

    run = os.fspath(args.run)
    if not os.path.exists(run):
        raise UsageError(f"{run} does not exist (pass the directory or .csv file given to bl.monitor as sink=)")
    try:
        frame, alerts = read(run)
    except ImportError as exc:
        raise UsageError(f"reading TensorBoard event files needs the tensorboard package ({exc}): "
                         f"pip install 'backlens[monitor]'") from exc
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if frame.empty:
        raise UsageError(f"{run} holds no values a gradient monitor wrote (tags such as norm/param/NAME)")
    out = args.html or (os.path.join(run, "grads.html") if os.path.isdir(run)
                        else os.path.splitext(run)[0] + ".html")
    name = os.path.basename(os.path.normpath(run))
    grads_report(frame, alerts, f"backlens monitor: {name}").write(out)
    steps = frame["step"].nunique()
    console = text_console()  # names read back from the run's files: text, never markup
    console.print(Text.assemble((run, "bold"), f": {steps} recorded steps, {len(alerts)} alerts"))
    for alert in alerts[:10]:
        console.print(f"  {alert.message}")
    console.print(f"HTML report: {os.path.abspath(out)}")


if __name__ == "__main__":
    sys.exit(main())
