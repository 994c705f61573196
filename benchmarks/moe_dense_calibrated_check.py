"""How far the MoE modelling is from measurements once the system is right.

The SimuMax B200 table (``../shared/reference/measured/published/
simumax_b200_measured.csv``) measures dense Llama 3 rows and DeepSeek-V2/V3
MoE rows on the same 8 B200 with the same Megatron-LM.  The shipped
``systems/b200_nvl8.json`` is not calibrated (its matrix-efficiency curve was
the H100 files' assumption; its plateau is now the published best-shape
matmul rate, systems/README.md, still above what SimuMax's machine reached
on Megatron-LM's shapes), so both kinds are predicted too fast.  This
script scales the bfloat16 matrix-efficiency curve by one factor fitted on
the *dense* rows only (median signed tokens/s error = 0, by bisection), then
predicts the MoE rows, which the fit never saw, and prints their errors.

    PYTHONPATH=$PWD python benchmarks/moe_dense_calibrated_check.py
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.model import evaluate_one
from autopar.studies import published as P


def scaled(system, factor: float):
    mat = dict(system.matrix)
    p = mat["bfloat16"]
    mat["bfloat16"] = dataclasses.replace(
        p, gflops_efficiency=tuple((t, min(1.0, e * factor)) for t, e in p.gflops_efficiency))
    return dataclasses.replace(system, matrix=mat)


def errors(cases, system) -> dict:
    out = {"dense": [], "moe": []}
    for c in cases:
        s = evaluate_one(c.model, system, c.execution)
        tok = s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]
        out["moe" if c.model.moe else "dense"].append(
            (c.label, tok / c.measured["tokens_per_s_per_gpu"] - 1,
             s["proc_mem_tier1_cap_req"] / P.GIB / c.measured["peak_mem_gib"] - 1))
    return out


def main() -> None:
    cases = [c for _, c in P.cases(P.TABLES["simumax_b200"]) if isinstance(c, P.PublishedCase)]
    system = P.system("b200_nvl8")
    lo, hi = 0.2, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        med = np.median([e for _, e, _ in errors(cases, scaled(system, mid))["dense"]])
        lo, hi = (mid, hi) if med < 0 else (lo, mid)
    factor = (lo + hi) / 2
    base = errors(cases, system)
    fit = errors(cases, scaled(system, factor))
    for name, errs in (("shipped b200_nvl8", base), (f"bf16 efficiency x {factor:.3f}", fit)):
        for kind in ("dense", "moe"):
            tok = np.array([e for _, e, _ in errs[kind]])
            print(f"{name:28s} {kind:5s} rows {len(tok):2d}  median tok/s error {np.median(tok):+.3f}"
                  f"  median |error| {np.median(np.abs(tok)):.3f}  worst |error| {np.abs(tok).max():.3f}")
    print("MoE rows with the dense-fitted factor (tokens/s error, peak-memory error):")
    for label, e, m in fit["moe"]:
        print(f"  {label:42s} {e:+.3f}  {m:+.3f}")


if __name__ == "__main__":
    main()
