"""Integer functions of a few small columns, by table lookup.

Integer division and remainder cost several times a multiplication per
element, and the columns they act on (tensor_par, pipeline_par,
context_par, interleaving, micro-batch size) take few, small values.
``by_value(f, a, b, ...)`` evaluates ``f`` once on every combination of the
values in the columns' ranges (a table) and gathers the result per row: the
same integer operations on the same values, so exactly what ``f(a, b, ...)``
gives.  Columns whose ranges would make a large table are computed directly.

``pack(columns)`` gives one integer key per row from a few integer columns
(mixed radix over each column's values, in their order) and ``distinct`` the
distinct keys' first rows and each row's distinct key, by a table over the
possible keys rather than a sort: the distinct transformer blocks of a
layout table (``BlockCache``), the skeletons of a space (``Completions``).
"""
from __future__ import annotations

import numpy as np

# Entries of a table at most: an eighth of the rows (a table entry costs
# about what a row costs computed directly), and a size that stays in cache.
LIMIT = 1 << 14


class Ranges:
    """The smallest and largest value of a column, found once however many
    calls ask (``by_value``'s tables, the rules' checks of what a column's
    values allow).  It holds the columns it has seen, so that an ``id`` stays
    theirs while it lives."""

    def __init__(self):
        self._seen: dict = {}

    def __call__(self, col: np.ndarray) -> tuple[int, int]:
        got = self._seen.get(id(col))
        if got is None:
            got = self._seen[id(col)] = (col, int(col.min()), int(col.max()))
        return got[1], got[2]


def by_value(f, *cols, ranges: Ranges | None = None):
    """``f(*cols)`` for integer columns (numpy arrays of one length), through
    a table over the columns' value ranges when it is small; ``ranges``: a
    ``Ranges`` shared by calls on the same columns."""
    cols = [np.asarray(c) for c in cols]
    if not len(cols[0]) or any(c.dtype.kind != "i" for c in cols):
        return f(*cols)
    limit = min(LIMIT, len(cols[0]) // 8)
    bounds, size, whole = [], 1, 1
    for c in cols:
        lo, hi = ranges(c) if ranges is not None else (int(c.min()), int(c.max()))
        size *= hi - lo + 1
        if size > limit:
            return f(*cols)
        whole = whole * (hi + 1) if lo >= 0 else limit + 1
        bounds.append((lo, hi))
    # A table from 0 (when every column is >= 0 and it stays small) is
    # indexed by the values themselves; otherwise from each column's smallest.
    if whole > limit:
        los = [lo for lo, _ in bounds]
    else:
        los = [0] * len(cols)
    spans = [hi - lo + 1 for lo, (_, hi) in zip(los, bounds)]
    # Every combination of the values (in each column's dtype), with one
    # axis per column; each row's place in it.
    grid = np.meshgrid(*[np.arange(lo, lo + k, dtype=c.dtype)
                         for lo, k, c in zip(los, spans, cols)], indexing="ij", sparse=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tables = f(*grid)
    flat = None
    for c, lo, k in zip(cols, los, spans):
        at = c - lo if lo else c
        flat = at if flat is None else flat * k + at
    return np.broadcast_to(tables, tuple(spans)).reshape(-1).take(flat)


def _compact(col: np.ndarray) -> tuple[np.ndarray | None, int]:
    """Codes 0..k-1 for the k distinct values of an integer column (ordered
    as the values), and k; (None, 1) for a column of one value."""
    if not len(col):
        return None, 1
    lo, hi = int(col.min()), int(col.max())
    if lo == hi:
        return None, 1
    span = hi - lo + 1
    if span > 1 << 16:
        _, inv = np.unique(col, return_inverse=True)
        return inv, int(inv.max()) + 1
    shifted = col.astype(np.int64) - lo
    seen = np.zeros(span, dtype=bool)
    seen[shifted] = True
    k = int(np.count_nonzero(seen))
    if k == span:
        return shifted, k
    rank = np.cumsum(seen) - 1
    return rank[shifted], k


# A column whose values span at most this many integers is coded as its
# value minus the smallest (no renumbering pass); a wider one is renumbered
# to its distinct values.  The key keeps the order of the columns' values
# either way, so the distinct keys come out in the same order.
_RAW_SPAN = 16


def pack(columns) -> tuple[np.ndarray, int]:
    """One int64 key per row from integer columns (mixed radix over each
    column's values), and the number of keys possible."""
    # The key is built in place from the columns' values; their smallest
    # values come off once at the end (``offset``), exactly (int64 wraps).
    key, size, offset = None, 1, 0
    for col in columns:
        if not len(col):
            break
        if col.strides == (0,):         # a view of one value: no pass over it
            continue
        lo, hi = int(col.min()), int(col.max())
        if lo == hi:
            continue
        if hi - lo < _RAW_SPAN:
            code, k, base = col, hi - lo + 1, lo
        else:
            (code, k), base = _compact(col), 0
        if size > (1 << 62) // k:       # too many combinations: renumber the key
            key, size = _compact(_less(key, offset))
            key = np.zeros(len(col), dtype=np.int64) if key is None else key
            offset = 0
        if key is None:
            key, offset = code.astype(np.int64), base       # (a copy: ours to update)
        else:
            key *= k
            key += code
            offset = offset * k + base
        size *= k
    n = len(columns[0])
    return (np.zeros(n, dtype=np.int64) if key is None else _less(key, offset)), size


def _less(key: np.ndarray, offset: int) -> np.ndarray:
    """``key - offset`` in place, modulo 2^64 as int64 arithmetic wraps."""
    if offset:
        key -= np.int64((offset + (1 << 63)) % (1 << 64) - (1 << 63))
    return key


def distinct(key: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What ``np.unique(key, return_index=True, return_inverse=True)`` gives
    after the values: the first row of each distinct key and each row's
    distinct key; by a table over the ``size`` possible keys when that is
    small, without sorting."""
    n = len(key)
    if size > max(4 * n, 1 << 16):
        _, idx, inv = np.unique(key, return_index=True, return_inverse=True)
        return idx, inv
    seen = np.zeros(size, dtype=bool)
    seen[key] = True
    inv = (np.cumsum(seen) - 1)[key]
    idx = np.full(int(np.count_nonzero(seen)), n, dtype=np.int64)
    np.minimum.at(idx, inv, np.arange(n))
    return idx, inv
