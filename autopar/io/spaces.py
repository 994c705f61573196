"""Space files: which execution parameters a search varies, which it fixes.

A space file (YAML, see ``search_spaces/README.md``) or mapping is read here,
once and whole, into a ``SpaceSpec``: for each parameter of ``PARAMS``
either the values a search may take (``Allowed``: every value the rules
derive, a list, or a range) or a fixed value.  What the values mean for a
case (divisors, network tiers, options that need another) is the search's
business: ``autopar.search.space`` turns a ``SpaceSpec`` into a ``Space``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.io.errors import SpecError, brief
from autopar.io.layouts import BOOL_FIELDS, CHOICES, EXT_DEFAULTS, layout_code
from autopar.io.specs import read_yaml

# The parameters a space decides on, in define-by-run order (Calculon's loop
# nesting; fused_activation and attention_type, which Calculon fixes, sit
# where Calculon loops over fused_activation).
PARAMS: tuple[str, ...] = (
    # the recipe of a training or fine-tuning job (issue 28), usually fixed;
    # first, as adapter_rank and adapter_targets depend on adapter (see below)
    "optimizer", "adapter", "adapter_rank", "adapter_targets", "sequence_fill",
    "attention_span", "optimizer_moment_bytes",
    "tensor_par", "pipeline_par", "context_par",
    # expert parallelism early: later nodes depend on it, and the nodes up to
    # the last one depended on are walked in Python (the prefix)
    "expert_par", "expert_tensor_par",
    "pipeline_interleaving",
    # uneven pipelines (issue 24): how the blocks split over the stages
    "pipeline_layout", "embedding_in_split", "loss_in_split", "first_stage_blocks",
    "last_stage_blocks",
    "activation_recompute", "recompute_layers", "optimizer_sharding", "weight_sharding",
    "sharding_group", "tensor_par_comm_type",
    "seq_par_ag_redo", "data_par_overlap", "tensor_par_overlap",
    "weight_offload", "activations_offload", "optimizer_offload", "activation_offload_blocks",
    "activation_offload_modules",
    "fused_activation", "attention_type", "microbatch_size",
    "tensor_par_net", "pipeline_par_net", "data_par_net",
    # autopar's extensions (optional in a file: when absent, fixed at their
    # defaults, which keep Calculon's meaning).
    "attention_impl", "fused_norm", "unsharded_grads",
    "context_par_net", "context_par_comm", "fp8_recipe", "bf16_first_blocks", "bf16_last_blocks",
    "fp32_grads", "param_gather_overlap", "recompute_moe_act", "recompute_mla_up_proj",
    "optimizer_outer_sharding",
    # mixture of experts (neutral for a dense model)
    "expert_par_net", "expert_tensor_par_net", "moe_dispatcher", "moe_overlap",
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
NET_FIELDS = ("tensor_par_net", "pipeline_par_net", "data_par_net", "context_par_net",
              "expert_par_net", "expert_tensor_par_net")
# Integer parameters whose smallest value is 0.
_ZERO_OK = NET_FIELDS + ("sharding_group", "recompute_layers", "first_stage_blocks",
                         "last_stage_blocks", "bf16_first_blocks", "bf16_last_blocks",
                         "attention_span", "activation_offload_blocks")



def value_kind(name: str) -> str:
    """'str', 'bool' or 'int': the type of a parameter's values."""
    if name in CHOICES:
        return "str"
    return "bool" if name in BOOL_FIELDS else "int"


def _value(src: str, where: str, name: str, v):
    """One allowed/fixed value, checked for its parameter's type."""
    kind = value_kind(name)
    if kind == "str":
        if name == "pipeline_layout" and isinstance(v, str) and v not in CHOICES[name]:
            # Megatron-Core's pipeline_model_parallel_layout (parsed once:
            # autopar.io.layouts.layout_code); the rules refuse it where the
            # pipeline sizes or the model's layers differ from its own
            try:
                layout_code(v)
            except ValueError as e:
                raise SpecError(src, where, f"{v!r}: {e}") from None
            return v
        if not isinstance(v, str) or v not in CHOICES[name]:
            raise SpecError(src, where, f"expected one of {', '.join(CHOICES[name])}, got {brief(v)}")
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise SpecError(src, where, f"expected true or false, got {brief(v)}")
        return v
    low = 0 if name in _ZERO_OK else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise SpecError(src, where, f"expected an integer >= {low}, got {brief(v)}")
    return v


@dataclass(frozen=True)
class Allowed:
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


def _allowed(src: str, name: str, spec) -> Allowed:
    where = f"params.{name}"
    if spec == "derived" or spec is None:
        return Allowed()
    if isinstance(spec, list):
        if not spec:
            raise SpecError(src, where, "an empty list allows nothing; fix the parameter or list values")
        vals = tuple(_value(src, f"{where}[{i}]", name, v) for i, v in enumerate(spec))
        if len(set(vals)) != len(vals):
            raise SpecError(src, where, "lists a value twice")
        return Allowed(values=vals)
    if isinstance(spec, dict):
        if value_kind(name) != "int":
            raise SpecError(src, where, "min/max apply to integer parameters only; list the values")
        extra = set(spec) - {"min", "max"}
        if extra or not spec:
            raise SpecError(src, where, f"expected keys min and/or max, got {', '.join(map(str, spec)) or 'none'}")
        lo = _value(src, f"{where}.min", name, spec["min"]) if "min" in spec else None
        hi = _value(src, f"{where}.max", name, spec["max"]) if "max" in spec else None
        if lo is not None and hi is not None and lo > hi:
            raise SpecError(src, where, f"min {lo} is above max {hi}")
        return Allowed(low=lo, high=hi)
    raise SpecError(src, where, f"expected 'derived', a list of values or {{min, max}}, got {brief(spec)}")


def _param_error(src: str, where: str, name: str) -> None:
    if name in FROM_CASE:
        raise SpecError(src, where, f"{name} is given by the case (command line), not by the space")
    if name in DERIVED:
        raise SpecError(src, where, f"{name} is derived (data_par = num_procs/(tensor_par*pipeline_par), "
                                    "batch_size by the batch policy); it cannot be searched or fixed")
    raise SpecError(src, where, f"unknown parameter {name!r}; parameters are: {', '.join(PARAMS)}")


@dataclass(frozen=True)
class SpaceSpec:
    """A space file, checked: searched parameters (``allowed``) and fixed ones."""
    name: str
    description: str
    batch_policy: str
    allowed: Mapping[str, Allowed] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    source: str = "dict"
    skeleton: tuple[str, ...] | None = None     # as the file says (None: the default)

    def to_dict(self) -> dict:
        """The space as the dict a YAML file would hold."""
        out = {"name": self.name, "description": self.description,
               "batch_policy": self.batch_policy,
               "params": {p: self.allowed[p].to_yaml() for p in PARAMS if p in self.allowed},
               "fixed": {p: self.fixed[p] for p in PARAMS if p in self.fixed}}
        if self.skeleton is not None:
            out["skeleton"] = list(self.skeleton)
        return out


def read_space(spec, source: str | None = None) -> SpaceSpec:
    """A space file (YAML) or a dict -> SpaceSpec.  SpecError on bad input.

    A relative path that is not found is looked up among the shipped spaces
    (``autopar.io.shipped.resolve``): ``search_spaces/small.yaml`` or a bare
    name (``calculon``) names a space that comes with autopar.
    """
    stem = "space"
    if isinstance(spec, (str, os.PathLike)):
        from autopar.io.shipped import resolve
        path = resolve(spec, "search_spaces")
        src = source or str(spec)
        if not path.is_file():
            raise SpecError(src, "file", "no such space file" if not path.exists() else "not a file")
        data = read_yaml(path, src, "file", syntax_field="yaml")
        stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    elif isinstance(spec, Mapping):
        data, src = dict(spec), source or "dict"
    else:
        raise SpecError(source or "space", "space",
                        f"expected a file path, a dict or a Space, got {type(spec).__name__}")
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
    allowed: dict[str, Allowed] = {}
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
    return SpaceSpec(name=name, description=desc, batch_policy=policy,
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
