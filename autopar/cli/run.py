"""``autopar run EXPERIMENT.yaml [--address ADDR] [--output-dir DIR]``

Runs an experiment file (``autopar.io.experiment``): a tune, an exhaustive
search, a comparison, a co-design study or a cliffs sweep described
declaratively (``kind:``), with the exit code of that command.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping

from autopar.io.errors import SpecError, brief
from autopar.io.experiment import (COMMON_KEYS, parse_case, parse_options, read, relative,
                                   storage_url)

# Kinds whose command lives elsewhere: kind -> module with
# ``run_experiment(path, output_dir, address, progress, data) -> exit code``.
EXTERNAL_KINDS = {"compare": "autopar.cli.compare", "codesign": "autopar.cli.codesign",
                  "cliffs": "autopar.cli.codesign"}
KINDS = ("tune", "exhaustive", *EXTERNAL_KINDS)
# key -> (type, default, is a path relative to the file)
TUNE_KEYS: dict[str, tuple[Any, Any, bool]] = {
    "sampler": (str, "skeleton-tpe", False), "trials": (int, 100, False), "seed": (int, None, False),
    "backend": (str, "optuna", False), "encoding": (str, None, False),
    "concurrency": (int, None, False), "storage": (str, None, False),
    "study_name": (str, None, False), "address": (str, None, False),
    "storage_path": (str, None, False), "max_failures": (int, 3, False),
    "output": (str, None, True), "trials_out": (str, None, True),
}
EXHAUSTIVE_KEYS: dict[str, tuple[Any, Any, bool]] = {
    "top_n": (int, 1, False), "output": (str, None, True), "top": (str, None, True),
    "summary": (str, None, True), "all": (str, None, True), "chunk_size": (int, None, False),
    "address": (str, None, False),
}


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

    For the external kinds (``compare``, ``codesign``, ``cliffs``) the
    arguments are None: their own modules check the file.
    """
    kind = data.get("kind")
    if kind not in KINDS:
        raise SpecError(src, "kind", f"expected one of {', '.join(KINDS)}, got {brief(kind)}")
    if kind in EXTERNAL_KINDS:
        return kind, None
    keys = TUNE_KEYS if kind == "tune" else EXHAUSTIVE_KEYS
    for k in data:
        if k not in COMMON_KEYS and k not in keys:
            raise SpecError(src, str(k), f"unknown key for kind {kind}; expected one of "
                                         f"{', '.join(COMMON_KEYS + tuple(keys))}")
    name = data.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise SpecError(src, "name", f"expected a non-empty string, got {brief(name)}")
    if not isinstance(data.get("description", ""), str):
        raise SpecError(src, "description", f"expected a string, got {brief(data['description'])}")
    case = parse_case(src, base, data.get("case"))
    opts = parse_options(src, base, data, keys)
    ns = argparse.Namespace(
        model=case["model"], system=case["system"], num_procs=case["num_procs"],
        max_batch_size=case["max_batch_size"], datatype=case["datatype"],
        space=case.get("space"), batch_policy=case.get("batch_policy"), progress=None)
    if kind == "tune":
        from autopar.search.samplers import SAMPLERS
        for k, options in (("sampler", SAMPLERS), ("backend", ("optuna", "ray"))):
            if opts[k] not in options:
                raise SpecError(src, k, f"expected one of {', '.join(options)}, got {brief(opts[k])}")
        opts["storage"] = storage_url(base, opts["storage"])
        sp = opts["storage_path"]
        if sp and "://" not in sp:
            opts["storage_path"] = str(relative(base, sp))
        ns.resume, ns.name = None, None
        ns.trials_out = opts.pop("trials_out")
    else:
        ns.all_rows = opts.pop("all")
    for k, v in opts.items():
        setattr(ns, k, v)
    return kind, ns


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
    # the folders the file names for its outputs are made (files are written whole)
    outs = [getattr(ns, k, None) for k in ("output", "trials_out", "top", "summary", "all_rows")]
    storage = getattr(ns, "storage", None)
    if storage and storage.startswith("sqlite:///"):
        outs.append(storage[len("sqlite:///"):])
    for p in outs:
        if p:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
    if kind == "tune":
        from autopar.cli.tune import run
    else:
        from autopar.cli.exhaustive import run
    label = data.get("name") or Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    print(f"experiment {label} ({kind})")
    return run(ns)
