"""Hardware/software co-design: search systems, each at its best layout.

A co-design study (YAML, ``kind: codesign``; format in ``docs/codesign.md``)
names a model, a base system, the system fields to vary (``hardware:``, see
``autopar.io.hardware``), a cost model, the objectives and how to search.  The
search is nested: every outer trial is one system (and processor count); its
value is the best sample rate any layout reaches on it (``autopar.studies.nested``),
and a system no layout fits is a pruned trial.

Outer searches:

``exhaustive``
    Every system of a discrete space: the ground truth.
``nsga2``, ``tpe`` (= ``motpe`` with two objectives), ``random``
    Optuna samplers in an ask/tell loop: ``batch`` trials asked at once and
    evaluated together (serially, in a process pool or as Ray tasks), an
    optional Optuna storage to resume from.

Objectives: ``sample_rate`` (maximised), with optionally ``cost`` or
``num_procs`` (minimised); with two, the result is the Pareto front.

With a ``compare:`` section the study is first enumerated (ground truth) and
then each sampler runs with each seed; a run's regret after t trials is
``1 - best / optimum`` with one objective and ``1 - HV_t / HV_truth`` (2-D
hypervolume of the front found so far against the true front's) with two,
reported with ``autopar.studies.regret`` as ``autopar compare`` does.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from autopar.io.experiment import (OBJECTIVES, CodesignCompare, Search, Study,  # noqa: F401
                                   load_study)
from autopar.io.specs import SpecError
from autopar.search.runner import Runner
from autopar.studies.nested import BREAKDOWN, context_of, map_points, with_run_options

# Hypervolume reference: rate 0 and this multiple of the dearest system's cost
# (or of the largest processor count).
HV_MARGIN = 1.1


# --------------------------------------------------------------------------
# Objectives and fronts

def objective_matrix(table, objectives: Sequence[str]) -> np.ndarray:
    """Rows of objectives to minimise (sample rate negated); NaN for pruned rows."""
    cols = []
    ok = (table["state"] == "COMPLETE").to_numpy()
    for o in objectives:
        v = table[o].to_numpy(dtype=np.float64)
        v = -v if OBJECTIVES[o] == "maximize" else v
        cols.append(np.where(ok, v, np.nan))
    return np.column_stack(cols) if cols else np.zeros((len(table), 0))


def hv_reference(hardware, objectives) -> tuple[float, float]:
    """Reference point of the hypervolume (minimised coordinates)."""
    if objectives[1] == "cost":
        top = hardware.max_cost()
    else:
        top = max(hardware.dim("num_procs").extremes()[1] if "num_procs" in hardware.names
                  else hardware.num_procs, 1)
    return (0.0, HV_MARGIN * top)


def truth_reference(front, objectives) -> tuple[float, float]:
    """Reference point for comparing with a known front: its nadir pushed out
    by a tenth of the front's range in each objective (or of the value where
    the range is 0), so only points near the front add hypervolume."""
    pts = objective_matrix(front, objectives)
    ideal, nadir = pts.min(axis=0), pts.max(axis=0)
    span = np.where(nadir > ideal, nadir - ideal, np.abs(nadir))
    span = np.where(span > 0, span, 1.0)
    return tuple(float(x) for x in nadir + 0.1 * span)


def pareto_rows(table, objectives: Sequence[str], names: Sequence[str]):
    """The front of a results table: one row per distinct system, no
    dominated point, sorted by the second objective (by rate with one)."""
    from autopar.studies.pareto import front_mask
    done = table[table["state"] == "COMPLETE"]
    done = done.drop_duplicates(subset=[c for c in names if c in done.columns] + ["num_procs"])
    if len(objectives) == 1:
        if done.empty:
            return done
        return done.loc[[done["sample_rate"].idxmax()]].reset_index(drop=True)
    mask = front_mask(objective_matrix(done, objectives))
    front = done[mask].sort_values([objectives[1], "sample_rate"], kind="stable")
    return front.reset_index(drop=True)


def hypervolume(table, objectives, ref) -> float:
    from autopar.studies.pareto import hypervolume_2d
    return hypervolume_2d(objective_matrix(table, objectives), ref)


# --------------------------------------------------------------------------
# Searches

ROW_HEAD = ("state",)
ROW_TAIL = ("num_procs", "cost", "sample_rate", "sample_rate_per_proc", "reason", "layouts",
            "feasible_layouts", *BREAKDOWN, "eval_s")


def _columns(names: Sequence[str], lead: str) -> list[str]:
    dims = [n for n in names if n != "num_procs"]
    return [lead, *ROW_HEAD, *dims, *ROW_TAIL]


def _frame(rows: Sequence[Mapping], names, lead: str, extra=()):
    import pandas as pd
    # With a memory headroom, each row also gives it and the rate without it.
    cols = _columns(names, lead) + list(extra) + [
        c for c in ("memory_headroom_GiB", "sample_rate_without_headroom")
        if any(c in r for r in rows)] + ["execution"]
    out = []
    for r in rows:
        d = {c: r.get(c) for c in cols}
        d["execution"] = json.dumps(r["execution"]) if r.get("execution") else ""
        out.append(d)
    frame = pd.DataFrame(out, columns=cols)
    for c in ("cost", "sample_rate", "sample_rate_per_proc", *BREAKDOWN, "eval_s"):
        frame[c] = frame[c].astype(float)
    return frame


def enumerate_systems(study: Study, runner: Runner, progress: bool | None = None,
                      cache: dict | None = None):
    """Every system of a discrete space (the ground truth); a table, one row
    per system in grid order, and the seconds it took."""
    from autopar.studies.nested import progress_bar
    hw = study.hardware
    grid = list(hw.grid())
    t0 = time.perf_counter()
    bar = progress_bar(len(grid), f"{study.name} (all systems)", progress)
    chunk = max(1, min(16, len(grid) // (4 * runner.workers) or 1))
    try:
        rows = map_points(runner, context_of(study).payload(), grid, per_task=chunk,
                          on_done=(lambda part: bar.update(len(part))) if bar else None)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    for i, r in enumerate(rows):
        r["system"] = i
        if cache is not None:
            cache[hw.key(r)] = r
    return _frame(rows, hw.names, "system"), seconds


def outer_sampler(search: Search, n_obj: int, batch: int):
    import optuna
    from autopar.search import samplers
    if search.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=search.population, seed=search.seed)
    if search.sampler in ("tpe", "motpe"):
        return samplers.get("tpe").optuna(None, search.seed, concurrency=batch)
    return samplers.get("random").optuna(None, search.seed)


def _open_study(study: Study, search: Search, name: str):
    import optuna
    directions = [OBJECTIVES[o] for o in study.objectives]
    storage = search.storage
    try:
        if isinstance(storage, str) and storage.startswith("sqlite:"):
            from autopar.search.backends.shared_study import sqlite_storage
            storage = sqlite_storage(storage)
        return optuna.create_study(storage=storage, study_name=name, directions=directions,
                                   load_if_exists=True)
    except Exception as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise SpecError(study.source, "search.storage",
                        f"cannot open study {name!r} in {search.storage!r}: {msg}") from None


def run_search(study: Study, search: Search, runner: Runner, cache: dict | None = None,
               progress: bool | None = None):
    """One sampler run (Optuna ask/tell; ``batch`` trials evaluated at once).

    ``cache`` (hardware key -> row) is shared between runs: a system is
    evaluated once.  Returns the trials table; ``elapsed_s`` counts each
    trial's evaluation seconds (its first evaluation's, when cached) plus
    the sampler's own time, i.e. the serial cost of the run so far.
    """
    import optuna
    from optuna.trial import TrialState
    from autopar.studies.nested import progress_bar
    from autopar.search.samplers import run_seed
    hw = study.hardware
    cache = {} if cache is None else cache
    batch = search.batch or (runner.workers if runner.backend != "serial" else 1)
    name = search.study_name or f"autopar-codesign-{study.name}-{search.name}-seed{search.seed}"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    payload = context_of(study).payload()
    rows: dict[int, dict] = {}
    bar = progress_bar(search.trials, f"{study.name} {search.name}", progress)
    try:
        ost = _open_study(study, search, name)
        for t in ost.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            ost.tell(t.number, state=TrialState.FAIL)
        old = ost.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        ost.sampler = outer_sampler(replace(search, seed=run_seed(search.seed, len(old))),
                                    len(study.objectives), batch)
        if old:            # resumed: the finished trials' rows, from their systems
            vals = [dict(t.params) for t in old]
            need = _unique([v for v in vals if hw.key(v) not in cache], hw)
            for r in map_points(runner, payload, need):
                cache[hw.key(r)] = r
            for t, v in zip(old, vals):
                rows[t.number] = {**cache[hw.key(v)], "trial": t.number, "cached": True}
        done = len(old)
        if bar is not None:
            bar.update(done)
        seen = {hw.key(r) for r in rows.values()}
        clock = sum(cache[k]["eval_s"] for k in seen)
        while done < search.trials:
            t0 = time.perf_counter()
            asked = [ost.ask() for _ in range(min(batch, search.trials - done))]
            try:
                vals = [hw.suggest(t) for t in asked]
                need = _unique([v for v in vals if hw.key(v) not in cache], hw)
                overhead = time.perf_counter() - t0
                fresh = map_points(runner, payload, need) if need else []
                for r in fresh:
                    cache[hw.key(r)] = r
                t1 = time.perf_counter()
                new_keys = {hw.key(r) for r in fresh}
                for t, v in zip(asked, vals):
                    k = hw.key(v)
                    r = cache[k]
                    if k not in seen:     # a repeat within the run costs nothing
                        clock += r["eval_s"]
                        seen.add(k)
                    if r["state"] == "COMPLETE":
                        ost.tell(t, [float(r[o]) for o in study.objectives])
                    else:
                        t.set_user_attr("reason", r["reason"])
                        ost.tell(t, state=TrialState.PRUNED)
                    rows[t.number] = {**r, "trial": t.number, "cached": k not in new_keys}
                    new_keys.discard(k)
                overhead += time.perf_counter() - t1
                clock += overhead
                for t in asked:
                    rows[t.number]["elapsed_s"] = clock
            except BaseException:
                for t in asked:
                    ost.tell(t, state=TrialState.FAIL, skip_if_finished=True)
                raise
            done += len(asked)
            if bar is not None:
                bar.update(len(asked))
    finally:
        optuna.logging.set_verbosity(verbosity)
        if bar is not None:
            bar.close()
    out = [rows[k] for k in sorted(rows)]
    return _frame(out, hw.names, "trial", extra=("cached", "elapsed_s"))


def _unique(vals: Sequence[Mapping], hw) -> list[dict]:
    seen, out = set(), []
    for v in vals:
        k = hw.key(v)
        if k not in seen:
            seen.add(k)
            out.append(hw.canonical(v))
    return out


# --------------------------------------------------------------------------
# The whole study

@dataclass
class Result:
    study: Study
    table: Any                       # trials (search) or systems (exhaustive)
    front: Any
    seconds: float
    hypervolume: float | None
    reference: tuple | None = None   # hypervolume reference point (minimised coordinates)
    truth: Any = None                # compare: the enumerated systems
    truth_front: Any = None
    truth_seconds: float = 0.0
    curves: Any = None
    regret: Any = None
    runs: list = field(default_factory=list)
    sampler_fronts: dict = field(default_factory=dict)   # compare: label -> front (first seed)
    base: dict | None = None         # the base system itself, for reference
    outputs: tuple = ()


def codesign(study, output_dir=None, *, address: str | None = None,
             parallel: str | None = None, workers: int | None = None,
             progress: bool | None = None, overrides: Mapping | None = None,
             memory_headroom: float | None = None) -> Result:
    """Run a co-design study (file, mapping or Study); with an output folder
    (argument or the file's ``output_dir``), write its results there.
    ``memory_headroom`` (GiB) replaces the file's ``inner.memory_headroom``."""
    st = with_run_options(load_study(study, overrides), address, parallel, workers)
    if memory_headroom is not None:
        from dataclasses import replace
        if not memory_headroom >= 0 or memory_headroom == float("inf"):     # nan too
            raise SpecError("command line", "--memory-headroom",
                            f"must be a finite number >= 0, got {memory_headroom}")
        st = replace(st, inner=replace(st.inner, memory_headroom=float(memory_headroom)))
    from autopar.io.writers import NO_OUTPUT, output_dir_arg
    out_dir = output_dir_arg(output_dir) if output_dir is not None else st.output_dir
    if out_dir == NO_OUTPUT:
        out_dir = None
    with Runner(st.parallel, st.workers, st.address) as runner:
        if st.compare is not None:
            res = _run_compare(st, runner, progress)
        else:
            t0 = time.perf_counter()
            if st.search.sampler == "exhaustive":
                table, _ = enumerate_systems(st, runner, progress)
            else:
                table = run_search(st, st.search, runner, progress=progress)
            seconds = time.perf_counter() - t0
            front = pareto_rows(table, st.objectives, st.hardware.names)
            ref = hv_reference(st.hardware, st.objectives) if len(st.objectives) == 2 else None
            hv = hypervolume(table, st.objectives, ref) if ref else None
            res = Result(st, table, front, seconds, hv, reference=ref)
        res.base = base_point(st)
    if out_dir is not None:
        from autopar.studies.codesign_report import write_outputs
        res.outputs = write_outputs(res, out_dir)
    return res


def base_point(st: Study) -> dict | None:
    """The base system at its best layout and its cost under the study's cost
    model (a reference: its values need not lie in the searched domains).
    None when the processor count is searched."""
    from autopar.io.hardware import PROCS, get_path
    hw = st.hardware
    if PROCS in hw.names:
        return None
    values = {d.name: get_path(hw.base, d.keys) for d in hw.dims}
    return context_of(st).point(values)


def _run_compare(st: Study, runner: Runner, progress) -> Result:
    from autopar.studies import regret as rg
    from autopar.studies.pareto import hypervolume_curve
    cmp = st.compare
    cache: dict = {}
    truth, truth_s = enumerate_systems(st, runner, progress, cache=cache)
    truth_front = pareto_rows(truth, st.objectives, st.hardware.names)
    two = len(st.objectives) == 2
    ref = truth_reference(truth_front, st.objectives) if two else None
    optimum = (hypervolume(truth, st.objectives, ref) if two else
               float(truth["sample_rate"].max()))
    if not (optimum > 0):
        raise SpecError(st.source, "hardware", "no system of the space runs any layout: "
                                               "nothing to compare")
    runs, per_run, fronts = [], [], {}
    for entry in cmp.samplers:
        for seed in cmp.seeds:
            s = replace(entry, seed=seed, trials=cmp.trials)
            table = run_search(st, s, runner, cache=cache, progress=progress)
            if two:
                score = hypervolume_curve(objective_matrix(table, st.objectives), ref)
                score = np.where(score > 0, score, np.nan)
            else:
                score = np.where(table["state"] == "COMPLETE", table["sample_rate"], np.nan)
            front = pareto_rows(table, st.objectives, st.hardware.names)
            el = table["elapsed_s"].to_numpy(dtype=float)
            runs.append({"sampler": s.name, "seed": seed, "sample_rate": score,
                         "trials": len(table), "pruned": int((table["state"] != "COMPLETE").sum()),
                         "wall_s": float(el[-1]) if len(el) else 0.0, "elapsed_s": el})
            per_run.append(_run_row(st, s, table, front, truth_front, score, optimum))
            fronts.setdefault(s.name, front)
    curves = rg.curves(runs, optimum)
    labels = [s.name for s in cmp.samplers]
    summary = rg.summarize(curves, runs, labels, cmp.budgets,
                           exhaustive={"layouts": len(truth),
                                       "feasible": int((truth["state"] == "COMPLETE").sum()),
                                       "seconds": truth_s})
    hv = optimum if two else None
    res = Result(st, truth, truth_front, truth_s, hv, reference=ref, base=base_point(st), truth=truth, truth_front=truth_front,
                 truth_seconds=truth_s, curves=curves, regret=summary, runs=per_run,
                 sampler_fronts=fronts)
    return res


def _run_row(st, s, table, front, truth_front, score, optimum) -> dict:
    names = [n for n in st.hardware.names] + ["num_procs"]
    names = list(dict.fromkeys(names))

    def keys(fr):      # NaN (an inactive dimension) compares equal to itself here
        return {tuple(None if r[n] != r[n] else r[n] for n in names) for _, r in fr.iterrows()}
    found = keys(front) & keys(truth_front)
    best = np.nanmax(score) if np.isfinite(score).any() else math.nan
    return {"sampler": s.name, "seed": s.seed, "trials": len(table),
            "pruned": int((table["state"] != "COMPLETE").sum()),
            "distinct_systems": int(len(table.drop_duplicates(subset=names))),
            "front_points": len(front), "on_true_front": len(found),
            "true_front_points": len(truth_front),
            "final_regret": (1 - best / optimum) if np.isfinite(best) else 1.0,
            "serial_seconds": float(table["elapsed_s"].iloc[-1]) if len(table) else 0.0}
