"""Risk: how likely a predicted layout is to fit, and how far its rate may be
off, from the model's own error (``autopar/data/errors.json``).

The errors are the distribution of ``log(measured / predicted)`` of tokens/s
and of peak memory per framework family (``family_of``: Megatron-family,
FSDP, MoE), estimated from leave-one-table-out residuals by ``autopar
validate published --cross-validate --write-errors`` (``autopar.studies.
crossval``).  Memory is a normal in log space, so

    P(fits) = P(true peak <= tier-1 capacity)
            = Phi((log(capacity / predicted peak) - mu) / sigma),

which falls with the predicted peak.  Asking ``P(fits) >= q`` is asking the
predicted peak to stay ``capacity * exp(-(mu + z_q sigma))`` or below: a
memory headroom (``autopar.search.headroom``) that the error sets, so a safe
search is a search with that headroom (``risk_headroom_gib``).

The user's risk choice (``--risk``):

- ``fast``: rank by predicted rate among layouts predicted to fit (with the
  memory headroom asked for); the behaviour before risk was counted.
- ``safe`` (default): rank by rate among layouts with ``P(fits) >=
  --min-p-fits`` (default 0.95).  A planner's recommendation is expected to
  run: a layout that runs out of memory costs a failed job and a second
  try, a few percent of rate does not.
- ``expected``: rank by rate x P(fits) (the expected rate when an
  out-of-memory run yields nothing): ``exhaustive`` exactly
  (``expected_search``), ``tune`` over its trials, ``estimate`` reports it;
  ``compare`` refuses it (its samplers rank by rate).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np

from autopar.io.errors import SpecError
from autopar.io.specs import SystemSpec

GIB = 1024 ** 3
FAMILIES = ("megatron", "fsdp", "moe", "finetune")
RISKS = ("fast", "safe", "expected")
DEFAULT_RISK = "safe"
DEFAULT_MIN_P_FITS = 0.95
ERRORS_FILE = "data/errors.json"
SQRT2 = math.sqrt(2.0)


def family_of(model, execution=None) -> str:
    """The framework family whose errors a layout shares: ``finetune`` for
    a layout with adapters (LoRA/QLoRA: a frozen base, the adapters'
    framework's own buffers), ``moe`` for a model with experts, ``fsdp`` for
    sharded weights (ZeRO-3), else ``megatron`` (Megatron-LM, Megatron-Core,
    NeMo).  ``execution`` may be a search space's fixed values."""
    if execution is not None and execution.get("adapter", "none") not in (None, "none"):
        return "finetune"
    if getattr(model, "moe", None) is not None:
        return "moe"
    if execution is not None and execution.get("weight_sharding"):
        return "fsdp"
    return "megatron"


# ----------------------------------------------------------------------------
# The normal distribution (numpy only).

_erfc = np.frompyfunc(math.erfc, 1, 1)


def normal_cdf(z):
    """Phi(z), elementwise."""
    z = np.asarray(z, dtype=float)
    return np.asarray(0.5 * _erfc(-z / SQRT2), dtype=float)


def log_normal_cdf(z):
    """log Phi(z), elementwise, finite down to z = -37."""
    return np.log(normal_cdf(np.clip(z, -37.0, 37.0)))


def normal_quantile(p: float) -> float:
    """z with Phi(z) = p (bisection; 0 < p < 1)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if normal_cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ----------------------------------------------------------------------------
# The error distributions.

@dataclass(frozen=True)
class Errors:
    """One family's errors: memory (mu, sigma) of log(true / predicted
    peak); time quantiles of log(measured / predicted rate) by probability."""
    family: str
    memory_mu: float
    memory_sigma: float
    time_quantiles: dict


def _errors_text(path) -> tuple[str, str]:
    if path is None:
        return resources.files("autopar").joinpath(ERRORS_FILE).read_text(), \
            f"autopar/{ERRORS_FILE}"
    try:
        with open(path) as f:
            return f.read(), str(path)
    except OSError as e:
        raise SpecError(str(path), "(file)", f"cannot read: {e.strerror}") from None


def load_errors(family: str, path=None) -> Errors:
    """``family``'s errors from ``path`` (default: the shipped errors.json)."""
    text, source = _errors_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(source, "(file)", f"not JSON: {e}") from None
    fams = doc.get("families") if isinstance(doc, dict) else None
    if not isinstance(fams, dict) or family not in fams:
        raise SpecError(source, "families", f"no errors for family {family!r}")
    f = fams[family]
    try:
        mu, sd = float(f["memory"]["mu"]), float(f["memory"]["sigma"])
        q = {float(k): float(v) for k, v in f["time"]["quantiles"].items()}
    except (KeyError, TypeError, ValueError):
        raise SpecError(source, f"families.{family}",
                        "needs memory.mu, memory.sigma and time.quantiles") from None
    if not sd > 0:
        raise SpecError(source, f"families.{family}.memory.sigma", "must be positive")
    return Errors(family, mu, sd, q)


def p_fits(peak_bytes, capacity_gib: float, err: Errors):
    """P(true peak <= capacity) for predicted peaks (bytes), elementwise;
    NaN where the peak is not a positive number."""
    peak = np.asarray(peak_bytes, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (np.log(capacity_gib * GIB / peak) - err.memory_mu) / err.memory_sigma
    p = normal_cdf(np.where(np.isfinite(z), z, 0.0))
    return np.where(peak > 0, p, np.nan)


def risk_headroom_gib(system: SystemSpec, err: Errors, min_p: float) -> float:
    """The headroom (GiB) below which a predicted peak has P(fits) >= min_p."""
    cap = system.mem1.GiB
    limit = cap * math.exp(-(err.memory_mu + normal_quantile(min_p) * err.memory_sigma))
    return max(0.0, cap - limit)


def rate_quantiles(rate, err: Errors) -> dict:
    """The predicted rate's quantiles under the time errors: {p: rate}."""
    return {p: float(rate) * math.exp(v) for p, v in sorted(err.time_quantiles.items())}


# ----------------------------------------------------------------------------
# The user's choice.

@dataclass(frozen=True)
class Risk:
    choice: str = DEFAULT_RISK
    min_p_fits: float = DEFAULT_MIN_P_FITS


def add_arguments(p) -> None:
    """``--risk`` and ``--min-p-fits`` on a search command's parser."""
    p.add_argument("--risk", default=None, metavar="{fast,safe,expected}",
                   help="rank by: fast = predicted rate (layouts predicted to fit); safe = "
                        "rate among layouts with P(fits) >= --min-p-fits (default); "
                        "expected = rate x P(fits)")
    p.add_argument("--min-p-fits", default=None, metavar="P",
                   help=f"safe: the least chance to fit (default {DEFAULT_MIN_P_FITS})")


def parse_risk(choice=None, min_p=None, source="command line", allowed=RISKS) -> Risk:
    """The risk asked for, checked (one-line SpecError on a bad value)."""
    c = DEFAULT_RISK if choice is None else str(choice)
    if c not in RISKS:
        raise SpecError(source, "--risk", f"expected one of {', '.join(RISKS)}, got {choice!r}")
    if c not in allowed:
        raise SpecError(source, "--risk", f"{c!r} is not offered here (use one of "
                                          f"{', '.join(allowed)})")
    if min_p is None:
        p = DEFAULT_MIN_P_FITS
    else:
        try:
            p = float(min_p)
        except (TypeError, ValueError):
            raise SpecError(source, "--min-p-fits", f"expected a number, got {min_p!r}") \
                from None
        if not 0 < p < 1:
            raise SpecError(source, "--min-p-fits", f"must be between 0 and 1, got {min_p}")
    return Risk(c, p)


def risk_of(args, allowed=RISKS) -> Risk:
    return parse_risk(getattr(args, "risk", None), getattr(args, "min_p_fits", None),
                      allowed=allowed)


def fits_text(p: float) -> str:
    return f"P(fits) {p:.3f}" if p == p else "P(fits) -"


def layout_risk(model, system: SystemSpec, execution: dict, peak_bytes, rate,
                risk: Risk | None = None) -> dict:
    """One layout's risk figures: its family, ``p_fits``, the rate's 5%,
    50% and 95% quantiles, the expected rate (rate x P(fits)) and whether it
    meets ``risk.min_p_fits``."""
    err = load_errors(family_of(model, execution))
    p = float(p_fits(peak_bytes, system.mem1.GiB, err)) if peak_bytes else float("nan")
    q = rate_quantiles(rate, err) if rate == rate and rate else {}
    risk = risk or Risk()
    return {"family": err.family, "p_fits": p,
            "rate_p05": q.get(0.05), "rate_p50": q.get(0.5), "rate_p95": q.get(0.95),
            "expected_rate": float(rate) * p if p == p and rate == rate else None,
            "min_p_fits": risk.min_p_fits, "meets_min_p_fits": bool(p >= risk.min_p_fits)}


def risk_text(r: dict) -> str:
    """'P(fits) 0.973 (megatron errors); rate 5-95% 1.2-1.5 samples/s'."""
    s = f"{fits_text(r['p_fits'])} ({r['family']} errors)"
    if r.get("rate_p05") is not None:
        s += (f"; rate 5%-95% {r['rate_p05']:.4g}-{r['rate_p95']:.4g} samples/s, "
              f"expected {r['expected_rate']:.4g}")
    return s


def expected_search(model, system: SystemSpec, num_procs: int, max_batch_size: int,
                    datatype: str, err: Errors, capacity_gib: float, top_n: int = 1,
                    start: int = 64, **kw):
    """The layouts of the highest expected rate (rate x P(fits)), exactly:
    exhaustive searches keeping the best ``k`` layouts by rate, ``k``
    growing eightfold until the k-th rate is at most the best expected rate
    found (a layout outside the k scores at most its rate, so none scores
    more).  ``capacity_gib``: the tier-1 capacity P(fits) is taken against
    (``system`` may carry a headroom).  Returns ``(table, summary)`` as
    ``exhaustive``: the table by expected rate with ``p_fits`` and
    ``expected_rate``, ``summary['best']`` the expected pick,
    ``summary['fast_pick']`` the fastest, ``summary['expected_candidates']``
    the k of the last search."""
    from autopar.search.exhaustive import exhaustive, execution_of
    k = max(int(start), int(top_n))
    while True:
        table, summary = exhaustive(model, system, num_procs, max_batch_size, datatype,
                                    top_n=k, **kw)
        if not len(table):
            return table, summary
        p = p_fits(table["proc_mem_tier1_cap_req"].to_numpy(), capacity_gib, err)
        score = table["sample_rate"].to_numpy() * np.nan_to_num(p)
        if len(table) < k or table["sample_rate"].min() <= score.max():
            break
        k *= 8
    table = table.assign(p_fits=p, expected_rate=score)
    summary["fast_pick"] = summary["best"]
    table = table.iloc[np.argsort(-score, kind="stable")]
    row = table.iloc[0]
    summary["best"] = {"execution": execution_of(row), "sample_rate": float(row.sample_rate)}
    summary["expected_candidates"] = k
    return table.head(top_n), summary


def safe_search(model, system: SystemSpec, num_procs: int, max_batch_size: int,
                datatype: str, base: SystemSpec, safe_headroom: float, top_n: int = 1,
                start: int = 64, **kw):
    """The fastest layouts that fit with ``safe_headroom`` GiB below
    ``base``'s capacity (P(fits) >= a threshold, ``risk_headroom_gib``) and
    the fastest on ``system`` (``base`` with the headroom asked for, the fast
    pick), from one search where it can: the search keeps the best ``k`` by
    rate on ``system``; when ``top_n`` of them fit with the safe headroom (or
    the k hold every feasible layout) they are the safe picks, as every layout
    outside is slower; else a second search with the safe headroom.  Returns
    ``(table, summary)`` as ``exhaustive`` with ``summary['fast_pick']`` and
    ``summary['searched_headroom_GiB']`` (the headroom its counts are for)."""
    from autopar.search.exhaustive import exhaustive, execution_of
    from autopar.search.headroom import fits, with_headroom
    k = max(int(start), int(top_n))
    table, summary = exhaustive(model, system, num_procs, max_batch_size, datatype,
                                top_n=k, **kw)
    fast = summary["best"]
    summary["searched_headroom_GiB"] = base.mem1.GiB - system.mem1.GiB
    ok = fits(table["proc_mem_tier1_cap_req"].to_numpy(), base, safe_headroom)
    if int(ok.sum()) < top_n and len(table) == k:
        kw.pop("all_path", None)             # every row was written by the first search
        table, second = exhaustive(model, with_headroom(base, safe_headroom), num_procs,
                                   max_batch_size, datatype, top_n=top_n, **kw)
        second["fast_pick"] = fast
        second["optimum"] = summary["optimum"]        # the fastest, without the safe headroom
        second["searched_headroom_GiB"] = safe_headroom
        second["seconds"] = round(second["seconds"] + summary["seconds"], 3)
        return table, second
    table = table[ok].head(top_n)
    summary["best"] = None if not len(table) else {
        "execution": execution_of(table.iloc[0]),
        "sample_rate": float(table.iloc[0].sample_rate)}
    summary["fast_pick"] = fast
    summary["safe_candidates"] = k
    return table, summary
