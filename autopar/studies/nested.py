"""The inner search of co-design: the best layout one system can run.

``best_layout`` finds, for one model on one system at one processor count,
the layout with the highest sample rate: by default by enumerating a layout
space (``autopar.search.space``) and evaluating it with the array model on the
sample rate alone, or with a sampler (``autopar.search.tune``) where the layout
space is too large to enumerate for every system.  The winner is evaluated
again on its own with every statistic, and those are the figures reported,
so an exported system and execution re-evaluate to them exactly.

``Point`` evaluation (one system of a co-design space -> one result row) and
``map_points`` (over ``autopar.search.runner.Runner``: serial, a process pool,
or Ray tasks) serve the co-design search and the processor-count sweep.
Tasks carry only plain data (``Context.payload``, sent once per runner), so
Ray workers on other machines need no local files.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from typing import Callable, Mapping, Sequence

import numpy as np

from autopar.io.experiment import INNER_SEARCHES, Inner  # noqa: F401
from autopar.io.specs import SpecError
from autopar.search.runner import Runner  # noqa: F401  (the studies' runner)

# Reported with every point: Calculon's names.
BREAKDOWN = ("total_time", "proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req",
             "compute_efficiency", "system_efficiency", "total_efficiency")
# Enumerated layout tables are kept per (processor count, tiers) up to this many rows.
LAYOUT_CACHE_ROWS = 1 << 21


# --------------------------------------------------------------------------
# The best layout of one system

_LAYOUTS: dict = {}
_CACHED_ROWS = 0


def _layout_chunks(space, case, space_key: str):
    """The space's layout tables for this case, kept for reuse where small.

    A space's layouts depend on the system only through whether it has a
    second memory tier and how many network tiers it has, so systems that
    differ in sizes and speeds share one enumeration."""
    key = (space_key, case.model, int(case.num_procs), int(case.max_batch_size),
           case.datatype, case.batch_policy, bool(case.training),
           float(case.system.mem2.GiB) > 0, len(case.system.networks))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    size = space.size(case)
    if size > LAYOUT_CACHE_ROWS:
        return space.enumerate(case, chunk_size=1 << 17)
    chunks = list(space.enumerate(case, chunk_size=1 << 17))
    global _CACHED_ROWS
    if _CACHED_ROWS + size > 4 * LAYOUT_CACHE_ROWS:      # bounded memory: start afresh
        _LAYOUTS.clear()
        _CACHED_ROWS = 0
    _LAYOUTS[key] = chunks
    _CACHED_ROWS += size
    return chunks


def best_layout(case, space, inner: Inner = Inner(), space_key: str | None = None) -> dict:
    """The best layout of ``space`` for ``case`` (an ``autopar.search.space.Case``).

    Returns ``state`` (COMPLETE, or PRUNED when no layout runs), ``reason``
    (the commonest reason when none runs), ``sample_rate``, ``execution``
    (23-field dict or None), ``layouts`` (tried), ``feasible_layouts`` and the
    ``BREAKDOWN`` statistics of the winner.
    """
    from autopar import model as perf
    from autopar.io.layouts import record
    model, system = case.model, case.system
    if inner.search != "exhaustive":
        return _best_by_sampler(case, space, inner)
    counts = np.zeros(len(perf.REASONS), dtype=np.int64)
    best_rate, best_ex, n = -math.inf, None, 0
    key = space_key if space_key is not None else json.dumps(space.to_dict(), sort_keys=True,
                                                             default=str)
    for cols in _layout_chunks(space, case, key):
        res = perf.evaluate_columns(model, system, cols, stats=("sample_rate",))
        code = np.asarray(res["reason_code"])
        counts += np.bincount(code, minlength=len(perf.REASONS))
        n += len(code)
        ok = np.asarray(res["feasible"], dtype=bool)
        if ok.any():
            rate = np.where(ok, res["sample_rate"], -np.inf)
            i = int(np.argmax(rate))              # first of equals: enumeration order
            if rate[i] > best_rate:
                best_rate, best_ex = float(rate[i]), record(cols, i)
    return _result(model, system, best_ex, n, int(counts[0]), counts, perf.REASONS)


def _best_by_sampler(case, space, inner: Inner) -> dict:
    from autopar import model as perf
    from autopar.search.space import load_space
    from autopar.search.tune import best_execution, tune, tune_options
    table = tune(case, load_space(space),
                 tune_options(inner.search, inner.trials, seed=inner.seed, progress=False))
    # a system is measured by its fastest layout (as the exhaustive inner
    # search does), not the simpler one autopar.search.ranking recommends
    ex = best_execution(table, fastest=True)
    counts = np.zeros(len(perf.REASONS), dtype=np.int64)
    for r in table.loc[table["state"] != "COMPLETE", "reason"]:
        if r in perf.REASONS:
            counts[perf.REASONS.index(r)] += 1
    feasible = int((table["state"] == "COMPLETE").sum())
    # layouts the model ran (a skeleton trial runs all of its completions)
    out = _result(case.model, case.system, ex, int(table["layouts"].sum()), feasible, counts,
                  perf.REASONS)
    if ex is None and not counts[1:].any():
        out["reason"] = "no layout fits: no trial ran"
    return out


def _result(model, system, ex, n, feasible, counts, reasons) -> dict:
    if ex is None:
        bad = counts.copy()
        bad[0] = 0
        if n == 0:
            reason = "no layout in the space for this case"
        else:
            k = int(np.argmax(bad))
            reason = f"no layout fits: {reasons[k]} ({int(bad[k])} of {n})"
        out = {"state": "PRUNED", "reason": reason, "sample_rate": math.nan,
               "execution": None, "layouts": int(n), "feasible_layouts": 0}
        out.update({k: math.nan for k in BREAKDOWN})
        return out
    from autopar.model import evaluate_one
    stats = evaluate_one(model, system, ex)
    out = {"state": "COMPLETE", "reason": "", "sample_rate": float(stats["sample_rate"]),
           "execution": ex, "layouts": int(n), "feasible_layouts": int(feasible)}
    out.update({k: float(stats[k]) for k in BREAKDOWN})
    return out


# --------------------------------------------------------------------------
# One co-design point: hardware values -> result row

class Context:
    """What every point of one study shares, rebuilt once per process."""

    def __init__(self, model, hardware, space, max_batch_size: int, datatype: str,
                 batch_policy: str | None, training: bool, inner: Inner):
        self.model, self.hardware, self.space = model, hardware, space
        self.max_batch_size, self.datatype = int(max_batch_size), datatype
        self.batch_policy, self.training, self.inner = batch_policy, bool(training), inner
        self.space_key = json.dumps(space.to_dict(), sort_keys=True, default=str)

    def payload(self) -> dict:
        from autopar.io.specs import model_to_json
        return {"model": model_to_json(self.model), "hardware": self.hardware.to_dict(),
                "space": self.space.to_dict(), "max_batch_size": self.max_batch_size,
                "datatype": self.datatype, "batch_policy": self.batch_policy,
                "training": self.training, "inner": self.inner.to_dict()}

    def case(self, system, num_procs: int):
        from autopar.search.space import Case
        return Case(model=self.model, system=system, num_procs=int(num_procs),
                    max_batch_size=self.max_batch_size, datatype=self.datatype,
                    batch_policy=self.batch_policy, training=self.training)

    def best(self, system, n: int, headroom: float) -> dict:
        """The best layout of ``system`` that fits with ``headroom`` GiB of
        tier 1 to spare; with a headroom, the row also carries it and the
        fastest layout's rate without it."""
        from autopar.search.headroom import with_headroom
        res = best_layout(self.case(with_headroom(system, headroom), n), self.space,
                          self.inner, self.space_key)
        if headroom > 0:
            plain = best_layout(self.case(system, n), self.space, self.inner, self.space_key)
            res["memory_headroom_GiB"] = headroom
            res["sample_rate_without_headroom"] = plain["sample_rate"]
        return res

    def point(self, values: Mapping) -> dict:
        """Evaluate one system of the space; a row for the trials table."""
        from autopar.search.headroom import headroom_gib
        t0 = time.perf_counter()
        hw = self.hardware
        vals = hw.canonical(values)
        n = hw.procs(values)
        row: dict = {**vals, "num_procs": n, "cost": hw.cost(values)}
        try:
            system = hw.system(values)
            headroom = headroom_gib(system, self.inner.memory_headroom,
                                    source="inner.memory_headroom")
        except SpecError as e:
            res = _result(self.model, None, None, 0, 0, np.zeros(1, np.int64), ("",))
            res["reason"] = f"invalid system: {e.field}: {e.message}"
        else:
            res = self.best(system, n, headroom)
        row.update(res)
        row["sample_rate_per_proc"] = row["sample_rate"] / n
        row["eval_s"] = time.perf_counter() - t0
        return row


def context_of(study) -> Context:
    """The Context of a co-design ``Study`` or a cliffs ``Sweep`` (their case,
    hardware and inner search)."""
    from autopar.search.space import load_space
    case = study.case
    return Context(case.model, study.hardware, load_space(case.space), case.max_batch_size,
                   case.datatype, case.batch_policy, case.training, study.inner)


def context_from_payload(payload: Mapping) -> Context:
    """A worker's setup: the study's Context rebuilt from plain data (the
    runner keeps it per process, so this runs once per worker)."""
    from autopar.io.hardware import hardware_from_dict
    from autopar.search.space import load_space
    from autopar.io.specs import load_model
    return Context(load_model(dict(payload["model"]), source="model"),
                   hardware_from_dict(payload["hardware"]),
                   load_space(dict(payload["space"]), source="space"),
                   payload["max_batch_size"], payload["datatype"], payload["batch_policy"],
                   payload["training"], Inner(**payload["inner"]))


def _point(ctx: Context, values: Mapping) -> dict:
    return ctx.point(values)


def map_points(runner, payload: Mapping, values: Sequence[Mapping], per_task: int | None = None,
               on_done: Callable[[list], None] | None = None) -> list[dict]:
    """Every system of ``values`` evaluated by ``runner``
    (``autopar.search.runner.Runner``; the payload travels once): their rows
    in order.  ``on_done`` sees each task's rows as they are taken."""
    return runner.map(_point, values, shared=dict(payload), setup=context_from_payload,
                      per_task=per_task, on_done=on_done)


# --------------------------------------------------------------------------
# Running tasks: serial, a process pool, or Ray

def with_run_options(spec, address: str | None = None, parallel: str | None = None,
                     workers: int | None = None):
    """``spec`` (a dataclass with ``address``, ``parallel`` and ``workers``)
    with the command line's run options: an address means Ray tasks there."""
    if address:
        spec = replace(spec, address=address, parallel="ray")
    if parallel:
        spec = replace(spec, parallel=parallel)
    if workers:
        spec = replace(spec, workers=int(workers))
    return spec


def progress_bar(total: int, desc: str, show: bool | None):
    import sys
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="system", file=sys.stderr, dynamic_ncols=True)
