"""``autopar exhaustive MODEL SYSTEM --num-procs N --max-batch-size B --datatype DT``

Evaluates every layout of a search space (``--space``, Calculon's own search
by default) and reports the best.  Files are written only when the search
succeeds, each atomically:

* ``--output``: the best execution, Calculon's 23 fields (``autopar estimate``
  and Calculon's ``llm`` command read it);
* ``--top``: the best ``--top-n`` with their statistics, in Calculon's
  optimal-execution layout ``{"0": {"execution": ..., "stats": ...}, ...}``;
* ``--all``: every layout with its statistics (Parquet; CSV for ``*.csv``);
* ``--summary``: layouts, feasible, infeasible counts by reason, seconds, best.

Exit 0 with a best layout, 1 when no layout is feasible (the commonest
reasons on one line), 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from autopar.io.layouts import CHOICES
from autopar.cli import output_path, positive



def register(subparsers) -> None:
    p = subparsers.add_parser(
        "exhaustive", help="evaluate every layout of a search space",
        description="Evaluate every layout of a search space and report the "
                    "best. Exit 0 found, 1 no feasible layout, 2 bad input.")
    p.add_argument("model", help="model (application) JSON file")
    p.add_argument("system", help="system JSON file")
    p.add_argument("--num-procs", type=int, required=True, help="processors (GPUs)")
    p.add_argument("--max-batch-size", type=int, required=True,
                   help="global batch: the largest multiple of data_par up to this "
                        "(batch policy max) or exactly this (fixed)")
    p.add_argument("--datatype", required=True, choices=CHOICES["datatype"])
    p.add_argument("--space", default=None,
                   help="search space YAML file or name under search_spaces/ "
                        "(default: calculon, the reference search)")
    p.add_argument("--batch-policy", choices=("max", "fixed"), default=None,
                   help="default: the space's (max)")
    p.add_argument("--top-n", type=int, default=1, help="best layouts kept (default 1)")
    p.add_argument("--output", metavar="FILE", help="write the best execution (Calculon JSON)")
    p.add_argument("--top", metavar="FILE", help="write the top N with statistics (JSON)")
    p.add_argument("--all", dest="all_rows", metavar="FILE",
                   help="write every layout with statistics (Parquet, or CSV for .csv)")
    p.add_argument("--summary", metavar="FILE", help="write the summary (JSON)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address: run chunks as Ray tasks "
                        "(default: $RAY_ADDRESS, else local)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="layouts evaluated at once (memory vs. overhead)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=run)


def _write_json(path: Path, data) -> Path:
    """Write JSON to a temporary file next to ``path``; returns it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    return tmp


def run(args) -> int:
    from autopar.search.exhaustive import DEFAULT_CHUNK, DEFAULT_SPACE, exhaustive, top_json
    from autopar.search.space import load_space
    from autopar.io.specs import load_model, load_system

    positive("--num-procs", args.num_procs)
    positive("--max-batch-size", args.max_batch_size)
    positive("--top-n", args.top_n)
    positive("--chunk-size", args.chunk_size)
    outs = {"--output": output_path("--output", args.output),
            "--top": output_path("--top", args.top),
            "--all": output_path("--all", args.all_rows),
            "--summary": output_path("--summary", args.summary)}
    model = load_model(args.model)
    system = load_system(args.system)
    space = load_space(args.space if args.space is not None else DEFAULT_SPACE)
    all_tmp = None
    if outs["--all"] is not None:
        p = outs["--all"]
        # held back under a temporary name until the search has succeeded
        all_tmp = p.with_name(f".{p.stem}.{os.getpid()}.partial{p.suffix}")
    temps: list[tuple[Path, Path]] = []
    try:
        table, summary = exhaustive(
            model, system, args.num_procs, args.max_batch_size, args.datatype,
            space=space, batch_policy=args.batch_policy, top_n=args.top_n,
            address=args.address, progress=args.progress,
            chunk_size=args.chunk_size or DEFAULT_CHUNK, all_path=all_tmp)
        best = summary["best"]
        if best is None:
            reasons = list(summary["infeasible"].items())[:3]
            why = "; ".join(f"{r} ({n:,})" for r, n in reasons) or "the space is empty"
            print(f"autopar: no feasible layout among {summary['layouts']:,} layouts of "
                  f"space {summary['space']}: {why}", file=sys.stderr)
            return 1
        if outs["--output"] is not None:
            temps.append((_write_json(outs["--output"], best["execution"]), outs["--output"]))
        if outs["--top"] is not None:
            temps.append((_write_json(outs["--top"], top_json(table, args.top_n)), outs["--top"]))
        if outs["--summary"] is not None:
            temps.append((_write_json(outs["--summary"], summary), outs["--summary"]))
        if all_tmp is not None:
            temps.append((all_tmp, outs["--all"]))
        for tmp, final in temps:
            os.replace(tmp, final)
        temps = []
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        if all_tmp is not None and all_tmp.exists():
            all_tmp.unlink()
    ex = best["execution"]
    print(f"space {summary['space']}: {summary['layouts']:,} layouts, "
          f"{summary['feasible']:,} feasible, {summary['seconds']:.1f} s")
    print(f"best: {best['sample_rate']:.4g} samples/s  tp={ex['tensor_par']} "
          f"pp={ex['pipeline_par']} dp={ex['data_par']} batch={ex['batch_size']} "
          f"mbs={ex['microbatch_size']} ppint={ex['pipeline_interleaving']} "
          f"recompute={ex['activation_recompute']} comm={ex['tensor_par_comm_type']}"
          + "".join(f" {k}={ex[k]}" for k in ("context_par", "weight_sharding", "sharding_group",
                                               "fp8_recipe") if k in ex))
    return 0
