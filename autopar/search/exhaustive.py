"""Exhaustive search: evaluate every layout of a search space.

The space (``autopar.search.space``) is enumerated in chunks of layouts; each chunk
is evaluated at once by the array model (``autopar.model.evaluate_columns``),
reduced to its best ``top_n`` layouts and its counts of unusable layouts by
reason, and dropped.  Memory stays bounded by the chunk size whatever the size
of the space.  With a Ray address (``address=`` or ``RAY_ADDRESS``) or a
``Runner`` of processes or Ray, the chunks run on its workers
(``autopar.search.runner``): model, system, space and case travel once, as
JSON-like dicts, so the workers need no local files; each task evaluates a
run of consecutive chunks and sends back only their counts and best layouts
(every row only where every row is kept).  The result is the same as a
local run (ties in sample rate go to the layout enumerated first, as in
Calculon; among layouts within 0.1% of the best rate the simpler is
recommended: ``autopar.search.ranking``).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from autopar.io.layouts import ALL_FIELDS, CHOICES, execution_from_row, record
from autopar.search import ranking
from autopar.io.experiment import DEFAULT_SPACE  # noqa: F401  (every command's default)
from autopar.search.runner import Runner
from autopar.search.space import Case, Space, load_space
from autopar.io.specs import (ModelSpec, SpecError, SystemSpec, load_model,
                           load_system, model_to_json, system_to_json)

# Layouts per chunk: the model holds ~100 float64 statistics per layout plus
# its temporaries, so 2**17 layouts stay well under 1 GiB.
DEFAULT_CHUNK = 1 << 17


@dataclass
class _Part:
    """What one chunk leaves behind."""
    start: int                         # the first and last layout + 1 it covers
    stop: int
    counts: np.ndarray                 # per reason code
    top: dict                          # name -> array: 'index', layout fields, stats
    rows: dict | None = None           # every row (layout fields, feasible, reason_code, stats)
    limit: int = 1                     # how many best layouts ``top`` keeps


def _top_indices(rate: np.ndarray, ok: np.ndarray, n: int) -> np.ndarray:
    """Indices of the feasible rows that can be among the n recommended
    (``autopar.search.ranking.candidates``)."""
    return ranking.candidates(rate, ok, n)


def _evaluate(model: ModelSpec, system: SystemSpec, space: Space, case: Case,
              start: int, stop: int, top_n: int, keep_rows: bool) -> _Part:
    from autopar import model as perf
    cols = space.layouts(case, start, stop)
    # Every statistic only when every row is kept; otherwise the sample rate
    # ranks the chunk and the few best rows are evaluated again in full.
    res = perf.evaluate_columns(model, system, cols,
                                stats=None if keep_rows else ("sample_rate",))
    code = np.asarray(res["reason_code"])
    counts = np.bincount(code, minlength=len(perf.REASONS)).astype(np.int64)
    ok = np.asarray(res["feasible"], dtype=bool)
    rate = np.asarray(res["sample_rate"], dtype=np.float64)
    sel = _top_indices(rate, ok, top_n)
    top = {"index": sel.astype(np.int64) + start}
    for f in ALL_FIELDS:
        top[f] = cols[f][sel]
    full = res if keep_rows else perf.evaluate_columns(
        model, system, {f: top[f] for f in ALL_FIELDS})
    sub = slice(None) if not keep_rows else sel
    for s in perf.STATS:
        top[s] = np.asarray(full[s])[sub]
    rows = None
    if keep_rows:
        rows = dict(cols)
        rows["feasible"] = ok
        rows["reason_code"] = code
        for s in perf.STATS:
            rows[s] = np.asarray(res[s])
    return _Part(start, stop, counts, top, rows, top_n)


def _merge_top(a: dict | None, b: dict, n: int) -> dict:
    if a is None:
        both = b
    else:
        both = {k: np.concatenate([a[k], b[k]]) for k in b}
    order = ranking.reduce(both, n)      # recommended first; the whole tie group kept
    return {k: v[order] for k, v in both.items()}


# --------------------------------------------------------------------------
# The work the runner spreads: ranges of layouts, folded on the workers

@dataclass(frozen=True)
class _Job:
    """What every range of one search needs."""
    model: ModelSpec
    system: SystemSpec
    space: Space
    case: Case
    top_n: int
    keep_rows: bool


def _payload(job: _Job) -> dict:
    """The job as plain data: workers elsewhere need no local files."""
    c = job.case
    return {"model": model_to_json(job.model), "model_source": job.model.source,
            "system": system_to_json(job.system), "system_source": job.system.source,
            "space": job.space.to_dict(),
            "case": {"num_procs": c.num_procs, "max_batch_size": c.max_batch_size,
                     "datatype": c.datatype, "batch_policy": c.batch_policy,
                     "training": c.training},
            "top_n": job.top_n, "keep_rows": job.keep_rows}


def _job_from_payload(p: Mapping) -> _Job:
    """A worker's setup: the job rebuilt once per process (``Runner``)."""
    model = load_model(dict(p["model"]), source=p["model_source"])
    system = load_system(dict(p["system"]), source=p["system_source"])
    case = Case(model=model, system=system, **p["case"])
    return _Job(model, system, load_space(dict(p["space"]), source="space"), case,
                int(p["top_n"]), bool(p["keep_rows"]))


def _evaluate_range(job: _Job, rng: tuple[int, int]) -> _Part:
    return _evaluate(job.model, job.system, job.space, job.case, rng[0], rng[1],
                     job.top_n, job.keep_rows)


def _merge_parts(a: _Part, b: _Part) -> _Part:
    """Two parts as one: counts added, best layouts merged (ties go to the
    lower index, so the order of folding does not matter; rows are never
    folded: a search that keeps them sends every part)."""
    return _Part(min(a.start, b.start), max(a.stop, b.stop), a.counts + b.counts,
                 _merge_top(a.top, b.top, a.limit), None, a.limit)


# --------------------------------------------------------------------------
# Writing every row

def _arrow_table(rows: Mapping, reasons: tuple, stats: tuple, csv: bool):
    import pyarrow as pa
    arrays, names = [], []
    for f in ALL_FIELDS:
        col = rows[f]
        if f in CHOICES:
            arr = pa.DictionaryArray.from_arrays(pa.array(col.astype(np.int8)),
                                                 pa.array(CHOICES[f]))
            arrays.append(arr.dictionary_decode() if csv else arr)
        else:
            arrays.append(pa.array(col))
        names.append(f)
    arrays.append(pa.array(rows["feasible"]))
    names.append("feasible")
    reason = pa.DictionaryArray.from_arrays(pa.array(rows["reason_code"].astype(np.int16)),
                                            pa.array(list(reasons)))
    arrays.append(reason.dictionary_decode() if csv else reason)
    names.append("reason")
    for s in stats:
        arrays.append(pa.array(np.asarray(rows[s], dtype=np.float64)))
        names.append(s)
    return pa.Table.from_arrays(arrays, names=names)


class _RowsWriter:
    """Parquet (CSV when the name ends in .csv), written chunk by chunk into a
    temporary file that replaces ``path`` only on success."""

    def __init__(self, path: str | os.PathLike, reasons: tuple, stats: tuple):
        self.path = Path(path)
        self.csv = self.path.name.lower().endswith(".csv")
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.reasons, self.stats = reasons, stats
        self.writer = None

    def write(self, rows: Mapping) -> None:
        table = _arrow_table(rows, self.reasons, self.stats, self.csv)
        if self.writer is None:
            if self.csv:
                import pyarrow.csv as pcsv
                self.writer = pcsv.CSVWriter(str(self.tmp), table.schema)
            else:
                import pyarrow.parquet as pq
                self.writer = pq.ParquetWriter(str(self.tmp), table.schema)
        self.writer.write_table(table)

    def close(self, ok: bool) -> None:
        if self.writer is not None:
            self.writer.close()
        if ok:
            if self.writer is None:    # no layout at all: still a valid empty file
                self.write({**{f: np.zeros(0, dtype=np.int64) for f in ALL_FIELDS},
                            "feasible": np.zeros(0, bool),
                            "reason_code": np.zeros(0, np.int16),
                            **{s: np.zeros(0) for s in self.stats}})
                self.writer.close()
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------
# The search

def _table(top: Mapping, reasons: tuple, stats: tuple):
    """Decoded pandas table: layout fields as Calculon writes them, then stats."""
    import pandas as pd
    data = {}
    for f in ALL_FIELDS:
        col = np.asarray(top[f])
        if f in CHOICES:
            data[f] = pd.Categorical.from_codes(col.astype(np.int64), categories=list(CHOICES[f]))
        else:
            data[f] = col
    data["feasible"] = np.asarray(top["feasible"], dtype=bool) if "feasible" in top else \
        np.ones(len(top[ALL_FIELDS[0]]), dtype=bool)
    code = np.asarray(top["reason_code"]) if "reason_code" in top else \
        np.zeros(len(top[ALL_FIELDS[0]]), dtype=np.int64)
    data["reason"] = pd.Categorical.from_codes(code.astype(np.int64), categories=list(reasons))
    for s in stats:
        data[s] = np.asarray(top[s], dtype=np.float64)
    return pd.DataFrame(data)


def exhaustive(model, system, num_procs: int, max_batch_size: int, datatype: str,
               space=DEFAULT_SPACE, batch_policy: str | None = None, top_n: int = 1,
               keep_all: bool = False, address: str | None = None,
               progress: bool | None = None, chunk_size: int = DEFAULT_CHUNK,
               training: bool = True, all_path: str | os.PathLike | None = None,
               runner: Runner | None = None):
    """Evaluate every layout of ``space`` for one model, system and size.

    ``model``/``system``: a path, a Calculon-format dict or a spec.  ``space``:
    a path, a name under ``search_spaces/``, a dict or a Space.  Returns
    ``(table, summary)``: ``table`` is a pandas DataFrame of the best
    ``top_n`` feasible layouts, best first (with ``keep_all``, every layout in
    enumeration order instead); ``summary`` is a dict with ``layouts``,
    ``feasible``, ``infeasible`` (count by reason, commonest first),
    ``seconds`` and ``best`` (``execution`` and ``sample_rate``, or None).
    ``all_path`` writes every layout with its statistics to a Parquet file
    (CSV when it ends in .csv), chunk by chunk, atomically.
    ``runner`` (``autopar.search.runner.Runner``, entered): where the ranges
    of layouts run; by default this process, or Ray tasks with an address.
    """
    t0 = time.perf_counter()
    model = load_model(model)
    system = load_system(system)
    space = load_space(space)
    if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n < 1:
        raise SpecError("arguments", "top_n", f"expected a positive integer, got {top_n!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise SpecError("arguments", "chunk_size", f"expected a positive integer, got {chunk_size!r}")
    case = Case(model=model, system=system, num_procs=num_procs,
                max_batch_size=max_batch_size, datatype=datatype,
                batch_policy=batch_policy, training=training)
    size = space.size(case)          # validates the case (SpecError)
    dts = getattr(system, "datatypes", None)
    if dts is not None and datatype not in dts:
        raise SpecError(system.source, "datatype",
                        f"{datatype!r} is not supported by the system (it runs: {', '.join(dts)})")
    ranges = [(a, min(a + chunk_size, size)) for a in range(0, size, chunk_size)]
    keep_rows = keep_all or all_path is not None
    job = _Job(model, system, space, case, int(top_n), keep_rows)
    with contextlib.ExitStack() as stack:
        if runner is None:
            address = address or os.environ.get("RAY_ADDRESS") or None
            runner = stack.enter_context(Runner("ray", address=address) if address
                                         else Runner("serial"))
        return _search(job, runner, ranges, progress, all_path, keep_all, t0,
                       int(chunk_size))


def _search(job: _Job, runner: Runner, ranges, progress, all_path, keep_all, t0, chunk_size):
    """The search proper, its parts computed by ``runner``."""
    from autopar import model as perf
    model, system, space, case = job.model, job.system, job.space, job.case
    size, top_n = space.size(case), job.top_n
    # In this process the job goes as it is, part by part; elsewhere as plain
    # data, in few large tasks that fold their parts (unless every row is kept).
    one_by_one = runner.backend == "serial" or job.keep_rows
    local = runner.backend == "serial"
    # (A task takes every n-th range: the costly regions of a space, where
    # many layouts are feasible, are shared out alike.)
    parts = runner.imap(_evaluate_range, ranges, shared=job if local else _payload(job),
                        setup=None if local else _job_from_payload, reduce=_merge_parts,
                        per_task=1 if one_by_one else None, interleave=not one_by_one)
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=size, unit="layout", unit_scale=True, file=sys.stderr,
                   desc=f"{space.name}", dynamic_ncols=True)
    writer = _RowsWriter(all_path, perf.REASONS, perf.STATS) if all_path is not None else None
    counts = np.zeros(len(perf.REASONS), dtype=np.int64)
    top = None
    kept = []
    ok = False
    try:
        for part in parts:
            counts += part.counts
            top = _merge_top(top, part.top, int(top_n))
            if writer is not None:
                writer.write(part.rows)
            if keep_all:
                kept.append(_table(part.rows, perf.REASONS, perf.STATS))
            if bar is not None:
                bar.update(int(part.counts.sum()))     # every layout has one reason
        ok = True
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close(ok)
    seconds = time.perf_counter() - t0
    if top is None:   # empty space
        top = {"index": np.zeros(0, np.int64), **{f: np.zeros(0, np.int64) for f in ALL_FIELDS},
               **{s: np.zeros(0) for s in perf.STATS}}
    fast = ranking.fastest(top)
    optimum = None if fast is None else {"execution": record(top, fast),
                                         "sample_rate": float(top["sample_rate"][fast])}
    top = {k: v[:int(top_n)] for k, v in top.items()}
    if keep_all:
        import pandas as pd
        table = pd.concat(kept, ignore_index=True) if kept else _table(top, perf.REASONS, perf.STATS)
    else:
        table = _table(top, perf.REASONS, perf.STATS)
        table.index = top["index"]
        table.index.name = "layout"
    feasible = int(counts[0])
    bad = {perf.REASONS[i]: int(c) for i, c in enumerate(counts) if i and c}
    bad = dict(sorted(bad.items(), key=lambda kv: (-kv[1], kv[0])))
    best = None
    if len(top["index"]):
        best = {"execution": record(top, 0), "sample_rate": float(top["sample_rate"][0])}
    summary = {
        "space": space.name, "model": model.name, "system": system.name,
        "num_procs": int(case.num_procs), "max_batch_size": int(case.max_batch_size),
        "datatype": case.datatype, "batch_policy": case.batch_policy or space.batch_policy,
        "training": bool(case.training),
        "layouts": int(size), "feasible": feasible, "infeasible": bad,
        "seconds": round(seconds, 3),
        "layouts_per_second": round(size / seconds, 1) if seconds > 0 else None,
        "chunks": len(ranges), "chunk_size": int(chunk_size),
        "runner": "local" if runner.backend == "serial" else
                  f"ray:{runner.address or 'local'}" if runner.backend == "ray" else runner.backend,
        "best": best,
        # the fastest layout (Calculon's pick; ``best`` is the recommended
        # one among those within autopar.search.ranking.TOLERANCE of it)
        "optimum": optimum,
    }
    return table, summary


def top_json(table, n: int | None = None) -> dict:
    """The best layouts in Calculon's optimal-execution output layout:
    ``{"0": {"execution": {...}, "stats": {...}}, ...}``."""
    from autopar import model as perf
    out = {}
    rows = table[table["feasible"]] if "feasible" in table else table
    if "sample_rate" in rows and not rows.index.name == "layout":
        rows = rows.sort_values("sample_rate", ascending=False, kind="stable")
    for k, (_, row) in enumerate(rows.iterrows()):
        if n is not None and k >= n:
            break
        out[str(k)] = {"execution": execution_of(row),
                       "stats": {s: json_number(row[s]) for s in perf.STATS}}
    return out


def execution_of(row) -> dict:
    """A table row -> an execution dict (see ``layouts.execution_from_row``)."""
    return execution_from_row(row)


def json_number(v):
    v = float(v)
    if math.isnan(v) or math.isinf(v):
        return None
    return int(v) if v.is_integer() and abs(v) < 2 ** 53 else v
