"""The analytical model as a trial: a layout in, its sample rate out.

A *problem* is what every trial of one search shares: the case (model, system,
num_procs, batch, datatype), the space and the encoding.  It travels inside
each Ray trial's config as plain JSON (``problem_payload``) so that workers on
other nodes need no local files; a worker builds it once and keeps it by its
key.  ``layout_trainable`` is the Ray Tune function trainable (a top-level
importable function, so a restored or remote experiment can find it);
``evaluate_params`` is the same evaluation for many layouts at once, used by
the in-process Optuna backend.

A trial ends one of two ways:

* ``COMPLETE``: the layout runs; ``sample_rate`` and the breakdown are set.
* ``PRUNED``: the layout is invalid (flat encoding only) or infeasible;
  ``feasible`` is False, ``reason`` says why and ``sample_rate`` is None.
  Reporting the metric *as None* keeps Ray Tune's strict metric check
  satisfied (the key is present) while Ray's OptunaSearch, which reads a
  missing value as "pruned", tells the study ``TrialState.PRUNED``; no
  process-wide switch (TUNE_DISABLE_STRICT_METRIC_CHECKING) is needed.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from autopar.io.layouts import EXT_DEFAULTS
from autopar.search.trial_rows import BREAKDOWN, METRIC, pruned_row

PAYLOAD_KEY = "autopar"      # the config entry that carries the problem


# --------------------------------------------------------------------------
# The problem: case + space + encoding, as JSON and back

def case_to_json(case) -> dict:
    from autopar.io.specs import model_to_json, system_to_json
    return {"model": model_to_json(case.model), "system": system_to_json(case.system),
            "num_procs": int(case.num_procs), "max_batch_size": int(case.max_batch_size),
            "datatype": case.datatype, "batch_policy": case.batch_policy,
            "training": bool(case.training)}


def case_from_json(d: Mapping):
    from autopar.search.space import Case
    from autopar.io.specs import load_model, load_system
    return Case(model=load_model(dict(d["model"]), source="case.model"),
                system=load_system(dict(d["system"]), source="case.system"),
                num_procs=int(d["num_procs"]), max_batch_size=int(d["max_batch_size"]),
                datatype=d["datatype"], batch_policy=d.get("batch_policy"),
                training=bool(d.get("training", True)))


@dataclass
class Problem:
    key: str
    case: Any
    space: Any
    encoder: Any

    def payload(self) -> dict:
        return problem_payload(self.case, self.space, self.encoder.encoding)


def problem_payload(case, space, encoding: str) -> dict:
    """The JSON form of a problem (what a Ray trial's config carries)."""
    body = {"case": case_to_json(case), "space": space.to_dict(), "encoding": encoding}
    key = hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {"key": key, **body}


_PROBLEMS: dict[str, Problem] = {}


def make_encoder(space, case, encoding: str):
    """The encoder of a problem: per layout, or of skeletons (a problem's
    encoding ``skeleton-KIND``, ``samplers.Choice.problem_encoding``)."""
    from autopar.search.samplers import SKELETON_PREFIX
    if encoding.startswith(SKELETON_PREFIX):
        from autopar.search.skeleton import SkeletonEncoder
        return SkeletonEncoder(space, case, encoding[len(SKELETON_PREFIX):])
    from autopar.search.encodings import Encoder
    return Encoder(space, case, encoding)


def make_problem(case, space, encoding: str) -> Problem:
    payload = problem_payload(case, space, encoding)
    prob = _PROBLEMS.get(payload["key"])
    if prob is None:
        prob = Problem(payload["key"], case, space, make_encoder(space, case, encoding))
        _PROBLEMS[payload["key"]] = prob
    return prob


def problem_from_payload(payload: Mapping) -> Problem:
    """Rebuild (once per process) the problem a trial's config carries."""
    prob = _PROBLEMS.get(payload["key"])
    if prob is None:
        from autopar.search.space import load_space
        case = case_from_json(payload["case"])
        space = load_space(dict(payload["space"]), source="space")
        prob = Problem(payload["key"], case, space, make_encoder(space, case, payload["encoding"]))
        _PROBLEMS[payload["key"]] = prob
    return prob


# --------------------------------------------------------------------------
# Evaluation

def is_skeleton_problem(prob: Problem) -> bool:
    return prob.encoder.skeleton


def evaluate_params(prob: Problem, params_list: list) -> list[dict]:
    """What a sampler proposed (searched parameters, or ``encodings.Invalid``)
    -> one result row each, with ``layouts``: how many layouts the model ran.

    A layout problem evaluates each layout (``evaluate_layouts``); a skeleton
    problem each skeleton's best completion
    (``autopar.search.skeleton.evaluate_skeletons``).
    """
    if is_skeleton_problem(prob):
        from autopar.search.skeleton import evaluate_skeletons
        return evaluate_skeletons(prob, params_list)
    rows = evaluate_layouts(prob, params_list)
    for r in rows:
        r["layouts"] = 0 if r["reason"].startswith("invalid") else 1
    return rows


def evaluate_layouts(prob: Problem, params_list: list) -> list[dict]:
    """Searched parameters (or ``encodings.Invalid``) -> one result row each.

    All valid layouts go through the model in one call.
    """
    from autopar import model as perf
    from autopar.search.encodings import Invalid
    from autopar.io.layouts import to_columns

    rows: list = [None] * len(params_list)
    execs, where = [], []
    for i, params in enumerate(params_list):
        if isinstance(params, Invalid):
            rows[i] = pruned_row(params.reason)
            continue
        ex = prob.space.complete(prob.case, params)
        reason = prob.space.check(prob.case, ex)
        if reason:
            rows[i] = pruned_row(reason, ex)
            continue
        execs.append(ex)
        where.append(i)
    if execs:
        res = perf.evaluate_columns(prob.case.model, prob.case.system, to_columns(execs))
        for j, (i, ex) in enumerate(zip(where, execs)):
            if not bool(res["feasible"][j]):
                rows[i] = pruned_row(perf.REASONS[int(res["reason_code"][j])], ex)
                continue
            row = {"state": "COMPLETE", "feasible": True, "reason": "",
                   METRIC: float(res[METRIC][j])}
            row.update({k: float(res[k][j]) for k in BREAKDOWN})
            row.update({**EXT_DEFAULTS, **ex})
            rows[i] = row
    return rows


def evaluate_config(config: Mapping, payload: Mapping | None = None) -> dict:
    """One Ray trial's config (the searched parameters) and the problem's
    payload -> its result row (no Ray needed).  Experiments made before the
    payload left the config carry it under ``PAYLOAD_KEY``."""
    from autopar.search.encodings import Invalid
    prob = problem_from_payload(payload if payload is not None else config[PAYLOAD_KEY])
    if "params" in config:            # grid and define-by-run: already decoded
        params = dict(config["params"])
    else:
        raw = {**prob.encoder.raw_defaults(), **{k: v for k, v in config.items() if k != PAYLOAD_KEY}}
        try:
            params = prob.encoder.decode(raw)
        except Invalid as e:
            params = e
    return evaluate_params(prob, [params])[0]


def layout_trainable(config: dict, problem: Mapping | None = None) -> None:
    """Ray Tune function trainable: evaluate one layout and report once.

    ``problem``: the payload (``tune.with_parameters``: it travels once in
    Ray's object store, not in every trial's config, so configs hold only the
    searched parameters).

    The report carries ``done=True`` so Tune stops the trial after this one
    result (one round trip per trial).  Pruned trials report the metric as
    None; see the module docstring.
    """
    import os
    import time

    import ray
    from ray import tune

    delay = os.environ.get("AUTOPAR_TRIAL_DELAY")   # seconds; for fault-tolerance tests
    if delay:
        time.sleep(float(delay))
    row = evaluate_config(config, problem)
    payload = problem if problem is not None else config.get(PAYLOAD_KEY, {})
    row["started_at"] = payload.get("started_at")
    if row["state"] == "PRUNED":
        row[METRIC] = None
        for k in BREAKDOWN:
            row[k] = None
    row["node_id"] = ray.get_runtime_context().get_node_id()
    row["finished_at"] = time.time()
    row["done"] = True
    tune.report(row)
