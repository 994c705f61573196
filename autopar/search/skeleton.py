"""Skeleton search: a trial proposes a skeleton, the array model completes it.

A layout's *skeleton* is a few parameters that shape everything else -- by
default ``tensor_par``, ``pipeline_par`` and ``microbatch_size``; a space file
may name others under ``skeleton:`` (``autopar.search.space``).  A skeleton
trial fixes those and evaluates *every* completion of the skeleton (all
values of the remaining searched parameters the space allows) at once through
the array model (``autopar.model.evaluate_columns``); its result is the best
completion, reported with its full execution and breakdown (the winner is
evaluated again on its own, so the reported figures are exactly what
``autopar estimate`` says of that execution).  A skeleton none of whose
completions runs is a pruned trial; its reason is the commonest one among its
completions.

Samplers are named ``skeleton-<sampler>`` (``skeleton-tpe``,
``skeleton-random``, ``skeleton-cmaes``, ``skeleton-smac``); they see only the
skeleton parameters, encoded as the per-layout samplers see a space
(``index``: one float per parameter over the valid values given the earlier
ones, the default; ``named``: define-by-run categoricals; ``flat``: the flat
domains, invalid combinations pruned).

A skeleton proposed again is answered from the run's cache: the sampler is
told the known result, and the proposal is not a new trial (the trials table
has one row per distinct skeleton; ``trials`` counts distinct skeletons, at
most as many as the space has).  In its place the unseen skeleton nearest to
the proposal (each parameter by its rank among its values) is evaluated and
added to the study as a trial of its own: the sampler asked for that region,
and asking it again would mostly return known skeletons (TPE on 100
skeletons of GPT-3 175B on 1,024 A100 proposed 517 times for 100 distinct).

Several skeletons proposed together (``concurrency``) share one model call:
the model's fixed cost per call (the distinct transformer blocks of the
batch) is paid once, which more than doubles throughput at 8 per call
(``benchmarks/skeleton_search.py``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

PREFIX = "skeleton-"
# Skeletons proposed together by default (one model call): see the module docstring.
DEFAULT_BATCH = 8


def is_skeleton(sampler: str) -> bool:
    return isinstance(sampler, str) and sampler.startswith(PREFIX)


def base_sampler(sampler: str) -> str:
    """``skeleton-tpe`` -> ``tpe`` (a per-layout name is returned as it is)."""
    return sampler[len(PREFIX):] if is_skeleton(sampler) else sampler


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _pick(u: float, n: int) -> int:
    if not math.isfinite(u):
        return 0
    return min(max(int(u * n), 0), n - 1)


class SkeletonEncoder:
    """The skeleton parameters of one space and case, as samplers see them.

    The same interface as ``autopar.search.encodings.Encoder`` (``searched``,
    ``encoding``, ``suggest``, ``decode``, ``distributions``, ``ray_space``,
    ``configspace``, ``raw_defaults``), so every sampler and backend drives
    it unchanged; ``encoding`` is ``skeleton-index`` etc.
    """

    def __init__(self, space, case, encoding: str = "index"):
        from autopar.search.encodings import ENCODINGS
        enc = encoding[len(PREFIX):] if encoding.startswith(PREFIX) else encoding
        if enc not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        self.space, self.case = space, case
        self.base_encoding = enc
        self.encoding = PREFIX + enc
        self.searched: tuple[str, ...] = tuple(space.skeleton)
        if not self.searched:
            raise ValueError(f"space {space.name!r} has no skeleton (no searched parameter of it)")
        self.all: list[tuple] = [tuple(_plain(v) for v in t) for t in space.skeletons(case)]
        self.known = set(self.all)
        self.flat: dict[str, list] = {}
        for k, p in enumerate(self.searched):
            vals = {t[k] for t in self.all}
            self.flat[p] = sorted(vals, key=_order_key)
        self._choices: dict = {}

    # -- the valid values ---------------------------------------------------

    def choices(self, param: str, partial: Mapping) -> list:
        """Values of ``param`` some skeleton has, given the earlier skeleton parameters."""
        k = self.searched.index(param)
        key = (k,) + tuple(partial[p] for p in self.searched[:k])
        got = self._choices.get(key)
        if got is None:
            seen = {}
            for t in self.all:
                if t[:k] == key[1:]:
                    seen[t[k]] = None
            got = self._choices[key] = sorted(seen, key=_order_key)
        return got

    def key(self, params: Mapping) -> tuple:
        return tuple(_plain(params[p]) for p in self.searched)

    def decode(self, raw: Mapping[str, Any]) -> dict:
        from autopar.search.encodings import Invalid, _name_of
        if self.base_encoding == "flat":
            params = {p: _plain(raw[p]) for p in self.searched}
            if self.key(params) not in self.known:
                raise Invalid("invalid: no layout of the space has skeleton "
                              + ", ".join(f"{p} {v}" for p, v in params.items()))
            return params
        params: dict = {}
        for p in self.searched:
            ch = self.choices(p, params)
            if self.base_encoding == "index":
                params[p] = ch[_pick(float(raw[p]), len(ch))]
            else:
                name = p if ch == self.flat[p] else _name_of(p, ch)
                params[p] = _plain(raw[name]) if len(ch) > 1 else ch[0]
                if params[p] not in ch:
                    raise Invalid(f"invalid: {p} {params[p]!r} is not one of {ch}")
        return params

    def raw_for(self, skeleton: tuple) -> dict:
        """What a sampler would propose for ``skeleton`` (to enqueue it)."""
        from autopar.search.encodings import _name_of
        params = dict(zip(self.searched, skeleton))
        if self.base_encoding == "flat":
            return params
        raw, partial = {}, {}
        for p in self.searched:
            ch = self.choices(p, partial)
            if self.base_encoding == "index":
                raw[p] = (ch.index(params[p]) + 0.5) / len(ch)
            elif len(ch) > 1:
                raw[p if ch == self.flat[p] else _name_of(p, ch)] = params[p]
            partial[p] = params[p]
        return raw

    def nearest_unseen(self, skeleton: tuple, seen, rng) -> tuple | None:
        """The unseen skeleton nearest to ``skeleton`` (by each parameter's
        rank among its values; ties broken by ``rng``), None when all are seen."""
        best, dist = [], math.inf
        rank = {p: {v: k / max(1, len(self.flat[p]) - 1) for k, v in enumerate(self.flat[p])}
                for p in self.searched}
        here = [rank[p][v] for p, v in zip(self.searched, skeleton)]
        for t in self.all:
            if t in seen:
                continue
            d = sum(abs(rank[p][v] - h) for p, v, h in zip(self.searched, t, here))
            if d < dist - 1e-12:
                best, dist = [t], d
            elif abs(d - dist) <= 1e-12:
                best.append(t)
        return rng.choice(best) if best else None

    def trial_params(self, skeleton: tuple) -> tuple[dict, dict]:
        """(params, distributions) of an Optuna trial that proposes ``skeleton``
        (``optuna.trial.create_trial``)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution
        from autopar.search.encodings import _name_of
        raw = self.raw_for(skeleton)
        if self.base_encoding != "named":
            dists = self.distributions()
            return {k: raw[k] for k in dists if k in raw}, {k: dists[k] for k in dists if k in raw}
        dists, partial = {}, {}
        for p, v in zip(self.searched, skeleton):
            ch = self.choices(p, partial)
            if len(ch) > 1:
                dists[p if ch == self.flat[p] else _name_of(p, ch)] = CategoricalDistribution(ch)
            partial[p] = v
        return raw, dists

    # -- what samplers see ------------------------------------------------

    def suggest(self, trial) -> dict:
        from autopar.search.encodings import _name_of
        if self.base_encoding == "index":
            return self.decode({p: trial.suggest_float(p, 0.0, 1.0) for p in self.searched})
        if self.base_encoding == "flat":
            return self.decode({p: trial.suggest_categorical(p, self.flat[p]) for p in self.searched})
        params: dict = {}
        for p in self.searched:
            ch = self.choices(p, params)
            if len(ch) == 1:
                params[p] = ch[0]
                continue
            params[p] = trial.suggest_categorical(p if ch == self.flat[p] else _name_of(p, ch), ch)
        return params

    def distributions(self) -> dict:
        from optuna.distributions import CategoricalDistribution, FloatDistribution
        if self.base_encoding == "index":
            return {p: FloatDistribution(0.0, 1.0) for p in self.searched}
        if self.base_encoding == "flat":
            return {p: CategoricalDistribution(self.flat[p]) for p in self.searched}
        raise ValueError("the named encoding has no static space")

    def ray_space(self) -> dict:
        from ray import tune
        if self.base_encoding == "index":
            return {p: tune.uniform(0.0, 1.0) for p in self.searched}
        if self.base_encoding == "flat":
            return {p: tune.choice(self.flat[p]) for p in self.searched}
        raise ValueError("the named encoding has no static space; use an Optuna sampler")

    def configspace(self, seed: int | None = None):
        import ConfigSpace as CS
        cs = CS.ConfigurationSpace(seed=seed)
        for p in self.searched:
            if self.base_encoding == "index":
                cs.add(CS.UniformFloatHyperparameter(p, lower=0.0, upper=1.0))
            elif self.base_encoding == "flat":
                if len(self.flat[p]) > 1:
                    cs.add(CS.CategoricalHyperparameter(p, choices=list(self.flat[p])))
            else:
                raise ValueError("the named encoding has no static space")
        return cs

    def raw_defaults(self) -> dict:
        if self.base_encoding == "flat":
            return {p: v[0] for p, v in self.flat.items() if len(v) == 1}
        return {}


def _order_key(v):
    return (str(type(v)), v)


# --------------------------------------------------------------------------
# Evaluating skeletons

def completions(space, case, skeleton: Mapping) -> dict:
    """Every layout of ``space`` with the skeleton's values, as a layout table."""
    sub = space.restrict(skeleton)
    return sub.layouts(case, 0, sub.size(case))


def evaluate_skeletons(prob, params_list: list) -> list[dict]:
    """Skeletons (searched skeleton parameters, or ``encodings.Invalid``) ->
    one result row each: the best completion, or PRUNED.

    All completions of all skeletons go through the model in one call (the
    model's fixed cost per call is paid once), asked for the sample rate and
    the reported breakdown only.  Each row also says how many completions
    were evaluated (``layouts``).
    """
    from autopar import model as perf
    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS, record
    from autopar.search.encodings import Invalid
    from autopar.search.trainable import BREAKDOWN, pruned_row

    space, case = prob.space, prob.case
    rows: list = [None] * len(params_list)
    tables, where, sizes = [], [], []
    for i, params in enumerate(params_list):
        if isinstance(params, Invalid):
            rows[i] = {**pruned_row(params.reason), "layouts": 0}
            continue
        cols = completions(space, case, params)
        n = len(cols["tensor_par"])
        if n == 0:
            rows[i] = {**pruned_row("invalid: no layout of the space has this skeleton", params),
                       "layouts": 0}
            continue
        tables.append(cols)
        where.append(i)
        sizes.append(n)
    if not tables:
        return rows
    cols = {f: np.concatenate([t[f] for t in tables]) for f in ALL_FIELDS}
    res = perf.evaluate_columns(case.model, case.system, cols, stats=(METRIC, *BREAKDOWN))
    ok = np.asarray(res["feasible"], dtype=bool)
    rate = np.where(ok, np.asarray(res[METRIC], dtype=np.float64), -np.inf)
    code = np.asarray(res["reason_code"])
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for k, i in enumerate(where):
        a, b = int(starts[k]), int(starts[k + 1])
        seg = rate[a:b]
        j = int(np.argmax(seg))               # the first of equals: enumeration order
        if not np.isfinite(seg[j]):
            counts = np.bincount(code[a:b], minlength=len(perf.REASONS))
            counts[0] = 0
            r = int(np.argmax(counts))
            reason = f"{perf.REASONS[r]} (all {b - a} completions; this one: {int(counts[r])})"
            rows[i] = {**pruned_row(reason, dict(params_list[i])), "layouts": b - a}
            continue
        at = a + j
        row = {"state": "COMPLETE", "feasible": True, "reason": "", METRIC: float(rate[at])}
        row.update({s: float(res[s][at]) for s in BREAKDOWN})
        row.update({**EXT_DEFAULTS, **record(cols, at)})
        row["layouts"] = b - a
        rows[i] = row
    return rows


METRIC = "sample_rate"
