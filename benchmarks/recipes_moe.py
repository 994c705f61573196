"""Megatron-Bridge's MoE performance recipes (autopar/data/recipes/bridge_moe.csv)
through autopar: per recipe, the predicted peak tier-1 memory against the
GPU's capacity, whether it fits, the predicted tokens/s/GPU and MFU (Calculon's
``total_efficiency``: useful model FLOPs over the datatype's peak), or why it
is skipped; then the counts.

    PYTHONPATH=$PWD python benchmarks/recipes_moe.py
"""
from __future__ import annotations

import math

from autopar.model import evaluate_one
from autopar.studies import published_base as P
from autopar.studies import recipes_moe as R
from autopar.studies.published import _reason


def rows():
    for name, c in R.cases():
        if isinstance(c, P.Skip):
            yield {"recipe": name, "status": "skipped", "reason": c.reason}
            continue
        s = evaluate_one(c.model, c.system, c.execution)
        ok = bool(s["feasible"])
        yield {"recipe": name, "status": "fits" if ok else "no",
               "peak_gib": s["proc_mem_tier1_cap_req"] / P.GIB, "cap_gib": c.system.mem1.GiB,
               "tok": s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]
               if ok else math.nan,
               "mfu": s["total_efficiency"] if ok else math.nan,
               "reason": "" if ok else _reason(s, c.system)}


def main() -> None:
    out = list(rows())
    print(f"{'recipe':64s} {'fits':5s} {'peak/cap GiB':>15s} {'tok/s/GPU':>10s} {'MFU':>6s}")
    for r in out:
        if r["status"] == "skipped":
            print(f"{r['recipe']:64s} skip  {r['reason']}")
            continue
        print(f"{r['recipe']:64s} {'yes' if r['status'] == 'fits' else 'NO':5s} "
              f"{r['peak_gib']:7.1f}/{r['cap_gib']:<7.0f} {r['tok']:10.0f} "
              f"{r['mfu'] * 100:5.1f}% {r['reason']}")
    n = {k: sum(r["status"] == k for r in out) for k in ("fits", "no", "skipped")}
    odd = [r["recipe"] for r in out if r["status"] == "fits" and not 0.10 <= r["mfu"] <= 0.70]
    print(f"\n{len(out)} recipes: {n['fits']} predicted to fit, {n['no']} predicted not to, "
          f"{n['skipped']} skipped; MFU outside 10-70% on {len(odd)}: {', '.join(odd) or '-'}")


if __name__ == "__main__":
    main()
