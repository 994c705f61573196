"""``autopar validate``: predictions against published or measured figures.

``autopar validate megatron [--system FILE]`` reproduces the Megatron-LM
figures of Korthikanti et al. (memory by recompute mode, time per batch).
``autopar validate SWEEP.csv --system FILE`` predicts a measured sweep (the
column format of the LLaMA sweeps) and scores the model on it.
``autopar validate published [--table NAME]`` predicts the published
training measurements (``autopar.studies.published``) and reports per table;
with ``--partial`` each row is also predicted over every completion of the
fields its source does not state (``Table.unstated``).
"""
from __future__ import annotations

from autopar.cli import framework_option

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "validate", help="compare predictions with published/measured figures",
        description="'megatron': reproduce the published Megatron-LM figures; "
                    "a CSV path: predict a measured sweep and report out-of-memory "
                    "agreement, Spearman rank correlation, step-time error and "
                    "top-1 regret.")
    p.add_argument("target", help="'megatron', 'published' or a measured sweep CSV")
    p.add_argument("--table", action="append", default=None,
                   help="published: only this table (repeatable; default: all)")
    p.add_argument("--no-rank", action="store_true",
                   help="published: skip ranking the published layouts among autopar's")
    p.add_argument("--rows", action="store_true",
                   help="published: also print every row's prediction")
    p.add_argument("--partial", action="store_true",
                   help="published: also predict each row over every completion of the "
                        "execution fields its source does not state (docs/validation.md): "
                        "rows some completion fits, the best completion's error, and "
                        "(with --rows) the fields it chose; a sweep: rows may leave "
                        "microbatch_size, checkpointing, kernel or sequence_parallel blank, "
                        "and are predicted over their completions")
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
    framework_option(p)
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
    if args.target == "published":
        return _published(args)
    if not args.system:
        raise SpecError("command line", "--system", "a system file is required for a sweep")
    from autopar.studies.validate import sweep_report, validate_sweep

    from autopar.search.headroom import headroom_gib
    from autopar.io.frameworks import system_under
    system = system_under(load_system(args.system), args.framework)
    headroom = headroom_gib(system, args.memory_headroom)
    from autopar.io.shipped import resolve, shipped_dir
    models_dir = resolve(args.models) if args.models else shipped_dir("models")
    rows = validate_sweep(args.target, system, models_dir=models_dir, headroom_gib=headroom,
                          partial=args.partial)
    report = sweep_report(rows)
    print(report.to_string(float_format=lambda x: f"{x:.3f}"))
    if args.partial:
        part = rows[rows.pred_partial.astype(bool)]
        print(f"{len(part)} rows with blank cells, predicted over their completions "
              f"({int(part.pred_feasible.sum())} fit for some completion)")
        for idx, r in part.iterrows():
            print(f"  row {idx}: {r.pred_chosen or r.pred_reason}")
    if headroom > 0:
        print(f"favourites: the fastest layouts predicted to fit with {headroom:g} GiB of "
              f"memory headroom")
    if args.output:
        write_atomic_csv(rows, args.output)
    return 0 if len(rows) else 1


def _published(args) -> int:
    import pandas as pd

    from autopar.io.writers import write_atomic_csv
    from autopar.studies.published import report

    summary, rows = report(args.table, rank=not args.no_rank, partial=args.partial)
    pct = lambda x: f"{100 * x:.1f}%" if x == x else "-"     # noqa: E731
    show = summary.copy()
    for c in ("median_abs_tok_error", "worst_abs_tok_error", "median_abs_mem_error",
              "median_abs_best_tok_error", "worst_abs_best_tok_error"):
        if c in show:
            show[c] = show[c].map(pct)
    print(show.to_string())
    for name, r in rows.items():
        skipped = r[r.status == "skipped"]
        if len(skipped):
            print(f"\n{name}: {len(skipped)} rows skipped")
            for reason, g in skipped.groupby("reason", sort=False):
                print(f"  {len(g)} x {reason}")
        bad = r[(r.status == "predicted") & ~r.feasible.astype(bool)]
        for _, b in bad.iterrows():
            print(f"  predicted not to run: {b.label}: {b.reason}")
        if args.partial:
            none = r[(r.status == "predicted") & ~r.feasible_any.astype(bool)]
            for _, b in none.iterrows():
                print(f"  no completion fits: {b.label}: {b.chosen}")
        if args.rows:
            print(f"\n{name}:")
            print(r[r.status == "predicted"].drop(columns=["status"]).to_string(
                index=False, float_format=lambda x: f"{x:.3f}"))
    if args.output:
        write_atomic_csv(pd.concat(rows, names=["table"]).reset_index(level=0), args.output)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(None))
