"""How a sampler sees a search space: the encodings.

A space (``autopar.search.space``) is a define-by-run tree: the valid values of a
parameter depend on the values chosen before it (``space.choices``).  Samplers
want a fixed set of named dimensions.  Three encodings bridge the two:

``index``
    Every searched parameter is one float ``u`` in [0, 1); its value is
    ``choices[floor(u * len(choices))]`` where ``choices`` are the values that
    are valid given the parameters already decoded (define-by-run order).  The
    dimensions never change, so every sampler (TPE, CMA-ES, random, BOHB) and
    every backend sees one static space, and *every* sample is a valid layout:
    only infeasible layouts (memory, network) are pruned.  Values are kept in
    their natural order, so nearby ``u`` are nearby sizes.

``named``
    Optuna's define-by-run with categorical choices: a parameter whose valid
    choices are narrower than its flat domain is suggested under a name that
    carries the choice set (``microbatch_size|1,2,4,8``), because Optuna does
    not allow one parameter name to change its categorical choices between
    trials.  Also always valid, but what is learnt about one name does not
    carry to another.  Optuna samplers only (the space is not static).

``flat``
    Every searched parameter is a categorical over its flat domain (the union
    of its values over the whole space, ``space.flat_domains``).  Static and
    simple, but combinations that break the space's rules are sampled too; they
    end as pruned trials with an ``invalid: ...`` reason.

Which is better (``benchmarks/tune_encodings.py``: GPT-3 175B on 1024 A100,
Calculon's space, 200 trials, median of 5 seeds; pruned fraction, then the
best sample rate after 50 / 200 trials as a fraction of the exhaustive
optimum)::

              index               named               flat
    tpe       0.20  0.58 / 0.73   0.49  0.66 / 0.88   0.71  0.00 / 0.87
    cmaes     0.67  0.53 / 0.87   0.86  0.48 / 0.62   0.98  0.00 / 0.22
    random    0.88  0.53 / 0.60   0.86  0.48 / 0.62   0.98  0.00 / 0.22
    bohb      0.72  0.53 / 0.74   (static space only)  0.98  0.00 / 0.40

The define-by-run encodings prune far less than ``flat`` (most flat samples
are not layouts at all) and find better layouts sooner with every sampler,
so ``flat`` is never the default.  Between the two, ``index`` prunes least
under TPE and is the only one CMA-ES and BOHB can model (with ``named``, CMA-ES falls
back to independent random sampling), but TPE stalls on it: many ``u`` decode
to the same layout, so TPE keeps re-proposing a few layouts it already knows
(22 distinct layouts in trials 100-200 of one run).  TPE's categorical
kernels on ``named`` keep exploring and end higher.  Hence the default is per
sampler (each sampler's ``encoding``, ``autopar.search.samplers``): ``named`` for TPE, ``index`` for the others;
every encoding stays selectable.
"""
from __future__ import annotations

import math
from typing import Any, Mapping
from autopar.io.experiment import ENCODINGS  # noqa: F401  (the names files may use)

DEFAULT_ENCODING = "index"


class Invalid(Exception):
    """Raised by ``Encoder.decode`` for a sample that is not a layout of the space."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def plain(v):
    """numpy scalars (as ConfigSpace hands them out) -> Python values."""
    return v.item() if hasattr(v, "item") else v


def choice_set_name(param: str, choices: list) -> str:
    return param + "|" + ",".join(str(c) for c in choices)


class Encoder:
    """One space, one case, one encoding: suggests, decodes and converts.

    ``decode(raw)`` turns what a sampler produced (floats for ``index``, values
    for ``flat``, values under choice-set names for ``named``) into the
    searched parameters; ``suggest(trial)`` does both on an Optuna trial
    (define-by-run).  ``distributions()``, ``ray_space()`` and
    ``configspace()`` give the static space for Optuna, Ray Tune and
    ConfigSpace (BOHB).  ``skeleton``: whether it encodes skeletons
    (``autopar.search.skeleton.SkeletonEncoder``) rather than layouts.
    """
    skeleton = False

    def __init__(self, space, case, encoding: str = DEFAULT_ENCODING):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}; expected one of {', '.join(ENCODINGS)}")
        self.space, self.case, self.encoding = space, case, encoding
        # how the searched parameters are encoded (``encoding`` names the
        # encoder; a subclass may search other parameters the same way)
        self.kind = encoding
        self.searched: tuple[str, ...] = tuple(space.searched)
        self.flat: dict[str, list] = {p: list(v) for p, v in space.flat_domains(case).items()}
        for p in self.searched:
            if not self.flat.get(p):
                raise ValueError(f"the space has no layout for this case ({p} has no value)")

    # -- decoding ------------------------------------------------------------

    def choices(self, param: str, partial: Mapping) -> list:
        return self.space.choices(self.case, param, partial)

    def decode(self, raw: Mapping[str, Any]) -> dict:
        """Sampler output -> searched parameters.

        ``index`` and ``named`` give valid layouts only; ``flat`` passes the
        values through (``space.check`` says later whether they are valid).
        """
        if self.kind == "flat":    # checked against the space when evaluated
            return {p: plain(raw[p]) for p in self.searched}
        params: dict = {}
        for p in self.searched:
            ch = self.choices(p, params)
            if not ch:     # cannot happen for a consistent space; kept as a guard
                raise Invalid(f"invalid: no valid value of {p} after {params}")
            if self.kind == "index":
                params[p] = ch[_pick(float(raw[p]), len(ch))]
            else:
                name = p if ch == self.flat[p] else choice_set_name(p, ch)
                params[p] = plain(raw[name]) if len(ch) > 1 else ch[0]
                if params[p] not in ch:
                    raise Invalid(f"invalid: {p} {params[p]!r} is not one of {ch}")
        return params

    # -- Optuna (define-by-run) ---------------------------------------------

    def suggest(self, trial) -> dict:
        """Suggest on an Optuna trial; returns the searched parameters."""
        if self.kind == "index":
            raw = {p: trial.suggest_float(p, 0.0, 1.0) for p in self.searched}
            return self.decode(raw)
        if self.kind == "flat":
            raw = {p: trial.suggest_categorical(p, self.flat[p]) for p in self.searched}
            return self.decode(raw)
        params: dict = {}
        for p in self.searched:
            ch = self.choices(p, params)
            if len(ch) == 1:
                params[p] = ch[0]
                continue
            name = p if ch == self.flat[p] else choice_set_name(p, ch)
            params[p] = trial.suggest_categorical(name, ch)
        return params

    def distributions(self) -> dict:
        """The static Optuna space (index and flat encodings)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution
        if self.kind == "index":
            return {p: FloatDistribution(0.0, 1.0) for p in self.searched}
        if self.kind == "flat":
            return {p: CategoricalDistribution(self.flat[p]) for p in self.searched}
        raise ValueError("the named encoding has no static space")

    # -- Ray Tune and ConfigSpace ------------------------------------------------

    def ray_space(self) -> dict:
        """Ray Tune's param_space entries for the searched parameters."""
        from ray import tune
        if self.kind == "index":
            return {p: tune.uniform(0.0, 1.0) for p in self.searched}
        if self.kind == "flat":
            return {p: tune.choice(self.flat[p]) for p in self.searched}
        raise ValueError("the named encoding has no static space; use an Optuna sampler")

    def configspace(self, seed: int | None = None):
        """A ConfigSpace for BOHB (index: floats; flat: categoricals).

        Parameters with a single value are left out (BOHB's kernel density
        estimate divides by the number of levels minus one); ``decode`` sees
        them through ``raw_defaults``.
        """
        import ConfigSpace as CS
        cs = CS.ConfigurationSpace(seed=seed)
        for p in self.searched:
            if self.kind == "index":
                cs.add(CS.UniformFloatHyperparameter(p, lower=0.0, upper=1.0))
            elif self.kind == "flat":
                if len(self.flat[p]) > 1:
                    cs.add(CS.CategoricalHyperparameter(p, choices=list(self.flat[p])))
            else:
                raise ValueError("the named encoding has no static space; BOHB needs index or flat")
        return cs

    def raw_defaults(self) -> dict:
        """Values of dimensions a ConfigSpace leaves out (single-valued ones)."""
        if self.kind == "flat":
            return {p: v[0] for p, v in self.flat.items() if len(v) == 1}
        return {}


def _pick(u: float, n: int) -> int:
    if not math.isfinite(u):
        return 0
    return min(max(int(u * n), 0), n - 1)
