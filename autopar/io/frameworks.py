"""Framework specs: what a training framework holds and does, as an input.

A framework file (``frameworks/<name>.json``, read like the model and system
files) says what the software adds to the model's own tensors and work; the
system file keeps the hardware.  Its records:

* ``memory_overhead`` / ``time_overhead`` (``MemoryOverhead`` /
  ``TimeOverhead`` of ``autopar.io.specs``, the same records a system file
  may still carry): reserved memory, allocator growth, the loss's logits
  handling, full-recompute checkpoints split over tensor_par, the master
  weights' bytes, pipeline synchronisation, MoE host syncs;
* ``memory_headroom`` (optional): the margin a recommended layout keeps,
  as ``autopar calibrate`` writes it;
* ``defaults``: execution fields the framework's recipe applies when a run
  does not state them (checked against ``autopar.io.layouts``; applied by
  ``load_execution(..., defaults=framework.defaults)``);
* ``options``: per execution field, the values the framework can express
  (a field not listed: any value);
* ``free``: the dotted record fields that are free constants, fitted by
  ``autopar calibrate`` (everything else is counted);
* ``citations``: term -> the source file/function or documentation page it
  is counted from (docs/validation.md, "Framework specs", has them all).

``with_framework(system, framework)`` is the one place a framework acts: the
system with the framework's records, so the model keeps reading
``system.memory_overhead`` / ``system.time_overhead``.  Without a framework
everything is as before (a system file's own records, else Calculon's count).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from autopar.io.errors import SpecError
from autopar.io.layouts import ALL_FIELDS, CHOICES, EXT_DEFAULTS
from autopar.io.specs import (MemoryHeadroom, MemoryOverhead, SystemSpec, TimeOverhead,
                              Checker, kind_of, execution_value, memory_headroom_json,
                              memory_overhead_json, read_json, read_memory_headroom,
                              read_memory_overhead, read_time_overhead, time_overhead_json)

FRAMEWORK_KEYS = ("name",)
FRAMEWORK_OPTIONAL_KEYS = ("description", "memory_overhead", "time_overhead",
                           "memory_headroom", "defaults", "options", "free", "citations")
# The record fields ``free`` may name (what ``autopar calibrate`` can fit).
RECORD_FIELDS = {
    "memory_overhead": tuple(f.name for f in dataclasses.fields(MemoryOverhead)),
    "time_overhead": tuple(f.name for f in dataclasses.fields(TimeOverhead)),
    "memory_headroom": tuple(f.name for f in dataclasses.fields(MemoryHeadroom)),
}


@dataclass(frozen=True)
class FrameworkSpec:
    """A training framework (see the module docstring).  ``None`` records
    keep Calculon's meaning: nothing beyond the model's own tensors/work."""
    name: str
    description: str = ""
    memory_overhead: MemoryOverhead | None = None
    time_overhead: TimeOverhead | None = None
    memory_headroom: MemoryHeadroom | None = None
    defaults: Mapping[str, object] = field(default_factory=dict)
    options: Mapping[str, tuple] = field(default_factory=dict)
    free: tuple[str, ...] = ()
    citations: Mapping[str, str] = field(default_factory=dict)
    source: str = "dict"


def _resolve(path) -> Path:
    from autopar.io.shipped import resolve
    return resolve(path, kind="frameworks")


def load_framework(path_or_dict, source: str | None = None) -> FrameworkSpec:
    """A framework file, a shipped framework's name (``megatron-core``) or a
    dict -> FrameworkSpec; SpecError naming the file and field on bad input."""
    if isinstance(path_or_dict, FrameworkSpec):
        return path_or_dict
    if isinstance(path_or_dict, Mapping):
        data, src = dict(path_or_dict), source or "dict"
    elif isinstance(path_or_dict, (str, os.PathLike)):
        p = _resolve(path_or_dict)
        data, src = read_json(p), source or str(p)
        if not isinstance(data, dict):
            raise SpecError(src, "(root)", f"expected a JSON object (a framework), "
                                           f"got {kind_of(data)}")
    else:
        raise SpecError(source or "dict", "(root)", "expected a file path, a framework name "
                        f"or an object (a framework), got {kind_of(path_or_dict)}")
    c = Checker(src)
    c.keys(data, "", FRAMEWORK_KEYS, FRAMEWORK_OPTIONAL_KEYS)
    name = c.str(data["name"], "name")
    if not name:
        c.fail("name", "must not be empty")
    desc = c.str(data.get("description", ""), "description")
    memory = read_memory_overhead(c, data["memory_overhead"]) \
        if "memory_overhead" in data else None
    time = read_time_overhead(c, data["time_overhead"]) if "time_overhead" in data else None
    headroom = read_memory_headroom(c, data["memory_headroom"]) \
        if "memory_headroom" in data else None
    defaults = _fields(c, data.get("defaults", {}), "defaults",
                       lambda f, v, path: execution_value(c, f, v, path))
    options = _fields(c, data.get("options", {}), "options", lambda f, v, path: _values(c, f, v, path))
    free = data.get("free", [])
    if not isinstance(free, list):
        c.fail("free", f"expected a list of record fields, got {kind_of(free)}")
    for i, f in enumerate(free):
        c.str(f, f"free[{i}]")
        rec, _, name_ = f.partition(".")
        if name_ not in RECORD_FIELDS.get(rec, ()):
            allowed = ", ".join(f"{r}.{n}" for r, ns in RECORD_FIELDS.items() for n in ns)
            c.fail(f"free[{i}]", f"unknown record field {f!r} (expected one of: {allowed})")
    cites = data.get("citations", {})
    if not isinstance(cites, Mapping):
        c.fail("citations", f"expected an object (term -> source), got {kind_of(cites)}")
    for k, v in cites.items():
        c.str(v, f"citations.{k}")
    for f, v in defaults.items():
        if f in options and v not in options[f]:
            c.fail(f"defaults.{f}", f"{v!r} is not among the framework's options for {f} "
                                    f"({', '.join(map(str, options[f]))})")
    return FrameworkSpec(name=name, description=desc, memory_overhead=memory,
                         time_overhead=time, memory_headroom=headroom, defaults=defaults,
                         options=options, free=tuple(free), citations=dict(cites), source=src)


def _fields(c: Checker, obj, path: str, value) -> dict:
    """An object keyed by execution field names, each value read by ``value``."""
    if not isinstance(obj, Mapping):
        c.fail(path, f"expected an object keyed by execution fields, got {kind_of(obj)}")
    out = {}
    for f, v in obj.items():
        if f not in ALL_FIELDS:
            c.fail(f"{path}.{f}", "unknown execution field (see autopar/io/layouts.py)")
        out[f] = value(f, v, f"{path}.{f}")
    return out


def _values(c: Checker, f: str, v, path: str) -> tuple:
    if not isinstance(v, list) or not v:
        what = f"values of {', '.join(CHOICES[f])}" if f in CHOICES else "values"
        c.fail(path, f"expected a non-empty list of {what}, got {kind_of(v)}")
    vals = tuple(execution_value(c, f, x, f"{path}[{i}]") for i, x in enumerate(v))
    if len(set(vals)) != len(vals):
        c.fail(path, "lists a value twice")
    return vals


def framework_to_json(framework: FrameworkSpec) -> dict:
    """FrameworkSpec -> the framework file's dict (what ``load_framework`` reads)."""
    out: dict = {"name": framework.name}
    if framework.description:
        out["description"] = framework.description
    if framework.memory_overhead is not None:
        out["memory_overhead"] = memory_overhead_json(framework.memory_overhead)
    if framework.time_overhead is not None:
        out["time_overhead"] = time_overhead_json(framework.time_overhead)
    if framework.memory_headroom is not None:
        out["memory_headroom"] = memory_headroom_json(framework.memory_headroom)
    if framework.defaults:
        out["defaults"] = dict(framework.defaults)
    if framework.options:
        out["options"] = {f: list(v) for f, v in framework.options.items()}
    if framework.free:
        out["free"] = list(framework.free)
    if framework.citations:
        out["citations"] = dict(framework.citations)
    return out


def with_framework(system: SystemSpec, framework: FrameworkSpec | None) -> SystemSpec:
    """The system as the model sees it under ``framework``: the framework's
    memory and time records replace the system's (a record the framework
    leaves out is Calculon's: none); its memory headroom replaces the
    system's where it states one.  ``None``: the system unchanged."""
    if framework is None:
        return system
    headroom = framework.memory_headroom or system.memory_headroom
    if headroom is not None and headroom.GiB >= system.mem1.GiB:
        raise SpecError(framework.source, "memory_headroom.GiB",
                        f"must be below the system's mem1.GiB ({system.mem1.GiB}), "
                        f"got {headroom.GiB}")
    return dataclasses.replace(system, memory_overhead=framework.memory_overhead,
                               time_overhead=framework.time_overhead,
                               memory_headroom=headroom)


def check_options(framework: FrameworkSpec | None, execution: Mapping, source: str) -> None:
    """SpecError (naming ``source`` and the field) where ``execution`` uses a
    value the framework cannot express."""
    if framework is None:
        return
    for f, allowed in framework.options.items():
        v = execution.get(f, EXT_DEFAULTS.get(f))
        if v is not None and v not in allowed:
            raise SpecError(source, f, f"{framework.name} cannot run {f} = {v!r} "
                                       f"(it can: {', '.join(map(str, allowed))})")


def system_under(system, framework=None) -> SystemSpec:
    """A system (spec, path or dict) under a framework (spec, name, path or
    dict; None: none): what every command that takes ``--framework`` runs on."""
    from autopar.io.specs import load_system
    system = load_system(system)
    return with_framework(system, None if framework is None else load_framework(framework))
