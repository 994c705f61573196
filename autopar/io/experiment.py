"""Experiment files: a search described in YAML, run by ``autopar run FILE``.

Every file names its ``kind`` and one ``case``; the other keys are the
options of that kind's command.  Paths (model, system, space files, outputs)
are relative to the file's folder, as is the path of a ``sqlite:///`` storage
URL.  ::

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
    # kind: tune (the options of `autopar tune`)
    sampler: tpe
    trials: 500
    seed: 0
    backend: optuna               # optuna | ray
    encoding: index               # optional
    concurrency: 4                # optional
    storage: sqlite:///../results/gpt3.db   # optional (optuna): resumable study
    study_name: ...               # optional
    address: ...                  # optional (ray; default $RAY_ADDRESS, else a local Ray)
    storage_path: ../results/ray  # optional (ray): keep the Tune experiment (resumable with
                                  #   autopar tune --resume); a folder or a URI (s3://...)
    max_failures: 3               # optional (ray): retries of a failed trial
    output: ../results/gpt3-175b-tpe/best.json
    trials_out: ../results/gpt3-175b-tpe/trials.csv
    # kind: exhaustive (the options of `autopar exhaustive`)
    top_n: 10
    output: best.json
    top: top.json
    summary: summary.json
    all: all.parquet
    chunk_size: 1048576
    address: ...

``kind: compare`` files are read by ``autopar.studies.compare``, ``codesign`` and
``cliffs`` files by ``autopar.studies.codesign`` / ``autopar.studies.cliffs`` (see there).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from autopar.io.errors import SpecError, brief
from autopar.io.specs import read_yaml

COMMON_KEYS = ("kind", "name", "description", "case")
CASE_KEYS = ("model", "system", "num_procs", "max_batch_size", "datatype", "space",
             "batch_policy")
CASE_REQUIRED = CASE_KEYS[:5]


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


def integer(src: str, fld: str, v, minimum: int) -> int:
    """An integer field of an experiment file, at least ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(src, fld, f"expected an integer >= {minimum}, got {brief(v)}")
    return int(v)


def parse_case(src: str, base: Path, case) -> dict:
    if not isinstance(case, Mapping):
        raise SpecError(src, "case", f"expected a mapping with {', '.join(CASE_REQUIRED)}, "
                                     f"got {brief(case)}")
    for k in case:
        if k not in CASE_KEYS:
            raise SpecError(src, f"case.{k}", f"unknown key; expected one of {', '.join(CASE_KEYS)}")
    for k in CASE_REQUIRED:
        if k not in case:
            raise SpecError(src, f"case.{k}", "missing")
    out = dict(case)
    for k in ("model", "system"):
        v = case[k]
        if isinstance(v, Mapping):
            out[k] = dict(v)
        elif isinstance(v, str) and v:
            out[k] = str(relative(base, v))
        else:
            raise SpecError(src, f"case.{k}", f"expected a file path or a mapping, got {brief(v)}")
    sp = case.get("space")
    if isinstance(sp, str) and ("/" in sp or sp.endswith((".yaml", ".yml"))):
        out["space"] = str(relative(base, sp))
    elif sp is not None and not (isinstance(sp, (str, Mapping)) and sp):
        raise SpecError(src, "case.space", f"expected a space name, a path or a mapping, got {brief(sp)}")
    for k in ("num_procs", "max_batch_size"):
        v = case[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(src, f"case.{k}", f"expected a positive integer, got {brief(v)}")
    if not isinstance(case["datatype"], str):
        raise SpecError(src, "case.datatype", f"expected a datatype name, got {brief(case['datatype'])}")
    bp = case.get("batch_policy")
    if bp is not None and bp not in ("max", "fixed"):
        raise SpecError(src, "case.batch_policy", f"expected max or fixed, got {brief(bp)}")
    return out


def relative(base: Path, p: str) -> Path:
    """A path of an experiment file: relative to the file's folder."""
    q = Path(p)
    return q if q.is_absolute() else base / q


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
            if is_path:
                v = str(relative(base, v))
        out[k] = v
    return out


def storage_url(base: Path, url: str | None) -> str | None:
    """``sqlite:///relative.db`` is relative to the experiment file's folder."""
    prefix = "sqlite:///"
    if url and url.startswith(prefix) and not url.startswith(prefix + "/"):
        rest = url[len(prefix):]
        if rest and rest != ":memory:":
            return prefix + str(relative(base, rest).resolve())
    return url
