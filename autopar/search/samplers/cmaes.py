"""cmaes: Optuna's CMA-ES (needs the ``cmaes`` package), started at the best
feasible layout random proposals found (``feasible_first.CmaFromFeasible``);
index encoding."""
from __future__ import annotations

from autopar.search.samplers.base import Sampler


class CmaEs(Sampler):
    name = "cmaes"
    package, install = "cmaes", "cmaes"

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        from autopar.search.samplers.feasible_first import CmaFromFeasible
        return CmaFromFeasible(encoder, seed=seed)


SAMPLER = CmaEs()
