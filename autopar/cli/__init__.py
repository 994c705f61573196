"""The ``autopar`` command line.

One subcommand per module named in ``COMMANDS``; each module defines
``register(subparsers)``, which adds its parser and sets ``func=run`` where
``run(args) -> int`` returns the exit code.  Command modules are imported
when the parser is built, so they must import heavy dependencies (ray,
optuna, pandas) inside ``run``, not at module level.

Exit codes: 0 success, 1 the command ran but the answer is negative (e.g. an
infeasible layout), 2 bad input (one line naming the file and the field),
130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from autopar.io.specs import SpecError

COMMANDS: tuple[str, ...] = ("estimate", "exhaustive", "validate", "compare", "tune", "run",
                             "codesign", "calibrate")


SOURCE = "command line"    # what SpecError names for a bad argument


def positive(name: str, v) -> None:
    """A count given on the command line must be at least 1 (None: not given)."""
    if v is not None and v < 1:
        raise SpecError(SOURCE, name, f"must be a positive integer, got {v}")


def output_path(name: str, path: str | None):
    """An output file argument that can be written (its folder exists), or None."""
    from pathlib import Path
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise SpecError(SOURCE, name, f"{path} is a directory")
    if not p.parent.is_dir():
        raise SpecError(SOURCE, name, f"directory {p.parent} does not exist")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Plan large-model training layouts with an analytical "
                    "performance model (Calculon's method).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"autopar.cli.{name}").register(sub)
    return parser


def error_line(err: SpecError) -> str:
    """The one line printed for bad input."""
    text = f"autopar: error: {err.source}: {err.field}: {err.message}"
    return " ".join(text.split())   # never more than one line


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecError as err:
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
