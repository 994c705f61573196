"""``autopar run EXPERIMENT.yaml [--address ADDR] [--output-dir DIR]``

Runs an experiment file (``autopar.experiment``): a tune, an exhaustive
search, a comparison, a co-design study or a cliffs sweep described
declaratively (``kind:``), with the exit code of that command.
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run an experiment file (kind: tune, exhaustive, compare, ...)",
        description="Run the search an experiment file describes (kind: tune, "
                    "exhaustive, compare, codesign or cliffs); exit code as that command.")
    p.add_argument("experiment", help="experiment file (YAML)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (overrides the file's address)")
    p.add_argument("--output-dir", default=None,
                   help="compare, codesign, cliffs: folder for the results")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=run)


def run(args) -> int:
    from autopar.experiment import run_file
    return run_file(args.experiment, address=args.address, progress=args.progress,
                    output_dir=args.output_dir)
