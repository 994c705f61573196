"""``autopar run EXPERIMENT.yaml [--address ADDR] [--output-dir DIR]``

Runs an experiment file (``autopar.io.experiment``): a tune, an exhaustive
search, a comparison, a co-design study or a cliffs sweep described
declaratively (``kind:``), with the exit code of that command.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping

from autopar.io.errors import SpecError
from autopar.io.writers import make_folder
from autopar.io.experiment import STUDY_KINDS, parse_command_file, read

# The module whose ``run_experiment(path, output_dir, address, progress, data)``
# runs a file of each study kind.
EXTERNAL_KINDS = {"compare": "autopar.cli.compare", "codesign": "autopar.cli.codesign",
                  "cliffs": "autopar.cli.codesign"}
assert set(EXTERNAL_KINDS) == set(STUDY_KINDS)


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
    return run_file(args.experiment, address=args.address, progress=args.progress,
                    output_dir=args.output_dir)


def parse(data: Mapping, src: str, base: Path) -> tuple[str, argparse.Namespace | None]:
    """Check an experiment mapping; returns (kind, the command's arguments).

    For the kinds with commands of their own (``compare``, ``codesign``,
    ``cliffs``) the arguments are None: those commands read the file.
    """
    exp = parse_command_file(data, src, base)
    if exp is None:
        return data.get("kind"), None
    case = exp.case
    ns = argparse.Namespace(
        model=case.model_file, system=case.system_file, num_procs=case.num_procs,
        max_batch_size=case.max_batch_size, datatype=case.datatype, space=case.space_given,
        batch_policy=case.batch_policy, progress=None, framework=case.framework_file,
        inference=not case.training)
    opts = dict(exp.options)
    if exp.kind == "tune":
        ns.resume, ns.name = None, None
        ns.trials_out = opts.pop("trials_out")
    else:
        ns.all_rows = opts.pop("all")
    for k, v in opts.items():
        setattr(ns, k, v)
    return exp.kind, ns


def run_file(path, *, address: str | None = None, progress: bool | None = None,
             output_dir=None) -> int:
    """Run one experiment file; the exit code of its command."""
    src = str(path)
    data = read(path)
    base = Path(path).resolve().parent
    kind, ns = parse(data, src, base)
    if kind in EXTERNAL_KINDS:
        import importlib
        module = importlib.import_module(EXTERNAL_KINDS[kind])
        return module.run_experiment(path, output_dir, address, progress, data=data)
    if output_dir is not None:
        raise SpecError("command line", "--output-dir",
                        f"not for kind {kind} (its file names its outputs)")
    ns.progress = progress
    if address is not None:
        ns.address = address
    # the folders the file names for its outputs are made (files are written
    # whole; on failure the command line removes the folders it made)
    outs = [getattr(ns, k, None) for k in ("output", "trials_out", "top", "summary", "all_rows")]
    storage = getattr(ns, "storage", None)
    if storage and storage.startswith("sqlite:///"):
        outs.append(storage[len("sqlite:///"):])
    for p in outs:
        if p:
            make_folder(Path(p).parent)
    if kind == "tune":
        from autopar.cli.tune import run
    else:
        from autopar.cli.exhaustive import run
    label = data.get("name") or Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    print(f"experiment {label} ({kind})")
    try:
        return run(ns)
    except SpecError as e:
        if e.source in ("command line", "arguments"):   # a check of a value the file gave
            raise SpecError(src, e.field.lstrip("-").replace("-", "_"), e.message) from None
        raise
