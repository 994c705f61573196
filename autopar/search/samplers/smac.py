"""smac: SMAC3's random forest and expected improvement (needs
``autopar[smac]``), by ask/tell over a ConfigSpace of valid combinations only
(``autopar.search.smac_search``), so it searches the parameter values: the
``flat`` encoding only, layouts and skeletons alike.  In process
``tell_ask.SmacSampler``, on Ray ``ray_searchers.SmacSearch``."""
from __future__ import annotations

from autopar.search.samplers.base import METRIC, RayPieces, Sampler


class Smac(Sampler):
    name = "smac"
    encoding = skeleton_encoding = only_encoding = "flat"
    static_only = True
    package, install = "smac", "autopar[smac]"

    def refuses(self, encoding):
        if encoding != "flat":
            return ("smac searches the parameter values (its ConfigSpace has the space's "
                    "conditions and forbidden combinations): use encoding flat")
        return None

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        from autopar.search.samplers.tell_ask import SmacSampler
        return SmacSampler(encoder, seed)

    def ray(self, encoder, seed, trials, concurrency, grid=None, skeleton=False):
        from autopar.search.samplers.ray_searchers import SmacSearch
        return RayPieces(SmacSearch(encoder, seed, METRIC), trials)


SAMPLER = Smac()
