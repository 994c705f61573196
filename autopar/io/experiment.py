"""Experiment files: a search described in YAML, run by ``autopar run FILE``.

Every file names its ``kind`` and one ``case``; the other keys are the
options of that kind's command.  One rule for paths: what the file *reads*
(model, system, space files) is relative to the file's folder; where results
*go* (``output``, ``trials_out``, ``top``, ``summary``, ``all``,
``output_dir``, ``storage_path``, a ``sqlite:///`` storage) is relative to the
current folder, as on the command line, so running an example from the
project never writes into the project's tracked files.  Paths written inside
outputs resolve from the output file itself (``autopar.io.writers.file_ref``).
::

    kind: tune                    # tune | exhaustive (| compare | codesign | cliffs)
    name: gpt3-175b-tpe           # default: the file's stem
    description: ...
    case:
      model: ../models/gpt3-175B.json     # a path or an inline mapping
      system: ../systems/a100_80g.json
      num_procs: 1024
      max_batch_size: 1536
      datatype: float16
      space: calculon             # a name under search_spaces/, a path or a mapping
      batch_policy: max           # optional
      framework: megatron-core    # optional: a name under frameworks/, a path or a mapping
      training: false             # optional: lay out inference (default true: training)
    # kind: tune (the options of `autopar tune`)
    sampler: tpe
    trials: 500
    seed: 0
    backend: optuna               # optuna | ray
    encoding: index               # optional
    concurrency: 4                # optional
    storage: sqlite:///results/gpt3.db      # optional (optuna): resumable study
    study_name: ...               # optional
    address: ...                  # optional (ray; default $RAY_ADDRESS, else a local Ray)
    storage_path: results/ray     # optional (ray): keep the Tune experiment (resumable with
                                  #   autopar tune --resume); a folder or a URI (s3://...)
    max_failures: 3               # optional (ray): retries of a failed trial
    output: results/gpt3-175b-tpe/best.json
    trials_out: results/gpt3-175b-tpe/trials.csv
    # kind: exhaustive (the options of `autopar exhaustive`)
    top_n: 10
    output: best.json
    top: top.json
    summary: summary.json
    all: all.parquet
    chunk_size: 1048576
    address: ...

Every kind is read here, once and whole, into a typed object: ``CaseSpec``
(the ``case:`` section every kind shares), ``Experiment`` (``kind: compare``,
format in ``autopar.studies.compare``), ``Study`` (``kind: codesign``, see
``docs/codesign.md``) and ``Sweep`` (``kind: cliffs``, see
``autopar.studies.cliffs``); ``tune`` and ``exhaustive`` files become the
arguments of their commands (``autopar.cli.run``).  The names the files may
use for samplers, encodings and backends are declared here, and the search
layer uses these declarations.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from autopar.io.errors import MAX_BATCH, MAX_PROCS, SpecError, brief
from autopar.io.hardware import Hardware, parse_dim, parse_hardware
from autopar.io.spaces import BATCH_POLICIES, SpaceSpec, read_space
from autopar.io.frameworks import load_framework, with_framework
from autopar.io.specs import ModelSpec, SystemSpec, load_model, load_system, read_yaml, system_to_json

# The vocabulary of experiment files (the search layer implements these names).
# autopar tune's samplers: per-layout ones, then skeleton ones (``autopar.search.skeleton``:
# a trial is a skeleton, completed by the array model).
# (the registry, ``autopar.io.sampler_names``, names them)
from autopar.io.sampler_names import LAYOUT_SAMPLERS, SAMPLERS, SKELETON_SAMPLERS  # noqa: E402,F401
# The default sampler: skeleton TPE had the lowest median regret at every
# budget of every sampler comparison run (docs/compare.md).
DEFAULT_SAMPLER = "skeleton-tpe"
ENCODINGS: tuple[str, ...] = ("index", "named", "flat")
BACKENDS: tuple[str, ...] = ("optuna", "ray")
# autopar.search.tune's keyword options (tune_options) that a compare entry may set
# (tests/test_experiment.py checks them against tune's signature).
SAMPLER_OPTIONS: tuple[str, ...] = ("backend", "concurrency", "encoding", "storage_path",
                                    "name", "max_failures", "on_start")
INNER_SEARCHES = ("exhaustive", "tpe", "random", "cmaes", "bohb", "grid", "smac",
                  "skeleton-tpe", "skeleton-random", "skeleton-cmaes", "skeleton-smac")
OUTER_SAMPLERS = ("exhaustive", "nsga2", "tpe", "motpe", "random")
OBJECTIVES = {"sample_rate": "maximize", "cost": "minimize", "num_procs": "minimize"}
PARALLEL = ("serial", "processes", "ray")
DEFAULT_SPACE = "calculon"          # every command's default layout space
DEFAULT_WORKERS = 2
DEFAULT_POPULATION = 20
DEFAULT_BUDGETS = (25, 50, 100, 250, 500, 1000)

CASE_KEYS = ("model", "system", "num_procs", "max_batch_size", "datatype", "space",
             "batch_policy", "framework", "training")
CASE_REQUIRED = CASE_KEYS[:5]
COMMON_KEYS = ("kind", "name", "description", "case")
# Kinds whose own commands read the file (``autopar compare``, ``codesign``, ``cliffs``).
STUDY_KINDS = ("compare", "codesign", "cliffs")
KINDS = ("tune", "exhaustive", *STUDY_KINDS)
# key -> (type, default, is a path relative to the file)
TUNE_KEYS: dict[str, tuple[Any, Any, bool]] = {
    "sampler": (str, DEFAULT_SAMPLER, False), "trials": (int, 100, False), "seed": (int, None, False),
    "backend": (str, "optuna", False), "encoding": (str, None, False),
    "concurrency": (int, None, False), "storage": (str, None, False),
    "study_name": (str, None, False), "address": (str, None, False),
    "storage_path": (str, None, False), "max_failures": (int, 3, False),
    "output": (str, None, True), "trials_out": (str, None, True),
    "format": (str, "autopar", False),
}
EXHAUSTIVE_KEYS: dict[str, tuple[Any, Any, bool]] = {
    "top_n": (int, 1, False), "output": (str, None, True), "top": (str, None, True),
    "summary": (str, None, True), "all": (str, None, True), "chunk_size": (int, None, False),
    "address": (str, None, False), "format": (str, "autopar", False),
}
COMPARE_KEYS = ("kind", "name", "description", "case", "samplers", "seeds", "trials",
                "budgets", "parallel", "workers", "output_dir")
CODESIGN_KEYS = ("kind", "name", "description", "case", "hardware", "cost", "objectives",
                 "inner", "search", "compare", "parallel", "workers", "address", "output_dir")
CODESIGN_SEARCH_KEYS = ("sampler", "trials", "seed", "population", "batch", "storage",
                        "study_name")
CODESIGN_COMPARE_KEYS = ("samplers", "seeds", "trials", "budgets")
CLIFFS_KEYS = ("kind", "name", "description", "case", "num_procs", "inner", "parallel",
               "workers", "address", "output_dir")


# --------------------------------------------------------------------------
# Reading a file, and the fields every kind shares

def read(path) -> dict:
    """An experiment YAML file -> its mapping (SpecError if missing or not YAML)."""
    src = str(path)
    p = Path(path)
    if not p.exists():
        raise SpecError(src, "(file)", "no such file")
    if not p.is_file():
        raise SpecError(src, "(file)", "not a file")
    data = read_yaml(p, src)
    if not isinstance(data, Mapping):
        raise SpecError(src, "(root)", f"expected a mapping, got {brief(data)}")
    return dict(data)


def open_file(path, source: str | None = None) -> tuple[dict, str, Path, str]:
    """An experiment file -> (its mapping, the name errors give it, the folder
    its relative paths start from, its stem: the default experiment name)."""
    stem = Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    return read(path), source or str(path), Path(path).resolve().parent, stem


def open_spec(spec, source: str | None, base_dir, kind: str,
              stem: str) -> tuple[dict, str, Path, str]:
    """A file path or a mapping of kind ``kind`` -> (its mapping, the name
    errors give it, the folder its relative paths start from, the default
    name).  A mapping's paths start from ``base_dir`` (default: the current
    folder) and its default name is ``stem``."""
    if isinstance(spec, (str, os.PathLike)):
        return open_file(spec, source)
    if isinstance(spec, Mapping):
        return dict(spec), source or kind, Path(base_dir or os.getcwd()), stem
    raise SpecError(source or kind, "(root)",
                    f"expected a file path or a mapping, got {type(spec).__name__}")


def integer(src: str, fld: str, v, minimum: int, maximum: int | None = None) -> int:
    """An integer field of an experiment file, at least ``minimum`` (and at
    most ``maximum`` when given)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(src, fld, f"expected an integer >= {minimum}, got {brief(v)}")
    if maximum is not None and v > maximum:
        raise SpecError(src, fld, f"must be at most {maximum:,}, got {brief(v)}")
    return int(v)


def relative(base: Path, p: str) -> Path:
    """A path an experiment file reads: relative to the file's folder; one
    not found there may name a shipped file (``systems/a100_80g.json``,
    ``autopar.io.shipped.resolve``)."""
    from autopar.io.shipped import resolve
    q = Path(p)
    if q.is_absolute() or (base / q).exists():
        return q if q.is_absolute() else base / q
    shipped = resolve(q)
    return shipped.resolve() if shipped.is_absolute() else base / q


def header(data: Mapping, src: str, stem: str, kind: str, keys) -> tuple[str, str]:
    """The keys every experiment file shares: no unknown key, the right
    ``kind`` (default: ``kind``), ``name`` (default: the file's stem) and
    ``description``.  Returns (name, description)."""
    for k in data:
        if k not in keys:
            raise SpecError(src, str(k), f"unknown key; expected one of {', '.join(keys)}")
    got = data.get("kind", kind)
    if got != kind:
        raise SpecError(src, "kind", f"expected {kind}, got {brief(got)}")
    name = data.get("name", stem)
    if not isinstance(name, str) or not name.strip():
        raise SpecError(src, "name", f"expected a non-empty string, got {brief(name)}")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise SpecError(src, "description", f"expected a string, got {brief(desc)}")
    return name, desc


def parse_options(src: str, base: Path, data: Mapping, keys: Mapping) -> dict:
    out = {}
    for k, (typ, default, is_path) in keys.items():
        v = data.get(k, default)
        if v is not None:
            if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise SpecError(src, k, f"expected an integer, got {brief(v)}")
            if typ is str and (not isinstance(v, str) or not v):
                raise SpecError(src, k, f"expected a non-empty string, got {brief(v)}")
            if is_path:               # an output: relative to the current folder
                v = str(Path(v))
        out[k] = v
    return out


def storage_url(base: Path, url: str | None) -> str | None:
    """``sqlite:///relative.db`` is relative to the current folder (an output)."""
    prefix = "sqlite:///"
    if url and url.startswith(prefix) and not url.startswith(prefix + "/"):
        rest = url[len(prefix):]
        if rest and rest != ":memory:":
            return prefix + str(Path(rest).resolve())
    return url


# --------------------------------------------------------------------------
# The case

@dataclass(frozen=True)
class CaseSpec:
    """The ``case:`` section: a model on a system, a size, a batch and a space."""
    model: ModelSpec
    system: SystemSpec
    model_given: Any               # as written in the file (a path or a mapping)
    system_given: Any
    model_file: Any                # the path resolved from the file's folder, or the mapping
    system_file: Any
    num_procs: int | None          # None where the kind varies it (co-design, cliffs)
    max_batch_size: int
    datatype: str
    space: SpaceSpec
    space_given: Any               # None when the file names none (DEFAULT_SPACE)
    batch_policy: str | None
    # The training framework (autopar.io.frameworks): ``system`` is already
    # under it; the name, path (from the file's folder) or mapping, else None.
    framework_file: Any = None
    # Training (true, the default) or inference (false): the layouts' training field.
    training: bool = True


def parse_case(src: str, base: Path, case, need_procs: bool = True) -> CaseSpec:
    """The ``case:`` section, checked whole: the model and system files are
    read, the datatype must be one the system runs, the space file is read
    (default ``DEFAULT_SPACE``).  Paths are relative to the file's folder."""
    required = tuple(k for k in CASE_REQUIRED if need_procs or k != "num_procs")
    if not isinstance(case, Mapping):
        raise SpecError(src, "case", f"expected a mapping with {', '.join(required)}, "
                                     f"got {brief(case)}")
    for k in case:
        if k not in CASE_KEYS:
            raise SpecError(src, f"case.{k}", f"unknown key; expected one of {', '.join(CASE_KEYS)}")
    for k in required:
        if k not in case:
            raise SpecError(src, f"case.{k}", "missing")

    def file_or_map(fld, v):
        if isinstance(v, Mapping):
            return dict(v)
        if not isinstance(v, str) or not v:
            raise SpecError(src, fld, f"expected a file path or a mapping, got {brief(v)}")
        return str(relative(base, v))

    model_file = file_or_map("case.model", case["model"])
    system_file = file_or_map("case.system", case["system"])
    model, system = load_model(model_file), load_system(system_file)
    framework_file = None
    if case.get("framework") is not None:
        fw = case["framework"]
        if isinstance(fw, str) and fw and ("/" in fw or fw.endswith(".json")):
            framework_file = str(relative(base, fw))
        elif isinstance(fw, (str, Mapping)) and fw:
            framework_file = dict(fw) if isinstance(fw, Mapping) else fw
        else:
            raise SpecError(src, "case.framework", f"expected a framework name, a path or a "
                                                   f"mapping, got {brief(fw)}")
        system = with_framework(system, load_framework(framework_file))
    num_procs = case.get("num_procs")
    if num_procs is not None:
        num_procs = integer(src, "case.num_procs", num_procs, 1, MAX_PROCS)
    max_batch = integer(src, "case.max_batch_size", case["max_batch_size"], 1, MAX_BATCH)
    datatype = case["datatype"]
    if datatype not in system.datatypes:
        raise SpecError(src, "case.datatype", f"{brief(datatype)} is not supported by "
                        f"{system.source} (it runs: {', '.join(system.datatypes)})")
    space_given = case.get("space")
    if isinstance(space_given, str) and ("/" in space_given
                                         or space_given.endswith((".yaml", ".yml"))):
        space_given = str(relative(base, space_given))
    elif space_given is not None and not (isinstance(space_given, (str, Mapping))
                                          and space_given):
        raise SpecError(src, "case.space", f"expected a space name, a path or a mapping, "
                                           f"got {brief(space_given)}")
    policy = case.get("batch_policy")
    if policy is not None and policy not in BATCH_POLICIES:
        raise SpecError(src, "case.batch_policy", f"expected max or fixed, got {brief(policy)}")
    training = case.get("training", True)
    if not isinstance(training, bool):
        raise SpecError(src, "case.training", f"expected true (training) or false (inference), "
                                              f"got {brief(training)}")
    return CaseSpec(model=model, system=system, model_given=case["model"],
                    system_given=case["system"], model_file=model_file,
                    system_file=system_file, num_procs=num_procs, max_batch_size=max_batch,
                    datatype=datatype,
                    space=read_space(space_given if space_given is not None else DEFAULT_SPACE),
                    space_given=space_given, batch_policy=policy,
                    framework_file=framework_file, training=training)


def parse_output_dir(src: str, base: Path, v) -> Path | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise SpecError(src, "output_dir", f"expected a folder path, got {brief(v)}")
    if str(v).strip().lower() == "none":
        raise SpecError(src, "output_dir", "to write nothing, leave output_dir out "
                        "(a folder named none: ./none)")
    return Path(v).resolve()           # an output folder: from the current folder


def parse_parallel(src: str, data: Mapping) -> tuple[str, int, str | None]:
    address = data.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise SpecError(src, "address", f"expected a Ray address, got {brief(address)}")
    parallel = data.get("parallel", "ray" if address else "serial")
    if parallel not in PARALLEL:
        raise SpecError(src, "parallel", f"expected one of {', '.join(PARALLEL)}, got {brief(parallel)}")
    if address and parallel != "ray":
        raise SpecError(src, "address", "a Ray address needs parallel: ray")
    workers = integer(src, "workers", data.get("workers", 2), 1)
    return parallel, workers, address


# --------------------------------------------------------------------------
# kind: tune and kind: exhaustive (the options of their commands)

@dataclass(frozen=True)
class CommandExperiment:
    """A ``tune`` or ``exhaustive`` file: its case and its command's options
    (paths resolved from the file's folder)."""
    kind: str
    name: str | None
    description: str
    case: CaseSpec
    options: Mapping[str, Any]


def parse_command_file(data: Mapping, src: str, base: Path) -> CommandExperiment | None:
    """Check an experiment mapping of any kind; a ``CommandExperiment`` for
    ``tune`` and ``exhaustive``, None for the kinds with commands of their own."""
    kind = data.get("kind")
    if kind not in KINDS:
        raise SpecError(src, "kind", f"expected one of {', '.join(KINDS)}, got {brief(kind)}")
    if kind in STUDY_KINDS:
        return None
    keys = TUNE_KEYS if kind == "tune" else EXHAUSTIVE_KEYS
    for k in data:
        if k not in COMMON_KEYS and k not in keys:
            raise SpecError(src, str(k), f"unknown key for kind {kind}; expected one of "
                                         f"{', '.join(COMMON_KEYS + tuple(keys))}")
    name = data.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise SpecError(src, "name", f"expected a non-empty string, got {brief(name)}")
    if not isinstance(data.get("description", ""), str):
        raise SpecError(src, "description", f"expected a string, got {brief(data['description'])}")
    case = parse_case(src, base, data.get("case"))
    opts = parse_options(src, base, data, keys)
    from autopar.io.export import check_format
    check_format(opts["format"], src, "format")
    if kind == "tune":
        for k, options in (("sampler", SAMPLERS), ("backend", BACKENDS)):
            if opts[k] not in options:
                raise SpecError(src, k, f"expected one of {', '.join(options)}, got {brief(opts[k])}")
        opts["storage"] = storage_url(base, opts["storage"])
        sp = opts["storage_path"]
        if sp and "://" not in sp:
            opts["storage_path"] = str(Path(sp).resolve())     # an output: from the current folder
    return CommandExperiment(kind, name, data.get("description", ""), case, opts)


# --------------------------------------------------------------------------
# The inner search (co-design and cliffs)

@dataclass(frozen=True)
class Inner:
    """How each system's best layout is found."""
    search: str = "exhaustive"        # or a sampler of autopar.search.tune
    trials: int = 0                   # sampler trials per system
    seed: int | None = 0
    # GiB each system's best layout must leave free on tier 1 (None: the
    # system's own memory_headroom, else 0).
    memory_headroom: float | None = None

    def to_dict(self) -> dict:
        return {"search": self.search, "trials": self.trials, "seed": self.seed,
                "memory_headroom": self.memory_headroom}


def parse_inner(src: str, v) -> Inner:
    if v is None:
        return Inner()
    if isinstance(v, str):
        v = {"search": v}
    if not isinstance(v, Mapping):
        raise SpecError(src, "inner", f"expected a mapping (search, trials, seed), got {v!r}")
    for k in v:
        if k not in ("search", "trials", "seed", "memory_headroom"):
            raise SpecError(src, f"inner.{k}", "unknown key; expected one of search, trials, "
                                               "seed, memory_headroom")
    search = v.get("search", "exhaustive")
    if search not in INNER_SEARCHES:
        raise SpecError(src, "inner.search", f"expected one of {', '.join(INNER_SEARCHES)}, "
                                             f"got {search!r}")
    trials = v.get("trials", 0 if search == "exhaustive" else 200)
    if search != "exhaustive" and (isinstance(trials, bool) or not isinstance(trials, int)
                                   or trials < 1):
        raise SpecError(src, "inner.trials", f"expected an integer >= 1, got {trials!r}")
    if search == "exhaustive" and "trials" in v:
        raise SpecError(src, "inner.trials", "only for a sampler (the exhaustive search tries every layout)")
    seed = v.get("seed", 0)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise SpecError(src, "inner.seed", f"expected an integer >= 0, got {seed!r}")
    headroom = v.get("memory_headroom")
    if headroom is not None and (isinstance(headroom, bool)
                                 or not isinstance(headroom, (int, float))
                                 or not 0 <= headroom < float("inf")):
        raise SpecError(src, "inner.memory_headroom", f"expected a number >= 0 (GiB), "
                                                      f"got {headroom!r}")
    return Inner(search, int(trials), seed,
                 None if headroom is None else float(headroom))


# --------------------------------------------------------------------------
# kind: compare

@dataclass(frozen=True)
class SamplerEntry:
    label: str                       # the name in curves.csv / summary.csv
    name: str                        # autopar.search.tune's sampler
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Experiment:
    source: str
    name: str
    description: str
    case: CaseSpec
    samplers: tuple[SamplerEntry, ...]
    seeds: tuple[int, ...]
    trials: int
    budgets: tuple[int, ...]
    parallel: str | None             # None: decided by the address
    workers: int
    output_dir: Path | None


def is_compare(data) -> bool:
    """Whether a loaded experiment mapping is a comparison (``kind: compare``)."""
    return isinstance(data, Mapping) and data.get("kind") == "compare"


def load_experiment(spec, overrides: Mapping | None = None,
                    base_dir=None, source: str | None = None) -> Experiment:
    """A comparison experiment (YAML path, dict or Experiment) -> Experiment.

    Relative paths in a file are relative to the file's folder; in a dict,
    to ``base_dir`` (default: the current directory).  ``overrides`` replace
    top-level keys (``case`` is merged key by key).  Bad input raises
    ``SpecError(file, field, message)``.
    """
    if isinstance(spec, Experiment) and not overrides:
        return spec
    data, src, base, stem = open_spec(
        spec, source, base_dir, "experiment",
        Path(source).name.removesuffix(".yaml").removesuffix(".yml") if source else "compare")
    overrides = dict(overrides or {})
    if "trials" in overrides and "budgets" not in overrides and isinstance(data.get("budgets"), list):
        t = overrides["trials"]     # fewer trials: keep the budgets that still fit
        if isinstance(t, int) and not isinstance(t, bool) and t >= 1:
            fit = [b for b in data["budgets"] if not isinstance(b, int) or b <= t]
            overrides["budgets"] = fit or [t]
    for k, v in overrides.items():
        if k == "case" and isinstance(v, Mapping) and isinstance(data.get("case"), Mapping):
            data["case"] = {**data["case"], **v}
        else:
            data[k] = v
    return _parse_experiment(data, src, base, stem)


def _parse_experiment(data: Mapping, src: str, base: Path, stem: str) -> Experiment:
    name, desc = header(data, src, stem, "compare", COMPARE_KEYS)

    case = parse_case(src, base, data.get("case"))
    samplers = _samplers(src, data.get("samplers"))
    seeds = _seeds(src, data.get("seeds", 1))
    if "trials" not in data:
        raise SpecError(src, "trials", "missing (trials per run)")
    trials = integer(src, "trials", data["trials"], 1)
    budgets = _budgets(src, data.get("budgets"), trials)
    parallel = data.get("parallel")
    if parallel is not None and parallel not in PARALLEL:
        raise SpecError(src, "parallel", f"expected one of {', '.join(PARALLEL)}, got {brief(parallel)}")
    workers = integer(src, "workers", data.get("workers", DEFAULT_WORKERS), 1)
    out = parse_output_dir(src, base, data.get("output_dir"))
    return Experiment(source=src, name=name.strip(), description=desc, case=case,
                      samplers=samplers, seeds=seeds,
                      trials=trials, budgets=budgets, parallel=parallel, workers=workers,
                      output_dir=out)


def _samplers(src: str, v) -> tuple[SamplerEntry, ...]:
    if not isinstance(v, list) or not v:
        raise SpecError(src, "samplers", f"expected a non-empty list, got {brief(v)}")
    allowed = SAMPLER_OPTIONS
    out, labels = [], set()
    for i, item in enumerate(v):
        fld = f"samplers[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping):
            raise SpecError(src, fld, f"expected a sampler name or a mapping, got {brief(item)}")
        name = item.get("name")
        if name not in SAMPLERS:
            raise SpecError(src, f"{fld}.name", f"expected one of {', '.join(SAMPLERS)}, got {brief(name)}")
        label = item.get("label", name)
        if not isinstance(label, str) or not label or label == "exhaustive":
            raise SpecError(src, f"{fld}.label", f"expected a name other than exhaustive, got {brief(label)}")
        if label in labels:
            raise SpecError(src, f"{fld}.label", f"{label!r} is used twice; give each entry its own label")
        labels.add(label)
        options = {}
        for k, val in item.items():
            if k in ("name", "label"):
                continue
            if k not in allowed:
                raise SpecError(src, f"{fld}.{k}", "unknown option; a sampler takes name, label"
                                + "".join(f", {o}" for o in allowed))
            options[k] = _option(src, f"{fld}.{k}", k, val)
        out.append(SamplerEntry(label=label, name=name, options=options))
    return tuple(out)


def _option(src: str, fld: str, key: str, val):
    """Check the values of the options autopar.search.tune takes."""
    if key == "encoding":
        if val not in ENCODINGS:
            raise SpecError(src, fld, f"expected one of {', '.join(ENCODINGS)}, got {brief(val)}")
    elif key == "backend":
        if val not in BACKENDS:
            raise SpecError(src, fld, f"expected one of {', '.join(BACKENDS)}, got {brief(val)}")
    elif key == "concurrency" and val is not None:
        integer(src, fld, val, 1)
    return val


def _seeds(src: str, v) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        n = integer(src, "seeds", v, 1)
        if n > 10_000:
            raise SpecError(src, "seeds", f"at most 10,000 seeds, got {n:,}")
        return tuple(range(n))
    if not isinstance(v, list) or not v:
        raise SpecError(src, "seeds", f"expected a count or a non-empty list of seeds, got {brief(v)}")
    seeds = tuple(integer(src, f"seeds[{i}]", s, 0) for i, s in enumerate(v))
    for i, s in enumerate(seeds):
        if s > 2 ** 32 - 1:
            raise SpecError(src, f"seeds[{i}]", f"must be between 0 and 2**32-1, got {s}")
    if len(set(seeds)) != len(seeds):
        raise SpecError(src, "seeds", "lists a seed twice")
    return seeds


def _budgets(src: str, v, trials: int) -> tuple[int, ...]:
    if v is None:
        return tuple(sorted({b for b in DEFAULT_BUDGETS if b < trials} | {trials}))
    if not isinstance(v, list) or not v:
        raise SpecError(src, "budgets", f"expected a non-empty list of trial counts, got {brief(v)}")
    out = []
    for i, b in enumerate(v):
        b = integer(src, f"budgets[{i}]", b, 1)
        if b > trials:
            raise SpecError(src, f"budgets[{i}]", f"{b} exceeds trials ({trials})")
        out.append(b)
    return tuple(sorted(set(out)))


# --------------------------------------------------------------------------
# kind: codesign

@dataclass(frozen=True)
class Search:
    sampler: str = "nsga2"
    trials: int = 100
    seed: int | None = 0
    population: int = DEFAULT_POPULATION
    batch: int | None = None
    storage: str | None = None
    study_name: str | None = None
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.sampler


@dataclass(frozen=True)
class CodesignCompare:
    samplers: tuple            # Search templates (seed set per run)
    seeds: tuple
    trials: int
    budgets: tuple


@dataclass(frozen=True)
class Study:
    source: str
    name: str
    description: str
    case: CaseSpec
    hardware: Hardware
    inner: Inner
    objectives: tuple
    search: Search
    compare: CodesignCompare | None
    parallel: str
    workers: int
    address: str | None
    output_dir: Path | None


def load_study(spec, overrides: Mapping | None = None, base_dir=None,
               source: str | None = None) -> Study:
    """A co-design file (path) or mapping -> Study; ``overrides`` replace
    top-level keys (``search`` is merged key by key)."""
    if isinstance(spec, Study) and not overrides:
        return spec
    data, src, base, stem = open_spec(spec, source, base_dir, "codesign", "codesign")
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k == "search" and isinstance(data.get("search"), Mapping):
            data["search"] = {**data["search"], **v}
        else:
            data[k] = v
    return _parse_study(data, src, base, stem)


def _outer_search(src: str, fld: str, v, n_obj: int, defaults: Search | None = None) -> Search:
    if isinstance(v, str):
        v = {"sampler": v}
    if v is None:
        v = {}
    if not isinstance(v, Mapping):
        raise SpecError(src, fld, f"expected a mapping ({', '.join(CODESIGN_SEARCH_KEYS)}), got {brief(v)}")
    allowed = CODESIGN_SEARCH_KEYS + (("label",) if fld != "search" else ())
    for k in v:
        if k not in allowed:
            raise SpecError(src, f"{fld}.{k}", f"unknown key; expected one of {', '.join(allowed)}")
    d = defaults or Search(sampler="nsga2" if n_obj == 2 else "tpe")
    sampler = v.get("sampler", d.sampler)
    if sampler not in OUTER_SAMPLERS:
        raise SpecError(src, f"{fld}.sampler", f"expected one of {', '.join(OUTER_SAMPLERS)}, "
                                               f"got {brief(sampler)}")
    if sampler == "nsga2" and n_obj == 1:
        raise SpecError(src, f"{fld}.sampler", "nsga2 is for two objectives; use tpe or random")
    if sampler == "motpe" and n_obj == 1:
        raise SpecError(src, f"{fld}.sampler", "motpe is for two objectives; use tpe")
    trials = integer(src, f"{fld}.trials", v.get("trials", d.trials), 1)
    seed = v.get("seed", d.seed)
    if seed is not None:
        seed = integer(src, f"{fld}.seed", seed, 0)
    population = integer(src, f"{fld}.population", v.get("population", d.population), 2)
    batch = v.get("batch", d.batch)
    if batch is not None:
        batch = integer(src, f"{fld}.batch", batch, 1)
    storage = v.get("storage", d.storage)
    if storage is not None and (not isinstance(storage, str) or not storage):
        raise SpecError(src, f"{fld}.storage", f"expected an Optuna storage URL, got {brief(storage)}")
    name = v.get("study_name", d.study_name)
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(src, f"{fld}.study_name", f"expected a non-empty string, got {brief(name)}")
    label = v.get("label", "")
    if not isinstance(label, str):
        raise SpecError(src, f"{fld}.label", f"expected a string, got {brief(label)}")
    return Search(sampler, trials, seed, population, batch, storage, name, label)


def _parse_study(data: Mapping, src: str, base: Path, stem: str) -> Study:
    name, desc = header(data, src, stem, "codesign", CODESIGN_KEYS)
    case = parse_case(src, base, data.get("case"), need_procs=False)
    hw = parse_hardware(src, data.get("hardware"), data.get("cost"),
                        system_to_json(case.system), case.num_procs)
    objectives = data.get("objectives", ["sample_rate", "cost"])
    if isinstance(objectives, str):
        objectives = [objectives]
    if not isinstance(objectives, list) or not objectives:
        raise SpecError(src, "objectives", f"expected a list, got {brief(objectives)}")
    for i, o in enumerate(objectives):
        if o not in OBJECTIVES:
            raise SpecError(src, f"objectives[{i}]", f"expected one of {', '.join(OBJECTIVES)}, "
                                                     f"got {brief(o)}")
    if objectives[0] != "sample_rate" or len(objectives) > 2 or len(set(objectives)) != len(objectives):
        raise SpecError(src, "objectives", "expected [sample_rate] or sample_rate with one of "
                                           f"cost, num_procs, got {brief(objectives)}")
    inner = parse_inner(src, data.get("inner"))
    n_obj = len(objectives)
    search = _outer_search(src, "search", data.get("search"), n_obj)
    search = replace(search, storage=storage_url(base, search.storage))
    if search.sampler == "exhaustive" and not hw.discrete:
        raise SpecError(src, "search.sampler", "exhaustive needs every hardware domain discrete "
                                               "(a list, or a range with step or num)")
    compare = None
    if data.get("compare") is not None:
        compare = _codesign_compare(src, data["compare"], n_obj)
        if not hw.discrete:
            raise SpecError(src, "compare", "the ground truth enumerates the hardware: every "
                                            "domain must be discrete (a list, or step or num)")
    parallel, workers, address = parse_parallel(src, data)
    return Study(source=src, name=name.strip(), description=desc, case=case, hardware=hw,
                 inner=inner,
                 objectives=tuple(objectives), search=search, compare=compare,
                 parallel=parallel, workers=workers, address=address,
                 output_dir=parse_output_dir(src, base, data.get("output_dir")))


def _codesign_compare(src: str, v, n_obj: int) -> CodesignCompare:
    if not isinstance(v, Mapping):
        raise SpecError(src, "compare", f"expected a mapping ({', '.join(CODESIGN_COMPARE_KEYS)}), got {brief(v)}")
    for k in v:
        if k not in CODESIGN_COMPARE_KEYS:
            raise SpecError(src, f"compare.{k}", f"unknown key; expected one of {', '.join(CODESIGN_COMPARE_KEYS)}")
    trials = integer(src, "compare.trials", v.get("trials", 100), 1)
    raw = v.get("samplers")
    if not isinstance(raw, list) or not raw:
        raise SpecError(src, "compare.samplers", f"expected a non-empty list, got {brief(raw)}")
    samplers = []
    for i, s in enumerate(raw):
        d = _outer_search(src, f"compare.samplers[{i}]", s, n_obj,
                    Search(sampler="random", trials=trials))
        if d.sampler == "exhaustive":
            raise SpecError(src, f"compare.samplers[{i}].sampler",
                            "the exhaustive search is the ground truth, not a sampler to compare")
        if d.storage:
            raise SpecError(src, f"compare.samplers[{i}].storage", "comparison runs keep no storage")
        samplers.append(d)
    labels = [s.name for s in samplers]
    if len(set(labels)) != len(labels):
        raise SpecError(src, "compare.samplers", "two entries share a label: give each a label")
    seeds = v.get("seeds", 1)
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = list(range(integer(src, "compare.seeds", seeds, 1)))
    if not isinstance(seeds, list) or not seeds:
        raise SpecError(src, "compare.seeds", f"expected a count or a list of seeds, got {brief(seeds)}")
    seeds = tuple(integer(src, f"compare.seeds[{i}]", s, 0) for i, s in enumerate(seeds))
    budgets = v.get("budgets")
    if budgets is None:
        budgets = [b for b in (10, 25, 50, 100, 250, 500, 1000) if b <= trials] or [trials]
    if not isinstance(budgets, list) or not budgets:
        raise SpecError(src, "compare.budgets", f"expected a list of trial counts, got {brief(budgets)}")
    budgets = tuple(integer(src, f"compare.budgets[{i}]", b, 1) for i, b in enumerate(budgets))
    for i, b in enumerate(budgets):
        if b > trials:
            raise SpecError(src, f"compare.budgets[{i}]", f"exceeds the trials per run ({trials})")
    return CodesignCompare(tuple(samplers), seeds, trials, tuple(sorted(set(budgets))))


# --------------------------------------------------------------------------
# kind: cliffs

@dataclass(frozen=True)
class Sweep:
    source: str
    name: str
    description: str
    case: CaseSpec
    hardware: Hardware
    inner: Inner
    counts: tuple
    parallel: str
    workers: int
    address: str | None
    output_dir: Path | None


def parse_counts(src: str, fld: str, v) -> tuple[int, ...]:
    """A list of counts, ``{min, max, step}`` or ``"MIN:MAX:STEP"``."""
    if isinstance(v, str):
        parts = v.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3):
            raise SpecError(src, fld, f"expected MIN:MAX or MIN:MAX:STEP, got {v!r}")
        v = {"min": nums[0], "max": nums[1], "step": nums[2] if len(nums) == 3 else 1}
    if isinstance(v, Mapping) and "step" not in v and "num" not in v and "values" not in v:
        v = {**v, "step": 1}
    if isinstance(v, Mapping) and "cost" in v:
        raise SpecError(src, f"{fld}.cost", "a sweep has no cost")
    d = parse_dim(src, "num_procs", v, integer=True, minimum=1)
    return tuple(sorted(d.values))


def load_sweep(spec, overrides: Mapping | None = None, base_dir=None,
               source: str | None = None) -> Sweep:
    if isinstance(spec, Sweep) and not overrides:
        return spec
    data, src, base, stem = open_spec(spec, source, base_dir, "cliffs", "cliffs")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    name, desc = header(data, src, stem, "cliffs", CLIFFS_KEYS)
    case = parse_case(src, base, data.get("case"), need_procs=False)
    if case.num_procs is not None:
        raise SpecError(src, "case.num_procs", "a sweep gives its counts in num_procs (top level)")
    if "num_procs" not in data:
        raise SpecError(src, "num_procs", "missing (a list, {min, max, step} or MIN:MAX:STEP)")
    counts = parse_counts(src, "num_procs", data["num_procs"])
    hw = parse_hardware(src, {"num_procs": list(counts)}, None, system_to_json(case.system),
                        None)
    inner = parse_inner(src, data.get("inner"))
    parallel, workers, address = parse_parallel(src, data)
    return Sweep(src, name.strip(), desc, case, hw, inner, counts, parallel, workers, address,
                 parse_output_dir(src, base, data.get("output_dir")))
