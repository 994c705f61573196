"""What a sampler family states about itself, and how it is built.

``Sampler`` is the interface every module of ``autopar.search.samplers``
implements (one instance, ``SAMPLER``, per module):

* ``name``: the family's name in files and on the command line;
* ``encoding``: the encoding it searches layouts in by default
  (``autopar.search.encodings``), ``skeleton_encoding`` the one it searches
  skeletons in (None: no skeleton form);
* ``grid``: its trials are ``trials`` points spread evenly over the space
  (``autopar.search.tune.grid_params``), not proposals;
* ``static_only``: it needs a static space (not the ``named`` encoding);
  ``only_encoding``: the one encoding it can search at all (SMAC: ``flat``);
* ``package``/``install``: the optional module it imports and the pip
  requirement that brings it;
* ``optuna(...)``: its Optuna sampler; ``ray(...)``: its Ray Tune pieces
  (``RayPieces``).  The default ``ray`` runs the Optuna sampler through Ray's
  ``OptunaSearch``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from autopar.search.trial_rows import METRIC


@dataclass
class RayPieces:
    """What a Ray Tune run takes from its sampler."""
    search_alg: object
    num_samples: int
    scheduler: object = None          # None: the backend's own
    param_space: dict = field(default_factory=dict)


class Sampler:
    name: str = ""
    encoding: str = "index"
    skeleton_encoding: str | None = "index"
    static_only: bool = False
    only_encoding: str | None = None
    grid = False              # its trials are the space's grid points (``tune.grid_params``)
    package: str | None = None
    install: str | None = None

    def missing(self) -> str | None:
        """Why this sampler cannot run here (its package is not installed), or None."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return (f"{self.name} needs the package {self.package} "
                    f"(pip install '{self.install or self.package}')")
        return None

    def refuses(self, encoding: str) -> str | None:
        """Why this sampler cannot search ``encoding``, or None."""
        if self.only_encoding and encoding != self.only_encoding:
            return f"{self.name} needs encoding {self.only_encoding}"
        if self.static_only and encoding == "named":
            return f"{self.name} needs a static space: use encoding index or flat"
        return None

    def optuna(self, encoder, seed: int | None, concurrency: int = 1, grid_points: int = 0):
        """The Optuna sampler (``encoder``: how it sees the space)."""
        raise NotImplementedError

    def ray(self, encoder, seed: int | None, trials: int, concurrency: int | None,
            grid: list | None = None, skeleton: bool = False) -> RayPieces:
        """The Ray Tune pieces (default: this Optuna sampler in Ray's OptunaSearch;
        ``skeleton``: the searcher is wrapped by the skeleton repeat cache,
        which needs a searcher that takes results, not a variant generator)."""
        from ray.tune.search.optuna import OptunaSearch

        from autopar.search.samplers.ray_searchers import DefineByRun
        sampler = self.optuna(encoder, seed, concurrency=concurrency or 2)
        # A static space lets the workers decode; only "named" must run on the driver.
        space = DefineByRun(encoder) if encoder.kind == "named" else encoder.distributions()
        alg = OptunaSearch(space=space, metric=METRIC, mode="max", sampler=sampler)
        return RayPieces(alg, trials)
