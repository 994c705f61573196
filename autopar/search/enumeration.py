"""Enumeration of a space, vectorised: a plan, then chunks of layouts.

The nodes up to the last one another node depends on form a small *prefix*
walked in Python; for each prefix row the remaining nodes are a plain
Cartesian product (a *pattern*) built once per distinct shape with numpy; a
chunk of layouts is two gathers per column.  A pattern too large moves its
outermost node into the prefix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.io.layouts import ALL_FIELDS, BOOL_FIELDS, CHOICES
from autopar.search.domains import RULES

def encode(name: str, v) -> int:
    """The layout table's code of a parameter value."""
    return CHOICES[name].index(v) if name in CHOICES else int(v)


@dataclass
class Plan:
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


def build_plan(space, ctx) -> Plan:
    """The enumeration plan of ``space`` for one case."""
    rules = RULES
    n = len(rules)
    # The last node another later node depends on ends the prefix.
    b = max((space._index[d] for r in rules for d in r.deps), default=-1)
    while True:
        plan = _try_plan(space, ctx, b + 1)
        if plan is not None:
            return plan
        b += 1
        if b >= n - 1:
            raise RuntimeError("search space too large to plan")  # pragma: no cover

def _try_plan(space, ctx, split: int) -> Plan | None:
    rules = RULES
    memo: dict = {}
    live = space._live[split - 1]
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
            doms = tuple(space._memo_domain(ctx, j, state, memo) for j in range(split, len(rules)))
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
        for v in space._memo_domain(ctx, i, state, memo):
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
        prefix[nm] = np.array([encode(nm, r[k]) for r in prefix_rows], dtype=np.int64)
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
            vals = np.array([encode(nm, v) for v in p[k]], dtype=np.int64)
            inner = math.prod(lens[k + 1:])
            outer = math.prod(lens[:k])
            parts.append(np.tile(np.repeat(vals, inner), outer))
        col = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        pat[nm] = col.astype(_small_dtype(col))
    return Plan(prefix_names=prefix_names, prefix=prefix, offsets=offsets,
                 pid=np.array(pids, dtype=np.int64), suffix_names=suffix_names,
                 pat_start=pat_start, pat=pat)


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


def materialize(ctx, plan: Plan, a: int, b: int) -> dict[str, np.ndarray]:
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
