"""SMAC3 (``smac`` 2.x) as a sampler: ``smac`` and ``skeleton-smac``.

SMAC models the objective with a random forest over a ConfigSpace and picks
the next configuration by expected improvement.  Here the ConfigSpace is
derived from the layout space so that it holds valid combinations only
(``configspace``):

* every searched parameter with more than one value is a hyperparameter
  (integers ordinal, in their natural order; options categorical);
* a parameter that only applies for some values of the one searched
  parameter it depends on (``tensor_par_net`` when ``tensor_par`` > 1,
  ``pipeline_interleaving`` when ``pipeline_par`` > 1, ...) is a *condition*:
  inactive otherwise, and its forced value is filled in;
* every other rule between a parameter and the searched parameters it
  depends on (directly or through ``data_par``/``batch_size``) becomes
  *forbidden clauses*: for each combination of those parameters, the values
  of the parameter that no layout has (``tensor_par``, ``pipeline_par`` ->
  ``microbatch_size`` that does not divide the local batch;
  ``tensor_par_comm_type``, ``activation_recompute`` -> ``seq_par_ag_redo``).

So SMAC never proposes an invalid layout; a layout that cannot run is told
to SMAC as a CRASHED trial (cost ``CRASH_COST``, SMAC's own convention for
failed runs) and is a pruned trial in the study.  The cost is 1 / sample
rate (positive, as SMAC's log-scaled random forest wants).

In process, ``samplers.tell_ask.SmacSampler`` drives SMAC by ask/tell as an Optuna sampler (so
storage, resume and the dashboard work as for the other samplers); on Ray,
``samplers.ray_searchers.SmacSearch`` is the same as a Ray Tune searcher.  The random forest runs
on one thread (``n_jobs=1`` and numpy's thread pools limited to 1 while SMAC
works): Optuna's trials and Ray's workers already use the cores.
"""
from __future__ import annotations

import atexit
import math
import shutil
import tempfile
from typing import Mapping

import numpy as np

from autopar.search.encodings import plain

CRASH_COST = 1e4        # cost of an infeasible layout (a rate of 1e-4 samples/s)
CHALLENGERS = 1000      # random configurations scored per proposal (SMAC's default: 10,000)
_DIRS: list[str] = []


def _cleanup() -> None:
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def _searched_deps(name: str) -> set[str]:
    """The searched parameters a rule depends on, through derived nodes."""
    from autopar.io.spaces import DERIVED
    from autopar.search.domains import RULES
    rules = {r.name: r for r in RULES}
    out: set[str] = set()
    todo = list(rules[name].deps)
    while todo:
        d = todo.pop()
        if d in DERIVED:
            todo.extend(rules[d].deps)
        else:
            out.add(d)
    return out


def configspace(encoder, seed: int | None = None):
    """The ConfigSpace of an encoder's parameters: valid combinations only.

    Returns ``(cs, forced)``: ``forced[p]`` maps a parent value to the value
    ``p`` takes where its condition makes it inactive.
    """
    import ConfigSpace as CS
    from autopar.io.layouts import CHOICES
    from autopar.search.space import PARAMS
    space, case = encoder.space, encoder.case
    names = tuple(encoder.searched)
    flat = encoder.flat
    cs = CS.ConfigurationSpace(seed=seed)
    hps: dict = {}
    default = _a_valid_point(encoder)      # ConfigSpace's default must be allowed
    for p in names:
        vals = list(flat[p])
        if len(vals) < 2:
            continue
        if p in CHOICES or isinstance(vals[0], bool):
            hps[p] = CS.CategoricalHyperparameter(p, choices=vals, default_value=default[p])
        else:
            hps[p] = CS.OrdinalHyperparameter(p, sequence=sorted(vals), default_value=default[p])
    cs.add(list(hps.values()))
    forced: dict[str, dict] = {}
    clauses: dict = {}
    order = [p for p in PARAMS if p in hps]
    for p in order:
        anc = [a for a in PARAMS if a in _searched_deps(p) and a in names]
        if not anc:
            continue
        group = tuple(anc) + (p,)
        valid = space.skeletons(case, names=group)
        by_parent: dict[tuple, set] = {}
        for t in valid:
            by_parent.setdefault(tuple(plain(x) for x in t[:-1]), set()).add(plain(t[-1]))
        live_anc = [a for a in anc if a in hps]
        if len(anc) == 1 and live_anc:
            a = anc[0]
            free = [pv[0] for pv, vs in by_parent.items() if len(vs) > 1]
            fixed = {pv[0]: next(iter(vs)) for pv, vs in by_parent.items() if len(vs) == 1}
            if free and fixed and len(set(fixed.values())) == 1:
                cs.add(CS.InCondition(hps[p], hps[a], sorted(free, key=_key)))
                forced[p] = fixed
                by_parent = {pv: vs for pv, vs in by_parent.items() if len(vs) > 1}
        for parent in _product(anc, flat):
            vs = by_parent.get(parent)
            if forced.get(p) is not None and len(anc) == 1 and parent[0] in forced[p]:
                continue
            bad = [v for v in flat[p] if not vs or v not in vs]
            if not bad:
                continue
            terms = [(a, v) for a, v in zip(anc, parent) if a in hps]
            if not vs:          # no value of p: the parents themselves are invalid
                _forbid(cs, hps, clauses, terms, None)
            else:
                _forbid(cs, hps, clauses, terms, (p, bad))
    cs.add(list(clauses.values()))      # at once: ConfigSpace checks the default per add
    return cs, forced


def _key(v):
    return (str(type(v)), v)


def _a_valid_point(encoder) -> dict:
    """The searched values of the space's first layout (or skeleton)."""
    if hasattr(encoder, "all"):
        return dict(zip(encoder.searched, encoder.all[0]))
    from autopar.io.layouts import EXT_DEFAULTS, record
    ex = {**EXT_DEFAULTS, **record(encoder.space.layouts(encoder.case, 0, 1), 0)}
    return {p: ex[p] for p in encoder.searched}


def _product(names, flat):
    import itertools
    return itertools.product(*(flat[a] for a in names))


def _forbid(cs, hps, clauses, terms, last) -> None:
    import ConfigSpace as CS
    key = (tuple(terms), None if last is None else (last[0], tuple(last[1])))
    if key in clauses or (not terms and last is None):
        return
    parts = [CS.ForbiddenEqualsClause(hps[a], v) for a, v in terms]
    if last is not None:
        p, bad = last
        if p not in hps:
            return
        parts.append(CS.ForbiddenInClause(hps[p], bad) if len(bad) > 1
                     else CS.ForbiddenEqualsClause(hps[p], bad[0]))
    if not parts:
        return
    clauses[key] = parts[0] if len(parts) == 1 else CS.ForbiddenAndConjunction(*parts)


def complete_config(encoder, forced: Mapping, config: Mapping) -> dict:
    """A SMAC configuration -> the encoder's raw values (every parameter):
    inactive parameters take their forced value, single-valued ones theirs."""
    raw = {k: plain(v) for k, v in dict(config).items()}
    for p in encoder.searched:
        if p in raw:
            continue
        if len(encoder.flat[p]) == 1:
            raw[p] = encoder.flat[p][0]
            continue
        f = forced.get(p, {})
        parent = next(iter(_parents(p, encoder)), None)
        raw[p] = f.get(raw.get(parent)) if parent in raw and raw.get(parent) in f else \
            encoder.flat[p][0]
    return raw


def _parents(p, encoder):
    from autopar.search.space import PARAMS
    return [a for a in PARAMS if a in _searched_deps(p) and a in encoder.searched]


class Smac:
    """One SMAC optimiser driven by ask/tell (HPO facade, one-thread forest)."""

    def __init__(self, encoder, seed: int | None, n_trials: int = 100_000):
        from smac import HyperparameterOptimizationFacade as HPO
        from smac import Scenario
        from smac.model.random_forest import RandomForest

        import logging
        logging.getLogger("smac").setLevel(logging.ERROR)   # no per-proposal notes
        self.encoder = encoder
        self.cs, self.forced = configspace(encoder, seed)
        out = tempfile.mkdtemp(prefix="autopar-smac-")
        _DIRS.append(out)
        scenario = Scenario(self.cs, deterministic=True, n_trials=n_trials,
                            seed=0 if seed is None else int(seed) % (2 ** 31),
                            output_directory=out, crash_cost=CRASH_COST)
        model = RandomForest(self.cs, log_y=True, n_trees=10, ratio_features=1.0,
                             min_samples_split=2, min_samples_leaf=1, max_depth=20,
                             bootstrapping=True, seed=scenario.seed, n_jobs=1)
        # SMAC's defaults score 10,000 random challengers per proposal, which
        # with forbidden clauses costs about a second; 1,000 and a shorter
        # local search keep a proposal near 0.1 s.
        maximizer = HPO.get_acquisition_maximizer(scenario, challengers=CHALLENGERS,
                                                  local_search_iterations=5)
        with self._threads():
            self.smac = HPO(scenario, _never_called, model=model, overwrite=True,
                            logging_level=False, acquisition_maximizer=maximizer,
                            initial_design=HPO.get_initial_design(scenario, n_configs=10))

    @staticmethod
    def _threads():
        from threadpoolctl import threadpool_limits
        return threadpool_limits(limits=1)

    def ask(self):
        """-> (TrialInfo, the encoder's raw values)."""
        import warnings
        # SMAC's local search averages an empty neighbourhood where every
        # neighbour is forbidden (numpy's "Mean of empty slice"); harmless, and
        # not the user's to see.
        with self._threads(), warnings.catch_warnings(), np.errstate(invalid="ignore"):
            warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
            info = self.smac.ask()
        return info, complete_config(self.encoder, self.forced, info.config)

    def tell(self, info, rate) -> None:
        from smac.runhistory.dataclasses import TrialValue
        from smac.runhistory.enumerations import StatusType
        ok = rate is not None and isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0
        value = (TrialValue(cost=1.0 / rate, status=StatusType.SUCCESS) if ok else
                 TrialValue(cost=CRASH_COST, status=StatusType.CRASHED))
        with self._threads():
            self.smac.tell(info, value, save=False)

    def info_for(self, raw: Mapping):
        """A TrialInfo for values SMAC did not propose (a resumed study)."""
        from ConfigSpace import Configuration
        from smac.runhistory.dataclasses import TrialInfo
        values = {k: raw[k] for k in self.cs.keys() if k in raw}
        try:
            config = Configuration(self.cs, values=values)
            config.check_valid_configuration()
        except Exception:       # inactive values given: keep only the active ones
            config = Configuration(self.cs, values={k: v for k, v in values.items()
                                                    if self._active(k, values)})
        return TrialInfo(config=config, seed=self.smac.scenario.seed)

    def _active(self, name, values) -> bool:
        for cond in self.cs.conditions:
            if cond.child.name == name:
                return values.get(cond.parent.name) in cond.values
        return True


def _never_called(config, seed: int = 0) -> float:     # ask/tell only
    raise RuntimeError("SMAC's target function is not used (ask/tell)")
