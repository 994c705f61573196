"""The samplers: tpe, cmaes, random, grid and bohb (Optuna samplers).

``optuna_sampler`` builds the Optuna sampler for a name; the in-process
backend uses it directly and the ray backend through Ray's OptunaSearch
(``autopar.search.tune_ray`` has the Ray Tune side: random, grid and TuneBOHB).

* ``tpe``: Optuna's multivariate TPE; ``cmaes``: Optuna's CMA-ES (needs the
  ``cmaes`` package) started at the first feasible layouts (``CmaFromFeasible``);
  ``random``: uniform over the encoded space.
* ``grid``: ``trials`` layouts spread evenly over the space's enumeration
  (the centres of ``trials`` equal strata; all of them when the space is
  smaller), visited in a seeded order (Optuna's GridSampler over their index).
* ``bohb``: hpbandster's BOHB model (below).
* ``smac``: SMAC3's random forest and expected improvement, by ask/tell over
  a ConfigSpace of valid combinations only (``autopar.search.smac_search``).
* TPE and BOHB propose at random until the first feasible layout
  (``UntilFeasible``): with only pruned trials they have nothing to learn
  from and would otherwise keep proposing near infeasible ones.

BOHB's budget.  BOHB (Falkner et al., 2018) is Hyperband's successive halving
over a budget plus a kernel-density model per budget.  A Calculon-style model
has no training budget: a layout's evaluation is exact, costs about the same
whatever is asked of it, and no cheaper proxy (e.g. fewer blocks, memory only)
ranks layouts reliably -- a layout's sample rate is decided by the very terms a
proxy would drop (pipeline bubble, exposed communication, memory fit).  So
the budget here is **one level**: every trial is a full evaluation, Hyperband
degenerates to brackets of one trial at ``max_t=1`` (nothing is paused or
stopped early), and what BOHB contributes is its model-based proposal: a
kernel density estimate of good versus bad layouts, a third of proposals
random.  Infeasible layouts are fed to it with loss +inf, which is BOHB's own
convention for failed runs.

On Ray, TuneBOHB (Ray 2.60) learns only from results the scheduler lets
through, and a trial that reports ``done`` (ours: one result per trial) never
reaches the scheduler, so ``autopar.search.tune_ray.TuneBOHBAll`` feeds each finished
trial to the model in ``on_trial_complete``.  In process, ``BohbSampler``
drives the same hpbandster model as an Optuna sampler, so storage, resume and
the dashboard work as for the other samplers.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.trial import TrialState
from autopar.io.experiment import (LAYOUT_SAMPLERS, SAMPLERS,  # noqa: F401  (file vocabulary)
                                   SKELETON_SAMPLERS)

METRIC = "sample_rate"


def resumed_seed(seed: int | None, done: int) -> int | None:
    """The sampler seed after ``done`` trials (a resumed run draws new numbers)."""
    if seed is None:
        return None
    return seed if done == 0 else (seed * 1_000_003 + done) % (2 ** 32)


# --------------------------------------------------------------------------
# Optuna

def optuna_sampler(name: str, encoder, seed: int | None, concurrency: int = 1,
                   grid_points: int = 0) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        if name == "tpe":
            return UntilFeasible(optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                                            constant_liar=concurrency > 1),
                                 seed=seed)
        if name == "cmaes":
            return CmaFromFeasible(encoder, seed=seed)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "grid":
            return GridPoints(grid_points, seed=seed)
        if name == "bohb":
            return UntilFeasible(BohbSampler(encoder, seed=seed), seed=seed)
        if name == "smac":
            from autopar.search.smac_search import smac_sampler
            return smac_sampler(encoder, seed)
    raise ValueError(f"unknown sampler {name!r}")


class _PerTrial(optuna.samplers.BaseSampler):
    """A sampler that hands each trial to one of its inner samplers
    (``_for(trial)``, chosen in ``before_trial``)."""

    def _for(self, trial) -> optuna.samplers.BaseSampler:
        raise NotImplementedError

    def infer_relative_search_space(self, study, trial):
        return self._for(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._for(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._for(trial).sample_independent(study, trial, param_name, param_distribution)


class UntilFeasible(_PerTrial):
    """Random proposals until the study has a feasible (COMPLETE) trial, then ``sampler``.

    TPE and BOHB learn from the split of trials into good and bad.  While every
    trial is pruned there is no good one: TPE then takes an arbitrary subset of
    infeasible trials as "good" and keeps sampling near them, and a run can end
    with no feasible layout at all.  Until the first feasible layout, random
    proposals are as good as any and do not get stuck.
    """

    def __init__(self, sampler: optuna.samplers.BaseSampler, seed: int | None = None):
        self._sampler = sampler
        self._random = optuna.samplers.RandomSampler(seed=seed)
        self._found = False
        self._use: dict[int, optuna.samplers.BaseSampler] = {}

    def _for(self, trial) -> optuna.samplers.BaseSampler:
        return self._use.get(trial.number, self._sampler)

    def before_trial(self, study, trial) -> None:
        if not self._found:
            self._found = bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        self._use[trial.number] = self._sampler if self._found else self._random
        self._sampler.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._use.pop(trial.number, None)
        self._sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._sampler.reseed_rng()
        self._random.reseed_rng()


class CmaFromFeasible(_PerTrial):
    """CMA-ES started at the best feasible layout found by random proposals.

    Optuna's CMA-ES learns only from COMPLETE trials and starts from the
    centre of the encoded space with a wide step.  On a case where most
    layouts cannot run (Megatron 1T on 3,072 A100: 387 of 400 trials pruned,
    best 43.2 against an optimum of 61.1) few generations ever fill, so it
    keeps sampling its starting distribution.  Here proposals are random
    until the study has a feasible trial; CMA-ES then starts from the best
    one (``x0``) with a step of ``sigma0`` (in the index encoding's [0, 1)
    units), so its proposals stay mostly among layouts that run, and
    restarts from the best trial so far when ``stall`` proposals in a row
    were pruned.  Measured on that case (400 trials, concurrency 8, seeds 0
    and 1): 114 and 190 pruned, best 56.4 and 59.0 samples/s (Optuna's
    CMA-ES as it was: 387 and 388 pruned, 43.2 and 49.5; with a step of 0.15:
    177 and 181 pruned, 55.9 and 61.1).
    """

    def __init__(self, encoder, seed: int | None = None, sigma0: float = 0.1,
                 stall: int = 40):
        self._encoder = encoder
        self._seed = seed
        self._sigma0, self._stall = sigma0, stall
        self._random = optuna.samplers.RandomSampler(seed=seed)
        self._cma: optuna.samplers.BaseSampler | None = None
        self._starts = 0
        self._use: dict[int, optuna.samplers.BaseSampler] = {}

    def _start(self, study) -> None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not done:
            return
        try:
            dists = self._encoder.distributions()
        except ValueError:      # named encoding: no static space, CMA-ES cannot model it
            dists = {}
        best = max(done, key=lambda t: t.value)
        x0 = {k: best.params[k] for k in dists if k in best.params}
        seed = None if self._seed is None else self._seed + 7919 * self._starts
        self._starts += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)    # x0/sigma0: kept until Optuna 6
            self._cma = optuna.samplers.CmaEsSampler(
                x0=x0 or None, sigma0=self._sigma0, seed=seed, warn_independent_sampling=False,
                source_trials=None)
        self._cma_from = len(study.get_trials(deepcopy=False))

    def _stalled(self, study) -> bool:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        tail = trials[-self._stall:]
        return (len(trials) - self._cma_from >= self._stall and len(tail) == self._stall
                and all(t.state == TrialState.PRUNED for t in tail))

    def before_trial(self, study, trial) -> None:
        if self._cma is None or self._stalled(study):
            self._start(study)
        use = self._cma if self._cma is not None else self._random
        self._use[trial.number] = use
        use.before_trial(study, trial)

    def _for(self, trial):
        return self._use.get(trial.number, self._random)

    def after_trial(self, study, trial, state, values) -> None:
        use = self._use.pop(trial.number, self._random)
        use.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._random.reseed_rng()
        if self._cma is not None:
            self._cma.reseed_rng()


class GridPoints(optuna.samplers.GridSampler):
    """Optuna's GridSampler over ``grid_point`` in range(n), in a seeded order.

    The caller maps a grid point to a layout and asks exactly n trials, so the
    sampler's own stop (``Study.stop``, only legal inside ``optimize``) is off.
    """

    def __init__(self, n: int, seed: int | None = None):
        super().__init__({"grid_point": list(range(n))}, seed=seed)

    def after_trial(self, study, trial, state, values) -> None:
        pass


class BohbJob:
    """What hpbandster's BOHB.new_result reads of a finished run."""

    def __init__(self, loss: float, config: dict):
        self.result = {"loss": loss}
        self.kwargs = {"budget": 1.0, "config": config}
        self.exception = None


@contextlib.contextmanager
def _numpy_state(rng):
    """Run hpbandster (which draws from numpy's global generator) on ``rng``."""
    saved = np.random.get_state()
    np.random.set_state(rng.get_state())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        rng.set_state(np.random.get_state())
        np.random.set_state(saved)


def _plain(v):
    return v.item() if hasattr(v, "item") else v


class TellAskSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler around an optimiser driven by tell and ask (BOHB,
    SMAC): before each proposal it tells the optimiser every finished trial
    of the study it has not been told (so a study resumed from storage
    rebuilds its history), then asks it for values of the encoder's static
    space; parameters outside that space are drawn at random.  Subclasses
    give ``_propose(trial) -> dict`` and ``_learn(finished_trial)``."""

    def __init__(self, encoder, seed: int | None):
        self._encoder = encoder
        self._dists = encoder.distributions()
        self._told: set[int] = set()
        self._independent = optuna.samplers.RandomSampler(seed=seed)

    def infer_relative_search_space(self, study, trial):
        return dict(self._dists)

    def sample_relative(self, study, trial, search_space):
        if not search_space:
            return {}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.number not in self._told:
                self._told.add(t.number)
                self._learn(t)
        return {k: v for k, v in self._propose(trial).items() if k in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._independent.sample_independent(study, trial, param_name, param_distribution)

    def reseed_rng(self) -> None:
        self._independent.reseed_rng()

    def _propose(self, trial) -> dict:
        raise NotImplementedError

    def _learn(self, t) -> None:
        raise NotImplementedError


class BohbSampler(TellAskSampler):
    """hpbandster's BOHB model as an Optuna sampler (one budget level)."""

    def __init__(self, encoder, seed: int | None = None, bohb_config: dict | None = None):
        from hpbandster.optimizers.config_generators.bohb import BOHB

        super().__init__(encoder, seed)
        self._cs = encoder.configspace(seed)
        self._names = [hp.name for hp in self._cs.values()]
        self._rng = np.random.RandomState(seed)
        with _numpy_state(self._rng):
            self._bohb = BOHB(self._cs, **(bohb_config or {}))

    def _propose(self, trial) -> dict:
        with _numpy_state(self._rng):
            config, _ = self._bohb.get_config(1.0)
        out = {k: _plain(v) for k, v in dict(config).items()}
        out.update(self._encoder.raw_defaults())
        return out

    def _learn(self, t) -> None:
        if not all(n in t.params for n in self._names):
            return
        config = {n: t.params[n] for n in self._names}
        ok = t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)
        with _numpy_state(self._rng):
            self._bohb.new_result(BohbJob(-t.value if ok else math.inf, config))
