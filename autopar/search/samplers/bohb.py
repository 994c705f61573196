"""bohb: hpbandster's BOHB model (needs ``autopar[bohb]``), index encoding,
static spaces only.  Random proposals until the first feasible layout
(``feasible_first.UntilFeasible``); in process ``tell_ask.BohbSampler``, on Ray
``ray_searchers.TuneBOHBAll``.

BOHB's budget.  BOHB (Falkner et al., 2018) is Hyperband's successive halving
over a budget plus a kernel-density model per budget.  A Calculon-style model
has no training budget: a layout's evaluation is exact, costs about the same
whatever is asked of it, and no cheaper proxy (e.g. fewer blocks, memory only)
ranks layouts reliably -- a layout's sample rate is decided by the very terms a
proxy would drop (pipeline bubble, exposed communication, memory fit).  So
the budget here is **one level**: every trial is a full evaluation, Hyperband
degenerates to brackets of one trial at ``max_t=1`` (nothing is paused or
stopped early), and what BOHB contributes is its model-based proposal: a
kernel density estimate of good versus bad layouts, a third of proposals
random.  Infeasible layouts are fed to it with loss +inf, which is BOHB's own
convention for failed runs.

On Ray, TuneBOHB (Ray 2.60) learns only from results the scheduler lets
through, and a trial that reports ``done`` (ours: one result per trial) never
reaches the scheduler, so ``autopar.search.samplers.ray_searchers.TuneBOHBAll`` feeds each finished
trial to the model in ``on_trial_complete``.  In process, ``BohbSampler``
drives the same hpbandster model as an Optuna sampler, so storage, resume and
the dashboard work as for the other samplers.
"""
from __future__ import annotations

from autopar.search.samplers.base import METRIC, RayPieces, Sampler


class Bohb(Sampler):
    name = "bohb"
    skeleton_encoding = None
    static_only = True
    package, install = "hpbandster", "autopar[bohb]"

    def optuna(self, encoder, seed, concurrency=1, grid_points=0):
        from autopar.search.samplers.feasible_first import UntilFeasible
        from autopar.search.samplers.tell_ask import BohbSampler
        return UntilFeasible(BohbSampler(encoder, seed=seed), seed=seed)

    def ray(self, encoder, seed, trials, concurrency, grid=None, skeleton=False):
        from ray.tune.schedulers import HyperBandForBOHB

        from autopar.search.samplers.ray_searchers import TuneBOHBAll
        alg = TuneBOHBAll(encoder.configspace(seed), metric=METRIC, mode="max",
                          seed=seed, max_concurrent=concurrency or 0)
        return RayPieces(alg, trials,
                         scheduler=HyperBandForBOHB(time_attr="training_iteration", max_t=1))


SAMPLER = Bohb()
