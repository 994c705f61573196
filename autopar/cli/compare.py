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


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare samplers against the exhaustive optimum",
        description="Find the exhaustive optimum of the experiment's case, run every "
                    "sampler with every seed, and write optimum.json, curves.csv, "
                    "summary.csv and regret.png. Exit 0 done, 2 bad input.")
    p.add_argument("experiment", help="comparison experiment (YAML, kind: compare)")
    p.add_argument("--output-dir", default=None,
                   help="folder for the results (default: the experiment's output_dir, "
                        "else results/<name>)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address: run the sampler x seed runs as Ray tasks "
                        "there (default: as the experiment says, else in this process)")
    p.add_argument("--trials", type=int, default=None,
                   help="trials per run (overrides the file; budgets above it are dropped)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per sampler: 0..N-1 (overrides the file)")
    p.add_argument("--samplers", default=None,
                   help="comma-separated sampler names to run (overrides the file's list)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=run)


def run_experiment(path, output_dir=None, address=None, progress=None, data=None,
                   overrides=None) -> int:
    """Run one comparison file and print its summary; the exit code.

    ``autopar run`` calls this for ``kind: compare`` files (``data``: the
    mapping it already read, else the file is read here).
    """
    from pathlib import Path

    from autopar.studies.compare import compare, load_experiment, summary_text
    from autopar.studies.regret import BeatsOptimum

    exp = load_experiment(data if data is not None else path, overrides=overrides,
                          base_dir=Path(path).resolve().parent, source=str(path))
    out = Path(output_dir) if output_dir else (exp.output_dir or Path("results") / exp.name)
    try:
        result = compare(exp, out, address=address, progress=progress)
    except BeatsOptimum as err:        # a bug, not bad input: say it on one line
        print(f"autopar: error: {err}", file=sys.stderr)
        return 1
    print(summary_text(result))
    print(f"wrote {', '.join(str(f) for f in result.files)}")
    return 0


def run(args) -> int:
    from autopar.cli import positive
    overrides = {}
    if getattr(args, "trials", None) is not None:
        positive("--trials", args.trials)
        overrides["trials"] = args.trials
    if getattr(args, "seeds", None) is not None:
        positive("--seeds", args.seeds)
        overrides["seeds"] = args.seeds
    if getattr(args, "samplers", None):
        overrides["samplers"] = [s.strip() for s in args.samplers.split(",") if s.strip()]
    return run_experiment(args.experiment, args.output_dir, args.address, args.progress,
                          overrides=overrides or None)
