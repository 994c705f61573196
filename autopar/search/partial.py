"""Partial layouts: a layout that states some execution fields and leaves
others unknown, predicted over every completion of its unknown fields.

A published row or a user's file often names only part of a layout (the
parallelism sizes, the batch) and leaves the rest (recompute, overlaps, the
micro-batch) to whatever the framework does.  Instead of reading the unknown
fields as autopar's own defaults, ``complete`` searches them: the stated
fields are taken as given, each unknown field ranges over its *options* (the
values the framework can express), and fields whose values depend on others
(interleaving on the pipeline, network tiers on their parallelism, options
that need another) follow the search's domain rules
(``autopar.search.domains``).  The completions are enumerated by the space
machinery (``autopar.search.space``, vectorised) and evaluated by the model
in columns; a completion the model calls invalid is not counted.  The best
completion is the fastest predicted, the memory-lowest the one with the
least tier-1 need; ties go to the values listed first in the options (a
framework's default, listed first, wins a tie).

The options come from ONE argument, ``options: {field: values}``, where
``values`` is a tuple of values, ``None`` (every value the rules allow for
the case: ``autopar.io.layouts.CHOICES`` for strings, both for flags,
divisors and tiers for counts) or ``{"min": .., "max": ..}`` for a count.
``default_options`` builds it from autopar's own choices, narrowed by a
space file; a framework spec's per-field options plug in the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from autopar.io.errors import SpecError
from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS, record
from autopar.io.spaces import DERIVED, PARAMS
from autopar.io.specs import CASE_FIELDS
from autopar.search.enumeration import encode
from autopar.search.space import Case, Space, layout_context, load_space

GIB = 1024 ** 3
# The most completions one partial layout is predicted over (a bigger search
# is ``autopar exhaustive``'s business: state more fields).
LIMIT = 1 << 20
_CHUNK = 1 << 16


# Unknown fields that are not searched unless a space asks: multi-query
# attention changes the model (its key/value projections), not how a given
# model is laid out (as search_spaces/default.yaml fixes it).
NEUTRAL_OPTIONS = {"attention_type": ("multihead",)}


def default_options(fields, space=None) -> dict:
    """Options of ``fields`` when no framework says: every value autopar's
    rules allow (``None``), or, with a space (file, dict or ``Space``), what
    it allows of each field (its ``params`` entry, or its ``fixed`` value).
    ``attention_type`` stays multi-head unless the space searches it
    (``NEUTRAL_OPTIONS``)."""
    if space is None:
        return {f: NEUTRAL_OPTIONS.get(f) for f in fields}
    sp = load_space(space)
    out = {}
    for f in fields:
        if f in NEUTRAL_OPTIONS and f not in sp.allowed:
            out[f] = NEUTRAL_OPTIONS[f]
        elif f in sp.allowed:
            y = sp.allowed[f].to_yaml()
            out[f] = None if y == "derived" else (tuple(y) if isinstance(y, list) else y)
        elif f in sp.fixed:
            out[f] = (sp.fixed[f],)
        else:
            out[f] = None
    return out


def defaults_first(options: Mapping, defaults: Mapping) -> dict:
    """``options`` with each field's default value (a framework recipe's, a
    table's assumption) moved to the front, so that it wins ties
    (``complete``); fields without a tuple of values are left as they are."""
    out = {}
    for f, o in options.items():
        if isinstance(o, (tuple, list)) and f in defaults and defaults[f] in o:
            o = (defaults[f],) + tuple(v for v in o if v != defaults[f])
        out[f] = o
    return out


@dataclass(frozen=True)
class Completion:
    """One completion of a partial layout, evaluated."""
    execution: dict          # the whole execution (Calculon's form)
    chosen: dict             # each unknown field -> its value here
    feasible: bool
    sample_rate: float       # NaN where it cannot run
    mem_gib: float           # tier-1 requirement (NaN where not computed)
    reason: str = ""         # why it cannot run ('' when feasible)


@dataclass(frozen=True)
class PartialResult:
    """What ``complete`` finds: whether any completion fits, the best one
    (highest predicted sample rate), the memory-lowest one, and the spread
    (min, median, max) of sample rate and tier-1 memory over the feasible
    completions."""
    stated: dict
    unknown: tuple
    options: dict
    completions: int                    # valid layouts that keep the stated fields
    feasible: int                       # of those, predicted to fit and run
    best: Completion | None
    lowest_memory: Completion | None
    spread: dict = field(default_factory=dict)
    reason: str = ""                    # why none fits ('' when some does)

    @property
    def fits(self) -> bool:
        return self.feasible > 0

    def to_json(self) -> dict:
        def comp(c):
            if c is None:
                return None
            return {"chosen": c.chosen, "feasible": c.feasible,
                    "sample_rate": _num(c.sample_rate), "mem_gib": _num(c.mem_gib),
                    "reason": c.reason, "execution": c.execution}
        return {"stated": self.stated, "unknown": list(self.unknown),
                "options": {f: (list(v) if isinstance(v, tuple) else v)
                            for f, v in self.options.items()},
                "fits": self.fits, "completions": self.completions,
                "feasible_completions": self.feasible, "reason": self.reason,
                "best": comp(self.best), "lowest_memory": comp(self.lowest_memory),
                "spread": {k: [_num(x) for x in v] for k, v in self.spread.items()}}


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def completion_space(stated: Mapping, unknown, options: Mapping | None = None,
                     source: str = "options") -> Space:
    """The space of the completions: stated fields as stated, unknown ones
    ranging over their options within the domain rules (a bad option value:
    SpecError naming ``source`` and ``params.<field>``)."""
    options = dict(options or {})
    params, fixed = {}, {}
    for p in PARAMS:
        if p in unknown:
            o = options.get(p)
            params[p] = "derived" if o is None else (list(o) if isinstance(o, (tuple, list))
                                                     else o)
        else:
            fixed[p] = stated[p] if p in stated else EXT_DEFAULTS[p]
    spec = load_space({"name": "completions", "batch_policy": "fixed", "params": params,
                       "fixed": fixed}, source=source).spec
    given = {f: v for f, v in stated.items() if (f in PARAMS or f in DERIVED) and f not in unknown}
    return _Completions(spec, given)


class _Completions(Space):
    """A space whose stated fields hold their stated values as given: the
    domain rules (Calculon's search, stricter in places than the model:
    a pipeline that does not divide the blocks, a micro-batch the tensor
    split does not divide) decide only the unknown fields; whether a
    completion is a valid layout is the model's check."""

    def __init__(self, spec, given: Mapping):
        super().__init__(spec)
        self.given = dict(given)

    def _domain(self, ctx, rule, state) -> tuple:
        if rule.name in self.given:
            # A stated all-gather redo (Transformer Engine's sequence-parallel
            # GEMMs gather their input again in backward) under a completion
            # with full recompute: the recompute's forward gathers it anyway,
            # which the model counts without the flag (the rules refuse both).
            if (rule.name == "seq_par_ag_redo" and self.given[rule.name]
                    and state.get("activation_recompute") == "full"):
                return (False,)
            return (self.given[rule.name],)
        return super()._domain(ctx, rule, state)


def complete(model, system, stated: Mapping, unknown, options: Mapping | None = None, *,
             source: str = "partial layout", options_source: str = "options",
             limit: int = LIMIT) -> PartialResult:
    """Predict a partial layout over every completion of its unknown fields.

    ``stated``: the stated fields (as ``autopar.io.specs.load_partial_execution``
    returns them: ``CASE_FIELDS`` included); ``unknown``: the unknown fields;
    ``options``: per unknown field, the values it may take (see the module
    docstring; a field without an entry takes ``default_options``' values:
    every value the rules allow, ``attention_type`` multi-head).
    """
    from autopar.model import REASONS, evaluate_columns
    from autopar.model.evaluate import reason_text

    unknown = tuple(f for f in ALL_FIELDS if f in set(unknown))
    for f in CASE_FIELDS:
        if f in unknown or f not in stated:
            raise SpecError(source, f, "cannot be unknown: it defines the case; state it")
    opts = {f: (options or {}).get(f, NEUTRAL_OPTIONS.get(f)) for f in unknown
            if f not in DERIVED}
    space = completion_space(stated, unknown, opts, options_source)
    case = Case(model, system, int(stated["num_procs"]), int(stated["batch_size"]),
                str(stated["datatype"]), batch_policy="fixed", training=bool(stated["training"]))
    total = space.size(case)
    if total > limit:
        raise SpecError(source, "(unknown fields)",
                        f"{total:,} completions of {', '.join(unknown)} exceed the limit of "
                        f"{limit:,}; state more fields or narrow their options")
    # A completion the model calls invalid (e.g. a stated overlap that needs
    # a parallelism an unknown field set to 1) is no completion of the layout.
    invalid = np.array([r.startswith("invalid") for r in REASONS])

    def make(cols, i, ok, rate, mem, reason=""):
        rec = record(cols, i)
        full = {f: rec.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS}
        return Completion(execution=rec, chosen={f: full[f] for f in unknown},
                          feasible=bool(ok[i]), sample_rate=float(rate[i]),
                          mem_gib=float(mem[i]), reason=reason)

    n_valid, rates, mems = 0, [], []
    # best, memory-lowest (feasible), memory-lowest (any): (value, key, Completion)
    picks: dict = {"best": None, "low": None, "low_any": None}

    def offer(name, value, at, keys, sign, make_it):
        """Keep the completion at ``at`` if its value beats the kept one
        (``sign`` -1: lower is better), ties going to the smaller key."""
        key = tuple(int(k) for k in keys[at])
        kept = picks[name]
        if kept is None or _better(sign * value, key, sign * kept[0], kept[1]):
            picks[name] = (value, key, make_it())

    first_reason = ""
    for cols in space.enumerate(case, chunk_size=_CHUNK):
        out = evaluate_columns(model, system, cols,
                               stats=("sample_rate", "proc_mem_tier1_cap_req"))
        ok = np.array(out["feasible"], dtype=bool)
        bad = invalid[np.asarray(out["reason_code"], dtype=np.int64)]
        n_valid += int((~bad).sum())
        if not first_reason and bad.any():
            i = int(np.argmax(bad))
            first_reason = REASONS[int(np.asarray(out["reason_code"])[i])]
        rate = np.array(out["sample_rate"], dtype=float)
        mem = np.array(out["proc_mem_tier1_cap_req"], dtype=float) / GIB
        keys = _preference(cols, unknown, opts)
        if ok.any():
            rates.append(rate[ok])
            mems.append(mem[ok])
            i = _pick(rate, ok, keys, +1)
            offer("best", rate[i], i, keys, +1, lambda: make(cols, i, ok, rate, mem))
            j = _pick(mem, ok, keys, -1)
            offer("low", mem[j], j, keys, -1, lambda: make(cols, j, ok, rate, mem))
        elif picks["low"] is None:
            known = np.isfinite(mem)
            if known.any():
                j = _pick(mem, known, keys, -1)
                one = {k: np.asarray(v)[[j]] for k, v in out.items()}
                offer("low_any", mem[j], j, keys, -1,
                      lambda: make(cols, j, ok, rate, mem, str(reason_text(one, system)[0])))
    best, low, low_any = (picks[k][2] if picks[k] else None for k in ("best", "low", "low_any"))

    n_feasible = int(sum(len(r) for r in rates))
    if rates:
        r, mm = np.concatenate(rates), np.concatenate(mems)
        spread = {"sample_rate": (float(r.min()), float(np.median(r)), float(r.max())),
                  "mem_gib": (float(mm.min()), float(np.median(mm)), float(mm.max()))}
    else:
        spread = {"sample_rate": (math.nan,) * 3, "mem_gib": (math.nan,) * 3}
    why = ""
    if not n_feasible:
        if not n_valid:
            why = "no completion is a valid layout: " + (
                first_reason or _why_none(space, case, stated))
        elif low_any is not None:
            why = f"no completion fits; the memory-lowest: {low_any.reason}"
        else:
            why = "no completion can run"
    return PartialResult(stated=dict(stated), unknown=unknown, options=opts,
                         completions=n_valid, feasible=n_feasible, best=best,
                         lowest_memory=low if low is not None else low_any,
                         spread=spread, reason=why)


_TIE = 1e-12      # relative: values this close are a tie


def _preference(cols: Mapping, unknown, opts: Mapping) -> np.ndarray:
    """Per completion, the position of each unknown field's value in its
    options (natural order where every value is allowed): ties between
    completions go to the earlier options, so a framework's (or table's)
    default, listed first, wins a tie."""
    n = len(cols["tensor_par"])
    keys = np.zeros((n, max(1, len(unknown))), dtype=np.int64)
    for k, f in enumerate(unknown):
        col = np.asarray(cols[f]).astype(np.int64)
        o = opts.get(f)
        if not isinstance(o, (tuple, list)):
            keys[:, k] = col
            continue
        pos = np.full(n, len(o), dtype=np.int64)
        for idx, v in reversed(list(enumerate(o))):
            pos[col == encode(f, v)] = idx
        keys[:, k] = pos
    return keys


def _pick(values: np.ndarray, mask: np.ndarray, keys: np.ndarray, sign: int) -> int:
    """The row of ``mask`` with the best value (``sign`` +1: highest, -1:
    lowest), ties to the smallest key."""
    at = np.flatnonzero(mask)
    v = sign * values[at]
    top = v.max()
    tied = at[v >= top - _TIE * abs(top)]
    if len(tied) == 1:
        return int(tied[0])
    k = keys[tied]
    return int(tied[np.lexsort(k.T[::-1])[0]])


def _better(v: float, key: tuple, kept_v: float, kept_key: tuple) -> bool:
    if v > kept_v + _TIE * abs(kept_v):
        return True
    return v >= kept_v - _TIE * abs(kept_v) and key < kept_key


def _why_none(space: Space, case: Case, stated: Mapping) -> str:
    """Why no completion is valid: the first stated field the domain rules
    reject, walking the rules with each unknown field at its first value."""
    ctx = layout_context(case, space)
    state: dict = {}
    for rule in space._rules:
        name = rule.name
        dom = space._domain(ctx, rule, state)
        if name in stated:
            v = stated[name]
            if v not in dom:
                if name in DERIVED:
                    return (space._no_derived(ctx, name, state) if not dom
                            else space._derived_mismatch(ctx, name, state, v, dom[0]))
                return space._why_not(ctx, rule, state, v)
        elif not dom:
            if name in DERIVED:
                return space._no_derived(ctx, name, state)
            return f"no option of {name} is valid with the fields before it"
        else:
            v = dom[0]
        state[name] = v
    return "the stated fields conflict with the options of the unknown ones"
