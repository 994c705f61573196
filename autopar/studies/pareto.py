"""Pareto fronts and 2-D hypervolume (pure numpy, no search).

Points are rows of an ``(n, k)`` array of objectives to **minimise** (a
maximised objective such as sample rate enters negated).  A point is on the
front when no other point is at least as good in every objective and
strictly better in one; equal points are all kept (callers de-duplicate the
same system first).
"""
from __future__ import annotations

import numpy as np


def front_mask(points) -> np.ndarray:
    """Boolean mask of the non-dominated rows (rows with NaN are never on it)."""
    p = np.asarray(points, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError("expected an (n, k) array")
    n = p.shape[0]
    ok = ~np.isnan(p).any(axis=1)
    mask = ok.copy()
    idx = np.flatnonzero(ok)
    q = p[idx]
    for j, i in enumerate(idx):
        le = (q <= q[j]).all(axis=1)
        lt = (q < q[j]).any(axis=1)
        if (le & lt).any():
            mask[i] = False
    return mask if n else np.zeros(0, dtype=bool)


def dominated_by(points, front) -> np.ndarray:
    """For each row of ``points``, whether some row of ``front`` dominates it."""
    p = np.asarray(points, dtype=np.float64)
    f = np.asarray(front, dtype=np.float64)
    if not len(f):
        return np.zeros(len(p), dtype=bool)
    le = (f[None, :, :] <= p[:, None, :]).all(axis=2)
    lt = (f[None, :, :] < p[:, None, :]).any(axis=2)
    return (le & lt).any(axis=1)


def hypervolume_2d(points, ref) -> float:
    """Area dominated by ``points`` (minimised, 2 objectives) and bounded by
    the reference point ``ref``; points not better than ``ref`` in both add
    nothing."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    r = np.asarray(ref, dtype=np.float64)
    p = p[~np.isnan(p).any(axis=1)]
    p = p[(p[:, 0] < r[0]) & (p[:, 1] < r[1])]
    if not len(p):
        return 0.0
    # sweep by the first objective; each point that lowers the running
    # minimum of the second owns the strip up to the next such point
    p = p[np.lexsort((p[:, 1], p[:, 0]))]
    area = 0.0
    xs, ys = [], []
    cur = r[1]
    for x, y in p:
        if y < cur:
            xs.append(x)
            ys.append(y)
            cur = y
    xs.append(r[0])
    for i in range(len(ys)):
        area += (xs[i + 1] - xs[i]) * (r[1] - ys[i])
    return float(area)


def hypervolume_curve(points, ref) -> np.ndarray:
    """Hypervolume of the first t points, for t = 1..n (NaN rows add nothing)."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    out = np.zeros(len(p))
    kept = np.zeros((0, 2))
    hv = 0.0
    for t in range(len(p)):
        row = p[t]
        if not np.isnan(row).any() and not dominated_by(row[None, :], kept)[0] \
                and not (kept == row).all(axis=1).any():
            kept = np.vstack([kept[~dominated_by(kept, row[None, :])], row])
            hv = hypervolume_2d(kept, ref)
        out[t] = hv
    return out
