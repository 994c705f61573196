"""Advice on a user's layout: how it does, the best layouts near it and
overall, what to change and what that gains (``autopar advise``).

The user's layout is evaluated by the model as ``autopar estimate`` does
(every statistic, P(fits) from the model's error, the memory need of the
first and last pipeline stage).  Two searches then look for better ones for
the same case (processors, global batch, datatype, training or inference):

* **near**: the user's parallel sizes kept (``PARALLEL_FIELDS``), every other
  field the space searches ranging over the space's values; and the user's
  layout with one or two of the fields the space searches changed, a
  parallel size among them (``data_par`` following); the fields it does not
  search held at the user's values: the completions of partial layouts
  (``autopar.search.partial.completion_space``), evaluated in columns;
* **overall**: the whole space (``autopar.search.exhaustive``) with the
  batch fixed at the user's, the fields the space neither searches nor fixes
  held at the user's values (a framework setting such as the attention
  kernel stays the user's).

Both rank as ``exhaustive`` does under the user's risk choice
(``autopar.search.risk``): ``fast`` by rate among layouts that fit with the
memory headroom, ``safe`` among those with P(fits) >= the threshold (the
headroom that probability sets), ``expected`` by rate x P(fits), and keep
only layouts the user's format can express (``accept``).  The
recommendation is, among the best found near and overall and the user's own
layout, those within 0.1% of the best score, the one that changes the
fewest fields of the user's (``recommend``); ``changes`` lists the fields
where it differs from the user's and ``gain`` its predicted rate over the
user's, minus one (None when the user's layout cannot run; 0 when the
user's own layout is the recommendation).
"""
from __future__ import annotations

import math
from itertools import combinations
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS, FIELDS, record, to_columns
from autopar.io.spaces import DERIVED, PARAMS
from autopar.search.headroom import GIB, PEAK, fits, with_headroom
from autopar.search.partial import completion_space, default_options
from autopar.search.risk import (Risk, family_of, load_errors, p_fits, risk_headroom_gib)
from autopar.search.space import Case, load_space

# The parallel sizes a near layout keeps (data_par follows from them).
PARALLEL_FIELDS = ("tensor_par", "pipeline_par", "data_par", "context_par", "expert_par",
                   "expert_tensor_par")
DEFAULT_TOP = 5
# Candidates kept from each search for the recommendation (``recommend``).
POOL = 64
# Scores this close (relative) to the best are the best's equals: the
# recommendation among them is the one with the fewest changes (issue 25's
# 0.1% within which a simpler layout is preferred).
TIE = 1e-3
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Row:
    """One evaluated layout, as the advise output writes it."""
    execution: dict
    stats: dict                     # every statistic (``top_json``'s keys), None where NaN
    p_fits: float | None
    memory_stages_gib: list | None  # [first, last] stage need (one entry without pipeline)
    feasible: bool = True
    reason: str = ""

    @property
    def rate(self) -> float:
        r = self.stats.get("sample_rate")
        return float(r) if r is not None else 0.0

    def to_json(self) -> dict:
        return {"execution": compact(self.execution), "stats": self.stats, "p_fits": self.p_fits,
                "memory_stages_gib": self.memory_stages_gib}


@dataclass(frozen=True)
class Advice:
    user: Row
    near: list
    overall: list
    best: Row | None                # the recommendation (None: nothing fits)
    changes: list = field(default_factory=list)
    gain: float | None = None
    headroom_gib: float = 0.0       # the memory headroom the searches ranked with
    left_out: int = 0               # layouts the user's format could not express

    def to_json(self) -> dict:
        return {"user": self.user.to_json(), "near": [r.to_json() for r in self.near],
                "overall": [r.to_json() for r in self.overall],
                "changes": self.changes, "gain": self.gain,
                "recommended": self.best.to_json() if self.best is not None else None}


def _num(v):
    from autopar.search.exhaustive import json_number
    return json_number(v)


def full_execution(execution: Mapping) -> dict:
    """Every field of ``ALL_FIELDS``, extensions at their defaults where unset."""
    return {f: execution.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS}


def compact(execution: Mapping) -> dict:
    """Calculon's fields and the extension fields that differ from their
    defaults (as ``autopar.io.specs.load_execution`` returns a layout)."""
    return {f: v for f, v in execution.items()
            if f in FIELDS or EXT_DEFAULTS.get(f, object()) != v}


def for_inference(model, system, execution: Mapping) -> dict:
    """``execution`` as an inference layout (``training`` false) with the
    fields that only training has (recompute, gradient and optimizer options,
    data-parallel overlap) at the values the search's domain rules force when
    not training (``autopar.search.domains``): the fields the rules complete
    differently for inference than for training take the inference value."""
    e = full_execution(execution)
    space = load_space({"name": "inference", "batch_policy": "fixed",
                        "params": {f: "derived" for f in PARAMS}})
    params = {f: e[f] for f in PARAMS}

    def completed(training: bool) -> dict:
        case = Case(model, system, int(e["num_procs"]), int(e["batch_size"]),
                    str(e["datatype"]), batch_policy="fixed", training=training)
        return full_execution(space.complete(case, params, normalize=True))
    train, infer = completed(True), completed(False)
    e.update({f: infer[f] for f in PARAMS if train[f] != infer[f]})
    e["training"] = False
    return e


def evaluate_rows(model, system, executions) -> list[Row]:
    """The layouts evaluated on ``system`` (its real capacity): statistics,
    P(fits) (the layout's framework family's memory error) and the stage
    needs (``autopar.model.memory.stage_needs``)."""
    from autopar import model as perf
    from autopar.model.memory import MEMORY_PARTS, stage_needs
    from autopar.model.evaluate import reason_text
    if not executions:
        return []
    out = perf.evaluate_columns(model, system, to_columns(executions),
                                stats=perf.STATS + MEMORY_PARTS)
    first, last = stage_needs({p: np.asarray(out[p]) for p in MEMORY_PARTS},
                              system.memory_overhead)
    reasons = reason_text(out, system)
    rows = []
    for i, e in enumerate(executions):
        stats = {s: _num(out[s][i]) for s in perf.STATS}
        peak = stats.get(PEAK)
        err = load_errors(family_of(model, e))
        p = float(p_fits(peak, system.mem1.GiB, err)) if peak else None
        stages = None
        if math.isfinite(first[i]) and math.isfinite(last[i]):
            stages = [float(first[i]) / GIB] if int(e["pipeline_par"]) == 1 else \
                [float(first[i]) / GIB, float(last[i]) / GIB]
        ok = bool(out["feasible"][i])
        rows.append(Row(execution=dict(e), stats=stats, p_fits=p, memory_stages_gib=stages,
                        feasible=ok, reason="" if ok else str(reasons[i])))
    return rows


def ranking(system, risk: Risk, headroom: float, model) -> tuple[float, object]:
    """The headroom a search ranks with under ``risk`` (``safe``: at least the
    one its P(fits) threshold sets) and the memory errors of the model's
    family (``expected`` scores by them)."""
    errors = load_errors(family_of(model))
    if risk.choice == "safe":
        headroom = max(headroom, math.ceil(100 * risk_headroom_gib(
            system, errors, risk.min_p_fits)) / 100)
    return headroom, errors


def changes(user: Mapping, better: Mapping) -> list[dict]:
    """The fields where ``better`` differs from ``user``, in ``ALL_FIELDS`` order."""
    a, b = full_execution(user), full_execution(better)
    return [{"field": f, "from": a[f], "to": b[f]} for f in ALL_FIELDS if a[f] != b[f]]


def near_spaces(user: Mapping, space) -> list[tuple[dict, tuple, dict]]:
    """The near search as partial layouts, each (stated, unknown, options):
    the user's layout with every field ``space`` searches unknown but the
    parallel sizes; then with one or two of the fields it searches unknown,
    a parallel size among them (``data_par`` follows from the others; the
    changes without one are in the first).  Unknown fields range over the
    space's values."""
    sp = load_space(space)
    e = full_execution(user)
    searched = tuple(f for f in PARAMS if f in sp.allowed)
    sets = [tuple(f for f in searched if f not in PARALLEL_FIELDS)]
    for k in (1, 2):
        sets += [c for c in combinations(searched, k) if set(c) & set(PARALLEL_FIELDS)]
    out = []
    for fields in sets:
        if not fields:
            continue
        unknown = fields + (("data_par",) if set(fields) & set(PARALLEL_FIELDS) else ())
        stated = {f: v for f, v in e.items() if f not in unknown}
        out.append((stated, unknown, default_options(fields, sp)))
    return out


def search_near(model, system, user: Mapping, space, headroom: float, risk: Risk, errors,
                top_n: int = DEFAULT_TOP, accept: Callable | None = None) -> list[dict]:
    """The best ``top_n`` layouts near the user's (``near_spaces``), best
    first, ties to the earlier found."""
    from autopar.model import evaluate_columns
    case = Case(model, system, int(user["num_procs"]), int(user["batch_size"]),
                str(user["datatype"]), batch_policy="fixed", training=bool(user["training"]))
    ranked = with_headroom(system, headroom)
    kept: dict = {}                    # layout -> (-score, order, execution)
    order = 0
    for stated, unknown, options in near_spaces(user, space):
        comp = completion_space(stated, unknown, options)
        for cols in comp.enumerate(case, chunk_size=_CHUNK):
            out = evaluate_columns(model, ranked, cols, stats=("sample_rate", PEAK))
            ok = np.asarray(out["feasible"], dtype=bool)
            score = np.asarray(out["sample_rate"], dtype=float)
            if risk.choice == "expected":
                score = score * np.nan_to_num(p_fits(np.asarray(out[PEAK], dtype=float),
                                                     system.mem1.GiB, errors))
            idx = np.flatnonzero(ok)
            idx = idx[np.argsort(-score[idx], kind="stable")]
            taken = 0
            for i in idx:
                if taken >= top_n:
                    break
                e = full_execution(record(cols, int(i)))
                key = tuple(e.values())
                if key in kept or (accept is not None and not accept(e)):
                    continue
                kept[key] = (-float(score[i]), order + int(i), e)
                taken += 1
            order += len(ok)
            kept = dict(sorted(kept.items(), key=lambda kv: kv[1][:2])[:top_n])
    return [e for _, _, e in sorted(kept.values(), key=lambda t: t[:2])]


def overall_space(user: Mapping, space) -> dict:
    """``space`` with the fields it neither searches nor fixes held at the
    user's values (where they differ from the defaults)."""
    sp = load_space(space)
    d = sp.to_dict()
    held = {f: v for f, v in full_execution(user).items()
            if f in PARAMS and f not in DERIVED and f not in sp.allowed
            and f not in sp.fixed and v != EXT_DEFAULTS.get(f)}
    d["fixed"] = {**(d.get("fixed") or {}), **held}
    return d


def search_overall(model, system, user: Mapping, space, headroom: float, risk: Risk,
                   errors, top_n: int = DEFAULT_TOP, accept: Callable | None = None,
                   **kw) -> list[dict]:
    """The best layouts of the whole space for the user's case, best first
    (``exhaustive``; ``expected``: ``risk.expected_search``); with ``accept``,
    only those it accepts (the search keeps more until ``top_n`` are or the
    space has no more)."""
    from autopar.search.exhaustive import execution_of, exhaustive
    from autopar.search.risk import expected_search
    sp = load_space(overall_space(user, space), source=getattr(load_space(space), "source",
                                                               "space"))
    args = (int(user["num_procs"]), int(user["batch_size"]), str(user["datatype"]))
    k = top_n
    while True:
        common = dict(space=sp, batch_policy="fixed", top_n=k, training=bool(user["training"]),
                      progress=kw.get("progress", False))
        if risk.choice == "expected":
            table, _ = expected_search(model, with_headroom(system, headroom), *args,
                                       err=errors, capacity_gib=system.mem1.GiB, **common)
        else:
            table, _ = exhaustive(model, with_headroom(system, headroom), *args, **common)
        rows = [full_execution(execution_of(r)) for _, r in table.iterrows()]
        good = [e for e in rows if accept is None or accept(e)]
        if len(good) >= top_n or len(rows) < k or k >= 1 << 12:
            return good[:top_n]
        k *= 8


def _score(row: Row, risk: Risk, system, errors) -> float:
    """What the search ranks ``row`` by: its rate, x P(fits) for ``expected``."""
    if risk.choice != "expected":
        return row.rate
    peak = row.stats.get(PEAK)
    return row.rate * (float(p_fits(peak, system.mem1.GiB, errors)) if peak else 0.0)


def advise(model, system, user: Mapping, space, risk: Risk, headroom: float = 0.0,
           top_n: int = DEFAULT_TOP, accept: Callable | None = None) -> Advice:
    """The advice on ``user`` (a whole execution): see the module docstring.
    ``accept(execution) -> bool``: whether a found layout can be written in
    the user's format (default: any)."""
    user = full_execution(user)
    headroom, errors = ranking(system, risk, headroom, model)
    k = max(top_n, POOL)
    near = search_near(model, system, user, space, headroom, risk, errors, k, accept)
    overall = search_overall(model, system, user, space, headroom, risk, errors, k, accept)
    rows = evaluate_rows(model, system, [user] + near + overall)
    me, near_rows, overall_rows = rows[0], rows[1:1 + len(near)], rows[1 + len(near):]
    # The candidates: the best found near and overall (near keeps the fields
    # the space fixes at the user's values, so it may beat the space's best)
    # and the user's own layout where it qualifies under the same ranking.
    pool = [r for r in overall_rows + near_rows if r.feasible]
    if me.feasible and fits(me.stats[PEAK], system, headroom) \
            and (accept is None or accept(user)):
        pool.append(me)
    best = recommend(pool, user, lambda r: _score(r, risk, system, errors))
    diff = changes(user, best.execution) if best is not None else []
    gain = None
    if best is not None and me.feasible and me.rate > 0:
        gain = best.rate / me.rate - 1.0
    return Advice(user=me, near=near_rows[:top_n], overall=overall_rows[:top_n], best=best,
                  changes=diff, gain=gain, headroom_gib=headroom)


def recommend(pool: list, user: Mapping, score: Callable) -> Row | None:
    """The recommendation among ``pool``: of the layouts within ``TIE``
    (relative) of the best score, the one that changes the fewest fields of
    the user's layout (then the higher score): a change that gains nothing
    the model can tell apart is not advice."""
    if not pool:
        return None
    top = max(score(r) for r in pool)
    close = [r for r in pool if score(r) >= top * (1 - TIE)]
    return min(close, key=lambda r: (len(changes(user, r.execution)), -score(r)))
