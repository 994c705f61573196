"""Optuna's GridSampler over grid points (the ``grid`` sampler's Optuna side)."""
from __future__ import annotations

import optuna


class GridPoints(optuna.samplers.GridSampler):
    """Optuna's GridSampler over ``grid_point`` in range(n), in a seeded order.

    The caller maps a grid point to a layout and asks exactly n trials, so the
    sampler's own stop (``Study.stop``, only legal inside ``optimize``) is off.
    """

    def __init__(self, n: int, seed: int | None = None):
        super().__init__({"grid_point": list(range(n))}, seed=seed)

    def after_trial(self, study, trial, state, values) -> None:
        pass
