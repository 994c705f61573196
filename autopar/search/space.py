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

The file itself is read by ``autopar.io.spaces``; the rules are in
``autopar.search.domains`` and the vectorised enumeration in
``autopar.search.enumeration``.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

import numpy as np

from autopar.io.layouts import (ALL_FIELDS, BOOL_FIELDS, CHOICES, EXT_DEFAULTS, SPLIT_FIELDS,
                                decoder_layer_counts)
from autopar.io.spaces import (BATCH_POLICIES, DEFAULT_SKELETON, DERIVED,  # noqa: F401
                               NET_FIELDS, OPTIONAL, PARAMS, Allowed, SpaceSpec, read_space,
                               value_kind)
from autopar.io.specs import FP8_MATRIX, SpecError, brief
from autopar.search.domains import RULES, Rule, divisors  # noqa: F401
from autopar.search.enumeration import Plan, build_plan, materialize

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
    fp8: tuple = ()       # fp8 recipes the system's matrix rates allow
    experts: int = 0      # routed experts (0: a dense model)
    expert_ff: int = 0    # an expert's feed-forward size
    mla: bool = False     # latent attention (TP communication not overlapped)
    uneven: bool = False  # the space searches or fixes a pipeline split field
    hybrid: bool = False  # a hybrid layer pattern (no context_par; even virtual stages)
    # gcd of the Mamba heads and groups and the Gated DeltaNet key and value
    # heads, which tensor_par must divide (0: no such layers)
    mamba_tp: int = 0
    # the decoder-layer counts an explicit pipeline layout of the model may
    # hold (autopar.io.layouts.decoder_layer_counts) and its MTP layers
    layer_counts: tuple = ()
    mtp: int = 0


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


def _check_tiers(case: Case, space: "Space") -> None:
    """A network tier a space names must exist in the case's system (else the
    search would silently leave those layouts out)."""
    n = len(case.system.networks)
    for f in NET_FIELDS:
        a = space.allowed.get(f)
        named = list(a.values or ()) + [a.low] if a is not None else []
        if f in space.fixed:
            named.append(space.fixed[f])
        bad = sorted({v for v in named if isinstance(v, int) and v >= n})
        if bad:
            where = f"fixed.{f}" if f in space.fixed else f"params.{f}"
            raise SpecError(space.source, where, f"network tier {bad[0]} is beyond the "
                            f"system's {n} tier(s) (0..{n - 1}) of {case.system.source}")


def layout_context(case: Case, space: "Space") -> _Ctx:
    _check_case(case)
    _check_tiers(case, space)
    m, s = case.model, case.system
    return _Ctx(num_procs=int(case.num_procs), hidden=int(m.hidden),
                heads=int(m.attn_heads), blocks=int(m.num_blocks),
                seq=int(m.seq_size), nets=len(s.networks),
                mem2=float(s.mem2.GiB) > 0, training=bool(case.training),
                max_batch=int(case.max_batch_size),
                policy=case.batch_policy or space.batch_policy,
                datatype=case.datatype,
                fp8=tuple(r for r in CHOICES["fp8_recipe"][1:]
                          if FP8_MATRIX[r] in s.matrix),
                experts=int(m.moe.experts) if getattr(m, "moe", None) else 0,
                expert_ff=int(m.moe.expert_feedforward) if getattr(m, "moe", None) else 0,
                mla=getattr(m, "mla", None) is not None,
                hybrid=bool(getattr(m, "hybrid_pattern", "")),
                mamba_tp=_mixer_heads_gcd(m),
                layer_counts=decoder_layer_counts(m), mtp=int(getattr(m, "mtp", 0) or 0),
                uneven=any(f in space.allowed or space.fixed.get(f, EXT_DEFAULTS[f])
                           != EXT_DEFAULTS[f] for f in SPLIT_FIELDS))


def _mixer_heads_gcd(m) -> int:
    """The gcd of the head counts a hybrid model's mixers split over
    tensor_par (Mamba-2 heads and groups, Gated DeltaNet key and value
    heads; autopar.model.rules._check_hybrid), 0 with none."""
    counts = []
    if getattr(m, "mamba", None) is not None:
        counts += [m.mamba.heads, m.mamba.groups]
    if getattr(m, "gdn", None) is not None:
        counts += [m.gdn.key_heads, m.gdn.value_heads]
    return math.gcd(*counts) if counts else 0


# --------------------------------------------------------------------------
# The space

class Space:
    """A search space; see the module docstring and search_spaces/README.md."""

    def __init__(self, spec: SpaceSpec):
        self.spec = spec
        self.name, self.description, self.source = spec.name, spec.description, spec.source
        self.batch_policy = spec.batch_policy
        self.allowed = dict(spec.allowed)
        self.fixed = dict(spec.fixed)
        self.skeleton_given = spec.skeleton
        self.searched: tuple[str, ...] = tuple(p for p in PARAMS if p in self.allowed)
        # The skeleton: as the file says, else the default's searched parameters.
        self.skeleton: tuple[str, ...] = spec.skeleton if spec.skeleton is not None else tuple(
            p for p in DEFAULT_SKELETON if p in self.allowed)
        self._rules = RULES
        self._index = {r.name: i for i, r in enumerate(RULES)}
        # live[i]: names read by nodes after i (what a state must carry past i)
        self._live: list[tuple[str, ...]] = []
        for i in range(len(RULES)):
            later = {d for r in RULES[i + 1:] for d in r.deps}
            self._live.append(tuple(n for n in (r.name for r in RULES[:i + 1]) if n in later))
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
        return self.spec.to_dict()

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
            allowed[p] = Allowed(values=(v,)) if self.allowed[p].ok(v) else Allowed(values=())
        return Space(replace(self.spec, allowed=allowed))

    def within(self, options: Mapping, who: str = "the framework") -> "Space":
        """This space cut down to what a framework can express (``options``:
        per execution field, the values it can run, as a framework spec's
        ``options``): a searched field keeps only those values; a fixed field
        must be one of them.  SpecError (naming this space's file and the
        field) where nothing of a field would be left: a search must not
        recommend a layout the framework cannot run."""
        allowed, spec = dict(self.allowed), self.spec
        for f, vals in options.items():
            vals = tuple(vals)
            can = ", ".join(map(str, vals))
            if f in allowed:
                keep = tuple(v for v in vals if allowed[f].ok(v))
                if not keep:
                    raise SpecError(self.source, f"params.{f}",
                                    f"allows none of the values {who} can run ({can})")
                allowed[f] = Allowed(values=keep)
            elif f in self.fixed and self.fixed[f] not in vals:
                raise SpecError(self.source, f"fixed.{f}",
                                f"{brief(self.fixed[f])} cannot be run by {who} (it can: {can})")
        return Space(replace(spec, allowed=allowed))

    def skeletons(self, case: Case, names: tuple[str, ...] | None = None) -> list[tuple]:
        """Every combination of the ``names`` parameters (default: the
        skeleton) that at least one layout of the space has, in enumeration
        order; each a tuple in ``names`` order (define-by-run order)."""
        names = self.skeleton if names is None else tuple(names)
        for p in names:
            if p not in self.allowed:
                raise ValueError(f"{p!r} is not searched in space {self.name!r}")
        order = tuple(p for p in PARAMS if p in names)
        ctx = layout_context(case, self)
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

    def _domain(self, ctx: _Ctx, rule: Rule, state: Mapping) -> tuple:
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
        ctx = layout_context(case, self)
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
        ctx = layout_context(case, self)
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
        return self._plan(layout_context(case, self)).size

    # -- one layout ---------------------------------------------------------

    def complete(self, case: Case, params: Mapping, normalize: bool = False) -> dict:
        """Searched values -> the full 23-field Calculon execution dict.

        Fixed parameters, data_par and batch_size (0 when the policy gives
        none) are filled in.  With ``normalize``, parameters whose option does
        not apply (e.g. tensor_par_net when tensor_par is 1) take their
        forced value whatever ``params`` says.
        """
        ctx = layout_context(case, self)
        state: dict = {}
        for rule in self._rules:
            try:
                cands, forced = rule.fn(ctx, state)
            except (ZeroDivisionError, TypeError, KeyError):
                cands, forced = (), None     # an earlier value is out of range
            if rule.name == "data_par":
                tp, pp = state["tensor_par"], state["pipeline_par"]
                cp = state.get("context_par", 1) or 0
                v = cands[0] if cands else (ctx.num_procs // (tp * pp * cp) if tp and pp and cp
                                            else 0)
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
        ctx = layout_context(case, self)
        ex = dict(execution)
        for f, want in (("num_procs", ctx.num_procs), ("datatype", ctx.datatype),
                        ("training", ctx.training)):
            if f in ex and ex[f] != want:
                return f"invalid: {f} {brief(ex[f])} is not the case's {want!r}"
        for f in ALL_FIELDS:
            if f in ex and not _typed(f, ex[f]):
                return f"invalid: {f} {brief(ex[f])} is not a valid {value_kind(f)} value"
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
                elif name in EXT_DEFAULTS:
                    # Extension fields are written only where they differ
                    # from their defaults (``complete``, ``layouts.record``).
                    v = EXT_DEFAULTS[name]
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
            cp = state.get("context_par", 1)
            if cp != 1:
                return (f"tensor_par*pipeline_par*context_par ({state['tensor_par']}*"
                        f"{state['pipeline_par']}*{cp}) does not divide num_procs {ctx.num_procs}")
            return (f"tensor_par*pipeline_par ({state['tensor_par']}*{state['pipeline_par']}) "
                    f"does not divide num_procs {ctx.num_procs}")
        dp = state["data_par"]
        if ctx.policy == "fixed":
            return f"data_par {dp} does not divide the batch {ctx.max_batch} (batch policy fixed)"
        return f"data_par {dp} exceeds the maximum batch size {ctx.max_batch}"

    def _derived_mismatch(self, ctx, name, state, v, want) -> str:
        if name == "data_par":
            if state.get("context_par", 1) != 1:
                return (f"data_par {brief(v)} is not num_procs/(tensor_par*pipeline_par*"
                        f"context_par) = {want}")
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

    def _plan(self, ctx: _Ctx) -> Plan:
        key = ("plan", ctx)
        plan = self._cache.get(key)
        if plan is None:
            plan = self._cache[key] = build_plan(self, ctx)
        return plan

    def layouts(self, case: Case, start: int, stop: int) -> dict[str, np.ndarray]:
        """Layouts ``start:stop`` (enumeration order) as a layout table."""
        ctx = layout_context(case, self)
        plan = self._plan(ctx)
        start, stop = max(0, int(start)), min(int(stop), plan.size)
        return materialize(ctx, plan, start, max(start, stop))

    def enumerate(self, case: Case, chunk_size: int = 1 << 20) -> Iterator[dict[str, np.ndarray]]:
        """Layout tables of at most ``chunk_size`` rows covering the space once,
        in define-by-run order (Calculon's loop order for calculon.yaml)."""
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        ctx = layout_context(case, self)
        plan = self._plan(ctx)
        for a in range(0, plan.size, chunk_size):
            yield materialize(ctx, plan, a, min(a + chunk_size, plan.size))


def framework_space(space, framework=None) -> "Space":
    """A space (as ``load_space`` takes it) under a training framework (spec,
    name, path or dict; None: the space as it is): ``Space.within`` the
    framework's ``options``, what ``exhaustive`` and ``tune`` search with
    ``--framework``."""
    space = load_space(space)
    if framework is None:
        return space
    from autopar.io.frameworks import load_framework
    fw = load_framework(framework)
    return space.within(fw.options, f"framework {fw.name}") if fw.options else space


def load_space(spec, source: str | None = None) -> "Space":
    """A space file (YAML), a dict, a SpaceSpec or a Space -> Space.  SpecError
    on bad input (``autopar.io.spaces.read_space``).

    A relative path that is not found is also looked up relative to the
    project root, and a bare name (``calculon``) names
    ``search_spaces/<name>.yaml``.
    """
    if isinstance(spec, Space):
        return spec
    if not isinstance(spec, SpaceSpec):
        spec = read_space(spec, source)
    return Space(spec)


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
