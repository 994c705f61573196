"""Efficiency cliffs: the best layout at every processor count of a range.

A sweep (YAML, ``kind: cliffs``, or ``autopar cliffs`` arguments) runs the
inner search of co-design (``autopar.studies.nested.best_layout``) for one model on
one system at each processor count, as Ray tasks (or serially, or in a
process pool), and plots the best sample rate per processor against the
count.  Where a count factors badly (a large prime factor that no tensor or
pipeline size can absorb, a data-parallel size that leaves the batch with a
remainder) the best layout is far worse than at a neighbouring count: an
efficiency cliff.  ::

    kind: cliffs
    name: cliffs-megatron-1t
    case:
      model: ../models/megatron-1T.json
      system: ../systems/a100_80g.json
      max_batch_size: 3072
      datatype: float16
      space: small                 # the layout space searched at each count
    num_procs: {min: 1024, max: 4096, step: 8}     # or a list
    inner: exhaustive              # or {search: tpe, trials: 300}
    parallel: ray                  # serial | processes | ray
    workers: 2
    output_dir: results/cliffs-megatron-1t

Outputs: ``cliffs.csv`` (one row per count: best sample rate, per
processor, relative to the best count, the winning layout), ``cliffs.png``
and ``summary.json``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from autopar.io.experiment import Sweep, load_sweep  # noqa: F401
from autopar.search.runner import Runner
from autopar.studies.nested import context_of, map_points, with_run_options

LAYOUT_COLUMNS = ("tensor_par", "pipeline_par", "data_par", "batch_size", "microbatch_size",
                  "pipeline_interleaving", "activation_recompute", "tensor_par_net",
                  "pipeline_par_net", "data_par_net")
# A count is "on a cliff" when its rate per processor is below this fraction
# of the best rate per processor at any smaller count.
CLIFF = 0.9


@dataclass
class SweepResult:
    sweep: Sweep
    table: object
    seconds: float
    outputs: tuple = ()


def sweep(spec, output_dir=None, *, address: str | None = None, parallel: str | None = None,
          workers: int | None = None, progress: bool | None = None,
          overrides: Mapping | None = None) -> SweepResult:
    """Run a processor-count sweep; with an output folder, write its results."""
    from autopar.studies.nested import progress_bar
    sw = with_run_options(load_sweep(spec, overrides), address, parallel, workers)
    counts = [{"num_procs": n} for n in sw.counts]
    t0 = time.perf_counter()
    bar = progress_bar(len(counts), f"{sw.name}", progress)
    try:
        with Runner(sw.parallel, sw.workers, sw.address) as runner:
            # Big counts first: they take longest, so the pool drains evenly.
            order = sorted(range(len(counts)), key=lambda i: -counts[i]["num_procs"])
            chunk = max(1, min(8, len(counts) // (4 * runner.workers) or 1))
            rows = map_points(runner, context_of(sw).payload(), [counts[i] for i in order],
                              per_task=chunk,
                              on_done=(lambda part: bar.update(len(part))) if bar else None)
    finally:
        if bar is not None:
            bar.close()
    rows.sort(key=lambda r: r["num_procs"])
    seconds = time.perf_counter() - t0
    res = SweepResult(sw, _table(rows), seconds)
    from autopar.io.writers import NO_OUTPUT, output_dir_arg
    out_dir = output_dir_arg(output_dir) if output_dir is not None else sw.output_dir
    if out_dir == NO_OUTPUT:
        out_dir = None
    if out_dir is not None:
        res.outputs = write_outputs(res, out_dir)
    return res


def _table(rows):
    import json
    import pandas as pd
    from autopar.studies.nested import BREAKDOWN
    out = []
    for r in rows:
        ex = r.get("execution") or {}
        d = {"num_procs": r["num_procs"], "state": r["state"], "sample_rate": r["sample_rate"],
             "sample_rate_per_proc": r["sample_rate_per_proc"], "reason": r["reason"],
             "layouts": r["layouts"], "feasible_layouts": r["feasible_layouts"]}
        d.update({f: ex.get(f) for f in LAYOUT_COLUMNS})
        d.update({k: r[k] for k in BREAKDOWN})
        d["eval_s"] = r["eval_s"]
        d["execution"] = json.dumps(ex) if ex else ""
        out.append(d)
    t = pd.DataFrame(out)
    per = t["sample_rate_per_proc"].to_numpy(dtype=float)
    top = np.nanmax(per) if np.isfinite(per).any() else math.nan
    t.insert(4, "relative", per / top)
    env = np.fmax.accumulate(np.where(np.isfinite(per), per, -np.inf))
    # rate per processor against the best at any smaller-or-equal count
    t.insert(5, "vs_envelope", np.where(env > 0, per / env, np.nan))
    return t


def summary_dict(res: SweepResult) -> dict:
    t = res.table
    sw = res.sweep
    ok = t["state"] == "COMPLETE"
    d = {"sweep": sw.name, "source": sw.source, "model": sw.case.model.name,
         "space": sw.case.space.name, "inner": sw.inner.to_dict(),
         "counts": len(t), "min": int(t["num_procs"].min()), "max": int(t["num_procs"].max()),
         "feasible": int(ok.sum()), "infeasible": int((~ok).sum()),
         "seconds": round(res.seconds, 3), "parallel": sw.parallel, "workers": sw.workers}
    if ok.any():
        per = t.loc[ok, "sample_rate_per_proc"]
        best, worst = t.loc[per.idxmax()], t.loc[per.idxmin()]
        d.update({
            "best_per_proc": {"num_procs": int(best["num_procs"]),
                              "sample_rate_per_proc": float(best["sample_rate_per_proc"]),
                              "sample_rate": float(best["sample_rate"])},
            "worst_per_proc": {"num_procs": int(worst["num_procs"]),
                               "sample_rate_per_proc": float(worst["sample_rate_per_proc"]),
                               "sample_rate": float(worst["sample_rate"])},
            "best_sample_rate": {"num_procs": int(t.loc[t.loc[ok, "sample_rate"].idxmax(), "num_procs"]),
                                 "sample_rate": float(t.loc[ok, "sample_rate"].max())},
            "within_5pct_of_best_per_proc": int((t.loc[ok, "relative"] >= 0.95).sum()),
            "on_a_cliff": int((t["vs_envelope"] < CLIFF).sum()),
            "cliff_threshold": CLIFF,
            "median_relative": float(t.loc[ok, "relative"].median()),
        })
    return d


def write_outputs(res: SweepResult, out_dir) -> tuple[Path, ...]:
    from autopar.io.writers import file_ref, write_atomic_csv, write_json
    out = Path(out_dir)
    plot(res, out / "cliffs.png")
    write_atomic_csv(res.table, out / "cliffs.csv")
    summary = summary_dict(res)
    for k in ("model", "system"):      # the files, from the summary's folder
        summary[f"{k}_file"] = file_ref(getattr(res.sweep.case, f"{k}_file"), out)
    write_json(summary, out / "summary.json")
    return (out / "cliffs.png", out / "cliffs.csv", out / "summary.json")


def summary_text(res: SweepResult) -> str:
    d = summary_dict(res)
    lines = [f"sweep {d['sweep']}: {d['counts']} counts {d['min']}..{d['max']}, "
             f"{d['feasible']} feasible, {d['seconds']:.1f} s"]
    if "best_per_proc" in d:
        b, w = d["best_per_proc"], d["worst_per_proc"]
        lines.append(f"best per processor: {b['sample_rate_per_proc']:.5f}/s at {b['num_procs']} "
                     f"({b['sample_rate']:.3f}/s); worst: {w['sample_rate_per_proc']:.5f}/s at "
                     f"{w['num_procs']} ({w['sample_rate']:.3f}/s)")
        lines.append(f"within 5% of the best per processor: {d['within_5pct_of_best_per_proc']} "
                     f"counts; below {CLIFF:.0%} of the best at any smaller count: "
                     f"{d['on_a_cliff']} counts")
    return "\n".join(lines)


def plot(res: SweepResult, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from autopar.io.writers import atomic_path
    t = res.table
    sw = res.sweep
    ok = (t["state"] == "COMPLETE").to_numpy()
    n = t["num_procs"].to_numpy()
    fig = Figure(figsize=(8.5, 6.0), dpi=120)
    ax1, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": (3, 2)})
    per = t["sample_rate_per_proc"].to_numpy(dtype=float)
    ax1.plot(n[ok], per[ok], color="tab:blue", linewidth=0.6, alpha=0.6)
    ax1.scatter(n[ok], per[ok], s=6, color="tab:blue", zorder=2, label="best layout at this count")
    env = np.fmax.accumulate(np.where(ok, per, -np.inf))
    ax1.step(n[np.isfinite(env)], env[np.isfinite(env)], where="post", color="0.35",
             linewidth=0.9, linestyle="--", label="best at any smaller count")
    cliff = (t["vs_envelope"] < CLIFF).to_numpy()
    if cliff.any():
        ax1.scatter(n[cliff], per[cliff], s=14, facecolors="none", edgecolors="tab:red",
                    zorder=3, label=f"cliff: < {CLIFF:.0%} of the best below")
    if (~ok).any():
        lo = np.nanmin(per[ok]) if ok.any() else 0
        ax1.scatter(n[~ok], np.full((~ok).sum(), lo), marker="x", s=12, color="k",
                    label=f"no layout fits ({int((~ok).sum())})")
    ax1.set_ylabel("samples/s per processor")
    ax1.grid(True, color="0.9", linewidth=0.6)
    ax1.legend(fontsize=7.5, loc="lower right", frameon=False)
    ax2.scatter(n[ok], t["sample_rate"].to_numpy(dtype=float)[ok], s=5, color="tab:green")
    ax2.set_ylabel("samples/s")
    ax2.set_xlabel("processors")
    ax2.grid(True, color="0.9", linewidth=0.6)
    title = (f"{sw.name}: {sw.case.model.name or 'model'}, best layout of space "
             f"'{sw.case.space.name}' per count (batch <= {sw.case.max_batch_size})")
    ax1.set_title(title, fontsize=9.5)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
