"""``autopar validate``: predictions against published or measured figures.

``autopar validate megatron [--system FILE]`` reproduces the Megatron-LM
figures of Korthikanti et al. (memory by recompute mode, time per batch).
``autopar validate SWEEP.csv --system FILE`` predicts a measured sweep (the
column format of the LLaMA sweeps) and scores the model on it.
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "validate", help="compare predictions with published/measured figures",
        description="'megatron': reproduce the published Megatron-LM figures; "
                    "a CSV path: predict a measured sweep and report out-of-memory "
                    "agreement, Spearman rank correlation, step-time error and "
                    "top-1 regret.")
    p.add_argument("target", help="'megatron' or a measured sweep CSV")
    p.add_argument("--system", default=None,
                   help="system JSON (default for megatron: systems/a100_80g.json)")
    p.add_argument("--models", default=None,
                   help="folder of model JSON files for a sweep (default: the shipped "
                        "models/)")
    p.add_argument("--output", default=None, help="write the per-row table (CSV)")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="a sweep's favourite (top-1 regret) is the fastest layout predicted "
                        "to fit with this much of tier 1 free (default: the system's "
                        "memory_headroom, else 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    import pandas as pd

    from autopar.io.specs import SpecError, load_system
    from autopar.io.writers import write_atomic_csv

    pd.set_option("display.width", 160)
    pd.set_option("display.max_rows", 200)
    if args.target == "megatron":
        from autopar.studies.validate import megatron, megatron_data, summarize

        system = load_system(args.system or "systems/a100_80g.json")
        table = megatron(system)
        summary = summarize(table)
        ref = megatron_data()["reference_model_errors"]
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print()
        print(summary.to_string(float_format=lambda x: f"{x:.2f}"))
        print()
        print("Calculon's own errors on these figures (mean / max):")
        for k, v in ref.items():
            print(f"  {k}: {v}")
        if args.output:
            write_atomic_csv(table, args.output)
        return 0
    if not args.system:
        raise SpecError("command line", "--system", "a system file is required for a sweep")
    from autopar.studies.validate import sweep_report, validate_sweep

    from autopar.search.headroom import headroom_gib
    system = load_system(args.system)
    headroom = headroom_gib(system, args.memory_headroom)
    from autopar.io.shipped import resolve, shipped_dir
    models_dir = resolve(args.models) if args.models else shipped_dir("models")
    rows = validate_sweep(args.target, system, models_dir=models_dir, headroom_gib=headroom)
    report = sweep_report(rows)
    print(report.to_string(float_format=lambda x: f"{x:.3f}"))
    if headroom > 0:
        print(f"favourites: the fastest layouts predicted to fit with {headroom:g} GiB of "
              f"memory headroom")
    if args.output:
        write_atomic_csv(rows, args.output)
    return 0 if len(rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(None))
