"""Risk-aware favourites on the LLaMA 13B/65B sweeps, leave-one-model-size-out.

For each model size left out: the DGX A100 constants are fitted on the other
size (``autopar.studies.calibrate.fit``), the memory error distribution is
estimated from that size's residuals alone (``crossval.censored_normal`` on
its out-of-memory labels), and the left-out size's sweeps are predicted.
Per sweep it prints OOM agreement, Spearman, median |step-time error| and the
favourite under three rankings, with its top-1 regret and whether it ran out
of memory:

- before: the fastest predicted to fit with the fitted headroom (the
  calibration's band; today's ``--risk fast`` on the calibrated system);
- safe: the fastest with P(fits) >= 0.95 (``--risk safe``, the default);
- expected: the highest rate x P(fits) (``--risk expected``).

    PYTHONPATH=$PWD python benchmarks/risk_llama.py   (about 15 s; needs ../shared/reference)
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.io.specs import load_system  # noqa: E402
from autopar.search.risk import Errors, p_fits  # noqa: E402
from autopar.studies import calibrate as C  # noqa: E402
from autopar.studies.crossval import censored_normal  # noqa: E402
from autopar.studies.validate import sweep_report  # noqa: E402
from llama_sweep import SWEEP, arguments  # noqa: E402

GIB = 1024 ** 3
MIN_P = 0.95


def memory_errors(rows, cap) -> Errors:
    """The memory error of ``rows`` (log(true / predicted) censored at the
    capacity by the out-of-memory labels)."""
    lab = rows[rows.status.isin(["ok", "oom"])]
    bound = np.log(cap / lab.pred_mem_gib.to_numpy())
    mu, sd = censored_normal([], bound[lab.status == "ok"], bound[lab.status == "oom"])
    return Errors("megatron", mu, sd, {})


def favourite(g, score):
    """The row of the highest score (NaN: not a candidate), or None."""
    s = score[g.index]
    return None if not np.isfinite(s).any() else g.loc[s.idxmax()]


def regret(g, fav) -> tuple[float, bool]:
    best = g.loc[g.status == "ok", "mfu"].max()
    if fav is None:
        return 1.0, False
    if fav.status != "ok":
        return 1.0, True
    return float((best - fav.mfu) / best), False


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    if args is None:
        return 1
    t0 = time.perf_counter()
    from autopar.io.frameworks import load_framework, with_framework
    framework = load_framework(args.framework)
    base_sys = with_framework(load_system(args.system), framework)
    # The loss buffers are refitted only where the framework lists them as
    # free (as ``autopar calibrate`` does); a counted loss keeps its copies.
    copies = "memory_overhead.logits_fp32_copies" in framework.free
    sweep = C.Sweep(SWEEP, base_sys, ROOT / "models", framework.defaults)
    base = C.base_constants(base_sys)
    cap = sweep.capacity
    print(f"{'sweep':<22}{'OOM':>6}{'rho':>7}{'med':>7}  "
          f"{'before: regret, fav':<28}{'safe: regret, fav':<32}{'expected: regret, fav':<30}")
    totals = {k: [] for k in ("before", "safe", "expected")}
    thresholds = (0.5, 0.8, 0.9, 0.95, 0.99)
    by_threshold = {q: [] for q in thresholds}
    held = []
    for left in sweep.frame["model"].unique():
        out = (sweep.frame["model"] == left).to_numpy()
        k = C.fit(sweep, ~out, base, copies=copies)
        train = sweep.predict(k)[~out]
        err = memory_errors(train, cap)
        rows = sweep.predict(k)[out]
        p = p_fits(rows.pred_mem_gib.to_numpy() * GIB, cap, err)
        rows["p_fits"] = p
        rate = 1.0 / rows.pred_step_time_s
        structural = sweep.structural[rows.index]
        scores = {
            "before": rate.where(rows.pred_fits_headroom),
            "safe": rate.where(structural & (rows.p_fits >= MIN_P)
                               & rows.pred_step_time_s.notna()),
            "expected": (rate * rows.p_fits).where(rows.pred_step_time_s.notna()),
        }
        rep = sweep_report(rows)
        held.append(rows[rows.status.isin(["ok", "oom"]) & structural])
        for q in thresholds:
            sc = rate.where(structural & (rows.p_fits >= q) & rows.pred_step_time_s.notna())
            for _, g in rows.groupby("sweep", sort=False):
                by_threshold[q].append(regret(g, favourite(g, sc)))
        print(f"fitted on the other size, predicting {left}: memory error mu {err.memory_mu:+.3f} "
              f"sigma {err.memory_sigma:.3f}, headroom before {k.headroom_GiB:g} GiB, safe "
              f"P(fits) >= {MIN_P} = predicted <= "
              f"{cap * math.exp(-(err.memory_mu + 1.6449 * err.memory_sigma)):.1f} GiB")
        for name, g in rows.groupby("sweep", sort=False):
            r = rep.loc[name]
            cells = []
            for kind, score in scores.items():
                fav = favourite(g, score)
                reg, oom = regret(g, fav)
                totals[kind].append((reg, oom))
                what = "none" if fav is None else (
                    f"{fav.pred_mem_gib:.1f} GiB P{fav.p_fits:.2f} "
                    + ("OOM" if oom else fav.status))
                cells.append(f"{reg:.3f} {what}")
            print(f"{name:<22}{r.oom_agreement:>6.3f}{r.spearman:>7.3f}"
                  f"{100 * r.median_abs_error:>6.1f}%  {cells[0]:<28}{cells[1]:<32}{cells[2]:<30}")
        o = rep.loc["overall"]
        print(f"{'  overall ' + left:<22}{o.oom_agreement:>6.3f}{o.spearman:>7.3f}"
              f"{100 * o.median_abs_error:>6.1f}%")
    for kind, v in totals.items():
        regs = [r for r, _ in v]
        print(f"{kind}: mean top-1 regret {np.mean(regs):.3f}, favourites that ran out of "
              f"memory {sum(o for _, o in v)} of {len(v)}")
    for q, v in by_threshold.items():
        print(f"  safe at P(fits) >= {q}: mean regret {np.mean([r for r, _ in v]):.3f}, "
              f"favourites out of memory {sum(o for _, o in v)} of {len(v)}")
    h = __import__("pandas").concat(held)
    print("reliability of the held-out P(fits) (labelled rows): P bin, rows, share that ran")
    for lo, hi in ((0, 0.05), (0.05, 0.5), (0.5, 0.95), (0.95, 1.0001)):
        b = h[(h.p_fits >= lo) & (h.p_fits < hi)]
        if len(b):
            print(f"  [{lo:.2f}, {min(hi, 1):.2f}): {len(b):>4} rows, mean P {b.p_fits.mean():.3f}, "
                  f"ran {(b.status == 'ok').mean():.3f}")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
