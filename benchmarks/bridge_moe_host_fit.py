"""The MoE host-time constant on its two tables, figure by figure (issue 24).

The host time per op issued after a dropless MoE block's token-count sync
(``time_overhead.moe_host_op_s``; the ops counted by
``autopar.model.overhead.moe_sync_ops``) is fitted on two Bridge rows
(``fit_bridge_host_op_time``) and on SimuMax's 12 DeepSeek rows alone
(``fit_simumax_host_op_time``).  Prints:

1. for each grid value (0.5 us steps): the Bridge fit rows' mean |tokens/s
   error| (what the fit minimises), the median |error| of the 34 held-out
   Bridge rows, of all 36, of release 26.04.01, and of the 12 DeepSeek rows;
2. leave one table out, both directions: each table's median |error| at its
   own fit and at the other table's, and their ratio (the bar: 1.5);
3. the error by release and by system at the shipped constant, and every
   MoE row's error;
4. the same two-way figures for other structures of the exposed time per
   MoE block and micro-batch: the flat per-block time of before
   (``moe_block_s``), and the count with other fixed-op and fp8-quantize
   counts (how much the result leans on those counts).  These apply the
   row's counted time as its ``moe_block_s`` (a third forward), which is
   the counted model's total on the rows without a pipeline.

Needs ../shared/reference.  About a minute.

    PYTHONPATH=$PWD python benchmarks/bridge_moe_host_fit.py
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from autopar.model import evaluate_one
from autopar.studies import published as P
from autopar.studies import published_moe as PM


def flat(system, per_block: float):
    """``system`` with a stated per-block host time and no counted one."""
    return dataclasses.replace(system, time_overhead=dataclasses.replace(
        system.time_overhead, moe_block_s=per_block, moe_host_op_s=0.0))


def tokens(c, system) -> float:
    s = evaluate_one(c.model, system, c.execution)
    return s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]


def errors(cases, op_s: float) -> np.ndarray:
    return np.array([tokens(c, PM.with_moe_host_op_time(c.system, op_s))
                     / c.measured["tokens_per_s_per_gpu"] - 1 for c in cases])


def med(a) -> float:
    return float(np.median(np.abs(a)))


def two_way(name, bridge, deepseek, fit, err_at, grid) -> None:
    """Fit on the Bridge fit rows / on the DeepSeek rows (mean |error| over
    ``grid``), then each table's median at both values."""
    def mean(cs, p):
        return float(np.mean(np.abs(err_at(cs, p))))
    pb = min(grid, key=lambda p: (round(mean(fit, p), 6), p))
    pd = min(grid, key=lambda p: (round(mean(deepseek, p), 6), p))
    bi, bo = med(err_at(bridge, pb)), med(err_at(bridge, pd))
    di, do = med(err_at(deepseek, pd)), med(err_at(deepseek, pb))
    print(f"  {name:34s} fit on Bridge {pb:9.3g}, on DeepSeek {pd:9.3g} | Bridge "
          f"{bi:.3f} -> {bo:.3f} ({bo / bi:.2f}x) | DeepSeek {di:.3f} -> {do:.3f} "
          f"({do / di:.2f}x)")


def main() -> None:
    bridge = [c for _, c in P.cases(P.TABLES["bridge_qwen3_moe"])
              if isinstance(c, P.PublishedCase)]
    deepseek = PM.simumax_moe_cases()
    labels = [c.label for c in bridge]
    fit = np.array([bool(re.match(PM.BRIDGE_FIT_ROWS, lab)) for lab in labels])
    latest = np.array([lab.startswith("26.04.01 ") for lab in labels])
    grid = [h for h in PM.HOST_OP_GRID if h <= 4e-5]
    E = np.array([errors(bridge, h) for h in grid])
    D = np.array([errors(deepseek, h) for h in grid])
    best, scores = PM.fit_bridge_host_op_time(grid)
    other, _ = PM.fit_simumax_host_op_time(grid)
    print(f"fit rows: {', '.join(np.array(labels)[fit])}; fitted {best * 1e6:.1f} us/op "
          f"(shipped MOE_HOST_OP_S {PM.MOE_HOST_OP_S * 1e6:.1f}); on the DeepSeek rows "
          f"{other * 1e6:.1f} us/op")
    print("us/op  fit mean|e|  held-out med  all med  26.04.01 med  DeepSeek med")
    for i, h in enumerate(grid):
        if i % 2:
            continue
        a = np.abs(E[i])
        print(f"{h * 1e6:5.1f}   {scores[h]:10.4f}  {np.median(a[~fit]):12.4f}  "
              f"{np.median(a):7.4f}  {np.median(a[latest]):12.4f}  "
              f"{np.median(np.abs(D[i])):12.4f}")
    ib, io = grid.index(best), grid.index(other)
    print("\nleave one table out (median |error|):")
    print(f"  Bridge (36 rows):   at its fit {med(E[ib]):.4f}, at the DeepSeek fit "
          f"{med(E[io]):.4f}, ratio {med(E[io]) / med(E[ib]):.2f}")
    print(f"  DeepSeek (12 rows): at its fit {med(D[io]):.4f}, at the Bridge fit "
          f"{med(D[ib]):.4f}, ratio {med(D[ib]) / med(D[io]):.2f}")
    a = np.abs(E[ib])
    print(f"\nat {best * 1e6:.1f} us/op: {int((a <= 0.15).sum())} of {len(a)} Bridge rows "
          "within 15%")
    for key, name in ((lambda lab: lab.split()[0], "release"),
                      (lambda lab: lab.split()[1], "system")):
        groups: dict = {}
        for lab, e in zip(labels, a):
            groups.setdefault(key(lab), []).append(e)
        print(f"by {name}: " + ", ".join(f"{k} {np.median(v):.3f}/{max(v):.3f} ({len(v)})"
                                         for k, v in groups.items()))
    for c, e in zip(bridge + deepseek, np.r_[E[ib], D[ib]]):
        print(f"  {c.label[:52]:52s} {e:+.3f}")

    # Other structures, the row's time applied as its moe_block_s.
    cache = {}

    def line(c):
        # time per token = a + b * (per-block host time): linear in it
        if id(c) not in cache:
            t0 = 1 / tokens(c, flat(c.system, 0.0))
            t1 = 1 / tokens(c, flat(c.system, 0.004))
            cache[id(c)] = (t0, (t1 - t0) / 0.004)
        return cache[id(c)]

    def at(per_block):
        def err(cs, p):
            out = []
            for c in cs:
                t0, b = line(c)
                out.append(1 / (t0 + b * per_block(c, p))
                           / c.measured["tokens_per_s_per_gpu"] - 1)
            return np.array(out)
        return err

    def ops(c, fixed, quant):
        local = c.model.moe.experts / c.execution["expert_par"]
        fp8 = bool(c.execution.get("fp8_recipe"))
        return fixed + local * (6 + (quant if fp8 else 0))

    fit_rows = [c for c, f in zip(bridge, fit) if f]
    print("\nother structures (fit on the two Bridge rows / on the DeepSeek rows; "
          "median |error| at its own fit -> at the other table's):")
    two_way("flat per block (moe_block_s, s)", bridge, deepseek, fit_rows,
            at(lambda c, p: p), [round(0.00025 * i, 5) for i in range(41)])
    us = [round(0.5e-6 * i, 8) for i in range(1, 121)]
    for fixed in (0, 16, 40, 80):
        for quant in (0, 4):
            two_way(f"counted, fixed {fixed}, fp8 +{quant}/expert (s/op)", bridge, deepseek,
                    fit_rows, at(lambda c, p, f=fixed, q=quant: p * ops(c, f, q)), us)


if __name__ == "__main__":
    main()
