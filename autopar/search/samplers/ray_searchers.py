"""The Ray Tune searchers of the sampler families that are not Tune's own:
``DefineByRun`` (an Optuna sampler's define-by-run space in Ray's
OptunaSearch), ``TuneBOHBAll`` (bohb) and ``SmacSearch`` (smac)."""
from __future__ import annotations

import math
import warnings

from ray.tune.search import Searcher
from ray.tune.search.bohb import TuneBOHB

from autopar.search.samplers.tell_ask import BohbJob


class DefineByRun:
    """Ray OptunaSearch's define-by-run space: suggest, decode, pass the params on."""

    def __init__(self, encoder):
        self.encoder = encoder

    def __call__(self, trial) -> dict:
        # Suggest on the Optuna trial itself, not on Ray's capturing wrapper:
        # the config is then only the decoded layout ({"params": {...}}), not
        # also the encoding's internal names (``microbatch_size|1,2,4,8``).
        return {"params": self.encoder.suggest(getattr(trial, "ot_trial", trial))}


class TuneBOHBAll(TuneBOHB):
    """TuneBOHB that learns from every finished trial (see autopar.search.samplers.bohb).

    hpbandster's deprecation warnings about ConfigSpace are kept quiet.
    """

    def _setup_bohb(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            super()._setup_bohb()

    def suggest(self, trial_id):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return super().suggest(trial_id)

    def on_trial_complete(self, trial_id, result=None, error=False):
        config = self.trial_to_params.get(trial_id)
        if config is not None and not error and result is not None:
            value = result.get(self.metric)
            ok = isinstance(value, (int, float)) and math.isfinite(value)
            loss = self._metric_op * value if ok else math.inf
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.bohber.new_result(BohbJob(loss, dict(config)))
        super().on_trial_complete(trial_id, result=result, error=error)


class SmacSearch(Searcher):
    """SMAC3 as a Ray Tune searcher: ask on suggest, tell on completion
    (an infeasible layout, reported with the metric None, is CRASHED)."""

    def __init__(self, encoder, seed: int | None, metric: str):
        super().__init__(metric=metric, mode="max")
        self._encoder, self._seed = encoder, seed
        self._smac = None            # built on first use: Tune pickles its searcher
        self._live: dict = {}

    def __getstate__(self):
        return {**self.__dict__, "_smac": None, "_live": {}}

    def suggest(self, trial_id):
        if self._smac is None:
            from autopar.search.smac_search import Smac
            self._smac = Smac(self._encoder, self._seed)
        info, raw = self._smac.ask()
        self._live[trial_id] = info
        return dict(raw)

    def on_trial_complete(self, trial_id, result=None, error=False):
        info = self._live.pop(trial_id, None)
        if info is not None:
            value = None if error or not result else result.get(self.metric)
            self._smac.tell(info, value)

    def get_state(self) -> dict:
        return {}

    def set_state(self, state) -> None:
        pass

    def save(self, checkpoint_path: str):
        import pickle
        with open(checkpoint_path, "wb") as f:
            pickle.dump({"live": list(self._live)}, f)

    def restore(self, checkpoint_path: str):
        pass
