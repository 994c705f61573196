"""What a launch format can express, field by field, and the typed reading of
a framework config's values with one-line errors.

Shared by the format modules (``torchtitan``, ``deepspeed``, ...): a format
lists, per execution field, the values its framework can state
(``refuse_values``, checked against a search space before any search and
against a layout before it is written), and reads the keys of a parsed
config through ``Keys``, which names the file and the dotted key in every
error.
"""
from __future__ import annotations

from typing import Mapping

from autopar.io.errors import SpecError, brief
from autopar.io.layouts import BOOL_FIELDS, CHOICES, EXT_DEFAULTS


# Recipe fields of issue 28 (``autopar.io.layouts``) that torchtitan's and
# DeepSpeed's configs are not written with: the optimizer (torchtitan 0.2.2,
# whose TOML autopar writes, builds Adam and AdamW only,
# torchtitan/components/optimizer.py; its later DistMuon is configured in
# Python; DeepSpeed widens this to Muon and Adafactor: deepspeed.py), the
# fine-tuning adapters (neither has LoRA in its config) and their rank and
# targets, the recipes' BF16 blocks, and Megatron-Core's output-discarding
# recompute of the experts' activation and MLA's up projections
# (``recompute_moe_act``, ``recompute_mla_up_proj``).  A layout with another value is
# refused in one line; a config read back states these defaults.
# ``sequence_fill`` (the real tokens of padded sequences) is the data's, not
# the config's: not written (a format's ``UNSTATED``).
RECIPE_DEFAULTS = {f: EXT_DEFAULTS[f] for f in ("optimizer", "adapter", "adapter_rank",
                                                "adapter_targets", "bf16_first_blocks",
                                                "bf16_last_blocks", "recompute_moe_act",
                                                "recompute_mla_up_proj",
                                                "optimizer_moment_bytes")}
RECIPE_EXPRESSIBLE = {"optimizer": ("adam",), "adapter": ("none",),
                      "bf16_first_blocks": (0,), "bf16_last_blocks": (0,),
                      "recompute_moe_act": (False,), "recompute_mla_up_proj": (False,),
                      # fp32 moments only (bf16 ones: Megatron-Core's
                      # precision-aware optimizer, mcore.py)
                      "optimizer_moment_bytes": (4,)}


def space_values(space, field: str):
    """The values of ``field`` a search space may choose (a tuple), or None
    where any integer the rules allow may come.  A field the space does not
    name is held at its default (``EXT_DEFAULTS``)."""
    fixed = getattr(space, "fixed", {}) or {}
    if field in fixed:
        return (fixed[field],)
    allowed = (getattr(space, "allowed", {}) or {}).get(field)
    if allowed is None:
        return (EXT_DEFAULTS[field],) if field in EXT_DEFAULTS else None
    if field in CHOICES:
        return tuple(v for v in CHOICES[field] if allowed.ok(v))
    if field in BOOL_FIELDS:
        return tuple(v for v in (True, False) if allowed.ok(v))
    return tuple(allowed.values) if allowed.values is not None else None


def refuse_values(fmt: str, space, expressible: Mapping[str, tuple],
                  why: Mapping[str, str] | None = None) -> str | None:
    """Why ``fmt`` cannot write any layout of ``space``: a field whose every
    value the space may choose is one the format cannot state (None: none);
    ``why``: the framework's reason per field, where the format gives one."""
    for f, ok in expressible.items():
        vals = space_values(space, f)
        if vals is not None and vals and not any(v in ok for v in vals):
            shown = ", ".join(str(v) for v in vals)
            name = getattr(space, "name", "") or "the space"
            return (f"{fmt}: space {name} has {f} = {shown}; {fmt} can state only "
                    f"{', '.join(str(v) for v in ok)}" + _because(f, why))
    return None


def refuse_fields(fmt: str, execution: Mapping, expressible: Mapping[str, tuple],
                  why: Mapping[str, str] | None = None) -> str | None:
    """The first field of ``execution`` (extension fields at their defaults
    where absent) whose value ``fmt`` cannot state (None: none); ``why`` as
    for ``refuse_values``."""
    for f, ok in expressible.items():
        v = execution.get(f, EXT_DEFAULTS.get(f))
        if v not in ok:
            return (f"{fmt}: the layout has {f}={v}; {fmt} can state only "
                    f"{', '.join(str(x) for x in ok)}" + _because(f, why))
    return None


def _because(field: str, why: Mapping[str, str] | None) -> str:
    return f" ({why[field]})" if why and field in why else ""


def states(expressible: Mapping[str, tuple]):
    """``LaunchFormat.writes`` of a format that lists its values per field:
    whether it can state ``value`` of ``field`` (a field it does not list:
    any)."""
    return lambda field, value: field not in expressible or value in expressible[field]


def json_object(text: str, source: str, what: str) -> "tuple[dict, Keys]":
    """A JSON config's top-level object and its ``Keys``; one line naming the
    file where the text is not JSON or not an object (``what``: the config
    it should be)."""
    import json
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        Keys({}, source).fail("(file)", f"invalid JSON at line {e.lineno} column {e.colno}: "
                                        f"{e.msg}")
    k = Keys(data, source)
    if not isinstance(data, dict):
        k.fail("(root)", f"expected a JSON object ({what})")
    return data, k


def full(execution: Mapping) -> dict:
    """An execution with every extension field, at its default where absent."""
    return {**EXT_DEFAULTS, **execution}


class Keys:
    """Typed values of a parsed config (nested dicts), each error one line
    naming the file and the dotted key."""

    def __init__(self, data: Mapping, source: str):
        self.data, self.source = data, source

    def fail(self, key: str, message: str):
        raise SpecError(self.source, key, message)

    def raw(self, key: str, default=None):
        """The value at the dotted ``key`` (``default`` where a part is absent)."""
        node = self.data
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, Mapping):
                self.fail(".".join(parts[:i]), f"expected a table/object, got {brief(node)}")
            if part not in node:
                return default
            node = node[part]
        return node

    def has(self, key: str) -> bool:
        return self.raw(key, _ABSENT) is not _ABSENT

    def table(self, key: str) -> Mapping:
        v = self.raw(key, {})
        if not isinstance(v, Mapping):
            self.fail(key, f"expected a table/object, got {brief(v)}")
        return v

    def int(self, key: str, default=None, minimum: int | None = None, allow=()):
        v = self.raw(key, default)
        if v in allow and not isinstance(v, bool):
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, f"expected an integer, got {brief(v)}")
        if minimum is not None and v < minimum:
            self.fail(key, f"must be >= {minimum}, got {v}")
        return v

    def bool(self, key: str, default=None):
        v = self.raw(key, default)
        if not isinstance(v, bool):
            self.fail(key, f"expected true or false, got {brief(v)}")
        return v

    def choice(self, key: str, choices, default=None):
        v = self.raw(key, default)
        if v not in choices or isinstance(v, bool):
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            self.fail(key, f"unknown value {brief(v)} (autopar reads: {shown})")
        return v


_ABSENT = object()


def divides(a: int, b: int) -> bool:
    return b > 0 and a % b == 0
