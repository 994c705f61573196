"""Exhaustive search: evaluate every layout of a search space.

The space (``autopar.search.space``) is enumerated in chunks of layouts; each chunk
is evaluated at once by the array model (``autopar.model.evaluate_columns``),
reduced to its best ``top_n`` layouts and its counts of unusable layouts by
reason, and dropped.  Memory stays bounded by the chunk size whatever the size
of the space.  With a Ray address (``address=`` or ``RAY_ADDRESS``), chunks
are Ray tasks; model, system and space travel as JSON-like dicts, so the
workers need no local files, and the result is the same as a local run (ties
in sample rate go to the layout enumerated first, as in Calculon; among layouts
within 0.1% of the best rate the simpler is recommended: ``autopar.search.ranking``).
"""
from __future__ import annotations

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
from autopar.search.space import Case, Space, load_space
from autopar.io.specs import (ModelSpec, SpecError, SystemSpec, load_model,
                           load_system, model_to_json, system_to_json)

# Layouts per chunk: the model holds ~100 float64 statistics per layout plus
# its temporaries, so 2**17 layouts stay well under 1 GiB.
DEFAULT_CHUNK = 1 << 17


@dataclass
class _Part:
    """What one chunk leaves behind."""
    start: int
    stop: int
    counts: np.ndarray                 # per reason code
    top: dict                          # name -> array: 'index', layout fields, stats
    rows: dict | None = None           # every row (layout fields, feasible, reason_code, stats)


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
    return _Part(start, stop, counts, top, rows)


def _merge_top(a: dict | None, b: dict, n: int) -> dict:
    if a is None:
        both = b
    else:
        both = {k: np.concatenate([a[k], b[k]]) for k in b}
    order = ranking.reduce(both, n)      # recommended first; the whole tie group kept
    return {k: v[order] for k, v in both.items()}


# --------------------------------------------------------------------------
# Ray

def _ray_part(model_json, system_json, space_json, case_args, start, stop, top_n, keep_rows):
    """A Ray task: rebuild the inputs from plain data, evaluate one chunk."""
    model = load_model(model_json, source="model")
    system = load_system(system_json, source="system")
    space = _worker_space(space_json)
    case = Case(model=model, system=system, **case_args)
    return _evaluate(model, system, space, case, start, stop, top_n, keep_rows)


_WORKER_SPACES: dict = {}


def _worker_space(space_json) -> Space:
    key = repr(space_json)
    sp = _WORKER_SPACES.get(key)
    if sp is None:        # keep the plan cache across tasks in one worker
        sp = _WORKER_SPACES[key] = load_space(space_json, source="space")
    return sp


def _reachable(address: str) -> None:
    from autopar.search.cluster import reachable
    reachable(address)


def _ray_parts(model, system, space, case, ranges, top_n, keep_rows, address):
    """Yield the parts of ``ranges`` in order, computed as Ray tasks."""
    import ray
    from autopar.search.cluster import join
    started = False
    if not ray.is_initialized():
        join(address)     # the package travels with the job: workers need no copy
        started = True
    try:
        task = ray.remote(num_cpus=1, max_retries=2)(_ray_part)
        m_ref = ray.put(model_to_json(model))
        s_ref = ray.put(system_to_json(system))
        case_args = {"num_procs": case.num_procs, "max_batch_size": case.max_batch_size,
                     "datatype": case.datatype, "batch_policy": case.batch_policy,
                     "training": case.training}
        sp_json = space.to_dict()
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        pending: dict = {}
        done: dict = {}
        nxt = 0   # next range to submit
        emit = 0  # next range to yield
        while emit < len(ranges):
            while nxt < len(ranges) and len(pending) < window:
                a, b = ranges[nxt]
                ref = task.remote(m_ref, s_ref, sp_json, case_args, a, b, top_n, keep_rows)
                pending[ref] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                done[pending.pop(ref)] = ray.get(ref)
            while emit in done:
                yield done.pop(emit)
                emit += 1
    finally:
        if started:
            ray.shutdown()


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
               training: bool = True, all_path: str | os.PathLike | None = None):
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
    """
    from autopar import model as perf
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
    address = address or os.environ.get("RAY_ADDRESS") or None
    ranges = [(a, min(a + chunk_size, size)) for a in range(0, size, chunk_size)]
    keep_rows = keep_all or all_path is not None
    if address:
        parts = _ray_parts(model, system, space, case, ranges, int(top_n), keep_rows, address)
    else:
        parts = (_evaluate(model, system, space, case, a, b, int(top_n), keep_rows)
                 for a, b in ranges)
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
                bar.update(part.stop - part.start)
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
        "num_procs": int(num_procs), "max_batch_size": int(max_batch_size),
        "datatype": datatype, "batch_policy": batch_policy or space.batch_policy,
        "training": bool(training),
        "layouts": int(size), "feasible": feasible, "infeasible": bad,
        "seconds": round(seconds, 3),
        "layouts_per_second": round(size / seconds, 1) if seconds > 0 else None,
        "chunks": len(ranges), "chunk_size": int(chunk_size),
        "runner": f"ray:{address}" if address else "local",
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
