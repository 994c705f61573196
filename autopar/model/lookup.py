"""Integer functions of a few small columns, by table lookup.

Integer division and remainder cost several times a multiplication per
element, and the columns they act on (tensor_par, pipeline_par,
context_par, interleaving, micro-batch size) take few, small values.
``by_value(f, a, b, ...)`` evaluates ``f`` once on every combination of the
values in the columns' ranges (a table) and gathers the result per row: the
same integer operations on the same values, so exactly what ``f(a, b, ...)``
gives.  Columns whose ranges would make a large table are computed directly.
"""
from __future__ import annotations

import numpy as np

# Entries of a table at most: an eighth of the rows (a table entry costs
# about what a row costs computed directly), and a size that stays in cache.
LIMIT = 1 << 14


def by_value(f, *cols):
    """``f(*cols)`` for integer columns (numpy arrays of one length), through
    a table over the columns' value ranges when it is small."""
    cols = [np.asarray(c) for c in cols]
    if not len(cols[0]) or any(c.dtype.kind != "i" for c in cols):
        return f(*cols)
    limit = min(LIMIT, len(cols[0]) // 8)
    los, spans, size = [], [], 1
    for c in cols:
        lo, hi = int(c.min()), int(c.max())
        size *= hi - lo + 1
        if size > limit:
            return f(*cols)
        los.append(lo)
        spans.append(hi - lo + 1)
    # Every combination of the values lo..hi (in each column's dtype), with
    # one axis per column; each row's place in it.
    grid = np.meshgrid(*[np.arange(lo, lo + k, dtype=c.dtype)
                         for lo, k, c in zip(los, spans, cols)], indexing="ij", sparse=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tables = f(*grid)
    flat = None
    for c, lo, k in zip(cols, los, spans):
        at = c - lo if lo else c
        flat = at if flat is None else flat * k + at
    return np.broadcast_to(tables, tuple(spans)).reshape(-1).take(flat)
