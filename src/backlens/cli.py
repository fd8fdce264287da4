"""The ``backlens`` command: ``demo``, ``doctor`` (``profile`` and ``show`` as they land)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backlens", description="See, edit and measure the backward pass.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="profile and explain the backward pass of a real model")
    commands.add_parser("doctor", help="print torch version and capability flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from backlens.demo import main as demo_main

            demo_main()
        elif args.command == "doctor":
            from backlens.report.doctor import doctor

            doctor()
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        print(f"backlens {args.command}: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
