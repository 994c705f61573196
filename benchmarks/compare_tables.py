"""Markdown tables of finished comparisons (``autopar compare`` output folders).

    python benchmarks/compare_tables.py docs/compare/*/

For each folder: the case, the optimum and the exhaustive search's wall time,
then one row per sampler: median regret [IQR] at each budget, trials to 1%,
pruned fraction, wall time per run.  Ends with the skeleton bars (median
regret <= 0.01 within 100 skeletons; a run's wall time below the exhaustive
search's) and whether every run's best trial, evaluated again on its own,
scored the rate the run reported (``best_rechecked`` in ``optimum.json``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def fmt(v, digits=3):
    return "" if v != v else f"{v:.{digits}g}"


def table(folder: Path) -> list[str]:
    opt = json.loads((folder / "optimum.json").read_text())
    s = pd.read_csv(folder / "summary.csv")
    budgets = sorted({int(c.split("@")[1]) for c in s.columns if c.startswith("regret_median@")})
    ex = s[s["sampler"] == "exhaustive"].iloc[0]
    out = [f"### {opt['name']}", "",
           f"{opt['model_name']} on {opt['num_procs']:,} x {opt['system_name']}, batch "
           f"{opt['max_batch_size']:,}, {opt['datatype']}, space {opt['space']}: "
           f"{opt['space_size']:,} layouts ({opt['feasible_layouts']:,} feasible); optimum "
           f"{opt['sample_rate']:.4g} samples/s; exhaustive search {opt['exhaustive_seconds']:.1f} s "
           f"(whole comparison {opt['compare_seconds']:.0f} s).", "",
           "| sampler | runs | " + " | ".join(f"regret@{b}" for b in budgets)
           + " | trials to 1% | pruned | s per run |",
           "|---" * (len(budgets) + 5) + "|"]
    best = {}
    for b in budgets:
        col = s.loc[s["sampler"] != "exhaustive", f"regret_median@{b}"]
        best[b] = col.min()
    for _, r in s.iterrows():
        if r["sampler"] == "exhaustive":
            continue
        cells = []
        for b in budgets:
            m = r[f"regret_median@{b}"]
            txt = f"{fmt(m)} [{fmt(r[f'regret_q1@{b}'])}-{fmt(r[f'regret_q3@{b}'])}]"
            cells.append(f"**{txt}**" if m == best[b] else txt)
        t1 = r["trials_to_1pct"]
        try:
            t1 = fmt(float(t1))
        except ValueError:
            pass
        out.append(f"| {r['sampler']} | {int(r['runs'])} | " + " | ".join(cells)
                   + f" | {t1} ({int(r['reached_1pct'])}/{int(r['runs'])}) | "
                   f"{r['pruned_fraction']:.0%} | {fmt(r['seconds_per_run'])} |")
    out.append(f"| exhaustive | 1 | " + " | ".join("" for _ in budgets)
               + f" | {int(float(ex['trials_to_1pct'])):,} (all layouts) | "
               f"{ex['pruned_fraction']:.0%} | {fmt(ex['seconds_per_run'])} |")
    sk = s[s["sampler"] == "skeleton-tpe"]
    if len(sk):
        r = sk.iloc[0]
        b = 100 if 100 in budgets else max(budgets)
        reg = r[f"regret_median@{b}"]
        out += ["", f"skeleton-tpe: median regret {fmt(reg)} at {b} skeletons "
                f"({'meets' if reg <= 0.01 else 'misses'} the 0.01 bar); median wall time per "
                f"run {fmt(r['seconds_per_run'])} s against the exhaustive search's "
                f"{fmt(ex['seconds_per_run'])} s "
                f"({'below' if r['seconds_per_run'] < ex['seconds_per_run'] else 'not below'})."]
    chk = opt.get("best_rechecked")
    if chk is not None:
        out += ["", f"Best trials evaluated again on their own (`autopar.model.evaluate_one`): "
                f"{chk['runs']} runs (every run with a feasible trial), largest relative "
                f"difference from the reported rate {chk['max_relative_difference']:.3g}."]
    else:
        out += ["", "Best trials not evaluated again (this comparison predates that check)."]
    return out + [""]


def main(argv) -> int:
    for d in argv[1:]:
        print("\n".join(table(Path(d))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
