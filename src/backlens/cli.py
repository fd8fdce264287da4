"""The ``backlens`` command: ``demo``, ``profile``, ``show`` and ``doctor``.

Bad input gets one clear line on stderr and exit code 2; ``--debug`` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from typing import Any


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backlens", description="See, edit and measure the backward pass.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="profile and explain the backward pass of a real model")
    demo.add_argument("--out", default="backlens-out", help="folder for the bundle and the HTML report")

    profile = commands.add_parser("profile", help="profile the backward pass of your model")
    profile.add_argument("factory", help="MODULE:FACTORY, a function returning an nn.Module")
    profile.add_argument("--input-shape", default="2,8", help="B,S,... of a random float input (default 2,8)")
    profile.add_argument("--input-ids", action="store_true",
                         help="make the input integer token ids (vocab from the model's config)")
    profile.add_argument("--loss", default="sum", choices=["sum", "mean", "square"],
                         help="loss over the first output tensor")
    profile.add_argument("--repeats", type=int, default=0, help="time the backward alone N times (bl.bench.backward)")
    profile.add_argument("--html", help="write a self-contained HTML report here")
    profile.add_argument("--save", help="save the capture as a bundle here")

    show = commands.add_parser("show", help="print the summary of a saved bundle")
    show.add_argument("bundle")
    show.add_argument("--html", help="write a self-contained HTML report here")

    commands.add_parser("doctor", help="print torch version and capability flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from backlens.demo import main as demo_main

            demo_main(out_dir=args.out)
        elif args.command == "profile":
            _profile(args)
        elif args.command == "show":
            _show(args)
        elif args.command == "doctor":
            from backlens.report.doctor import doctor

            doctor()
    except UsageError as exc:
        if args.debug:
            raise
        print(f"backlens {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"backlens {args.command}: {type(exc).__name__}: {first}", file=sys.stderr)
        return 2
    return 0


# -- profile -----------------------------------------------------------------

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
        model = factory()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"factory {spec} raised {type(exc).__name__}: {exc}") from exc
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"factory {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


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


def _signature_of(model) -> str:
    try:
        return f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward(...)"


def _profile(args) -> None:
    from rich.console import Console

    import backlens as bl
    from backlens.report.profile import build_profile, html_report, rich_tables, summary_line

    console = Console()
    model = _load_factory(args.factory)
    x = _make_input(model, args.input_shape, args.input_ids)
    loss_fn = _loss_of(args.loss)
    with console.status("Capturing forward and backward..."):
        try:
            cap = bl.capture(model, x)
        except TypeError as exc:
            raise UsageError(
                f"the model's forward did not accept one input tensor of shape {tuple(x.shape)} "
                f"({exc}); it expects {_signature_of(model)}"
            ) from exc
        cap.backward(loss_fn(cap.output))
    profile = build_profile(cap, f"backlens profile: {args.factory}")
    for table in rich_tables(profile):
        console.print(table)
    console.print(summary_line(profile))
    if args.repeats:
        with console.status(f"Timing the backward alone ({args.repeats} repeats)..."):
            result = bl.bench.backward(model, x, loss_fn, repeats=args.repeats)
        console.print(result)
    if args.save:
        cap.save(args.save, overwrite=True)
        console.print(f"Bundle: {os.path.abspath(args.save)}")
    if args.html:
        html_report(profile).write(args.html)
        console.print(f"HTML report: {os.path.abspath(args.html)}")


# -- show ----------------------------------------------------------------------

def _show(args) -> None:
    from rich.console import Console

    import backlens as bl
    from backlens.report.profile import build_profile, html_report, rich_tables, summary_line

    console = Console()
    cap = bl.load(args.bundle)
    console.print(f"[bold]{args.bundle}[/bold]: {len(cap.ops)} forward ops, {len(cap.modules)} module calls, "
                  f"{len(cap.grad_fns)} autograd nodes, {len(cap.passes)} backward passes")
    profile = build_profile(cap, f"backlens show: {os.path.basename(os.path.normpath(args.bundle))}")
    for table in rich_tables(profile):
        console.print(table)
    console.print(summary_line(profile))
    if args.html:
        html_report(profile).write(args.html)
        console.print(f"HTML report: {os.path.abspath(args.html)}")


if __name__ == "__main__":
    sys.exit(main())
