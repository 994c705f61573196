"""The skeleton repeat cache, one for both backends.

In a skeleton search (``autopar.search.skeleton``) a skeleton proposed again
is not a new trial: the sampler is told the known result, and in its place
the unseen skeleton nearest to the proposal is evaluated
(``SkeletonEncoder.nearest_unseen``).  ``SkeletonRepeats`` holds what that
needs: every skeleton evaluated or placed so far with who evaluates it (an
Optuna trial number, a Ray Tune trial id; None while placed and not yet a
trial) and the generator that breaks ties among the nearest.  The optuna
backend (``backends.optuna_loop``) and the Ray searcher wrapper
(``backends.ray_tune.SkeletonCache``) both use it.
"""
from __future__ import annotations

import random

from autopar.search.encodings import Invalid


class SkeletonRepeats:
    def __init__(self, encoder, seed: int | None = None, owner: dict | None = None,
                 rng: random.Random | None = None):
        self.encoder = encoder
        self.owner: dict = {} if owner is None else owner
        self.rng = random.Random(seed) if rng is None else rng

    def key(self, params):
        """The skeleton of searched parameters (None: not a skeleton search,
        or an invalid proposal)."""
        if not self.encoder.skeleton or isinstance(params, Invalid):
            return None
        return self.encoder.key(params)

    def __contains__(self, key) -> bool:
        return key in self.owner

    def claim(self, key, owner) -> None:
        """``owner`` evaluates the skeleton ``key``."""
        self.owner[key] = owner

    def instead(self, key, owner=None):
        """The unseen skeleton nearest to ``key`` (a repeat), claimed for
        ``owner``; None when every skeleton has been seen."""
        sk = self.encoder.nearest_unseen(key, self.owner, self.rng)
        if sk is not None:
            self.owner[sk] = owner
        return sk

    def unseen(self) -> list:
        """The space's skeletons not yet evaluated or placed, in enumeration order."""
        return [sk for sk in self.encoder.all if sk not in self.owner]
