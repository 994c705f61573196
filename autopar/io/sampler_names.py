"""The sampler names that files and the command line may use: the registry.

Each family's name, the module of ``autopar.search.samplers`` that
implements it (imported by the search layer when the sampler is first
asked for) and whether users may also name its skeleton form
(``skeleton-<name>``; ``autopar.search.skeleton``).  The io layer validates
names against this table without importing the search layer; the module
states the rest (encodings, optional package, how it builds its Optuna
sampler and its Ray searcher).  Adding a sampler is its module plus one line
here (``tests/test_samplers_registry.py`` checks that each line and its
module agree).
"""
from __future__ import annotations

# name -> (module under autopar/search/samplers/, searches skeletons too)
REGISTRY: dict[str, tuple[str, bool]] = {
    "tpe": ("tpe", True),
    "cmaes": ("cmaes", True),
    "random": ("uniform", True),
    "grid": ("grid", False),
    "bohb": ("bohb", False),
    "smac": ("smac", True),
}
SKELETON_PREFIX = "skeleton-"        # the user-facing names of the skeleton wrapper

LAYOUT_SAMPLERS: tuple[str, ...] = tuple(REGISTRY)
SKELETON_SAMPLERS: tuple[str, ...] = tuple(SKELETON_PREFIX + n for n, (_, sk) in REGISTRY.items()
                                           if sk)
SAMPLERS: tuple[str, ...] = LAYOUT_SAMPLERS + SKELETON_SAMPLERS
