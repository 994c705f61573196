"""``autopar calibrate``: fit a system's free constants to a measured sweep.

With a framework (``--framework``, ``autopar.io.frameworks``) the software
constants are the framework's: the base is the system under it, the loss
buffers are fitted only where the framework lists
``memory_overhead.logits_fp32_copies`` among its ``free`` constants (else its
counted figure is kept), and the result is written as a framework file
(``framework_result``); the efficiency curves and network efficiencies are
still fitted on the system (hardware) and written only on request.

The free constants and their bounds (everything else in the system file is
a datasheet figure and stays as it is):

- ``matrix_scale``: one factor on the efficiency curves of the 16-bit matrix
  engines (float16 and bfloat16; the curve's shape is kept, its level moves),
  from 0.5x to the factor that puts the curve's best point at 100%.
- ``net{i}_efficiency``: the efficiency of each network tier, 0.2 to 1.
- ``pipeline_fraction`` (time_overhead): 0 to 0.2.
- memory_overhead ``logits_fp32_copies`` (0 to 32 in steps of 0.5): the
  loss's buffers on the last stage, in fp32 copies of one micro-batch's
  logits.  ``reserved_GiB`` (CUDA context, NCCL buffers, workspaces) and
  ``fraction`` (the caching allocator's fragmentation of transient tensors)
  are counted, not fitted: they are kept from the base system (unless
  ``overheads``, ``--fit-overheads``: fragmentation 0 to 0.5, reserve 0 to
  16 GiB), as is ``logits_gathered`` (a property of the framework).  Fitted together with
  the loss buffers they trade off against them on a sweep whose micro-batches
  hold few tokens (a 65B sweep fits them at their bounds and predicts a 13B
  sweep badly), see docs/validation.md.

Memory and time are fitted apart, as they are apart in the model: the need
on tier 1 does not depend on a time constant, and a time does not depend on
a memory constant.  The loss buffers maximise the likelihood of the
measured out-of-memory labels under a logistic model of the chance to run
out given the predicted need (the fitted slope gives the uncertainty band of
a predicted peak, and from it the default headroom).  The time constants
minimise ``(1 - Spearman) + median |error| + top-1 regret`` by a pattern
search (coordinate steps that halve when no step helps); the pipeline
fraction is fitted in closed form on a grid for each candidate, as it scales
the times of pipelined layouts.  The model is evaluated once per candidate
time constants on the whole sweep (memoised), with unbounded memory, and the
need for any memory constants comes from the parts the model reports
(``autopar.model.memory.MEMORY_PARTS``) through the model's own
``tier1_need``.

Cross-validation fits on all sweeps but one (leave-one-sweep-out) and on all
models but one (leave-one-model-out), predicts the left-out rows, and scores
the pooled predictions with ``validate``'s four figures.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from autopar.io.errors import SpecError
from autopar.io.specs import MemoryHeadroom, MemoryOverhead, SystemSpec, TimeOverhead
from autopar.model.memory import MEMORY_PARTS, tier1_need
from autopar.studies.validate import GIB, read_sweep, sweep_groups, sweep_report, unbounded

MATRIX_TYPES = ("float16", "bfloat16")
COPIES = np.round(np.arange(0.0, 32.0001, 0.5), 4)
# Grids of the reserve and fragmentation when they are fitted (--fit-overheads).
OVERHEAD_FRACTIONS = np.round(np.arange(0.0, 0.5001, 0.05), 4)
OVERHEAD_RESERVED = np.round(np.arange(0.0, 16.0001, 1.0), 4)
PIPELINE_BOUNDS = (0.0, 0.2)
NET_BOUNDS = (0.2, 1.0)
# The chance of running out that the default headroom leaves at the margin.
HEADROOM_RISK = 0.25
FIGURES = ("oom_agreement", "spearman", "median_abs_error", "top1_regret")


@dataclass(frozen=True)
class Constants:
    """The free constants of a system (see the module's docstring)."""
    matrix_scale: float
    net_efficiency: tuple
    pipeline_fraction: float
    reserved_GiB: float
    fraction: float
    logits_fp32_copies: float
    band_GiB: float = 0.0

    @property
    def headroom_GiB(self) -> float:
        return headroom_from_band(self.band_GiB)


def headroom_from_band(band_gib: float) -> float:
    """The default headroom: the margin at which the fitted chance of running
    out falls to HEADROOM_RISK, which is the band's half-width (rounded up to
    0.5 GiB)."""
    return math.ceil(band_gib * 2) / 2


def base_constants(system: SystemSpec) -> Constants:
    o = system.memory_overhead or MemoryOverhead()
    t = system.time_overhead or TimeOverhead()
    band = system.memory_headroom.band_GiB if system.memory_headroom else 0.0
    return Constants(1.0, tuple(n.efficiency for n in system.networks), t.pipeline_fraction,
                     o.reserved_GiB, o.fraction, o.logits_fp32_copies, band)


def max_matrix_scale(system: SystemSpec) -> float:
    best = max(e for dt in MATRIX_TYPES if dt in system.matrix
               for _, e in system.matrix[dt].gflops_efficiency)
    return 1.0 / best if best > 0 else 1.0


def apply(system: SystemSpec, k: Constants, name=None, description=None) -> SystemSpec:
    """The system with constants ``k`` (matrix curves scaled from ``system``'s)."""
    matrix = dict(system.matrix)
    for dt in MATRIX_TYPES:
        if dt in matrix:
            p = matrix[dt]
            curve = tuple((g, round(min(1.0, e * k.matrix_scale), 4))
                          for g, e in p.gflops_efficiency)
            matrix[dt] = dataclasses.replace(p, gflops_efficiency=curve)
    nets = tuple(dataclasses.replace(n, efficiency=round(e, 4))
                 for n, e in zip(system.networks, k.net_efficiency))
    # The fitted constants replace theirs; the system's other overhead fields stay.
    memory = dataclasses.replace(system.memory_overhead or MemoryOverhead(),
                                 reserved_GiB=k.reserved_GiB, fraction=k.fraction,
                                 logits_fp32_copies=k.logits_fp32_copies)
    time = dataclasses.replace(system.time_overhead or TimeOverhead(),
                               pipeline_fraction=k.pipeline_fraction)
    return dataclasses.replace(
        system, matrix=matrix, networks=nets, memory_overhead=memory, time_overhead=time,
        memory_headroom=MemoryHeadroom(k.headroom_GiB, round(k.band_GiB, 2)),
        name=system.name if name is None else name,
        description=system.description if description is None else description)


# ----------------------------------------------------------------------------
# Predictions from constants.

class Sweep:
    """A measured sweep, ready to be predicted under many constants."""

    def __init__(self, path, system: SystemSpec, models_dir="models", defaults=None):
        self.frame = read_sweep(path).reset_index(drop=True)
        self.base = system
        self.groups = sweep_groups(self.frame, system, models_dir, defaults)
        self.capacity = system.mem1.GiB
        self.pipelined = (self.frame["pipeline_par"] > 1).to_numpy()
        self.ran = (self.frame["status"] == "ok").to_numpy()
        self.labelled = self.frame["status"].isin(["ok", "oom"]).to_numpy()
        self._times: dict = {}
        self.evaluations = 0
        self.parts, self.structural, self.reason = self._memory_parts()

    def _evaluate(self, system: SystemSpec, stats) -> dict:
        from autopar.io.layouts import to_columns
        from autopar.model.evaluate import evaluate_columns, reason_text

        n = len(self.frame)
        out = {s: np.full(n, np.nan) for s in stats}
        out["feasible"] = np.zeros(n, dtype=bool)
        out["reason"] = np.empty(n, dtype=object)
        for rows, model, exes in self.groups:
            at = rows.index.to_numpy()
            r = evaluate_columns(model, system, to_columns(exes), stats=stats)
            for s in stats:
                out[s][at] = r[s]
            out["feasible"][at] = r["feasible"]
            out["reason"][at] = np.asarray(reason_text(r, system), dtype=object)
        self.evaluations += 1
        return out

    def _memory_parts(self):
        r = self._evaluate(unbounded(self.base), MEMORY_PARTS)
        return {p: r[p] for p in MEMORY_PARTS}, r["feasible"], r["reason"]

    def need_gib(self, k: Constants):
        o = MemoryOverhead(k.reserved_GiB, k.fraction, k.logits_fp32_copies)
        return tier1_need(self.parts, o) / GIB

    def base_times(self, k: Constants):
        """Step times under the time constants of ``k`` without the pipeline
        fraction (one model evaluation per distinct constants)."""
        key = (round(k.matrix_scale, 4),) + tuple(round(e, 4) for e in k.net_efficiency)
        if key not in self._times:
            sys_k = apply(self.base, dataclasses.replace(k, pipeline_fraction=0.0))
            self._times[key] = self._evaluate(unbounded(sys_k), ("total_time",))["total_time"]
        return self._times[key]

    def predict(self, k: Constants, headroom_gib=None) -> pd.DataFrame:
        """The sweep with validate's prediction columns under constants ``k``."""
        need = self.need_gib(k)
        fits = self.structural & (need <= self.capacity)
        t = self.base_times(k) * np.where(self.pipelined, 1.0 + k.pipeline_fraction, 1.0)
        rows = self.frame.copy()
        rows["pred_feasible"] = fits
        rows["pred_step_time_s"] = np.where(fits, t, np.nan)
        rows["pred_mem_gib"] = need
        h = k.headroom_GiB if headroom_gib is None else headroom_gib
        rows["pred_fits_headroom"] = fits & (need <= self.capacity - h)
        return rows


def loss(report: pd.DataFrame) -> float:
    """One number to minimise from validate's overall figures."""
    r = report.loc["overall"]
    rho = 0.0 if np.isnan(r.spearman) else r.spearman
    err = 1.0 if np.isnan(r.median_abs_error) else r.median_abs_error
    return float((1 - r.oom_agreement) + (1 - rho) + err + r.top1_regret)


# ----------------------------------------------------------------------------
# Fitting.

def _logistic_slopes(x: np.ndarray, y: np.ndarray, iters=15):
    """For each row of ``x`` (offsets from capacity, GiB), the slope ``a`` of
    P(out of memory) = sigmoid(a * x) that maximises the likelihood of the
    labels ``y``, and that likelihood's negative log.  Newton steps, with the
    slope kept in [0.05, 20] per GiB."""
    a = np.full(x.shape[0], 1.0)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(a[:, None] * x, -60, 60)))
        g = ((p - y) * x).sum(axis=1)
        h = (p * (1 - p) * x * x).sum(axis=1) + 1e-9
        a = np.clip(a - g / h, 0.05, 20.0)
    z = np.clip(a[:, None] * x, -60, 60)
    nll = (np.logaddexp(0, z) - y * z).sum(axis=1)
    return a, nll


def fit_memory(sweep: Sweep, mask: np.ndarray, base: Constants,
               overheads: bool = False, copies: bool = True) -> Constants:
    """The loss's buffers (``logits_fp32_copies``) that make the measured
    out-of-memory labels of the rows in ``mask`` most likely, with the counted
    reserve and fragmentation of ``base`` (with ``overheads``, those fitted
    too: fragmentation 0 to 0.5, reserve 0 to 16 GiB); the band is where the
    fitted chance lies between HEADROOM_RISK and 1 - HEADROOM_RISK.  Without
    ``copies`` (a framework whose loss buffers are counted, not free) the
    base's ``logits_fp32_copies`` is kept and only the band is fitted."""
    grid_copies = COPIES if copies else np.array([base.logits_fp32_copies])
    use = mask & sweep.labelled & sweep.structural
    y = (~sweep.ran[use]).astype(float)
    grid = [(base.reserved_GiB, base.fraction)]
    if overheads:
        grid = [(float(r), float(f)) for f in OVERHEAD_FRACTIONS for r in OVERHEAD_RESERVED]
    best = None
    for reserved, fraction in grid:
        k = dataclasses.replace(base, reserved_GiB=reserved, fraction=fraction)
        X = np.stack([sweep.need_gib(dataclasses.replace(k, logits_fp32_copies=float(c)))[use]
                      for c in grid_copies]) - sweep.capacity
        a, nll = _logistic_slopes(X, y)
        i = int(np.argmin(nll))
        if best is None or nll[i] < best[0] - 1e-9:
            best = (nll[i], k, float(grid_copies[i]), float(a[i]))
    _, k, fitted, slope = best
    band = math.log((1 - HEADROOM_RISK) / HEADROOM_RISK) / slope
    return dataclasses.replace(k, logits_fp32_copies=fitted, band_GiB=band)


def fit_time(sweep: Sweep, mask: np.ndarray, k: Constants) -> Constants:
    """Time constants minimising the loss on the rows of ``mask``: a pattern
    search over the matrix scale, the network efficiencies (relative steps)
    and the pipeline fraction (absolute steps), the steps halving from 20%
    (0.04) when no coordinate step helps, down to 2.5%."""
    hi_matrix = max_matrix_scale(sweep.base)
    nets = len(k.net_efficiency)

    def score(c: Constants) -> float:
        return loss(sweep_report(sweep.predict(c)[mask]))

    def moved(c: Constants, which: int, sign: int, step: float):
        if which == 0:
            v = min(hi_matrix, max(0.5, c.matrix_scale * (1 + sign * step)))
            return None if abs(v - c.matrix_scale) < 1e-6 else \
                dataclasses.replace(c, matrix_scale=v)
        if which <= nets:
            e = list(c.net_efficiency)
            v = min(NET_BOUNDS[1], max(NET_BOUNDS[0], e[which - 1] * (1 + sign * step)))
            if abs(v - e[which - 1]) < 1e-6:
                return None
            e[which - 1] = v
            return dataclasses.replace(c, net_efficiency=tuple(e))
        v = min(PIPELINE_BOUNDS[1], max(PIPELINE_BOUNDS[0],
                                        c.pipeline_fraction + sign * step / 5))
        return None if abs(v - c.pipeline_fraction) < 1e-9 else \
            dataclasses.replace(c, pipeline_fraction=round(v, 4))

    cur, cur_s = k, score(k)
    step = 0.2
    while step >= 0.025:
        improved = False
        for which in range(nets + 2):
            for sign in (1, -1):
                cand = moved(cur, which, sign, step)
                if cand is None:
                    continue
                s = score(cand)
                if s < cur_s - 1e-9:
                    cur, cur_s, improved = cand, s, True
                    break
        if not improved:
            step /= 2
    return cur


def fit(sweep: Sweep, mask: np.ndarray, base: Constants, overheads: bool = False,
        copies: bool = True) -> Constants:
    k = fit_memory(sweep, mask, base, overheads, copies)
    return fit_time(sweep, mask, k)


# ----------------------------------------------------------------------------
# Cross-validation and the whole command.

@dataclass
class Calibration:
    constants: Constants
    base: Constants
    in_sample: pd.DataFrame                      # report of the fitted constants
    base_in_sample: pd.DataFrame                 # report of the base system
    cv: dict = field(default_factory=dict)       # kind -> report (pooled held-out)
    base_cv: dict = field(default_factory=dict)  # kind -> report of the base, same rows
    folds: dict = field(default_factory=dict)    # kind -> {left out: Constants}
    fold_reports: dict = field(default_factory=dict)  # kind -> {left out: report}
    evaluations: int = 0

    def worse(self) -> list:
        """The cross-validations on which the calibrated constants score worse
        than the base (by the loss of their overall figures)."""
        return [kind for kind, rep in self.cv.items()
                if loss(rep) > loss(self.base_cv[kind]) + 1e-9]


def folds_of(frame: pd.DataFrame) -> dict:
    """kind -> column to leave one value of out at a time (kinds with 2+ values)."""
    out = {}
    for kind, col in (("leave-one-sweep-out", "sweep"), ("leave-one-model-out", "model")):
        if frame[col].nunique() >= 2:
            out[kind] = col
    return out


def calibrate(path, system: SystemSpec, models_dir="models", progress=True,
              overheads: bool = False, copies: bool = True, defaults=None) -> Calibration:
    from tqdm import tqdm

    sweep = Sweep(path, system, models_dir, defaults)
    frame = sweep.frame
    if not sweep.ran.any():
        raise SpecError(str(path), "status", "no row ran ('ok'): nothing to fit times to")
    kinds = folds_of(frame)
    if not kinds:
        raise SpecError(str(path), "sweep",
                        "cross-validation needs at least two sweeps or two models")
    base = base_constants(system)
    every = np.ones(len(frame), dtype=bool)
    n_fits = 1 + sum(frame[col].nunique() for col in kinds.values())
    bar = tqdm(total=n_fits, desc="calibrate", unit="fit", disable=not progress,
               leave=False)
    try:
        result_cv, base_cv, folds, fold_reports = {}, {}, {}, {}
        base_rows = sweep.predict(base, headroom_gib=base.headroom_GiB)
        for kind, col in kinds.items():
            parts, folds[kind], fold_reports[kind] = [], {}, {}
            for left in frame[col].unique():
                out = (frame[col] == left).to_numpy()
                k = fit(sweep, ~out, base, overheads, copies)
                folds[kind][left] = k
                parts.append(sweep.predict(k)[out])
                fold_reports[kind][left] = sweep_report(parts[-1])
                bar.set_postfix(evaluations=sweep.evaluations)
                bar.update(1)
            result_cv[kind] = sweep_report(pd.concat(parts).loc[frame.index])
            base_cv[kind] = sweep_report(base_rows)
        k = fit(sweep, every, base, overheads, copies)
        bar.update(1)
    finally:
        bar.close()
    return Calibration(k, base, sweep_report(sweep.predict(k)), sweep_report(base_rows),
                       result_cv, base_cv, folds, fold_reports, sweep.evaluations)


def describe(k: Constants, base_system: SystemSpec, source_name: str,
             overheads: bool = False) -> str:
    how = "fitted" if overheads else "counted, kept from the base"
    nets = ", ".join(f"tier {i} {e:.3f}" for i, e in enumerate(k.net_efficiency))
    return (f"{base_system.description} Calibrated by `autopar calibrate` on {source_name}: "
            f"16-bit matrix efficiency curve x{k.matrix_scale:.3f}; network efficiency "
            f"{nets}; time_overhead.pipeline_fraction {k.pipeline_fraction:.2f}; "
            f"memory_overhead ({how}) reserved {k.reserved_GiB:g} GiB, "
            f"fragmentation {k.fraction:.2f} of transient tensors; (fitted) loss buffers "
            f"{k.logits_fp32_copies:g} fp32 copies of the logits; out-of-memory band "
            f"+-{k.band_GiB:.2f} GiB of the predicted peak "
            f"(25%-75% chance of running out), default memory headroom {k.headroom_GiB:g} GiB.")


def framework_result(framework, calibrated: SystemSpec, name: str, source_name: str):
    """The framework spec ``autopar calibrate --framework`` writes: the
    framework with the calibrated system's memory, time and headroom records
    (its free constants fitted, the counted ones as they were)."""
    note = (f" Free constants fitted by `autopar calibrate` on {source_name} (with the "
            f"system {calibrated.name or calibrated.source}).")
    return dataclasses.replace(framework, name=name,
                               description=framework.description + note,
                               memory_overhead=calibrated.memory_overhead,
                               time_overhead=calibrated.time_overhead,
                               memory_headroom=calibrated.memory_headroom)
