"""TPE: Optuna's multivariate tree-structured Parzen estimator (the default
sampler, as ``skeleton-tpe``; docs/compare.md).  Random proposals until the
first feasible layout (``feasible_first.UntilFeasible``); with several trials
asked at once, Optuna's constant liar.  Searches layouts in the ``named``
encoding by default (``autopar.search.encodings``: TPE stalls on ``index``)."""
from __future__ import annotations

from autopar.search.samplers.base import Sampler


class Tpe(Sampler):
    name = "tpe"
    encoding = "named"

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        import warnings

        import optuna
        from optuna.exceptions import ExperimentalWarning

        from autopar.search.samplers.feasible_first import UntilFeasible
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            return UntilFeasible(optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                                            constant_liar=concurrency > 1),
                                 seed=seed)


SAMPLER = Tpe()
