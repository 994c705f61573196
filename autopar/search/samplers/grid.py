"""grid: ``trials`` layouts spread evenly over the space's enumeration (the
centres of ``trials`` equal strata; all of them when the space is smaller),
visited in a seeded order (Optuna's GridSampler over their index,
``grid_points.GridPoints``; on Ray, Tune's grid search over the layouts)."""
from __future__ import annotations

from autopar.search.samplers.base import RayPieces, Sampler


class Grid(Sampler):
    name = "grid"
    skeleton_encoding = None
    grid = True

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        from autopar.search.samplers.grid_points import GridPoints
        return GridPoints(grid_points, seed=seed)

    def ray(self, encoder, seed, trials, concurrency, grid=None, skeleton=False):
        from ray import tune
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return RayPieces(BasicVariantGenerator(max_concurrent=concurrency or 0), 1,
                         param_space={"params": tune.grid_search(grid or [])})


SAMPLER = Grid()
