"""random: uniform proposals over the encoded space (Optuna's RandomSampler;
on Ray, Tune's own variant generator over the static space)."""
from __future__ import annotations

from autopar.search.samplers.base import RayPieces, Sampler


class Uniform(Sampler):
    name = "random"

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        import optuna
        return optuna.samplers.RandomSampler(seed=seed)

    def ray(self, encoder, seed, trials, concurrency, grid=None, skeleton=False):
        if skeleton or encoder.kind == "named":
            # the repeat cache tells its searcher results: an Optuna random
            # sampler (Tune's generator takes none); named: define-by-run
            return super().ray(encoder, seed, trials, concurrency, grid, skeleton)
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return RayPieces(BasicVariantGenerator(random_state=seed, max_concurrent=concurrency or 0),
                         trials, param_space=encoder.ray_space())


SAMPLER = Uniform()
