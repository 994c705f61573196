"""Which of several feasible layouts is recommended: the ranking every
search uses to pick its best.

Layouts whose sample rates differ by a hair are, for a user, equally fast;
picking among them by enumeration order recommended, for GPT-3 175B on 4,096
A100s, offloading activations and optimizer state to host memory for no
gain.  The rule:

1. The *tie group* is every feasible layout whose rate is within
   ``TOLERANCE`` (0.1%) of the best rate: ``rate >= best * (1 - TOLERANCE)``.
2. Inside the group the simpler layout comes first, by these keys in turn:

   a. fewer kinds of offloading (``weight_offload``, ``activations_offload``,
      ``optimizer_offload``, and ``activation_offload_blocks`` above 0:
      none first);
   b. less tier-1 memory (``proc_mem_tier1_cap_req``, compared exactly;
      left out where a table does not have it);
   c. fewer pipeline stages (``pipeline_par``);
   d. fewer virtual stages (``pipeline_interleaving``);
   e. less recompute (``activation_recompute``: none, then the selective
      ``attn_only``/``mlp_only``, then full);
   f. the higher rate, then the layout enumerated (or the trial run) first.

3. After the group, the other layouts by rate, highest first (ties: first
   enumerated), as Calculon ranks them.

A skeleton trial (``autopar.search.skeleton``) is its fastest completion;
among completions of exactly that rate the simplest (``simplest_fastest``),
so that the trial's rate is still the highest and the rule above then ranks
the trials.

The fastest layout itself (the *optimum*, highest rate, first enumerated on
ties: Calculon's pick) is not changed by the rule; the searches report its
rate as the optimum, and ``autopar compare`` measures regret against it.

The order is the same however the layouts are split into chunks: a layout
within the tolerance of the overall best rate is within it of the best rate
of any subset holding it, so ``candidates`` (a chunk's) and ``reduce`` (a
merge's) keep every layout that can still belong to the final tie group.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from autopar.io.layouts import CHOICES

TOLERANCE = 1e-3
RATE = "sample_rate"
MEMORY = "proc_mem_tier1_cap_req"
OFFLOADS = ("weight_offload", "activations_offload", "optimizer_offload")
PARTIAL_OFFLOAD = "activation_offload_blocks"
RECOMPUTE = {"none": 0, "attn_only": 1, "mlp_only": 1, "full": 2}


def in_tie(rate, best: float) -> np.ndarray:
    """Rows of ``rate`` within ``TOLERANCE`` of ``best``."""
    return np.asarray(rate, dtype=np.float64) >= best * (1.0 - TOLERANCE)


def _values(col) -> np.ndarray:
    return np.asarray(getattr(col, "to_numpy", lambda: col)())


def _recompute_rank(col) -> np.ndarray:
    v = _values(col)
    if v.dtype.kind in "iu" or v.dtype.kind == "f":     # codes into CHOICES
        names = CHOICES["activation_recompute"]
        table = np.array([RECOMPUTE.get(n, 1) for n in names])
        return table[v.astype(np.int64)]
    return np.array([RECOMPUTE.get(str(x), 1) for x in v])


def _index(cols: Mapping, n: int) -> np.ndarray:
    for name in ("index", "trial"):
        if name in cols:
            return _values(cols[name]).astype(np.int64)
    return np.arange(n)


def order(cols: Mapping) -> np.ndarray:
    """Positions of the rows of ``cols`` (every one feasible, a ``sample_rate``
    column, the layout fields, optionally ``proc_mem_tier1_cap_req`` and the
    enumeration ``index`` or ``trial``), recommended first (module docstring)."""
    rate = _values(cols[RATE]).astype(np.float64)
    n = rate.size
    if n == 0:
        return np.zeros(0, np.int64)
    idx = _index(cols, n)
    tie = in_tie(rate, float(np.nanmax(rate)))
    offloads = sum(_values(cols[f]).astype(np.int64) for f in OFFLOADS if f in cols)
    if PARTIAL_OFFLOAD in cols:
        # some blocks' activations offloaded: a kind of offloading too
        offloads = offloads + (_values(cols[PARTIAL_OFFLOAD]) > 0).astype(np.int64)
    zero = np.zeros(n)
    memory = _values(cols[MEMORY]).astype(np.float64) if MEMORY in cols else zero
    pp = _values(cols["pipeline_par"]).astype(np.int64) if "pipeline_par" in cols else zero
    vs = (_values(cols["pipeline_interleaving"]).astype(np.int64)
          if "pipeline_interleaving" in cols else zero)
    rc = _recompute_rank(cols["activation_recompute"]) if "activation_recompute" in cols else zero

    def only_tie(v):
        return np.where(tie, v, 0)
    # np.lexsort: the last key is the primary one
    return np.lexsort((idx, -rate, only_tie(rc), only_tie(vs), only_tie(pp),
                       only_tie(np.nan_to_num(memory)), only_tie(offloads), ~tie))


def candidates(rate, ok, n: int) -> np.ndarray:
    """Rows of one chunk that can still be among the ``n`` recommended or in
    the tie group: the ``n`` fastest feasible rows (ties by position) and
    every feasible row within ``TOLERANCE`` of the chunk's best rate; in
    position order."""
    rate = np.asarray(rate, dtype=np.float64)
    idx = np.flatnonzero(ok)
    if idx.size > n:
        r = rate[idx]
        t = np.partition(r, r.size - n)[r.size - n]        # n-th largest
        keep = (r > t) | in_tie(r, float(r.max()))
        eq = np.flatnonzero(r == t)[: max(0, n - int(np.count_nonzero(r > t)))]
        keep[eq] = True
        idx = idx[keep]
    return idx


def reduce(rows: Mapping, n: int) -> np.ndarray:
    """Positions of the rows of ``rows`` (as ``order`` takes them) worth
    keeping when more may be merged in, recommended first: the whole tie
    group (a later, faster layout can shrink it, promoting a less simple
    member) and the ``n`` first by ``order`` besides."""
    o = order(rows)
    if o.size <= n:
        return o
    rate = _values(rows[RATE]).astype(np.float64)
    tie = in_tie(rate[o], float(np.max(rate)))
    keep = tie.copy()
    keep[:n] = True
    return o[keep]


def simplest_fastest(rows: Mapping) -> int | None:
    """Position of the simplest (by the keys of ``order``) among the rows of
    exactly the highest rate, or None for no rows: a skeleton trial's
    completion (``autopar.search.skeleton``), whose rate stays the highest
    while offloading that gains nothing is not chosen."""
    rate = _values(rows[RATE]).astype(np.float64)
    if rate.size == 0:
        return None
    top = np.flatnonzero(rate == np.max(rate))
    if top.size == 1:
        return int(top[0])
    sub = {k: _values(v)[top] for k, v in rows.items()}
    return int(top[order(sub)[0]])


def fastest(rows: Mapping) -> int | None:
    """Position of the fastest row (the optimum: highest rate, first
    enumerated on ties), or None for no rows."""
    rate = _values(rows[RATE]).astype(np.float64)
    if rate.size == 0:
        return None
    idx = _index(rows, rate.size)
    return int(np.lexsort((idx, -rate))[0])
