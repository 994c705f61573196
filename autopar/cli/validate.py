"""``autopar validate``: predictions against published or measured figures.

``autopar validate megatron [--system FILE]`` reproduces the Megatron-LM
figures of Korthikanti et al. (memory by recompute mode, time per batch).
``autopar validate SWEEP.csv --system FILE`` predicts a measured sweep (the
column format of the LLaMA sweeps) and scores the model on it.
``autopar validate published [--table NAME]`` predicts the published
training measurements (``autopar.studies.published``) and reports per table;
with ``--partial`` each row is also predicted over every completion of the
fields its source does not state (``Table.unstated``).
``autopar validate recipes [--family F] [--rows] [--partial]`` predicts
Megatron-Bridge's performance recipes (``autopar.studies.recipes``): each is
a layout NVIDIA ran, so each should be predicted to fit.
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
    p.add_argument("target", help="'megatron', 'published', 'recipes' (Megatron-Bridge's "
                                  "performance recipes: do they fit?) or a measured sweep CSV")
    p.add_argument("--family", default=None,
                   help="recipes: only this family (llama3, llama31, nemotronh, ...)")
    p.add_argument("--table", action="append", default=None,
                   help="published: only this table (repeatable; default: all)")
    p.add_argument("--no-rank", action="store_true",
                   help="published: skip ranking the published layouts among autopar's")
    p.add_argument("--rows", action="store_true",
                   help="published, recipes: also print every row's prediction")
    p.add_argument("--partial", action="store_true",
                   help="published: also predict each row over every completion of the "
                        "execution fields its source does not state (docs/validation.md): "
                        "rows some completion fits, the best completion's error, and "
                        "(with --rows) the fields it chose; a sweep: rows may leave "
                        "microbatch_size, checkpointing, kernel or sequence_parallel blank, "
                        "and are predicted over their completions")
    p.add_argument("--cross-validate", action="store_true",
                   help="published: refit every fitted constant without each table (and the "
                        "LLaMA sweeps' calibration without each model size) and print "
                        "in-sample against left-out errors")
    p.add_argument("--write-errors", default=None, metavar="PATH",
                   help="with --cross-validate: write the model's error distributions "
                        "(JSON; the shipped one is autopar/data/errors.json)")
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
    p.add_argument("--risk", default=None, metavar="{fast,safe,expected}",
                   help="a sweep's favourite: fast = the fastest predicted to fit with the "
                        "headroom (default here, the model's figure); safe = the fastest with "
                        "P(fits) >= --min-p-fits; expected = the highest rate x P(fits)")
    p.add_argument("--min-p-fits", default=None, metavar="P",
                   help="safe: the least chance to fit (default 0.95)")
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
    if getattr(args, "family", None) and args.target != "recipes":
        raise SpecError("command line", "--family", "needs 'validate recipes'")
    if args.target == "published" and getattr(args, "cross_validate", False):
        return _cross_validate(args)
    if getattr(args, "write_errors", None):
        raise SpecError("command line", "--write-errors", "needs 'published --cross-validate'")
    if args.target == "published":
        return _published(args)
    if args.target == "recipes":
        return _recipes(args)
    if not args.system:
        raise SpecError("command line", "--system", "a system file is required for a sweep")
    from autopar.studies.validate import sweep_report, validate_sweep

    from autopar.search.headroom import headroom_gib
    from autopar.io.frameworks import load_framework, with_framework
    framework = load_framework(args.framework) if args.framework else None
    system = with_framework(load_system(args.system), framework)
    headroom = headroom_gib(system, args.memory_headroom)
    from autopar.io.shipped import resolve, shipped_dir
    models_dir = resolve(args.models) if args.models else shipped_dir("models")
    from autopar.search.risk import parse_risk
    risk = parse_risk(args.risk or "fast", args.min_p_fits)
    rows = validate_sweep(args.target, system, models_dir=models_dir, headroom_gib=headroom,
                          partial=args.partial,
                          defaults=framework.defaults if framework is not None else None)
    _risk_favourites(rows, system, risk)
    report = sweep_report(rows)
    print(report.to_string(float_format=lambda x: f"{x:.3f}"))
    if args.partial:
        part = rows[rows.pred_partial.astype(bool)]
        print(f"{len(part)} rows with blank cells, predicted over their completions "
              f"({int(part.pred_feasible.sum())} fit for some completion)")
        for idx, r in part.iterrows():
            print(f"  row {idx}: {r.pred_chosen or r.pred_reason}")
    if risk.choice == "safe":
        print(f"favourites: the fastest layouts with P(fits) >= {risk.min_p_fits:g}")
    elif risk.choice == "expected":
        print("favourites: the layouts of the highest rate x P(fits)")
    elif headroom > 0:
        print(f"favourites: the fastest layouts predicted to fit with {headroom:g} GiB of "
              f"memory headroom")
    if args.output:
        write_atomic_csv(rows, args.output)
    return 0 if len(rows) else 1


def _cross_validate(args) -> int:
    import json

    from autopar.cli import output_path
    from autopar.io.writers import write_atomic_csv
    from autopar.studies import crossval

    out = output_path("--write-errors", args.write_errors) if args.write_errors else None
    cv = crossval.cross_validate(args.table)
    print(crossval.text(cv))
    doc = crossval.errors_document(cv)
    for fam, e in doc["families"].items():
        t, m = e.get("time"), e.get("memory")
        parts = []
        if t:
            parts.append(f"tokens/s log(measured/predicted) median {t['quantiles']['0.5']:+.3f}, "
                         f"5-95% [{t['quantiles']['0.05']:+.3f}, {t['quantiles']['0.95']:+.3f}] "
                         f"({t['n']} rows)")
        if m:
            parts.append(f"peak memory mu {m['mu']:+.3f} sigma {m['sigma']:.3f}"
                         + (f" (borrowed from {m['borrowed_from']})" if "borrowed_from" in m
                            else f" ({m['n_exact']} measured, {m['n_censored']} censored)")
                         + (f"; own sigma {m['own_sigma']:.3f} widened to the Megatron "
                            f"family's" if "own_sigma" in m else ""))
        print(f"{fam}: " + "; ".join(parts))
    if out is not None:
        tmp = out.with_name(f".{out.name}.partial")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    if args.output:
        write_atomic_csv(cv.residuals, args.output)
    return 0


def _risk_favourites(rows, system, risk) -> None:
    """Each row's P(fits) (``p_fits``), and the rows a favourite is chosen
    from under ``risk`` (``pred_fits_headroom``; for expected, the one row of
    the highest rate x P(fits) per sweep)."""
    import numpy as np

    from autopar.search.risk import load_errors, p_fits
    err = load_errors("megatron")        # the sweeps' format is Megatron's
    rows["p_fits"] = p_fits(rows["pred_mem_gib"].to_numpy() * 1024 ** 3, system.mem1.GiB, err)
    ok = rows["pred_feasible"].astype(bool)
    if risk.choice == "safe":
        rows["pred_fits_headroom"] = ok & (rows["p_fits"] >= risk.min_p_fits)
    elif risk.choice == "expected":
        score = (rows["p_fits"] / rows["pred_step_time_s"]).where(ok)
        best = score.groupby(rows["sweep"]).transform("max")
        rows["pred_fits_headroom"] = ok & np.isclose(score, best) & score.notna()


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


def _recipes(args) -> int:
    """Megatron-Bridge's performance recipes: per recipe, the predicted peak
    per GPU against the capacity, fits or not (and with ``--partial`` whether
    some completion of what it leaves unset fits), tokens/s/GPU and MFU; the
    skipped ones with their reason; one summary line."""
    from autopar.io.writers import write_atomic_csv
    from autopar.studies.recipes import predict, summary_line

    rows = predict(args.family, partial=args.partial)
    pred = rows[rows.status == "predicted"]
    if args.rows:
        show = pred.drop(columns=["status", "family"]).copy()
        show["mfu"] = show["mfu"].map(lambda x: f"{100 * x:.1f}%" if x == x else "-")
        print(show.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    for _, b in pred[~pred.fits.astype(bool)].iterrows():
        print(f"  predicted not to fit: {b.recipe}: {b.reason}")
    if args.partial:
        for _, b in pred[~pred.fits_any.astype(bool)].iterrows():
            print(f"  no completion fits: {b.recipe}: {b.completion}")
    odd = pred[pred.fits.astype(bool) & ((pred.mfu < 0.15) | (pred.mfu > 0.75))]
    for _, b in odd.iterrows():
        print(f"  implausible MFU {100 * b.mfu:.1f}%: {b.recipe}")
    skipped = rows[rows.status == "skipped"]
    for reason, g in skipped.groupby("reason", sort=False):
        print(f"  skipped {len(g)} x {reason}")
    print(summary_line(rows))
    if args.output:
        write_atomic_csv(rows, args.output)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(None))
