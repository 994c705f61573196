"""Hardware dimensions: the system fields a co-design search varies, and their cost.

A co-design file's ``hardware:`` section maps a field path of the system
(Calculon's system JSON, e.g. ``mem1.GiB``, ``mem2.GBps``,
``networks[0].size``, ``networks[1].bandwidth``, ``matrix.float16.tflops``)
or ``num_procs`` to a domain::

    hardware:
      num_procs: [1024, 2048, 4096]            # a list
      mem1.GiB: {values: [40, 80, 160], cost: 12}
      mem1.GBps: {min: 1500, max: 3000, step: 500, cost: 0.5}   # linear grid
      mem2.GBps: {min: 50, max: 500, num: 4, log: true}         # log grid, 4 points
      networks[1].bandwidth: {min: 12.5, max: 100, log: true}   # continuous (samplers only)
    cost:
      processor: 10000      # per processor
      fixed: 0              # once per system

``cost`` (per unit, per processor) is optional on every dimension, so a
system's cost is ``fixed + num_procs * (processor + sum(cost_d * value_d))``
over the active dimensions.  A ``mem2.GiB`` of 0 means the system has no
second memory tier: then the other ``mem2.*`` dimensions are inactive (not
sampled, not costed, left at the base system's values).

Every sampled system is rebuilt from the base system's JSON and validated by
``autopar.io.specs.load_system``, so it is a valid system (``networks[0].size``
keeps its ``must_be_filled`` meaning: layouts must fill that domain).
"""
from __future__ import annotations

import copy
import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

from autopar.io.errors import (MAX_GRID_SYSTEMS, MAX_PROCS, MAX_RANGE_POINTS, SpecError,
                               brief)
from autopar.io.specs import SystemSpec, load_system

PROCS = "num_procs"
DIM_KEYS = ("values", "min", "max", "step", "num", "log", "cost")
COST_KEYS = ("processor", "fixed")
INT_LEAVES = ("size",)          # system fields that are integers
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*$")
_TOKEN = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_NO_TIER2 = "mem2.GiB"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------
# Field paths

def parse_path(path: str) -> tuple:
    """``networks[1].bandwidth`` -> ('networks', 1, 'bandwidth'); ValueError if malformed."""
    if not isinstance(path, str) or not _PATH.match(path):
        raise ValueError("expected a field path such as mem1.GiB or networks[0].size")
    return tuple(name if name else int(idx) for name, idx in _TOKEN.findall(path))


def get_path(obj, keys: tuple):
    for k in keys:
        if isinstance(k, int):
            if not isinstance(obj, list) or k >= len(obj):
                raise KeyError(k)
        elif not isinstance(obj, Mapping) or k not in obj:
            raise KeyError(k)
        obj = obj[k]
    return obj


def set_path(obj, keys: tuple, value) -> None:
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value


# --------------------------------------------------------------------------
# Domains

@dataclass(frozen=True)
class Dim:
    """One searched dimension: a finite list of values or a range."""
    name: str                          # the field path, or "num_procs"
    keys: tuple                        # parsed path (empty for num_procs)
    integer: bool
    values: tuple | None = None        # discrete domain (list or gridded range)
    low: float | None = None           # continuous range (values is None)
    high: float | None = None
    log: bool = False
    cost: float = 0.0                  # per unit, per processor

    @property
    def discrete(self) -> bool:
        return self.values is not None

    def suggest(self, trial):
        """The value an Optuna trial proposes for this dimension."""
        if self.discrete:
            return trial.suggest_categorical(self.name, list(self.values))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def extremes(self) -> tuple:
        return (min(self.values), max(self.values)) if self.discrete else (self.low, self.high)


def _grid(src, fld, lo, hi, step, num, log, integer) -> tuple:
    if step is not None:
        if log:
            raise SpecError(src, f"{fld}.step", "a log range takes num (points), not step")
        if not _number(step) or step <= 0:
            raise SpecError(src, f"{fld}.step", f"expected a number > 0, got {brief(step)}")
        k = int(math.floor((hi - lo) / step + 1e-9))
        if k + 1 > MAX_RANGE_POINTS:
            raise SpecError(src, f"{fld}.step", f"makes {k + 1:,} points; at most "
                                                f"{MAX_RANGE_POINTS:,} a range")
        vals = [lo + i * step for i in range(k + 1)]
    else:
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise SpecError(src, f"{fld}.num", f"expected an integer >= 1, got {brief(num)}")
        if num > MAX_RANGE_POINTS:
            raise SpecError(src, f"{fld}.num", f"at most {MAX_RANGE_POINTS:,} points a range, "
                                               f"got {num:,}")
        if num == 1:
            vals = [lo]
        elif log:
            r = math.log(hi / lo)
            vals = [lo * math.exp(r * i / (num - 1)) for i in range(num)]
        else:
            vals = [lo + (hi - lo) * i / (num - 1) for i in range(num)]
        vals[-1] = hi
    if integer:
        vals = [int(round(v)) for v in vals]
    else:
        vals = [float(f"{v:.6g}") for v in vals]
        vals = [int(v) if v.is_integer() else v for v in vals]
    return tuple(dict.fromkeys(vals))


def parse_dim(src: str, name: str, spec, integer: bool, minimum: float | None) -> Dim:
    """One ``hardware:`` entry -> Dim (SpecError naming ``hardware.<name>``)."""
    fld = f"hardware.{name}"
    keys = () if name == PROCS else parse_path(name)
    if isinstance(spec, list):
        spec = {"values": spec}
    if not isinstance(spec, Mapping):
        raise SpecError(src, fld, f"expected a list of values or a mapping with values or "
                                  f"min/max, got {brief(spec)}")
    for k in spec:
        if k not in DIM_KEYS:
            raise SpecError(src, f"{fld}.{k}", f"unknown key; expected one of {', '.join(DIM_KEYS)}")
    cost = spec.get("cost", 0)
    if not _number(cost) or cost < 0:
        raise SpecError(src, f"{fld}.cost", f"expected a number >= 0, got {brief(cost)}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpecError(src, f"{fld}.log", f"expected true or false, got {brief(log)}")
    kind = "integers" if integer else "numbers"

    def check(v, where):
        ok = (isinstance(v, int) and not isinstance(v, bool)) if integer else _number(v)
        if not ok:
            raise SpecError(src, where, f"expected {kind}, got {brief(v)}")
        if minimum is not None and v < minimum:
            raise SpecError(src, where, f"must be >= {minimum:g}, got {brief(v)}")
        if name == PROCS and v > MAX_PROCS:
            raise SpecError(src, where, f"must be at most {MAX_PROCS:,}, got {brief(v)}")
        return v

    if "values" in spec:
        extra = [k for k in ("min", "max", "step", "num", "log") if k in spec]
        if extra:
            raise SpecError(src, f"{fld}.{extra[0]}", "give either values or a min/max range, not both")
        vals = spec["values"]
        if not isinstance(vals, list) or not vals:
            raise SpecError(src, f"{fld}.values", f"expected a non-empty list, got {brief(vals)}")
        vals = tuple(check(v, f"{fld}.values[{i}]") for i, v in enumerate(vals))
        if len(set(vals)) != len(vals):
            raise SpecError(src, f"{fld}.values", "lists a value twice")
        return Dim(name, keys, integer, values=vals, cost=float(cost))
    for k in ("min", "max"):
        if k not in spec:
            raise SpecError(src, f"{fld}.{k}", "missing (a range needs min and max; or give values)")
    lo, hi = check(spec["min"], f"{fld}.min"), check(spec["max"], f"{fld}.max")
    if hi < lo:
        raise SpecError(src, f"{fld}.max", f"must be >= min ({brief(lo)}), got {brief(hi)}")
    if log and lo <= 0:
        raise SpecError(src, f"{fld}.min", f"a log range needs min > 0, got {brief(lo)}")
    if "step" in spec and "num" in spec:
        raise SpecError(src, f"{fld}.num", "give step or num, not both")
    if "step" in spec or "num" in spec:
        if integer and "step" in spec:
            check(spec["step"], f"{fld}.step")
        vals = _grid(src, fld, lo, hi, spec.get("step"), spec.get("num"), log, integer)
        return Dim(name, keys, integer, values=vals, log=log, cost=float(cost))
    return Dim(name, keys, integer, low=lo, high=hi, log=log, cost=float(cost))


# --------------------------------------------------------------------------
# Systems with substituted values

def build_system(base_json: Mapping, values: Mapping, source: str = "system") -> SystemSpec:
    """The base system's JSON with ``values`` (path -> value) substituted,
    validated by ``load_system``.  ``mem2.GiB`` 0 is a system without a second
    memory tier."""
    d = copy.deepcopy(dict(base_json))
    for path, v in values.items():
        if path != PROCS:
            set_path(d, parse_path(path), v)
    return load_system(d, source=source)


# --------------------------------------------------------------------------
# The hardware space

@dataclass(frozen=True)
class Hardware:
    """The searched system dimensions of a co-design study, and its cost model."""
    source: str
    base: Mapping                  # the base system's JSON
    dims: tuple                    # Dim, in file order, num_procs first when searched
    num_procs: int | None          # fixed processor count (None: searched)
    processor_cost: float = 0.0
    fixed_cost: float = 0.0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def discrete(self) -> bool:
        return all(d.discrete for d in self.dims)

    def dim(self, name: str) -> Dim:
        return next(d for d in self.dims if d.name == name)

    def active(self, name: str, values: Mapping) -> bool:
        """Whether a dimension matters given the others (``mem2.*`` needs a tier)."""
        if name.startswith("mem2.") and name != _NO_TIER2:
            return values.get(_NO_TIER2, self.base["mem2"]["GiB"]) != 0
        return True

    def canonical(self, values: Mapping) -> dict:
        """``values`` restricted to the active dimensions, in dimension order."""
        return {d.name: values[d.name] for d in self.dims
                if d.name in values and self.active(d.name, values)}

    def procs(self, values: Mapping) -> int:
        return int(values[PROCS]) if PROCS in values else int(self.num_procs)

    def system(self, values: Mapping) -> SystemSpec:
        sys_values = {k: v for k, v in self.canonical(values).items() if k != PROCS}
        return build_system(self.base, sys_values, source=f"{self.source}: system")

    def cost(self, values: Mapping) -> float:
        vals = self.canonical(values)
        per_proc = self.processor_cost + sum(d.cost * float(vals[d.name]) for d in self.dims
                                             if d.name != PROCS and d.name in vals)
        return self.fixed_cost + self.procs(values) * per_proc

    def max_cost(self) -> float:
        """The cost of the dearest system of the space (hypervolume reference)."""
        return self.cost({d.name: d.extremes()[1] for d in self.dims})

    def grid(self) -> Iterator[dict]:
        """Every distinct system of a discrete space (inactive dimensions
        collapsed), in file order (the last dimension varies fastest)."""
        if not self.discrete:
            raise SpecError(self.source, "hardware", "a continuous range cannot be enumerated: "
                                                     "give it step or num")
        seen = set()
        for combo in itertools.product(*(d.values for d in self.dims)):
            vals = self.canonical(dict(zip(self.names, combo)))
            key = tuple(vals.items())
            if key not in seen:
                seen.add(key)
                yield vals

    def size(self) -> int:
        return sum(1 for _ in self.grid())

    def suggest(self, trial) -> dict:
        """Define-by-run: the dimensions an Optuna trial proposes (inactive ones skipped)."""
        vals: dict = {}
        for d in self.dims:
            if self.active(d.name, vals):
                vals[d.name] = d.suggest(trial)
        return vals

    def key(self, values: Mapping) -> tuple:
        return tuple(self.canonical(values).items())

    def to_dict(self) -> dict:
        """Plain data (Ray task payloads)."""
        hw = {}
        for d in self.dims:
            e: dict = {"cost": d.cost}
            if d.discrete:
                e["values"] = list(d.values)
            else:
                e.update({"min": d.low, "max": d.high, "log": d.log})
            hw[d.name] = e
        return {"source": self.source, "base": dict(self.base), "hardware": hw,
                "num_procs": self.num_procs,
                "cost": {"processor": self.processor_cost, "fixed": self.fixed_cost}}


def hardware_from_dict(d: Mapping) -> Hardware:
    return parse_hardware(d["source"], d["hardware"], d["cost"], d["base"], d["num_procs"])


def parse_hardware(src: str, hardware, cost, base_json: Mapping,
                   num_procs: int | None) -> Hardware:
    """Check a ``hardware:`` section (and ``cost:``) against the base system.

    Every value of a discrete domain (and both ends of a range) is tried on
    the base system, so a value the system format rejects (a negative
    bandwidth, an efficiency above 1) is reported here, naming the field.
    """
    if hardware is None:
        hardware = {}
    if not isinstance(hardware, Mapping):
        raise SpecError(src, "hardware", f"expected a mapping of field path -> domain, got {brief(hardware)}")
    if cost is None:
        cost = {}
    if not isinstance(cost, Mapping):
        raise SpecError(src, "cost", f"expected a mapping with {', '.join(COST_KEYS)}, got {brief(cost)}")
    for k in cost:
        if k not in COST_KEYS:
            raise SpecError(src, f"cost.{k}", f"unknown key; expected one of {', '.join(COST_KEYS)} "
                                              "(per-dimension costs go in hardware.<path>.cost)")
    costs = {}
    for k in COST_KEYS:
        v = cost.get(k, 0)
        if not _number(v) or v < 0:
            raise SpecError(src, f"cost.{k}", f"expected a number >= 0, got {brief(v)}")
        costs[k] = float(v)
    dims = []
    for name, spec in hardware.items():
        fld = f"hardware.{name}"
        if not isinstance(name, str):
            raise SpecError(src, "hardware", f"expected field paths as keys, got {brief(name)}")
        if name == PROCS:
            dims.append(parse_dim(src, name, spec, integer=True, minimum=1))
            continue
        try:
            keys = parse_path(name)
            current = get_path(base_json, keys)
        except ValueError as e:
            raise SpecError(src, fld, str(e)) from None
        except KeyError:
            raise SpecError(src, fld, "no such field in the base system") from None
        if not _number(current):
            raise SpecError(src, fld, f"not a numeric field of the system (it holds {brief(current)})")
        integer = keys[-1] in INT_LEAVES
        dims.append(parse_dim(src, name, spec, integer=integer, minimum=0))
    dims.sort(key=lambda d: d.name != PROCS)            # num_procs first
    names = [d.name for d in dims]
    if PROCS not in names and num_procs is None:
        raise SpecError(src, "case.num_procs", "missing (give it in case or as hardware.num_procs)")
    if PROCS in names and num_procs is not None:
        raise SpecError(src, "case.num_procs", "given both here and as hardware.num_procs")
    if _NO_TIER2 in names:      # the tier-dependent ones come after mem2.GiB
        dims.sort(key=lambda d: (d.name != PROCS, d.name.startswith("mem2.") and d.name != _NO_TIER2))
    grid = math.prod(len(d.values) for d in dims if d.discrete)
    if grid > MAX_GRID_SYSTEMS:
        raise SpecError(src, "hardware", f"a grid of {grid:,} systems; at most "
                                         f"{MAX_GRID_SYSTEMS:,}")
    hw = Hardware(source=src, base=dict(base_json), dims=tuple(dims), num_procs=num_procs,
                  processor_cost=costs["processor"], fixed_cost=costs["fixed"])
    # Every value on its own must give a valid system.
    for d in hw.dims:
        if d.name == PROCS:
            continue
        for v in (d.values if d.discrete else (d.low, d.high)):
            try:
                build_system(base_json, {d.name: v}, source=src)
            except SpecError as e:
                raise SpecError(src, f"hardware.{d.name}",
                                f"value {brief(v)} makes an invalid system: {e.field}: {e.message}"
                                ) from None
    return hw
