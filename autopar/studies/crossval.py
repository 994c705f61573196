"""Leave-one-table-out cross-validation of the fitted constants, and the
model's own error distributions from its held-out residuals.

Every constant fitted on a measured table (docs/validation.md, "Fitted
constants") is listed in ``FITTED`` with the tables it was fitted on and its
unfitted default.  ``cross_validate`` predicts each published table twice:
in sample (the shipped constants) and left out (every constant fitted on
that table refitted without it).  A constant with a second table that
measures it is refitted there (the MoE host time: on SimuMax's DeepSeek rows
when the Bridge table is left out); one fitted on its one table only has
nothing left to fit on and falls back to its unfitted default; the output
says which.  The
LLaMA sweeps' calibrated DGX A100 system is cross-validated by model size
(``autopar.studies.calibrate.fit`` on the 13B rows predicts the 65B rows,
and the reverse).

``error_distributions`` turns the held-out residuals into the distribution
of ``log(measured / predicted)`` per framework family (Megatron-family,
FSDP, MoE): for tokens/s, and for peak memory where the tables measured it
(SimuMax's B200 rows exactly; the LLaMA sweeps' out-of-memory labels as
censored observations: a layout that ran needed at most the capacity, one
that ran out more).  ``autopar.search.risk`` reads the result from
``autopar/data/errors.json``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from autopar.search.risk import FAMILIES, family_of, log_normal_cdf
from autopar.studies import published as P
from autopar.studies import published_moe  # noqa: F401  (registers the MoE rows' host time)

# The LLaMA sweeps and the systems their constants were fitted from.
SWEEP_CSV = Path("measured/llama-sweeps/llama_13B_65B_a100.csv")
SWEEP_BASE = "a100_80g_dgx_hdr200_base"
SWEEP_SHIPPED = "a100_80g_dgx_hdr200"
SWEEP_FRAMEWORK_BASE = "megatron-llama-sweeps-base"
SWEEP_FRAMEWORK = "megatron-llama-sweeps-fitted"
SWEEP_NAME = "llama_sweeps"


def family(case: "P.PublishedCase") -> str:
    """A case's framework family (``autopar.search.risk.family_of``)."""
    return family_of(case.model, case.execution)


# ----------------------------------------------------------------------------
# The fitted constants and their unfitted defaults.

@dataclass(frozen=True)
class Fitted:
    """A constant fitted on tables: its name, the tables, what it falls back
    to without them, and ``unfit(case)``: the case with that fallback.
    ``fallback`` may be a callable returning the text (a refit whose value
    is known only once it has run)."""
    name: str
    fitted_on: tuple
    fallback: "str | Callable[[], str]"
    unfit: Callable

    def fallback_text(self) -> str:
        return self.fallback() if callable(self.fallback) else self.fallback


_REFITS: dict = {}


def moe_host_without_bridge() -> float:
    """``MOE_HOST_OP_S`` (host time per op after the MoE sync) refitted
    without the Bridge table: the grid value that fits SimuMax's 12 DeepSeek
    rows (``published_moe.fit_simumax_host_op_time``), computed once."""
    if "moe_host" not in _REFITS:
        _REFITS["moe_host"] = published_moe.fit_simumax_host_op_time()[0]
    return _REFITS["moe_host"]


def _refit_moe_host(c):
    t = c.system.time_overhead
    if t is None or not t.moe_host_op_s:
        return c
    return dataclasses.replace(c, system=published_moe.with_moe_host_op_time(
        c.system, moe_host_without_bridge()))


def moe_host_reverse() -> dict:
    """The other direction of the MoE host-time transfer: SimuMax's 12
    DeepSeek rows predicted with the constant fitted on the Bridge rows (as
    shipped) against refitted on themselves; their median / worst |tokens/s
    error| each way and the ratio (left out over in sample)."""
    from autopar.model import evaluate_one

    def figs(h):
        errs = []
        for c in published_moe.simumax_moe_cases():
            s = evaluate_one(c.model, published_moe.with_moe_host_op_time(c.system, h),
                             c.execution)
            tok = s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]
            errs.append(abs(tok / c.measured["tokens_per_s_per_gpu"] - 1))
        return float(np.median(errs)), float(np.max(errs))
    own, shipped = moe_host_without_bridge(), published_moe.MOE_HOST_OP_S
    (a, aw), (b, bw) = figs(own), figs(shipped)
    return {"fitted_here_s": own, "fitted_on_bridge_s": shipped, "in_median": a,
            "in_worst": aw, "out_median": b, "out_worst": bw, "ratio": _ratio(a, b)}


def _unfit_curves_keep_peaks(name: str, datasheet: str):
    """``case -> case``: the system ``name``'s matrix efficiency curves set
    back to ``datasheet``'s, each datatype keeping ``name``'s own peak
    (``tflops``: a hardware figure, not fitted)."""
    def unfit(c):
        if c.system.name != name:
            return c
        ds = P.system(datasheet)
        matrix = {dt: dataclasses.replace(ds.matrix[dt], tflops=p.tflops)
                  for dt, p in c.system.matrix.items()}
        return dataclasses.replace(c, system=dataclasses.replace(c.system, matrix=matrix))
    return unfit


def _unfit_micro_batch(c):
    return dataclasses.replace(c, execution=dict(c.execution, microbatch_size=1))


FITTED = (
    # the host time per op after the MoE sync (ops counted), fitted on two
    # Bridge rows; SimuMax's DeepSeek rows (another framework release,
    # dispatcher, model and system) measure it too: refitted there.
    Fitted(f"MOE_HOST_OP_S ({1e6 * published_moe.MOE_HOST_OP_S:.1f} us/op)",
           ("bridge_qwen3_moe",),
           lambda: f"{1e6 * moe_host_without_bridge():.1f} us/op, refitted on "
                   "simumax_b200's 12 DeepSeek rows",
           _refit_moe_host),
    # systems/b200_nvl8_megatron.json holds no fitted constant any more: its
    # efficiencies are SimuMax's published B200 kernel and nccl-tests
    # measurements (benchmarks/simumax_b200_system.py), so simumax_b200 has
    # nothing to refit.
    # systems/h100_96g_nvl8.json: the peaks are the 500 W power limit's
    # clock (a hardware figure from the datasheets and the benchmark page,
    # docs/validation.md "torchtitan on 500 W H100"); what stays fitted is
    # the efficiency curve, x0.6135 the H100 curve.  Left out: the H100 80GB
    # curve at those 500 W peaks.
    Fitted("h100_96g_nvl8 matrix efficiency x0.6135 (over the 500 W peaks)", ("torchtitan",),
           "the h100_80g_nvl8 curve at the 500 W peaks (x1)", _unfit_curves_keep_peaks(
               "h100_96g_nvl8", "h100_80g_nvl8")),
    Fitted("mcore_h100 micro-batch 2", ("mcore_h100",),
           "micro-batch 1 (Megatron has no default; the smallest)", _unfit_micro_batch),
)


def left_out_transform(table: str):
    """``case -> case`` with every constant fitted on ``table`` refitted
    without it (None when no constant was), and the fallbacks it took.  A
    constant fitted on ``table`` alone falls back to its unfitted default."""
    mine = [f for f in FITTED if table in f.fitted_on]
    if not mine:
        return None, []
    several = [f.name for f in mine if len(f.fitted_on) > 1]
    if several:       # none today: each constant was fitted on one table
        raise NotImplementedError(f"refit of {several[0]} on several tables")

    def transform(c):
        for f in mine:
            c = f.unfit(c)
        return c
    return transform, [f"{f.name} -> {f.fallback_text()}" for f in mine]


# ----------------------------------------------------------------------------
# Cross-validation.

@dataclass
class CrossValidation:
    """``table``: one row per table (constants fitted on it, in-sample and
    left-out figures, their ratio, the fallbacks); ``residuals``: one row per
    held-out prediction (table, family, kind time | memory, log ratio, or a
    censored bound ``censor`` = 'at_most' | 'more_than')."""
    table: pd.DataFrame
    residuals: pd.DataFrame
    # the MoE host time's other direction (``moe_host_reverse``), where
    # simumax_b200 or bridge_qwen3_moe was cross-validated
    moe_reverse: dict | None = None


def _figures(rows: pd.DataFrame) -> dict:
    ok = rows[(rows.status == "predicted") & rows.feasible.astype(bool)]
    err = ok.tok_error.abs()
    mem = ok.mem_error.abs().dropna()
    return {"median_tok": float(err.median()) if len(err) else np.nan,
            "worst_tok": float(err.max()) if len(err) else np.nan,
            "median_mem": float(mem.median()) if len(mem) else np.nan,
            "infeasible": int((~rows.feasible.fillna(True).astype(bool)).sum())}


def _ratio(a, b) -> float:
    return float(b / a) if a and a == a and b == b else np.nan


def published_folds(names=None):
    """Per published table: (summary row, held-out residual records)."""
    names = list(P.TABLES) if names is None else list(names)
    out, res = [], []
    for name in names:
        table = P.TABLES[name]
        fam = {i: family(c) for i, c in P.cases(table) if isinstance(c, P.PublishedCase)}
        inside = P.predict(table, rank=False)
        transform, fallbacks = left_out_transform(name)
        left = inside if transform is None else P.predict(table, rank=False,
                                                          transform=transform)
        a, b = _figures(inside), _figures(left)
        out.append({"table": name, "constants": "; ".join(fallbacks) or "-",
                    "in_median_tok": a["median_tok"], "in_worst_tok": a["worst_tok"],
                    "out_median_tok": b["median_tok"], "out_worst_tok": b["worst_tok"],
                    "ratio_median_tok": _ratio(a["median_tok"], b["median_tok"]),
                    "in_median_mem": a["median_mem"], "out_median_mem": b["median_mem"],
                    "out_infeasible": b["infeasible"]})
        ok = left[(left.status == "predicted") & left.feasible.fillna(False).astype(bool)]
        for _, r in ok.iterrows():
            f = fam[int(r.row)]
            res.append({"table": name, "family": f, "kind": "time", "censor": "",
                        "log_ratio": math.log(r.tokens_per_s_per_gpu
                                              / r.pred_tokens_per_s_per_gpu)})
            # torchtitan's memory is the allocator's reserve, not the peak:
            # an upper bound far above it, not an observation of the peak.
            if r.peak_mem_gib == r.peak_mem_gib and name != "torchtitan":
                res.append({"table": name, "family": f, "kind": "memory", "censor": "",
                            "log_ratio": math.log(r.peak_mem_gib / r.pred_mem_gib)})
    return out, res


def sweep_folds(reference: Path):
    """The LLaMA sweeps by model size: the calibrated constants fitted on
    one model predict the other (``calibrate.fit``), against the shipped
    calibrated system in sample.  (summary row, residuals) or None when the
    sweep is absent."""
    from autopar.studies import calibrate as C
    from autopar.studies.validate import sweep_report

    path = reference / SWEEP_CSV
    if not path.is_file():
        return None
    # the hardware under the sweeps' framework files, before and after
    # calibration.  The fitted loss buffers, not the counted Megatron-Core
    # loss: left out by model size they keep out-of-memory agreement at
    # 0.957/0.972 where the counted loss gives 0.851/0.906 (docs/validation.md)
    base_sys = P.system(SWEEP_BASE, SWEEP_FRAMEWORK_BASE)
    shipped = P.system(SWEEP_SHIPPED, SWEEP_FRAMEWORK)
    sweep = C.Sweep(path, base_sys, P.MODELS)
    inside = C.Sweep(path, shipped, P.MODELS).predict(C.base_constants(shipped))
    base = C.base_constants(base_sys)
    parts, fits = [], {}
    for m in sweep.frame["model"].unique():
        out = (sweep.frame["model"] == m).to_numpy()
        k = C.fit(sweep, ~out, base)
        fits[m] = k
        parts.append(sweep.predict(k)[out])
    left = pd.concat(parts).loc[sweep.frame.index]

    def figs(rows):
        both = rows[(rows.status == "ok") & rows.pred_feasible]
        err = (both.pred_step_time_s / both.step_time_s - 1).abs()
        rep = sweep_report(rows).loc["overall"]
        return float(err.median()), float(err.max()), float(rep.oom_agreement), rep
    a, b = figs(inside), figs(left)
    row = {"table": SWEEP_NAME,
           "constants": "DGX A100 calibration (matrix, networks, pipeline, loss buffers) "
                        "-> refitted on the other model size",
           "in_median_tok": a[0], "in_worst_tok": a[1], "out_median_tok": b[0],
           "out_worst_tok": b[1], "ratio_median_tok": _ratio(a[0], b[0]),
           "in_median_mem": np.nan, "out_median_mem": np.nan,
           "in_oom_agreement": a[2], "out_oom_agreement": b[2],
           "out_infeasible": int((~left.pred_feasible).sum())}
    res = []
    cap = sweep.capacity
    ran = left[(left.status == "ok") & left.pred_feasible]
    for _, r in ran.iterrows():
        res.append({"table": SWEEP_NAME, "family": "megatron", "kind": "time", "censor": "",
                    "log_ratio": math.log(r.pred_step_time_s / r.step_time_s)})
    labelled = left[left.status.isin(["ok", "oom"]) & sweep.structural[left.index]]
    for _, r in labelled.iterrows():
        # log(true / predicted) is at most log(cap / predicted) if it ran,
        # more than that if it ran out of memory.
        res.append({"table": SWEEP_NAME, "family": "megatron", "kind": "memory",
                    "censor": "at_most" if r.status == "ok" else "more_than",
                    "log_ratio": math.log(cap / r.pred_mem_gib)})
    return row, res, fits


def cross_validate(names=None, reference: Path | None = None):
    """Every published table and the LLaMA sweeps (by model size), or the
    ``names`` among them (``llama_sweeps`` names the sweeps)."""
    from autopar.io.errors import SpecError

    known = list(P.TABLES) + [SWEEP_NAME]
    names = known if names is None else list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SpecError("command line", "--table",
                        f"unknown table {unknown[0]!r} (one of: {', '.join(known)})")
    rows, res = published_folds([n for n in names if n != SWEEP_NAME])
    if SWEEP_NAME in names:
        ref = reference or P.shared_reference()
        got = sweep_folds(Path(ref))
        if got is not None:
            rows.append(got[0])
            res += got[1]
    reverse = moe_host_reverse() if {"simumax_b200", "bridge_qwen3_moe"} & set(names) else None
    return CrossValidation(pd.DataFrame(rows).set_index("table"), pd.DataFrame(res), reverse)


# ----------------------------------------------------------------------------
# Error distributions.

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def censored_normal(exact, at_most, more_than) -> tuple[float, float]:
    """(mu, sigma) of a normal that makes the exact values and the censored
    bounds (value <= bound, value > bound) most likely: a grid of mu and
    log sigma, then a finer grid around the best point."""
    exact, at_most, more_than = (np.asarray(x, float) for x in (exact, at_most, more_than))

    def nll(mu, sd):
        mu, sd = mu[:, None], sd[:, None]
        v = (0.5 * ((exact[None, :] - mu) / sd) ** 2 + np.log(sd)).sum(axis=1)
        v -= log_normal_cdf((at_most[None, :] - mu) / sd).sum(axis=1)
        v -= log_normal_cdf((mu - more_than[None, :]) / sd).sum(axis=1)
        return v

    mu_c, lsd_c, mstep, lstep = 0.0, math.log(0.05), 0.02, 0.15
    for _ in range(3):
        mus = mu_c + mstep * np.arange(-20, 21)
        lsds = lsd_c + lstep * np.arange(-20, 21)
        M, S = np.meshgrid(mus, np.exp(lsds), indexing="ij")
        i = int(np.argmin(nll(M.ravel(), S.ravel())))
        mu_c, lsd_c = float(M.ravel()[i]), math.log(float(S.ravel()[i]))
        mstep, lstep = mstep / 10, lstep / 10
    return mu_c, math.exp(lsd_c)


def error_distributions(cv: CrossValidation) -> dict:
    """Per family: the time and memory distribution of log(measured /
    predicted) from the held-out residuals, with the tables they came from.
    A family without measured memory uses the Megatron family's, and says
    so; a family's memory spread is at least the Megatron family's."""
    r = cv.residuals
    out = {}
    for fam in FAMILIES:
        entry = {}
        t = r[(r.family == fam) & (r.kind == "time")]
        if len(t):
            x = t.log_ratio.to_numpy()
            entry["time"] = {
                "mu": float(np.mean(x)), "sigma": float(np.std(x, ddof=1)) if len(x) > 1 else 0.0,
                "quantiles": {str(q): float(np.quantile(x, q)) for q in QUANTILES},
                "n": int(len(x)), "tables": sorted(t.table.unique().tolist())}
        m = r[(r.family == fam) & (r.kind == "memory")]
        if len(m):
            exact = m[m.censor == ""].log_ratio
            lo = m[m.censor == "at_most"].log_ratio
            hi = m[m.censor == "more_than"].log_ratio
            mu, sd = censored_normal(exact, lo, hi)
            entry["memory"] = {"mu": mu, "sigma": sd, "n_exact": int(len(exact)),
                               "n_censored": int(len(lo) + len(hi)),
                               "tables": sorted(m.table.unique().tolist())}
        out[fam] = entry
    for fam in FAMILIES:
        for kind in ("time", "memory"):
            if kind not in out[fam] and kind in out["megatron"]:
                out[fam][kind] = dict(out["megatron"][kind], borrowed_from="megatron")
    # MoE models train on Megatron-Core and share its unknowns (the loss's
    # buffers, the allocator's reserve); a handful of rows of one system
    # cannot show a narrower memory error than the Megatron family's.
    meg = out["megatron"].get("memory")
    for fam in FAMILIES:
        m = out[fam].get("memory")
        if meg and m and "borrowed_from" not in m and m["sigma"] < meg["sigma"]:
            m["own_sigma"], m["sigma"] = m["sigma"], meg["sigma"]
            m["sigma_from"] = "megatron (wider)"
    return out


def errors_document(cv: CrossValidation) -> dict:
    return {"what": "the model's own error: log(measured / predicted) of tokens/s and of "
                    "peak memory, from leave-one-table-out residuals "
                    "(autopar validate published --cross-validate --write-errors)",
            "families": error_distributions(cv)}


def text(cv: CrossValidation) -> str:
    """The printed table: in sample, left out, their ratio (bar: <= 1.5)."""
    pct = lambda x: f"{100 * x:.1f}%" if x == x else "-"      # noqa: E731
    lines = [f"{'table':<18} {'in-sample med/worst':>20} {'left-out med/worst':>20} "
             f"{'ratio':>6} {'mem in/out':>14}  refitted without the table"]
    for name, r in cv.table.iterrows():
        mem = f"{pct(r.in_median_mem)}/{pct(r.out_median_mem)}"
        if "in_oom_agreement" in r and r.in_oom_agreement == r.in_oom_agreement:
            mem = f"OOM {r.in_oom_agreement:.3f}/{r.out_oom_agreement:.3f}"
        ratio = f"{r.ratio_median_tok:.2f}" if r.ratio_median_tok == r.ratio_median_tok else "-"
        bar = "" if ratio == "-" else (" ok" if r.ratio_median_tok <= 1.5 else " >1.5")
        lines.append(f"{name:<18} {pct(r.in_median_tok) + ' / ' + pct(r.in_worst_tok):>20} "
                     f"{pct(r.out_median_tok) + ' / ' + pct(r.out_worst_tok):>20} "
                     f"{ratio:>6}{bar:<5}{mem:>14}  {r.constants}")
    r = cv.moe_reverse
    if r:
        pct2 = lambda a, b: f"{pct(a)} / {pct(b)}"      # noqa: E731
        bar = "ok" if r["ratio"] <= 1.5 else ">1.5"
        lines.append(f"{'  DeepSeek rows':<18} {pct2(r['in_median'], r['in_worst']):>20} "
                     f"{pct2(r['out_median'], r['out_worst']):>20} {r['ratio']:>6.2f} {bar:<4}"
                     f"{'':>14}  the other direction: simumax_b200's 12 DeepSeek rows at "
                     f"MOE_HOST_OP_S fitted on them ({1e6 * r['fitted_here_s']:.1f} us/op) "
                     f"against fitted on the Bridge rows ({1e6 * r['fitted_on_bridge_s']:.1f} "
                     "us/op)")
    lines.append("A constant fitted on one table only has nothing left to fit on without "
                 "it: its left-out value is the unfitted default named above; one that a "
                 "second table measures is refitted there.")
    return "\n".join(lines)
