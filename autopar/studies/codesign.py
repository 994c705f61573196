"""Hardware/software co-design: search systems, each at its best layout.

A co-design study (YAML, ``kind: codesign``; format in ``docs/codesign.md``)
names a model, a base system, the system fields to vary (``hardware:``, see
``autopar.studies.hardware``), a cost model, the objectives and how to search.  The
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
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from autopar.io.experiment import header, integer, open_file, relative, storage_url
from autopar.studies.nested import (BREAKDOWN, PARALLEL, Context, Runner, parse_inner, points_task,
                            with_run_options)
from autopar.io.specs import SpecError, brief

TOP_KEYS = ("kind", "name", "description", "case", "hardware", "cost", "objectives", "inner",
            "search", "compare", "parallel", "workers", "address", "output_dir")
CASE_KEYS = ("model", "system", "num_procs", "max_batch_size", "datatype", "space",
             "batch_policy")
SEARCH_KEYS = ("sampler", "trials", "seed", "population", "batch", "storage", "study_name")
COMPARE_KEYS = ("samplers", "seeds", "trials", "budgets")
OUTER_SAMPLERS = ("exhaustive", "nsga2", "tpe", "motpe", "random")
OBJECTIVES = {"sample_rate": "maximize", "cost": "minimize", "num_procs": "minimize"}
DEFAULT_SPACE = "calculon"
DEFAULT_POPULATION = 20
# Hypervolume reference: rate 0 and this multiple of the dearest system's cost
# (or of the largest processor count).
HV_MARGIN = 1.1


# --------------------------------------------------------------------------
# The study file

@dataclass(frozen=True)
class Search:
    sampler: str = "nsga2"
    trials: int = 100
    seed: int | None = 0
    population: int = DEFAULT_POPULATION
    batch: int | None = None
    storage: str | None = None
    study_name: str | None = None
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.sampler


@dataclass(frozen=True)
class Compare:
    samplers: tuple            # Search templates (seed set per run)
    seeds: tuple
    trials: int
    budgets: tuple


@dataclass(frozen=True)
class Study:
    source: str
    name: str
    description: str
    context: Context
    objectives: tuple
    search: Search
    compare: Compare | None
    parallel: str
    workers: int
    address: str | None
    output_dir: Path | None

    @property
    def hardware(self):
        return self.context.hardware


def load_study(spec, overrides: Mapping | None = None, base_dir=None,
               source: str | None = None) -> Study:
    """A co-design file (path) or mapping -> Study; ``overrides`` replace
    top-level keys (``search`` is merged key by key)."""
    if isinstance(spec, Study) and not overrides:
        return spec
    if isinstance(spec, (str, os.PathLike)):
        data, src, base, stem = open_file(spec, source)
    elif isinstance(spec, Mapping):
        data, src = dict(spec), source or "codesign"
        base = Path(base_dir or os.getcwd())
        stem = "codesign"
    else:
        raise SpecError(source or "codesign", "(root)",
                        f"expected a file path or a mapping, got {type(spec).__name__}")
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k == "search" and isinstance(data.get("search"), Mapping):
            data["search"] = {**data["search"], **v}
        else:
            data[k] = v
    return _parse(data, src, base, stem)


def parse_case(src: str, base: Path, case, need_procs: bool = False) -> dict:
    """The ``case:`` section -> model spec, base system JSON and case values."""
    from autopar.search.space import load_space
    from autopar.io.specs import load_model, load_system, system_to_json
    if not isinstance(case, Mapping):
        raise SpecError(src, "case", f"expected a mapping with model, system, max_batch_size, "
                                     f"datatype, got {brief(case)}")
    for k in case:
        if k not in CASE_KEYS:
            raise SpecError(src, f"case.{k}", f"unknown key; expected one of {', '.join(CASE_KEYS)}")
    for k in ("model", "system", "max_batch_size", "datatype") + (("num_procs",) if need_procs else ()):
        if k not in case:
            raise SpecError(src, f"case.{k}", "missing")

    def file_or_map(fld, v):
        if isinstance(v, Mapping):
            return dict(v)
        if not isinstance(v, str) or not v:
            raise SpecError(src, fld, f"expected a file path or a mapping, got {brief(v)}")
        return str(relative(base, v))

    model = load_model(file_or_map("case.model", case["model"]))
    system = load_system(file_or_map("case.system", case["system"]))
    out = {"model": model, "system": system, "base": system_to_json(system)}
    out["num_procs"] = (None if case.get("num_procs") is None
                        else integer(src, "case.num_procs", case["num_procs"], 1))
    out["max_batch_size"] = integer(src, "case.max_batch_size", case["max_batch_size"], 1)
    dt = case["datatype"]
    if dt not in system.datatypes:
        raise SpecError(src, "case.datatype", f"{brief(dt)} is not supported by {system.source} "
                                              f"(it runs: {', '.join(system.datatypes)})")
    out["datatype"] = dt
    sp = case.get("space", DEFAULT_SPACE)
    if isinstance(sp, str) and ("/" in sp or sp.endswith((".yaml", ".yml"))):
        sp = str(relative(base, sp))
    elif not isinstance(sp, (str, Mapping)) or not sp:
        raise SpecError(src, "case.space", f"expected a space name, a path or a mapping, got {brief(sp)}")
    out["space"] = load_space(sp)
    bp = case.get("batch_policy")
    if bp is not None and bp not in ("max", "fixed"):
        raise SpecError(src, "case.batch_policy", f"expected max or fixed, got {brief(bp)}")
    out["batch_policy"] = bp
    return out


def parse_parallel(src: str, data: Mapping) -> tuple[str, int, str | None]:
    address = data.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise SpecError(src, "address", f"expected a Ray address, got {brief(address)}")
    parallel = data.get("parallel", "ray" if address else "serial")
    if parallel not in PARALLEL:
        raise SpecError(src, "parallel", f"expected one of {', '.join(PARALLEL)}, got {brief(parallel)}")
    if address and parallel != "ray":
        raise SpecError(src, "address", "a Ray address needs parallel: ray")
    workers = integer(src, "workers", data.get("workers", 2), 1)
    return parallel, workers, address


def parse_output_dir(src: str, base: Path, v) -> Path | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise SpecError(src, "output_dir", f"expected a folder path, got {brief(v)}")
    p = Path(v)
    return (p if p.is_absolute() else base / p).resolve()


def _search(src: str, fld: str, v, n_obj: int, defaults: Search | None = None) -> Search:
    if isinstance(v, str):
        v = {"sampler": v}
    if v is None:
        v = {}
    if not isinstance(v, Mapping):
        raise SpecError(src, fld, f"expected a mapping ({', '.join(SEARCH_KEYS)}), got {brief(v)}")
    allowed = SEARCH_KEYS + (("label",) if fld != "search" else ())
    for k in v:
        if k not in allowed:
            raise SpecError(src, f"{fld}.{k}", f"unknown key; expected one of {', '.join(allowed)}")
    d = defaults or Search(sampler="nsga2" if n_obj == 2 else "tpe")
    sampler = v.get("sampler", d.sampler)
    if sampler not in OUTER_SAMPLERS:
        raise SpecError(src, f"{fld}.sampler", f"expected one of {', '.join(OUTER_SAMPLERS)}, "
                                               f"got {brief(sampler)}")
    if sampler == "nsga2" and n_obj == 1:
        raise SpecError(src, f"{fld}.sampler", "nsga2 is for two objectives; use tpe or random")
    if sampler == "motpe" and n_obj == 1:
        raise SpecError(src, f"{fld}.sampler", "motpe is for two objectives; use tpe")
    trials = integer(src, f"{fld}.trials", v.get("trials", d.trials), 1)
    seed = v.get("seed", d.seed)
    if seed is not None:
        seed = integer(src, f"{fld}.seed", seed, 0)
    population = integer(src, f"{fld}.population", v.get("population", d.population), 2)
    batch = v.get("batch", d.batch)
    if batch is not None:
        batch = integer(src, f"{fld}.batch", batch, 1)
    storage = v.get("storage", d.storage)
    if storage is not None and (not isinstance(storage, str) or not storage):
        raise SpecError(src, f"{fld}.storage", f"expected an Optuna storage URL, got {brief(storage)}")
    name = v.get("study_name", d.study_name)
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(src, f"{fld}.study_name", f"expected a non-empty string, got {brief(name)}")
    label = v.get("label", "")
    if not isinstance(label, str):
        raise SpecError(src, f"{fld}.label", f"expected a string, got {brief(label)}")
    return Search(sampler, trials, seed, population, batch, storage, name, label)


def _parse(data: Mapping, src: str, base: Path, stem: str) -> Study:
    from autopar.studies.hardware import parse_hardware
    name, desc = header(data, src, stem, "codesign", TOP_KEYS)
    case = parse_case(src, base, data.get("case"))
    hw = parse_hardware(src, data.get("hardware"), data.get("cost"), case["base"],
                        case["num_procs"])
    objectives = data.get("objectives", ["sample_rate", "cost"])
    if isinstance(objectives, str):
        objectives = [objectives]
    if not isinstance(objectives, list) or not objectives:
        raise SpecError(src, "objectives", f"expected a list, got {brief(objectives)}")
    for i, o in enumerate(objectives):
        if o not in OBJECTIVES:
            raise SpecError(src, f"objectives[{i}]", f"expected one of {', '.join(OBJECTIVES)}, "
                                                     f"got {brief(o)}")
    if objectives[0] != "sample_rate" or len(objectives) > 2 or len(set(objectives)) != len(objectives):
        raise SpecError(src, "objectives", "expected [sample_rate] or sample_rate with one of "
                                           f"cost, num_procs, got {brief(objectives)}")
    inner = parse_inner(src, data.get("inner"))
    n_obj = len(objectives)
    search = _search(src, "search", data.get("search"), n_obj)
    search = replace(search, storage=storage_url(base, search.storage))
    if search.sampler == "exhaustive" and not hw.discrete:
        raise SpecError(src, "search.sampler", "exhaustive needs every hardware domain discrete "
                                               "(a list, or a range with step or num)")
    compare = None
    if data.get("compare") is not None:
        compare = _compare(src, data["compare"], n_obj)
        if not hw.discrete:
            raise SpecError(src, "compare", "the ground truth enumerates the hardware: every "
                                            "domain must be discrete (a list, or step or num)")
    parallel, workers, address = parse_parallel(src, data)
    ctx = Context(case["model"], hw, case["space"], case["max_batch_size"], case["datatype"],
                  case["batch_policy"], True, inner)
    return Study(source=src, name=name.strip(), description=desc, context=ctx,
                 objectives=tuple(objectives), search=search, compare=compare,
                 parallel=parallel, workers=workers, address=address,
                 output_dir=parse_output_dir(src, base, data.get("output_dir")))


def _compare(src: str, v, n_obj: int) -> Compare:
    if not isinstance(v, Mapping):
        raise SpecError(src, "compare", f"expected a mapping ({', '.join(COMPARE_KEYS)}), got {brief(v)}")
    for k in v:
        if k not in COMPARE_KEYS:
            raise SpecError(src, f"compare.{k}", f"unknown key; expected one of {', '.join(COMPARE_KEYS)}")
    trials = integer(src, "compare.trials", v.get("trials", 100), 1)
    raw = v.get("samplers")
    if not isinstance(raw, list) or not raw:
        raise SpecError(src, "compare.samplers", f"expected a non-empty list, got {brief(raw)}")
    samplers = []
    for i, s in enumerate(raw):
        d = _search(src, f"compare.samplers[{i}]", s, n_obj,
                    Search(sampler="random", trials=trials))
        if d.sampler == "exhaustive":
            raise SpecError(src, f"compare.samplers[{i}].sampler",
                            "the exhaustive search is the ground truth, not a sampler to compare")
        if d.storage:
            raise SpecError(src, f"compare.samplers[{i}].storage", "comparison runs keep no storage")
        samplers.append(d)
    labels = [s.name for s in samplers]
    if len(set(labels)) != len(labels):
        raise SpecError(src, "compare.samplers", "two entries share a label: give each a label")
    seeds = v.get("seeds", 1)
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = list(range(integer(src, "compare.seeds", seeds, 1)))
    if not isinstance(seeds, list) or not seeds:
        raise SpecError(src, "compare.seeds", f"expected a count or a list of seeds, got {brief(seeds)}")
    seeds = tuple(integer(src, f"compare.seeds[{i}]", s, 0) for i, s in enumerate(seeds))
    budgets = v.get("budgets")
    if budgets is None:
        budgets = [b for b in (10, 25, 50, 100, 250, 500, 1000) if b <= trials] or [trials]
    if not isinstance(budgets, list) or not budgets:
        raise SpecError(src, "compare.budgets", f"expected a list of trial counts, got {brief(budgets)}")
    budgets = tuple(integer(src, f"compare.budgets[{i}]", b, 1) for i, b in enumerate(budgets))
    for i, b in enumerate(budgets):
        if b > trials:
            raise SpecError(src, f"compare.budgets[{i}]", f"exceeds the trials per run ({trials})")
    return Compare(tuple(samplers), seeds, trials, tuple(sorted(set(budgets))))


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
    cols = _columns(names, lead) + list(extra) + ["execution"]
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
        rows = runner.map(points_task, study.context.payload(), grid, chunk=chunk,
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
    from autopar.search.samplers import optuna_sampler
    if search.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=search.population, seed=search.seed)
    if search.sampler in ("tpe", "motpe"):
        return optuna_sampler("tpe", None, search.seed, concurrency=batch)
    return optuna_sampler("random", None, search.seed)


def _open_study(study: Study, search: Search, name: str):
    import optuna
    directions = [OBJECTIVES[o] for o in study.objectives]
    storage = search.storage
    try:
        if isinstance(storage, str) and storage.startswith("sqlite:"):
            from autopar.search.tune import _sqlite_storage
            storage = _sqlite_storage(storage)
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
    from autopar.search.samplers import resumed_seed
    hw = study.hardware
    cache = {} if cache is None else cache
    batch = search.batch or (runner.workers if runner.parallel != "serial" else 1)
    name = search.study_name or f"autopar-codesign-{study.name}-{search.name}-seed{search.seed}"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    payload = study.context.payload()
    rows: dict[int, dict] = {}
    bar = progress_bar(search.trials, f"{study.name} {search.name}", progress)
    try:
        ost = _open_study(study, search, name)
        for t in ost.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            ost.tell(t.number, state=TrialState.FAIL)
        old = ost.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        ost.sampler = outer_sampler(replace(search, seed=resumed_seed(search.seed, len(old))),
                                    len(study.objectives), batch)
        if old:            # resumed: the finished trials' rows, from their systems
            vals = [dict(t.params) for t in old]
            need = _unique([v for v in vals if hw.key(v) not in cache], hw)
            for r in runner.map(points_task, payload, need):
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
                fresh = runner.map(points_task, payload, need) if need else []
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
             progress: bool | None = None, overrides: Mapping | None = None) -> Result:
    """Run a co-design study (file, mapping or Study); with an output folder
    (argument or the file's ``output_dir``), write its results there."""
    st = with_run_options(load_study(study, overrides), address, parallel, workers)
    out_dir = Path(output_dir) if output_dir is not None else st.output_dir
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
    from autopar.studies.hardware import PROCS, get_path
    hw = st.hardware
    if PROCS in hw.names:
        return None
    values = {d.name: get_path(hw.base, d.keys) for d in hw.dims}
    return st.context.point(values)


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
