"""Regret of sampled searches against the exhaustive optimum.

Pure analysis, no search: trial tables in, curves, a summary and a plot out.

For one run (one sampler, one seed) after ``t`` trials, ``best_so_far`` is
the highest sample rate of a feasible trial among the first ``t`` and
``regret = 1 - best_so_far / optimum``; it is 1.0 until the first feasible
trial.  ``trial`` counts trials from 1, so "regret at budget B" is the row
with ``trial == B`` (a run that ended earlier, e.g. a grid over a small
space, keeps its last value).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

CURVE_COLUMNS = ("sampler", "seed", "trial", "sample_rate", "best_sample_rate", "regret")
THRESHOLDS = (("5pct", 0.05), ("1pct", 0.01))
NOT_REACHED = "not reached"
# A sampler may tie the optimum but never beat it; allow float noise only.
TOLERANCE = 1e-9


class BeatsOptimum(RuntimeError):
    """A sampled layout scored above the exhaustive optimum (a bug: the sampler
    searched outside the space, or the two searches saw different cases)."""


class BestMismatch(RuntimeError):
    """A run's best trial, evaluated again on its own, does not score the rate
    the run reported for it (a bug: the sampler's result and the layout it
    reports disagree)."""


def recheck_best(runs: Sequence[Mapping], model, system) -> dict:
    """Evaluate each run's best execution (``best_execution``) again with
    ``autopar.model.evaluate_one`` and compare with the run's best rate.

    Returns ``{"runs": checked, "max_relative_difference": d}``; raises
    ``BestMismatch`` when one differs by more than ``TOLERANCE`` (relative) or
    no longer runs.
    """
    from autopar import model as perf
    checked, worst = 0, 0.0
    for run in runs:
        ex = run.get("best_execution")
        rate = np.asarray(run["sample_rate"], dtype=np.float64)
        if ex is None or not np.isfinite(rate).any():
            continue
        told = float(np.nanmax(rate))
        res = perf.evaluate_one(model, system, ex)
        got = float(res["sample_rate"]) if bool(res["feasible"]) else math.nan
        diff = abs(got - told) / told if math.isfinite(got) else math.inf
        if not diff <= TOLERANCE:
            why = (f"{got:.9g} samples/s" if math.isfinite(got)
                   else f"infeasible ({perf.REASONS[int(res['reason_code'])]})")
            raise BestMismatch(
                f"sampler {run['sampler']} seed {run['seed']}: best trial reported "
                f"{told:.9g} samples/s, its execution evaluated again gives {why}")
        checked += 1
        worst = max(worst, diff)
    return {"runs": checked, "max_relative_difference": worst}


def run_curve(sample_rate: np.ndarray, optimum: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-trial sample rates (NaN where pruned) -> (best_so_far, regret)."""
    rate = np.asarray(sample_rate, dtype=np.float64)
    best = np.fmax.accumulate(rate) if rate.size else rate
    regret = np.where(np.isnan(best), 1.0, 1.0 - best / optimum)
    return best, regret


def curves(runs: Sequence[Mapping], optimum: float):
    """Runs (``sampler``, ``seed``, ``sample_rate`` per trial) -> curves table.

    Raises ``BeatsOptimum`` when any trial scores above the optimum.
    """
    import pandas as pd
    parts = []
    for run in runs:
        rate = np.asarray(run["sample_rate"], dtype=np.float64)
        best, regret = run_curve(rate, optimum)
        top = np.nanmax(rate) if np.isfinite(rate).any() else -math.inf
        if top > optimum * (1 + TOLERANCE):
            t = int(np.nanargmax(rate)) + 1
            raise BeatsOptimum(
                f"sampler {run['sampler']} seed {run['seed']} trial {t} scored "
                f"{top:.6g} samples/s, above the exhaustive optimum {optimum:.6g}")
        n = rate.size
        parts.append(pd.DataFrame({
            "sampler": np.full(n, run["sampler"], dtype=object),
            "seed": np.full(n, int(run["seed"]), dtype=np.int64),
            "trial": np.arange(1, n + 1, dtype=np.int64),
            "sample_rate": rate, "best_sample_rate": best, "regret": regret}))
    if not parts:
        return pd.DataFrame({c: [] for c in CURVE_COLUMNS})
    return pd.concat(parts, ignore_index=True)[list(CURVE_COLUMNS)]


def regret_matrix(curve_rows, length: int) -> np.ndarray:
    """One sampler's curves -> array (runs, length) of regret after 1..length
    trials; a run shorter than ``length`` keeps its last value."""
    out = []
    for _, g in curve_rows.groupby("seed", sort=True):
        r = g.sort_values("trial")["regret"].to_numpy(dtype=np.float64)
        if r.size == 0:
            r = np.ones(1)
        if r.size < length:
            r = np.concatenate([r, np.full(length - r.size, r[-1])])
        out.append(r[:length])
    return np.vstack(out) if out else np.ones((0, length))


def first_within(regret: np.ndarray, threshold: float) -> float:
    """Trials (1-based) until regret <= threshold, or inf."""
    hit = np.flatnonzero(regret <= threshold + 1e-12)
    return float(hit[0] + 1) if hit.size else math.inf


def _median_or_not(values: Sequence[float]):
    """Median with never-reached runs as +inf: a number, or NOT_REACHED."""
    if not len(values):
        return NOT_REACHED
    m = float(np.median(np.asarray(values, dtype=np.float64)))
    return NOT_REACHED if not math.isfinite(m) else m


def summarize(curve_table, runs: Sequence[Mapping], labels: Sequence[str],
              budgets: Sequence[int], exhaustive: Mapping | None = None):
    """Per sampler: regret median / quartiles at each budget, trials and
    seconds to within 5% and 1%, pruned fraction, wall time per trial.

    ``runs``: per run ``sampler``, ``seed``, ``trials``, ``pruned``,
    ``wall_s`` and ``elapsed_s`` (seconds from the run's start to each
    trial's end).  ``exhaustive``: ``layouts``, ``feasible``, ``seconds``,
    which adds an ``exhaustive`` row for comparison.
    """
    import pandas as pd
    rows = []
    for label in labels:
        mine = [r for r in runs if r["sampler"] == label]
        sub = curve_table[curve_table["sampler"] == label]
        length = max([int(r["trials"]) for r in mine] + list(budgets) + [1])
        mat = regret_matrix(sub, length)
        row: dict = {"sampler": label, "runs": len(mine),
                     "trials": int(np.median([r["trials"] for r in mine])) if mine else 0}
        for b in budgets:
            col = mat[:, b - 1] if mat.shape[0] else np.array([np.nan])
            q1, med, q3 = np.percentile(col, [25, 50, 75])
            row[f"regret_median@{b}"] = float(med)
            row[f"regret_q1@{b}"] = float(q1)
            row[f"regret_q3@{b}"] = float(q3)
        by_seed = {int(s): g.sort_values("trial")["regret"].to_numpy()
                   for s, g in sub.groupby("seed")}
        for tag, th in THRESHOLDS:
            trials_to, secs_to = [], []
            for r in mine:
                t = first_within(by_seed.get(int(r["seed"]), np.ones(0)), th)
                trials_to.append(t)
                secs_to.append(_seconds_at(r, t))
            row[f"trials_to_{tag}"] = _median_or_not(trials_to)
            row[f"reached_{tag}"] = int(sum(math.isfinite(t) for t in trials_to))
            row[f"seconds_to_{tag}"] = _median_or_not(secs_to)
        total = sum(int(r["trials"]) for r in mine)
        row["pruned_fraction"] = (sum(int(r["pruned"]) for r in mine) / total) if total else math.nan
        per_trial = [r["wall_s"] / r["trials"] for r in mine if r["trials"]]
        row["ms_per_trial"] = float(np.median(per_trial)) * 1e3 if per_trial else math.nan
        row["seconds_per_run"] = float(np.median([r["wall_s"] for r in mine])) if mine else math.nan
        rows.append(row)
    if exhaustive is not None:
        n, secs = int(exhaustive["layouts"]), float(exhaustive["seconds"])
        row = {"sampler": "exhaustive", "runs": 1, "trials": n}
        for b in budgets:
            for k in ("median", "q1", "q3"):
                row[f"regret_{k}@{b}"] = math.nan
        for tag, _ in THRESHOLDS:     # it knows the optimum only at the end
            row[f"trials_to_{tag}"] = float(n)
            row[f"reached_{tag}"] = 1
            row[f"seconds_to_{tag}"] = secs
        row["pruned_fraction"] = (1 - int(exhaustive["feasible"]) / n) if n else math.nan
        row["ms_per_trial"] = secs / n * 1e3 if n else math.nan
        row["seconds_per_run"] = secs
        rows.append(row)
    return pd.DataFrame(rows)


def _seconds_at(run: Mapping, t: float) -> float:
    """Seconds from the run's start until its t-th trial ended (inf if never)."""
    if not math.isfinite(t):
        return math.inf
    k = int(t) - 1
    el = np.asarray(run.get("elapsed_s", ()), dtype=np.float64)
    wall, n = float(run["wall_s"]), int(run["trials"])
    if el.size == n and n and np.isfinite(el[k]) and np.isfinite(el[-1]):
        return float(el[k] + max(wall - el[-1], 0.0))   # + the run's set-up time
    return wall * (k + 1) / n if n else math.inf


# --------------------------------------------------------------------------
# The plot

def plot(curve_table, labels: Sequence[str], path, title: str = "",
         note: str = "", ylabel: str = "regret = 1 - best / optimum") -> None:
    """Regret versus trials (log x): median line and interquartile band per
    sampler.  Writes a PNG atomically."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from autopar.io.writers import atomic_path

    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    colors = matplotlib.colormaps["tab10"]
    longest = 1
    floor = 1e-2
    for i, label in enumerate(labels):
        sub = curve_table[curve_table["sampler"] == label]
        if sub.empty:
            continue
        length = int(sub["trial"].max())
        longest = max(longest, length)
        mat = regret_matrix(sub, length)
        q1, med, q3 = np.percentile(mat, [25, 50, 75], axis=0)
        pos = q1[q1 > 0]
        if pos.size:
            floor = min(floor, float(pos.min()))
        x = np.arange(1, length + 1)
        c = colors(i % 10)
        ax.fill_between(x, q1, q3, color=c, alpha=0.18, linewidth=0, step="post")
        ax.step(x, med, where="post", color=c, linewidth=1.6,
                label=f"{label} ({mat.shape[0]} seeds)")
    for th, style in ((0.05, ":"), (0.01, "--")):
        ax.axhline(th, color="0.45", linestyle=style, linewidth=0.8)
        ax.annotate(f"{th:.0%}", xy=(1, th), xycoords=("axes fraction", "data"),
                    xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=8, color="0.35")
    ax.set_xscale("log")
    # log scale down to the smallest quartile shown (at most 1%), linear below
    # it so that 0 (the optimum found) has a place
    ax.set_yscale("symlog", linthresh=_linthresh(floor), linscale=0.5)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(1, longest)
    ax.set_xlabel("trials")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", color="0.9", linewidth=0.6)
    if title:
        ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7.5, color="0.3")
    ax.legend(fontsize=8, loc="best", frameon=False)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def _linthresh(smallest: float) -> float:
    """A power of ten at or below ``smallest``, between 1e-4 and 1e-2."""
    return 10.0 ** max(-4, min(-2, math.floor(math.log10(smallest))))

