"""Skeleton search: a trial proposes a skeleton, the array model completes it.

A layout's *skeleton* is a few parameters that shape everything else -- by
default ``tensor_par``, ``pipeline_par`` and ``microbatch_size``; a space file
may name others under ``skeleton:`` (``autopar.search.space``).  A skeleton
trial fixes those and evaluates *every* completion of the skeleton (all
values of the remaining searched parameters the space allows) at once through
the array model (``autopar.model.evaluate_columns``); its result is the best
completion, reported with its full execution and breakdown (the figures are
those ``autopar estimate`` gives for that execution alone: ``autopar
compare`` evaluates every run's best again and stops on a difference).  A skeleton none of whose
completions runs is a pruned trial; its reason is the commonest one among its
completions.

Skeleton search wraps a sampler (``autopar.search.samplers.Choice``); users
name it ``skeleton-<sampler>`` (``skeleton-tpe``,
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

The completions of a space of up to ``WHOLE_SPACE_MAX`` layouts are
enumerated once per run and split by skeleton (``Completions``: GPT-3 13B on
64 A100, the small space's 48 skeletons, 6 ms against 150 ms skeleton by
skeleton); larger spaces enumerate each skeleton when it is asked.

A budget that covers every skeleton not yet evaluated leaves the sampler
nothing to choose: the optuna backend then evaluates them all at once (a
model call per ``WHOLE_SPACE_MAX`` layouts, in the space's enumeration order,
each recorded as a trial with the user attribute ``whole_space``), which
gives the exact optimum of the space for about the exhaustive search's cost
(compare-quick: 48 skeletons, 0.07 s against the exhaustive search's
0.08-0.1 s; proposing them eight at a time with TPE took 0.31 s).  No new
trial is possible after that (``tune``'s table says so in
``attrs["skeleton_space_covered"]``, ``autopar tune`` in a line).  The Ray
backend proposes skeletons one trial at a time whatever the budget.

Several skeletons proposed together (``concurrency``) share one model call:
the model's fixed cost per call (the distinct transformer blocks of the
batch) is paid once, which more than doubles throughput at 8 per call
(``benchmarks/skeleton_search.py``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from autopar.search.samplers import SKELETON_PREFIX
from autopar.search.encodings import ENCODINGS, Encoder, Invalid, choice_set_name, plain

# Skeletons proposed together by default (one model call): see the module docstring.
DEFAULT_BATCH = 8


class SkeletonEncoder(Encoder):
    """The skeleton parameters of one space and case, as samplers see them.

    An ``autopar.search.encodings.Encoder`` (its ``decode``, ``suggest``,
    ``distributions``, ``ray_space``, ``configspace`` and ``raw_defaults``)
    over the skeleton parameters instead of every searched one: the valid
    values (``choices``, ``flat``) come from the space's skeletons, and a flat
    proposal that is no skeleton of the space is ``Invalid``.  ``encoding`` is
    ``skeleton-index`` etc. (the problem's encoding); ``kind`` the encoding proper.
    """

    skeleton = True

    def __init__(self, space, case, encoding: str = "index"):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        self.space, self.case = space, case
        self.kind = encoding
        self.encoding = SKELETON_PREFIX + encoding
        self.searched: tuple[str, ...] = tuple(space.skeleton)
        if not self.searched:
            raise ValueError(f"space {space.name!r} has no skeleton (no searched parameter of it)")
        self.all: list[tuple] = [tuple(plain(v) for v in t) for t in space.skeletons(case)]
        self.known = set(self.all)
        self.flat: dict[str, list] = {}
        for k, p in enumerate(self.searched):
            vals = {t[k] for t in self.all}
            self.flat[p] = sorted(vals, key=_order_key)
        self._choices: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forget the enumerated completions (a new run pays for them again)."""
        self.completions = Completions(self.space, self.case, self.searched)

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
        return tuple(plain(params[p]) for p in self.searched)

    def decode(self, raw: Mapping[str, Any]) -> dict:
        params = super().decode(raw)
        if self.kind == "flat" and self.key(params) not in self.known:
            raise Invalid("invalid: no layout of the space has skeleton "
                          + ", ".join(f"{p} {v}" for p, v in params.items()))
        return params

    def raw_for(self, skeleton: tuple) -> dict:
        """What a sampler would propose for ``skeleton`` (to enqueue it)."""
        params = dict(zip(self.searched, skeleton))
        if self.kind == "flat":
            return params
        raw, partial = {}, {}
        for p in self.searched:
            ch = self.choices(p, partial)
            if self.kind == "index":
                raw[p] = (ch.index(params[p]) + 0.5) / len(ch)
            elif len(ch) > 1:
                raw[p if ch == self.flat[p] else choice_set_name(p, ch)] = params[p]
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
        from optuna.distributions import CategoricalDistribution
        raw = self.raw_for(skeleton)
        if self.kind != "named":
            dists = self.distributions()
            return {k: raw[k] for k in dists if k in raw}, {k: dists[k] for k in dists if k in raw}
        dists, partial = {}, {}
        for p, v in zip(self.searched, skeleton):
            ch = self.choices(p, partial)
            if len(ch) > 1:
                dists[p if ch == self.flat[p] else choice_set_name(p, ch)] = CategoricalDistribution(ch)
            partial[p] = v
        return raw, dists


def _order_key(v):
    return (str(type(v)), v)


# --------------------------------------------------------------------------
# Evaluating skeletons

# Spaces up to this many layouts are enumerated once and split by skeleton
# (``Completions``); larger ones enumerate each skeleton's completions when
# it is asked (a restricted space's enumeration costs a few milliseconds, an
# enumeration of the whole space of this size about as much as five of them).
WHOLE_SPACE_MAX = 1 << 18


def completions(space, case, skeleton: Mapping) -> dict:
    """Every layout of ``space`` with the skeleton's values, as a layout table."""
    sub = space.restrict(skeleton)
    return sub.layouts(case, 0, sub.size(case))


class Completions:
    """The completions of every skeleton of one space and case, enumerated once.

    A small space (``WHOLE_SPACE_MAX`` layouts or fewer) is enumerated whole
    on the first request and each skeleton's rows are picked from it (in
    enumeration order, so they are the rows ``completions`` gives, in the same
    order); a larger one is enumerated skeleton by skeleton, each once.
    """

    def __init__(self, space, case, names: tuple[str, ...]):
        self.space, self.case, self.names = space, case, tuple(names)
        self._whole = None            # (table, {skeleton: row indices})
        self._each: dict = {}
        self.small = space.size(case) <= WHOLE_SPACE_MAX

    def _split(self):
        from autopar.io.layouts import ALL_FIELDS
        from autopar.model.lookup import distinct, pack
        table = self.space.layouts(self.case, 0, self.space.size(self.case))
        if any(p not in table for p in self.names):
            self.small = False        # a skeleton parameter that is no column
            return None
        # rows grouped by skeleton (one integer key per row), each group in
        # enumeration order
        cols = [np.asarray(table[p]) for p in self.names]
        first, inv = distinct(*pack(cols))
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(len(first) + 1))
        names = zip(*(c[first].tolist() for c in cols))
        rows = {k: order[a:b] for k, a, b in zip(names, bounds[:-1], bounds[1:])}
        self._whole = ({f: table[f] for f in ALL_FIELDS}, rows)
        return self._whole

    def grouped(self, skeletons: list):
        """A small space's layouts of ``skeletons`` (value tuples), grouped
        by skeleton in that order, each group in enumeration order, and the
        groups' sizes; None for a large space."""
        whole = (self._whole or self._split()) if self.small else None
        if whole is None:
            return None
        table, rows = whole
        empty = np.zeros(0, dtype=np.int64)
        parts = [rows.get(tuple(plain(v) for v in sk), empty) for sk in skeletons]
        at = np.concatenate(parts) if parts else empty
        return {f: v[at] for f, v in table.items()}, [len(p) for p in parts]

    def __call__(self, skeleton: Mapping) -> dict:
        key = tuple(plain(skeleton[p]) for p in self.names)
        if self.small:
            whole = self._whole or self._split()
            if whole is not None:
                table, rows = whole
                at = rows.get(key, np.zeros(0, dtype=np.int64))
                return {f: v[at] for f, v in table.items()}
        got = self._each.get(key)
        if got is None:
            got = self._each[key] = completions(self.space, self.case, skeleton)
        return got


def evaluate_skeletons(prob, params_list: list) -> list[dict]:
    """Skeletons (searched skeleton parameters, or ``encodings.Invalid``) ->
    one result row each: the best completion, or PRUNED.

    All completions of all skeletons go through the model in one call (the
    model's fixed cost per call is paid once), asked for the sample rate and
    the reported breakdown only.  Each row also says how many completions
    were evaluated (``layouts``).
    """
    from autopar.io.layouts import ALL_FIELDS
    from autopar.search.trial_rows import pruned_row

    rows: list = [None] * len(params_list)
    tables, where = [], []
    for i, params in enumerate(params_list):
        if isinstance(params, Invalid):
            rows[i] = {**pruned_row(params.reason), "layouts": 0}
            continue
        tables.append(prob.encoder.completions(params))
        where.append(i)
    if tables:
        cols = {f: np.concatenate([t[f] for t in tables]) for f in ALL_FIELDS}
        got = _best_completions(prob, cols, [len(t["tensor_par"]) for t in tables],
                                [params_list[i] for i in where])
        for i, row in zip(where, got):
            rows[i] = row
    return rows


def evaluate_all_skeletons(prob, skeletons: list) -> list[dict] | None:
    """``evaluate_skeletons`` for ``skeletons`` (tuples of the skeleton
    parameters' values) of a small space, taken from its whole enumeration
    in one gather; None for a space too large to enumerate whole."""
    got = prob.encoder.completions.grouped(skeletons)
    if got is None:
        return None
    cols, sizes = got
    return _best_completions(prob, cols, sizes,
                             [dict(zip(prob.encoder.searched, sk)) for sk in skeletons])


def _best_completions(prob, cols: dict, sizes: list, params_list: list) -> list[dict]:
    """One model call over ``cols`` (consecutive groups of ``sizes`` rows,
    one group per skeleton of ``params_list``) -> a row per skeleton."""
    from autopar import model as perf
    from autopar.io.layouts import EXT_DEFAULTS, record
    from autopar.search.trial_rows import BREAKDOWN, pruned_row

    case = prob.case
    res = perf.evaluate_columns(case.model, case.system, cols, stats=(METRIC, *BREAKDOWN))
    ok = np.asarray(res["feasible"], dtype=bool)
    rate = np.where(ok, np.asarray(res[METRIC], dtype=np.float64), -np.inf)
    code = np.asarray(res["reason_code"])
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = []
    for k, params in enumerate(params_list):
        a, b = int(starts[k]), int(starts[k + 1])
        if a == b:
            rows.append({**pruned_row("invalid: no layout of the space has this skeleton",
                                      params), "layouts": 0})
            continue
        seg = rate[a:b]
        j = int(np.argmax(seg))               # the first of equals: enumeration order
        if not np.isfinite(seg[j]):
            counts = np.bincount(code[a:b], minlength=len(perf.REASONS))
            counts[0] = 0
            r = int(np.argmax(counts))
            reason = f"{perf.REASONS[r]} (all {b - a} completions; this one: {int(counts[r])})"
            rows.append({**pruned_row(reason, dict(params)), "layouts": b - a})
            continue
        ties = a + np.flatnonzero(seg == seg[j])
        if ties.size > 1:         # equally fast completions: the simplest (search.ranking)
            from autopar.search import ranking
            sub = {f: np.asarray(cols[f])[ties] for f in (*ranking.OFFLOADS, "pipeline_par",
                                                          "pipeline_interleaving",
                                                          "activation_recompute")}
            sub.update({METRIC: rate[ties], ranking.MEMORY: np.asarray(res[ranking.MEMORY])[ties],
                        "index": ties})
            j = int(ties[ranking.simplest_fastest(sub)]) - a
        at = a + j
        row = {"state": "COMPLETE", "feasible": True, "reason": "", METRIC: float(rate[at])}
        row.update({s: float(res[s][at]) for s in BREAKDOWN})
        row.update({**EXT_DEFAULTS, **record(cols, at)})
        row["layouts"] = b - a
        rows.append(row)
    return rows


METRIC = "sample_rate"
