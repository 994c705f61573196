"""``autopar compare EXPERIMENT.yaml [--output-dir DIR] [--address ADDR]``

Runs a comparison experiment (``autopar.studies.compare``): the exhaustive optimum of
one case, then every sampler with every seed, and writes ``optimum.json``,
``curves.csv``, ``summary.csv`` and ``regret.png`` to the output folder
(``--output-dir``, else the experiment's ``output_dir``, else
``results/<experiment name>``).  Ends with the summary as a table.  Exit 0
done, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys

from autopar.io.export import DEFAULT_FORMAT, FORMATS, HELP as FORMAT_HELP


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare samplers against the exhaustive optimum",
        description="Find the exhaustive optimum of the experiment's case, run every "
                    "sampler with every seed, and write optimum.json, curves.csv, "
                    "summary.csv and regret.png. Exit 0 done, 2 bad input.")
    p.add_argument("experiment", help="comparison experiment (YAML, kind: compare)")
    p.add_argument("--output-dir", default=None,
                   help="folder for the results, relative to the current folder "
                        "(default: the experiment's output_dir, else results/<name>); "
                        "none: write nothing, only print")
    p.add_argument("--address", default=None,
                   help="Ray cluster address: run the sampler x seed runs as Ray tasks "
                        "there (default: as the experiment says, else in this process)")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="layouts must leave this much of tier 1 free (default: the system's "
                        "memory_headroom, else 0); the fastest layout without it is named too")
    from autopar.search.risk import add_arguments
    add_arguments(p)
    p.add_argument("--trials", type=int, default=None,
                   help="trials per run (overrides the file; budgets above it are dropped)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per sampler: 0..N-1 (overrides the file)")
    p.add_argument("--samplers", default=None,
                   help="comma-separated sampler names to run (overrides the file's list)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT,
                   help="the execution in optimum.json (a launch format: autopar's there, "
                        "the framework's config beside it as optimum.sh/.overrides/...): "
                        + FORMAT_HELP)
    # issue 25: inference from the command line
    from autopar.cli import inference_option
    inference_option(p)
    p.set_defaults(func=run)


def run_experiment(path, output_dir=None, address=None, progress=None, data=None,
                   fmt: str = DEFAULT_FORMAT, memory_headroom=None,
                   overrides=None, risk=None) -> int:
    """Run one comparison file and print its summary; the exit code.

    ``autopar run`` calls this for ``kind: compare`` files (``data``: the
    mapping it already read, else the file is read here).
    """
    from pathlib import Path

    from autopar.studies.compare import compare, load_experiment, summary_text
    from autopar.studies.regret import BeatsOptimum, BestMismatch

    exp = load_experiment(data if data is not None else path, overrides=overrides,
                          base_dir=Path(path).resolve().parent, source=str(path))
    from autopar.io.writers import NO_OUTPUT, output_dir_arg
    out = output_dir_arg(output_dir) or exp.output_dir or Path("results") / exp.name
    if out == NO_OUTPUT:
        out = NO_OUTPUT
    from autopar.io.export import check_run
    check_run(fmt, exp.case.model, exp.case.space, exp.case.datatype)
    try:
        result = compare(exp, out, address=address, progress=progress, execution_format=fmt,
                         memory_headroom=memory_headroom, risk=risk)
    except (BeatsOptimum, BestMismatch) as err:        # a bug, not bad input: say it on one line
        print(f"autopar: error: {err}", file=sys.stderr)
        return 1
    print(summary_text(result))
    if result.files:
        print(f"wrote {', '.join(str(f) for f in result.files)}")
    return 0


def run(args) -> int:
    from autopar.cli import positive
    from autopar.search.risk import risk_of
    risk = risk_of(args, allowed=("fast", "safe"))
    overrides = {}
    if getattr(args, "trials", None) is not None:
        positive("--trials", args.trials)
        overrides["trials"] = args.trials
    if getattr(args, "seeds", None) is not None:
        positive("--seeds", args.seeds)
        overrides["seeds"] = args.seeds
    if getattr(args, "samplers", None):
        overrides["samplers"] = [s.strip() for s in args.samplers.split(",") if s.strip()]
    from autopar.cli import training_of
    if not training_of(args):
        overrides["case"] = {"training": False}     # merged into the file's case
    return run_experiment(args.experiment, args.output_dir, args.address, args.progress,
                          fmt=args.format, memory_headroom=args.memory_headroom,
                          overrides=overrides or None, risk=risk)
