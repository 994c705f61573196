"""Search spaces: which execution parameters are searched, which are fixed.

A space file (YAML, see ``search_spaces/README.md``) names, for each of the 18
layout parameters Calculon's execution has besides ``num_procs``,
``training``, ``datatype`` (given by the case) and ``data_par`` /
``batch_size`` (derived), whether it is searched (``params:``) or fixed
(``fixed:``).  Domains that depend on the case are derived by the rules below
(divisors, network tiers, options that need another); a space may only narrow
them.  The rules follow Calculon's own search (``llm-optimal-execution``), so
``search_spaces/calculon.yaml`` yields exactly its layouts, in its order.

Every parameter is a *node* in one fixed define-by-run order (dependencies
first).  A node's domain is ``rule(case, earlier values)``; a rule either
offers candidates (then narrowed by the space's allowed values) or, when the
option does not apply (e.g. ``data_par_overlap`` with ``data_par == 1``),
forces its neutral value, which no space setting overrides.

Enumeration is vectorised: the nodes up to the last one another node depends
on form a small *prefix* walked in Python; for each prefix row the remaining
nodes are a plain Cartesian product (a *pattern*) built once per distinct
shape with numpy; a chunk of layouts is two gathers per column.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from autopar.io.layouts import ALL_FIELDS, BOOL_FIELDS, CHOICES, EXT_DEFAULTS
from autopar.io.specs import SpecError, brief, read_yaml

# The parameters a space decides on, in define-by-run order (Calculon's loop
# nesting; fused_activation and attention_type, which Calculon fixes, sit
# where Calculon loops over fused_activation).
PARAMS: tuple[str, ...] = (
    "tensor_par", "pipeline_par", "pipeline_interleaving",
    "activation_recompute", "optimizer_sharding", "tensor_par_comm_type",
    "seq_par_ag_redo", "data_par_overlap", "tensor_par_overlap",
    "weight_offload", "activations_offload", "optimizer_offload",
    "fused_activation", "attention_type", "microbatch_size",
    "tensor_par_net", "pipeline_par_net", "data_par_net",
    # autopar's extensions (optional in a file: when absent, fixed at their
    # defaults, which keep Calculon's meaning).
    "attention_impl", "fused_norm", "unsharded_grads",
)
OPTIONAL = tuple(EXT_DEFAULTS)
DERIVED = ("data_par", "batch_size")          # computed from the others
FROM_CASE = ("num_procs", "datatype", "training")
BATCH_POLICIES = ("max", "fixed")
TOP_KEYS = ("name", "description", "batch_policy", "params", "fixed", "skeleton")
# The parameters a skeleton search proposes (``autopar.search.skeleton``) unless
# the space file names others under ``skeleton:``; every other searched
# parameter is completed by evaluating all its values at once.
DEFAULT_SKELETON = ("tensor_par", "pipeline_par", "microbatch_size")
NET_FIELDS = ("tensor_par_net", "pipeline_par_net", "data_par_net")

_ROOT = Path(__file__).resolve().parent.parent.parent
SPACES_DIR = _ROOT / "search_spaces"


# --------------------------------------------------------------------------
# The case: what the search is for

@dataclass(frozen=True)
class Case:
    """One search problem: a model on a system at a size and batch."""
    model: Any                     # autopar.io.specs.ModelSpec
    system: Any                    # autopar.io.specs.SystemSpec
    num_procs: int
    max_batch_size: int
    datatype: str
    batch_policy: str | None = None   # None: the space's default
    training: bool = True


@dataclass(frozen=True)
class _Ctx:
    """The few case numbers the rules read (hashable, cheap to key on)."""
    num_procs: int
    hidden: int
    heads: int
    blocks: int
    seq: int
    nets: int
    mem2: bool
    training: bool
    max_batch: int
    policy: str
    datatype: str


def _check_case(case: Case, source: str = "case") -> None:
    def bad(f, msg):
        raise SpecError(source, f, msg)
    for f in ("num_procs", "max_batch_size"):
        v = getattr(case, f)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            bad(f, f"expected a positive integer, got {v!r}")
    if case.datatype not in CHOICES["datatype"]:
        bad("datatype", f"expected one of {', '.join(CHOICES['datatype'])}, got {case.datatype!r}")
    if case.batch_policy is not None and case.batch_policy not in BATCH_POLICIES:
        bad("batch_policy", f"expected 'max' or 'fixed', got {case.batch_policy!r}")
    if not isinstance(case.training, (bool, np.bool_)):
        bad("training", f"expected true or false, got {case.training!r}")


def _ctx(case: Case, space: "Space") -> _Ctx:
    _check_case(case)
    m, s = case.model, case.system
    return _Ctx(num_procs=int(case.num_procs), hidden=int(m.hidden),
                heads=int(m.attn_heads), blocks=int(m.num_blocks),
                seq=int(m.seq_size), nets=len(s.networks),
                mem2=float(s.mem2.GiB) > 0, training=bool(case.training),
                max_batch=int(case.max_batch_size),
                policy=case.batch_policy or space.batch_policy,
                datatype=case.datatype)


# --------------------------------------------------------------------------
# Rules: node -> (candidates, forced reason or None)

@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of n, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return tuple(small + large[::-1])


_TF = (True, False)


def _r_tp(c, s):
    return tuple(d for d in divisors(c.num_procs)
                 if c.hidden % d == 0 and c.heads % d == 0), None


def _r_pp(c, s):
    return divisors(math.gcd(c.num_procs // s["tensor_par"], c.blocks)), None


def _r_dp(c, s):
    tp, pp = s["tensor_par"], s["pipeline_par"]
    return ((c.num_procs // (tp * pp),) if c.num_procs % (tp * pp) == 0 else ()), None


def batch_for(policy: str, data_par: int, max_batch: int) -> int | None:
    """The global batch of a layout, or None when its data_par allows none."""
    if policy == "fixed":
        return max_batch if max_batch % data_par == 0 else None
    return (max_batch // data_par) * data_par if data_par <= max_batch else None


def _r_batch(c, s):
    b = batch_for(c.policy, s["data_par"], c.max_batch)
    return ((b,) if b is not None else ()), None


def _r_ppint(c, s):
    pp = s["pipeline_par"]
    if pp == 1:
        return (1,), "must be 1 when pipeline_par is 1"
    return divisors(c.blocks // pp), None


def _r_recompute(c, s):
    if not c.training:
        return ("none",), "must be none when not training"
    return CHOICES["activation_recompute"], None


def _r_optsh(c, s):
    if s["data_par"] == 1:
        return (False,), "needs data_par > 1"
    return _TF, None


def _r_comm(c, s):
    return CHOICES["tensor_par_comm_type"], None


def _r_redo(c, s):
    if s["tensor_par_comm_type"] != "rs_ag" or s["activation_recompute"] == "full":
        return (False,), ("needs tensor_par_comm_type rs_ag and "
                          "activation_recompute other than full")
    return _TF, None


def _r_dpov(c, s):
    if s["data_par"] == 1 or not c.training:
        return (False,), "needs data_par > 1 and training"
    return _TF, None


def _r_tpov(c, s):
    if s["tensor_par"] == 1:
        return ("none",), "must be none when tensor_par is 1"
    return CHOICES["tensor_par_overlap"], None


def _r_woff(c, s):
    if not c.mem2:
        return (False,), "needs a second memory tier (mem2)"
    return _TF, None


def _r_aoff(c, s):
    if not c.mem2 or s["activation_recompute"] == "full":
        return (False,), "needs a second memory tier (mem2) and activation_recompute other than full"
    return _TF, None


def _r_ooff(c, s):
    if not c.mem2 or not c.training:
        return (False,), "needs a second memory tier (mem2) and training"
    return _TF, None


def _r_fused(c, s):
    return _TF, None


def _r_attn(c, s):
    return CHOICES["attention_type"], None


def _r_impl(c, s):
    return CHOICES["attention_impl"], None


def _r_unsharded(c, s):
    if not s["optimizer_sharding"]:
        return (False,), "needs optimizer_sharding"
    return _TF, None


def _r_mbs(c, s):
    tp = s["tensor_par"]
    local = s["batch_size"] // s["data_par"]
    return tuple(m for m in divisors(local) if (m * c.seq) % tp == 0), None


def _r_net(par):
    def rule(c, s):
        if s[par] == 1:
            return (0,), f"must be 0 when {par} is 1"
        return tuple(range(c.nets)), None
    return rule


@dataclass(frozen=True)
class _Rule:
    name: str
    deps: tuple[str, ...]
    fn: Callable
    text: str            # why a value outside the candidates is invalid


_RULES: tuple[_Rule, ...] = (
    _Rule("tensor_par", (), _r_tp, "must divide num_procs, hidden and attn_heads"),
    _Rule("pipeline_par", ("tensor_par",), _r_pp,
          "must divide num_procs/tensor_par and num_blocks"),
    _Rule("data_par", ("tensor_par", "pipeline_par"), _r_dp,
          "tensor_par*pipeline_par must divide num_procs"),
    _Rule("batch_size", ("data_par",), _r_batch, "batch"),
    _Rule("pipeline_interleaving", ("pipeline_par",), _r_ppint,
          "must divide num_blocks/pipeline_par"),
    _Rule("activation_recompute", (), _r_recompute, ""),
    _Rule("optimizer_sharding", ("data_par",), _r_optsh, ""),
    _Rule("tensor_par_comm_type", (), _r_comm, ""),
    _Rule("seq_par_ag_redo", ("tensor_par_comm_type", "activation_recompute"), _r_redo, ""),
    _Rule("data_par_overlap", ("data_par",), _r_dpov, ""),
    _Rule("tensor_par_overlap", ("tensor_par",), _r_tpov, ""),
    _Rule("weight_offload", (), _r_woff, ""),
    _Rule("activations_offload", ("activation_recompute",), _r_aoff, ""),
    _Rule("optimizer_offload", (), _r_ooff, ""),
    _Rule("fused_activation", (), _r_fused, ""),
    _Rule("attention_type", (), _r_attn, ""),
    _Rule("microbatch_size", ("tensor_par", "data_par", "batch_size"), _r_mbs,
          "must divide batch_size/data_par, with microbatch_size*seq_size "
          "divisible by tensor_par"),
    _Rule("tensor_par_net", ("tensor_par",), _r_net("tensor_par"), "network tier"),
    _Rule("pipeline_par_net", ("pipeline_par",), _r_net("pipeline_par"), "network tier"),
    _Rule("data_par_net", ("data_par",), _r_net("data_par"), "network tier"),
    _Rule("attention_impl", (), _r_impl, ""),
    _Rule("fused_norm", (), _r_fused, ""),
    _Rule("unsharded_grads", ("optimizer_sharding",), _r_unsharded, ""),
)
assert tuple(r.name for r in _RULES if r.name not in DERIVED) == PARAMS


def _kind(name: str) -> str:
    if name in CHOICES:
        return "str"
    return "bool" if name in BOOL_FIELDS else "int"


def _encode(name: str, v) -> int:
    return CHOICES[name].index(v) if name in CHOICES else int(v)


# --------------------------------------------------------------------------
# Loading space files

def _value(src: str, where: str, name: str, v):
    """One allowed/fixed value, checked for its parameter's type."""
    kind = _kind(name)
    if kind == "str":
        if not isinstance(v, str) or v not in CHOICES[name]:
            raise SpecError(src, where, f"expected one of {', '.join(CHOICES[name])}, got {brief(v)}")
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise SpecError(src, where, f"expected true or false, got {brief(v)}")
        return v
    low = 0 if name in NET_FIELDS else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise SpecError(src, where, f"expected an integer >= {low}, got {brief(v)}")
    return v


@dataclass(frozen=True)
class _Allowed:
    """What a space allows of one parameter: all derived values, a set, or a range."""
    values: tuple | None = None     # None: any
    low: int | None = None
    high: int | None = None

    def ok(self, v) -> bool:
        if self.values is not None and v not in self.values:
            return False
        if self.low is not None and v < self.low:
            return False
        return self.high is None or v <= self.high

    def to_yaml(self):
        if self.values is not None:
            return list(self.values)
        if self.low is None and self.high is None:
            return "derived"
        out = {}
        if self.low is not None:
            out["min"] = self.low
        if self.high is not None:
            out["max"] = self.high
        return out


def _allowed(src: str, name: str, spec) -> _Allowed:
    where = f"params.{name}"
    if spec == "derived" or spec is None:
        return _Allowed()
    if isinstance(spec, list):
        if not spec:
            raise SpecError(src, where, "an empty list allows nothing; fix the parameter or list values")
        vals = tuple(_value(src, f"{where}[{i}]", name, v) for i, v in enumerate(spec))
        if len(set(vals)) != len(vals):
            raise SpecError(src, where, "lists a value twice")
        return _Allowed(values=vals)
    if isinstance(spec, dict):
        if _kind(name) != "int":
            raise SpecError(src, where, "min/max apply to integer parameters only; list the values")
        extra = set(spec) - {"min", "max"}
        if extra or not spec:
            raise SpecError(src, where, f"expected keys min and/or max, got {', '.join(map(str, spec)) or 'none'}")
        lo = _value(src, f"{where}.min", name, spec["min"]) if "min" in spec else None
        hi = _value(src, f"{where}.max", name, spec["max"]) if "max" in spec else None
        if lo is not None and hi is not None and lo > hi:
            raise SpecError(src, where, f"min {lo} is above max {hi}")
        return _Allowed(low=lo, high=hi)
    raise SpecError(src, where, f"expected 'derived', a list of values or {{min, max}}, got {brief(spec)}")


def _param_error(src: str, where: str, name: str) -> None:
    if name in FROM_CASE:
        raise SpecError(src, where, f"{name} is given by the case (command line), not by the space")
    if name in DERIVED:
        raise SpecError(src, where, f"{name} is derived (data_par = num_procs/(tensor_par*pipeline_par), "
                                    "batch_size by the batch policy); it cannot be searched or fixed")
    raise SpecError(src, where, f"unknown parameter {name!r}; parameters are: {', '.join(PARAMS)}")


def load_space(spec, source: str | None = None) -> "Space":
    """A space file (YAML), a dict or a Space -> Space.  SpecError on bad input.

    A relative path that is not found is also looked up relative to the
    project root, and a bare name (``calculon``) names
    ``search_spaces/<name>.yaml``.
    """
    if isinstance(spec, Space):
        return spec
    stem = "space"
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if not path.exists() and not path.is_absolute():
            for alt in (_ROOT / path, SPACES_DIR / f"{path}.yaml"):
                if alt.is_file():     # relative to the project, or a bare name
                    path = alt
                    break
        src = source or str(spec)
        if not path.is_file():
            raise SpecError(src, "file", "no such space file" if not path.exists() else "not a file")
        data = read_yaml(path, src, "file", syntax_field="yaml")
        stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    elif isinstance(spec, Mapping):
        data, src = dict(spec), source or "dict"
    else:
        raise SpecError(source or "space", "space", f"expected a file path, a dict or a Space, got {type(spec).__name__}")
    if not isinstance(data, Mapping):
        raise SpecError(src, "space", f"expected a mapping at the top level, got {brief(data)}")
    for k in data:
        if k not in TOP_KEYS:
            raise SpecError(src, str(k), f"unknown key; expected {', '.join(TOP_KEYS)}")
    name = data.get("name", stem)
    if not isinstance(name, str) or not name:
        raise SpecError(src, "name", f"expected a non-empty string, got {brief(name)}")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise SpecError(src, "description", f"expected a string, got {brief(desc)}")
    policy = data.get("batch_policy", "max")
    if policy not in BATCH_POLICIES:
        raise SpecError(src, "batch_policy", f"expected max or fixed, got {brief(policy)}")
    params = data.get("params") or {}
    fixed = data.get("fixed") or {}
    for key, part in (("params", params), ("fixed", fixed)):
        if not isinstance(part, Mapping):
            raise SpecError(src, key, f"expected a mapping of parameter names, got {brief(part)}")
    allowed: dict[str, _Allowed] = {}
    for n, v in params.items():
        if n not in PARAMS:
            _param_error(src, f"params.{n}", str(n))
        allowed[n] = _allowed(src, n, v)
    fixed_vals: dict[str, Any] = {}
    for n, v in fixed.items():
        if n not in PARAMS:
            _param_error(src, f"fixed.{n}", str(n))
        if n in allowed:
            raise SpecError(src, f"fixed.{n}", "is also under params; a parameter is searched or fixed, not both")
        fixed_vals[n] = _value(src, f"fixed.{n}", n, v)
    for p in OPTIONAL:
        if p not in allowed and p not in fixed_vals:
            fixed_vals[p] = EXT_DEFAULTS[p]
    missing = [p for p in PARAMS if p not in allowed and p not in fixed_vals]
    if missing:
        raise SpecError(src, "params", f"neither searched nor fixed: {', '.join(missing)}")
    skeleton = _skeleton(src, data.get("skeleton"), allowed)
    return Space(name=name, description=desc, batch_policy=policy,
                 allowed=allowed, fixed=fixed_vals, source=src, skeleton=skeleton)


def _skeleton(src: str, v, allowed: Mapping) -> tuple[str, ...] | None:
    """The ``skeleton:`` list: searched parameters, in define-by-run order (None: default)."""
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise SpecError(src, "skeleton", f"expected a non-empty list of searched parameters, got {brief(v)}")
    for i, n in enumerate(v):
        if n not in PARAMS:
            _param_error(src, f"skeleton[{i}]", str(n))
        if n not in allowed:
            raise SpecError(src, f"skeleton[{i}]", f"{n} is not searched (not under params)")
    if len(set(v)) != len(v):
        raise SpecError(src, "skeleton", "lists a parameter twice")
    return tuple(p for p in PARAMS if p in v)


# --------------------------------------------------------------------------
# The space

@dataclass
class _Plan:
    """The enumeration of one case: prefix rows x per-row patterns."""
    prefix_names: tuple[str, ...]
    prefix: dict                   # name -> int64 codes, one per prefix row
    offsets: np.ndarray            # int64, len P+1: first layout of each prefix row
    pid: np.ndarray                # pattern id of each prefix row
    suffix_names: tuple[str, ...]
    pat_start: np.ndarray          # first row of each pattern in pat
    pat: dict                      # name -> codes of all patterns, concatenated

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


# Patterns larger than this move their outermost node into the prefix.
_PATTERN_ROWS = 1 << 17
_PATTERN_TOTAL = 1 << 21


class Space:
    """A search space; see the module docstring and search_spaces/README.md."""

    def __init__(self, name: str, description: str, batch_policy: str,
                 allowed: Mapping[str, _Allowed], fixed: Mapping[str, Any],
                 source: str = "dict", skeleton: tuple[str, ...] | None = None):
        self.name, self.description, self.source = name, description, source
        self.skeleton_given = skeleton
        self.batch_policy = batch_policy
        self.allowed = dict(allowed)
        self.fixed = dict(fixed)
        self.searched: tuple[str, ...] = tuple(p for p in PARAMS if p in self.allowed)
        # The skeleton: as the file says, else the default's searched parameters.
        self.skeleton: tuple[str, ...] = skeleton if skeleton is not None else tuple(
            p for p in DEFAULT_SKELETON if p in self.allowed)
        self._rules = _RULES
        self._index = {r.name: i for i, r in enumerate(_RULES)}
        # live[i]: names read by nodes after i (what a state must carry past i)
        self._live: list[tuple[str, ...]] = []
        for i in range(len(_RULES)):
            later = {d for r in _RULES[i + 1:] for d in r.deps}
            self._live.append(tuple(n for n in (r.name for r in _RULES[:i + 1]) if n in later))
        self._cache: dict = {}

    def __repr__(self):
        return f"Space({self.name!r}, searched={len(self.searched)}, fixed={sorted(self.fixed)})"

    def __getstate__(self):
        return self.to_dict() | {"_source": self.source}

    def __setstate__(self, d):
        d = dict(d)
        src = d.pop("_source", "dict")
        self.__dict__.update(load_space(d, source=src).__dict__)

    def to_dict(self) -> dict:
        """The space as the dict a YAML file would hold."""
        out = {"name": self.name, "description": self.description,
               "batch_policy": self.batch_policy,
               "params": {p: self.allowed[p].to_yaml() for p in self.searched},
               "fixed": {p: self.fixed[p] for p in PARAMS if p in self.fixed}}
        if self.skeleton_given is not None:
            out["skeleton"] = list(self.skeleton_given)
        return out

    # -- skeletons ----------------------------------------------------------

    def restrict(self, values: Mapping) -> "Space":
        """This space with some searched parameters held at one value each
        (the completions of a skeleton: ``restrict(skeleton).layouts(...)``)."""
        allowed = dict(self.allowed)
        for p, v in values.items():
            if p not in self.allowed:
                raise ValueError(f"{p!r} is not searched in space {self.name!r}")
            if isinstance(v, np.generic):
                v = v.item()
            allowed[p] = _Allowed(values=(v,)) if self.allowed[p].ok(v) else _Allowed(values=())
        return Space(name=self.name, description=self.description,
                     batch_policy=self.batch_policy, allowed=allowed, fixed=self.fixed,
                     source=self.source, skeleton=self.skeleton_given)

    def skeletons(self, case: Case, names: tuple[str, ...] | None = None) -> list[tuple]:
        """Every combination of the ``names`` parameters (default: the
        skeleton) that at least one layout of the space has, in enumeration
        order; each a tuple in ``names`` order (define-by-run order)."""
        names = self.skeleton if names is None else tuple(names)
        for p in names:
            if p not in self.allowed:
                raise ValueError(f"{p!r} is not searched in space {self.name!r}")
        order = tuple(p for p in PARAMS if p in names)
        ctx = _ctx(case, self)
        key = ("skeletons", ctx, order)
        got = self._cache.get(key)
        if got is not None:
            return list(got)
        memo: dict = {}
        n = len(self._rules)

        def walk(i, live_key):
            # -> tuple of distinct skeleton tails reachable below node i
            if i == n:
                return ((),)
            hit = memo.get((i, live_key))
            if hit is not None:
                return hit
            names_before = self._live[i - 1] if i else ()
            state = dict(zip(names_before, live_key))
            rule = self._rules[i]
            out: dict = {}
            for v in self._domain(ctx, rule, state):
                state[rule.name] = v
                for tail in walk(i + 1, tuple(state[m] for m in self._live[i])):
                    out[((v,) + tail) if rule.name in order else tail] = None
            res = memo[(i, live_key)] = tuple(out)
            return res

        sk = walk(0, ())
        self._cache[key] = sk
        if order != names:
            pos = [order.index(p) for p in names]
            sk = tuple(tuple(t[k] for k in pos) for t in sk)
        return list(sk)

    # -- domains ----------------------------------------------------------

    def _domain(self, ctx: _Ctx, rule: _Rule, state: Mapping) -> tuple:
        cands, forced = rule.fn(ctx, state)
        if forced is not None:
            return cands
        if rule.name in self.fixed:
            v = self.fixed[rule.name]
            return (v,) if v in cands else ()
        allowed = self.allowed.get(rule.name)
        if allowed is None:
            return cands
        return tuple(v for v in cands if allowed.ok(v))

    def _memo_domain(self, ctx, i, state, memo):
        rule = self._rules[i]
        key = (i,) + tuple(state[d] for d in rule.deps)
        dom = memo.get(key)
        if dom is None:
            dom = memo[key] = self._domain(ctx, rule, state)
        return dom

    def _count(self, ctx: _Ctx, i: int, key: tuple) -> int:
        """Layouts below a state at node i (key: values of the live names)."""
        memo = self._cache.setdefault(("count", ctx), {})
        got = memo.get((i, key))
        if got is not None:
            return got
        if i == len(self._rules):
            return 1
        names = self._live[i - 1] if i else ()
        state = dict(zip(names, key))
        rule = self._rules[i]
        total = 0
        live = self._live[i]
        for v in self._domain(ctx, rule, state):
            state[rule.name] = v
            total += self._count(ctx, i + 1, tuple(state[n] for n in live))
        memo[(i, key)] = total
        return total

    def _state_before(self, ctx: _Ctx, i: int, values: Mapping) -> dict | None:
        """Walk nodes before i with searched values from ``values``; None if dead."""
        state: dict = {}
        for j in range(i):
            rule = self._rules[j]
            dom = self._domain(ctx, rule, state)
            if rule.name in self.allowed:
                if rule.name not in values:
                    raise ValueError(f"choices for {self._rules[i].name} need {rule.name} first "
                                     f"(define-by-run order: {', '.join(self.searched)})")
                v = values[rule.name]
                if v not in dom:
                    return None
            else:
                if len(dom) != 1:
                    return None
                v = dom[0]
            state[rule.name] = v
        return state

    def choices(self, case: Case, param: str, partial: Mapping) -> list:
        """Values of ``param`` that lead to at least one layout, given the
        searched parameters before it (``space.searched`` order) in ``partial``."""
        if param not in PARAMS:
            raise ValueError(f"unknown parameter {param!r}")
        ctx = _ctx(case, self)
        i = self._index[param]
        state = self._state_before(ctx, i, partial)
        if state is None:
            return []
        rule = self._rules[i]
        out = []
        for v in self._domain(ctx, rule, state):
            state[rule.name] = v
            if self._count(ctx, i + 1, tuple(state[n] for n in self._live[i])):
                out.append(v)
        return out

    def flat_domains(self, case: Case) -> dict[str, list]:
        """For each searched parameter, every value some layout of the space uses."""
        ctx = _ctx(case, self)
        memo: dict = {}
        n = len(self._rules)

        def reach(i, key):
            if i == n:
                return ()
            got = memo.get((i, key))
            if got is not None:
                return got
            names = self._live[i - 1] if i else ()
            state = dict(zip(names, key))
            rule = self._rules[i]
            sets: list[set] | None = None
            for v in self._domain(ctx, rule, state):
                state[rule.name] = v
                sub = reach(i + 1, tuple(state[m] for m in self._live[i]))
                if sub is None:
                    continue
                if sets is None:
                    sets = [set() for _ in range(n - i)]
                sets[0].add(v)
                for s, t in zip(sets[1:], sub):
                    s |= t
            out = None if sets is None else tuple(frozenset(s) for s in sets)
            memo[(i, key)] = out
            return out

        sets = reach(0, ())
        result = {}
        for p in self.searched:
            vals = sets[self._index[p]] if sets is not None else frozenset()
            result[p] = _ordered(p, vals)
        return result

    def size(self, case: Case) -> int:
        """The number of layouts in the space for this case."""
        return self._plan(_ctx(case, self)).size

    # -- one layout ---------------------------------------------------------

    def complete(self, case: Case, params: Mapping, normalize: bool = False) -> dict:
        """Searched values -> the full 23-field Calculon execution dict.

        Fixed parameters, data_par and batch_size (0 when the policy gives
        none) are filled in.  With ``normalize``, parameters whose option does
        not apply (e.g. tensor_par_net when tensor_par is 1) take their
        forced value whatever ``params`` says.
        """
        ctx = _ctx(case, self)
        state: dict = {}
        for rule in self._rules:
            try:
                cands, forced = rule.fn(ctx, state)
            except (ZeroDivisionError, TypeError, KeyError):
                cands, forced = (), None     # an earlier value is out of range
            if rule.name == "data_par":
                tp, pp = state["tensor_par"], state["pipeline_par"]
                v = cands[0] if cands else (ctx.num_procs // (tp * pp) if tp and pp else 0)
            elif rule.name == "batch_size":
                v = cands[0] if cands else 0
            elif forced is not None and (normalize or rule.name not in self.allowed):
                v = cands[0]
            elif rule.name in self.allowed:
                if rule.name not in params:
                    raise ValueError(f"missing searched parameter {rule.name!r}")
                v = params[rule.name]
                if isinstance(v, np.generic):
                    v = v.item()
            else:
                v = self.fixed[rule.name]
            state[rule.name] = v
        out = {"num_procs": ctx.num_procs, "datatype": ctx.datatype, "training": ctx.training}
        out.update(state)
        # Extension fields only where they differ from their defaults, as
        # ``autopar.io.layouts.record`` writes them: plain layouts stay Calculon's.
        return {f: out[f] for f in ALL_FIELDS
                if f not in EXT_DEFAULTS or out[f] != EXT_DEFAULTS[f]}

    def check(self, case: Case, execution: Mapping) -> str:
        """'' when the layout is in the space, else 'invalid: <why>'.

        ``execution`` is a full Calculon execution or just the searched
        parameters (the rest is completed as ``complete`` does).
        """
        ctx = _ctx(case, self)
        ex = dict(execution)
        for f, want in (("num_procs", ctx.num_procs), ("datatype", ctx.datatype),
                        ("training", ctx.training)):
            if f in ex and ex[f] != want:
                return f"invalid: {f} {brief(ex[f])} is not the case's {want!r}"
        for f in ALL_FIELDS:
            if f in ex and not _typed(f, ex[f]):
                return f"invalid: {f} {brief(ex[f])} is not a valid {_kind(f)} value"
        state: dict = {}
        for rule in self._rules:
            name = rule.name
            dom = self._domain(ctx, rule, state)
            if name in DERIVED:
                if not dom:
                    return "invalid: " + self._no_derived(ctx, name, state)
                v = ex.get(name, dom[0])
                if v != dom[0]:
                    return "invalid: " + self._derived_mismatch(ctx, name, state, v, dom[0])
            else:
                if name in ex:
                    v = ex[name]
                elif name in self.allowed:
                    return f"invalid: {name} is missing"
                else:
                    v = dom[0] if len(dom) == 1 else self.fixed[name]
                if isinstance(v, np.generic):
                    v = v.item()
                if v not in dom:
                    return "invalid: " + self._why_not(ctx, rule, state, v)
            state[name] = v
        return ""

    def _no_derived(self, ctx, name, state) -> str:
        if name == "data_par":
            return (f"tensor_par*pipeline_par ({state['tensor_par']}*{state['pipeline_par']}) "
                    f"does not divide num_procs {ctx.num_procs}")
        dp = state["data_par"]
        if ctx.policy == "fixed":
            return f"data_par {dp} does not divide the batch {ctx.max_batch} (batch policy fixed)"
        return f"data_par {dp} exceeds the maximum batch size {ctx.max_batch}"

    def _derived_mismatch(self, ctx, name, state, v, want) -> str:
        if name == "data_par":
            return f"data_par {brief(v)} is not num_procs/(tensor_par*pipeline_par) = {want}"
        how = ("the batch size" if ctx.policy == "fixed"
               else f"the largest multiple of data_par {state['data_par']} <= {ctx.max_batch}")
        return f"batch_size {brief(v)} is not {how} = {want} (batch policy {ctx.policy})"

    def _why_not(self, ctx, rule, state, v) -> str:
        cands, forced = rule.fn(ctx, state)
        name = rule.name
        if forced is not None:
            return f"{name} {brief(v)}: {forced}"
        if v not in cands:
            if name in NET_FIELDS:
                return f"{name} {brief(v)} is not a network tier of the system (0..{ctx.nets - 1})"
            return f"{name} {brief(v)} {rule.text or 'is not a valid value'}"
        if name in self.fixed:
            return f"{name} {brief(v)} is not the space's fixed value {self.fixed[name]!r}"
        return f"{name} {brief(v)} is outside space {self.name!r} ({self.allowed[name].to_yaml()})"

    # -- enumeration --------------------------------------------------------

    def _plan(self, ctx: _Ctx) -> _Plan:
        key = ("plan", ctx)
        plan = self._cache.get(key)
        if plan is None:
            plan = self._cache[key] = self._build_plan(ctx)
        return plan

    def _build_plan(self, ctx: _Ctx) -> _Plan:
        rules = self._rules
        n = len(rules)
        # The last node another later node depends on ends the prefix.
        b = max((self._index[d] for r in rules for d in r.deps), default=-1)
        while True:
            plan = self._try_plan(ctx, b + 1)
            if plan is not None:
                return plan
            b += 1
            if b >= n - 1:
                raise RuntimeError("search space too large to plan")  # pragma: no cover

    def _try_plan(self, ctx: _Ctx, split: int) -> _Plan | None:
        rules = self._rules
        memo: dict = {}
        live = self._live[split - 1]
        prefix_rows: list[tuple] = []
        sizes: list[int] = []
        pids: list[int] = []
        pat_keys: dict = {}
        pat_list: list[tuple] = []
        pat_memo: dict = {}
        total = [0]
        state: dict = {}

        def pattern_of():
            key = tuple(state[m] for m in live)
            got = pat_memo.get(key)
            if got is None:
                doms = tuple(self._memo_domain(ctx, j, state, memo) for j in range(split, len(rules)))
                size = math.prod(len(d) for d in doms)
                pid = -1
                if size:
                    pid = pat_keys.get(doms)
                    if pid is None:
                        pid = pat_keys[doms] = len(pat_list)
                        pat_list.append(doms)
                        total[0] += size
                got = pat_memo[key] = (pid, size)
            return got

        def walk(i, row):
            if i == split:
                pid, size = pattern_of()
                if size:
                    prefix_rows.append(row)
                    sizes.append(size)
                    pids.append(pid)
                return
            rule = rules[i]
            for v in self._memo_domain(ctx, i, state, memo):
                state[rule.name] = v
                walk(i + 1, row + (v,))
            state.pop(rule.name, None)

        walk(0, ())
        if total[0] > _PATTERN_TOTAL or any(math.prod(len(d) for d in p) > _PATTERN_ROWS for p in pat_list):
            if split < len(rules) - 1:
                return None
        prefix_names = tuple(r.name for r in rules[:split])
        suffix_names = tuple(r.name for r in rules[split:])
        prefix = {}
        for k, nm in enumerate(prefix_names):
            prefix[nm] = np.array([_encode(nm, r[k]) for r in prefix_rows], dtype=np.int64)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(np.array(sizes, dtype=np.int64), out=offsets[1:])
        pat_sizes = [math.prod(len(d) for d in p) for p in pat_list]
        pat_start = np.zeros(len(pat_list) + 1, dtype=np.int64)
        np.cumsum(np.array(pat_sizes, dtype=np.int64), out=pat_start[1:])
        pat = {}
        for k, nm in enumerate(suffix_names):
            parts = []
            for p in pat_list:
                lens = [len(d) for d in p]
                vals = np.array([_encode(nm, v) for v in p[k]], dtype=np.int64)
                inner = math.prod(lens[k + 1:])
                outer = math.prod(lens[:k])
                parts.append(np.tile(np.repeat(vals, inner), outer))
            col = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            pat[nm] = col.astype(_small_dtype(col))
        return _Plan(prefix_names=prefix_names, prefix=prefix, offsets=offsets,
                     pid=np.array(pids, dtype=np.int64), suffix_names=suffix_names,
                     pat_start=pat_start, pat=pat)

    def layouts(self, case: Case, start: int, stop: int) -> dict[str, np.ndarray]:
        """Layouts ``start:stop`` (enumeration order) as a layout table."""
        ctx = _ctx(case, self)
        plan = self._plan(ctx)
        start, stop = max(0, int(start)), min(int(stop), plan.size)
        return _materialize(ctx, plan, start, max(start, stop))

    def enumerate(self, case: Case, chunk_size: int = 1 << 20) -> Iterator[dict[str, np.ndarray]]:
        """Layout tables of at most ``chunk_size`` rows covering the space once,
        in define-by-run order (Calculon's loop order for calculon.yaml)."""
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        ctx = _ctx(case, self)
        plan = self._plan(ctx)
        for a in range(0, plan.size, chunk_size):
            yield _materialize(ctx, plan, a, min(a + chunk_size, plan.size))


def _typed(f: str, v) -> bool:
    if isinstance(v, np.generic):
        v = v.item()
    if f in CHOICES:
        return isinstance(v, str)
    if f in BOOL_FIELDS:
        return isinstance(v, bool)
    return isinstance(v, int) and not isinstance(v, bool)


def _ordered(name: str, vals) -> list:
    if name in CHOICES:
        return [v for v in CHOICES[name] if v in vals]
    if name in BOOL_FIELDS:
        return [v for v in (True, False) if v in vals]
    return sorted(vals)


def _small_dtype(col: np.ndarray):
    if col.size == 0:
        return np.int8
    hi, lo = int(col.max()), int(col.min())
    for dt in (np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    return np.int64


def _out_dtype(f: str):
    if f in CHOICES:
        return np.int8
    return bool if f in BOOL_FIELDS else np.int64


def _materialize(ctx: _Ctx, plan: _Plan, a: int, b: int) -> dict[str, np.ndarray]:
    n = b - a
    cols: dict[str, np.ndarray] = {}
    if n <= 0:
        return {f: np.zeros(0, dtype=_out_dtype(f)) for f in ALL_FIELDS}
    off = plan.offsets
    p0 = int(np.searchsorted(off, a, side="right")) - 1
    p1 = int(np.searchsorted(off, b, side="left"))
    starts = np.maximum(off[p0:p1], a)
    ends = np.minimum(off[p0 + 1:p1 + 1], b)
    prow = np.repeat(np.arange(p0, p1), ends - starts)
    # position of each layout inside its prefix row's pattern
    local = np.arange(a, b, dtype=np.int64)
    local -= off[prow]
    local += plan.pat_start[plan.pid[prow]]
    for nm in plan.prefix_names:
        cols[nm] = plan.prefix[nm][prow]
    for nm in plan.suffix_names:
        cols[nm] = plan.pat[nm][local]
    cols["num_procs"] = np.full(n, ctx.num_procs, dtype=np.int64)
    cols["datatype"] = np.full(n, CHOICES["datatype"].index(ctx.datatype), dtype=np.int8)
    cols["training"] = np.full(n, ctx.training, dtype=bool)
    out = {}
    for f in ALL_FIELDS:
        c = cols[f]
        dt = _out_dtype(f)
        out[f] = c if c.dtype == dt else c.astype(dt)
    return out
