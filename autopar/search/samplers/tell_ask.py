"""Optimisers driven by tell and ask (hpbandster's BOHB, SMAC3) as Optuna
samplers: ``TellAskSampler`` and its ``BohbSampler``; ``BohbJob``, what BOHB
reads of a finished run (also fed to it by the Ray searcher,
``ray_searchers.TuneBOHBAll``)."""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import optuna
from optuna.trial import TrialState

from autopar.search.encodings import plain


class BohbJob:
    """What hpbandster's BOHB.new_result reads of a finished run."""

    def __init__(self, loss: float, config: dict):
        self.result = {"loss": loss}
        self.kwargs = {"budget": 1.0, "config": config}
        self.exception = None


@contextlib.contextmanager
def numpy_state(rng):
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
        with numpy_state(self._rng):
            self._bohb = BOHB(self._cs, **(bohb_config or {}))

    def _propose(self, trial) -> dict:
        with numpy_state(self._rng):
            config, _ = self._bohb.get_config(1.0)
        out = {k: plain(v) for k, v in dict(config).items()}
        out.update(self._encoder.raw_defaults())
        return out

    def _learn(self, t) -> None:
        if not all(n in t.params for n in self._names):
            return
        config = {n: t.params[n] for n in self._names}
        ok = t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)
        with numpy_state(self._rng):
            self._bohb.new_result(BohbJob(-t.value if ok else math.inf, config))


class SmacSampler(TellAskSampler):
    """SMAC3 by ask/tell as an Optuna sampler (the encoder's flat space)."""

    def __init__(self, encoder, seed: int | None):
        from autopar.search.smac_search import Smac
        super().__init__(encoder, seed)
        self._smac = Smac(encoder, seed)
        self._asked: dict[int, object] = {}

    def _propose(self, trial) -> dict:
        info, raw = self._smac.ask()
        self._asked[trial.number] = info
        return raw

    def _learn(self, t) -> None:
        info = self._asked.pop(t.number, None)
        if info is None:
            if not all(p in t.params for p in self._dists):
                return
            info = self._smac.info_for(t.params)
        ok = t.state == TrialState.COMPLETE and t.value is not None
        self._smac.tell(info, t.value if ok else None)
