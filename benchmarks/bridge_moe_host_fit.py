"""The MoE host-time constant and the Qwen3-30B-A3B table, figure by figure.

Prints, for the exposed host time per MoE block (``time_overhead.moe_block_s``)
on its 0.25 ms grid: the fit rows' mean |tokens/s error| (what
``fit_bridge_host_time`` minimises), the median |error| of the 34 held-out
Bridge rows, of all 36, of release 26.04.01, and of SimuMax's 12 DeepSeek
rows; then, at the shipped constant, the error by release and by system, and
a leave-one-system-out check on release 26.04.01 (fit on four systems'
rows, predict the fifth).  Needs ../shared/reference.  About a minute.

    PYTHONPATH=$PWD python benchmarks/bridge_moe_host_fit.py
"""
from __future__ import annotations

import re

import numpy as np

from autopar.model import evaluate_one
from autopar.studies import published as P
from autopar.studies import published_moe as PM


def errors(cases, h: float) -> np.ndarray:
    out = []
    for c in cases:
        s = evaluate_one(c.model, PM.with_moe_host_time(c.system, h), c.execution)
        tok = s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]
        out.append(tok / c.measured["tokens_per_s_per_gpu"] - 1)
    return np.array(out)


def main() -> None:
    bridge = [c for _, c in P.cases(P.TABLES["bridge_qwen3_moe"])
              if isinstance(c, P.PublishedCase)]
    deepseek = [c for _, c in P.cases(P.TABLES["simumax_b200"])
                if isinstance(c, P.PublishedCase) and c.model.moe is not None]
    labels = [c.label for c in bridge]
    fit = np.array([bool(re.match(PM.BRIDGE_FIT_ROWS, lab)) for lab in labels])
    latest = np.array([lab.startswith("26.04.01 ") for lab in labels])
    grid = PM.BRIDGE_HOST_GRID
    E = np.array([errors(bridge, h) for h in grid])
    D = np.array([errors(deepseek, h) for h in grid])
    best, scores = PM.fit_bridge_host_time(grid)
    print(f"fit rows: {', '.join(np.array(labels)[fit])}; fitted {best * 1e3:.2f} ms "
          f"(shipped MOE_HOST_S {PM.MOE_HOST_S * 1e3:.2f} ms)")
    print(" h ms   fit mean|e|  held-out med  all med  26.04.01 med  DeepSeek med")
    for i, h in enumerate(grid):
        a = np.abs(E[i])
        print(f"{h * 1e3:5.2f}   {scores[h]:10.4f}  {np.median(a[~fit]):12.4f}  "
              f"{np.median(a):7.4f}  {np.median(a[latest]):12.4f}  "
              f"{np.median(np.abs(D[i])):12.4f}")
    i = grid.index(PM.MOE_HOST_S)
    a = np.abs(E[i])
    print(f"\nat {PM.MOE_HOST_S * 1e3:.2f} ms: {int((a <= 0.15).sum())} of {len(a)} rows "
          "within 15%")
    for key, name in ((lambda lab: lab.split()[0], "release"),
                      (lambda lab: lab.split()[1], "system")):
        groups: dict = {}
        for lab, e in zip(labels, a):
            groups.setdefault(key(lab), []).append(e)
        print(f"by {name}: " + ", ".join(f"{k} {np.median(v):.3f}/{max(v):.3f} ({len(v)})"
                                         for k, v in groups.items()))
    print("\nleave one system out on 26.04.01 (fit on the other four):")
    rows = np.flatnonzero(latest)
    for k in rows:
        others = [j for j in rows if j != k]
        j = int(np.argmin(np.abs(E[:, others]).mean(axis=1)))
        print(f"  without {labels[k].split()[1]:10s} fit {grid[j] * 1e3:.2f} ms, its error "
              f"{E[j, k]:+.3f}")


if __name__ == "__main__":
    main()
