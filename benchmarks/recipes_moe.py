"""Megatron-Bridge's MoE performance recipes (autopar/data/recipes/bridge_moe.csv)
through autopar: per recipe, the predicted peak tier-1 memory against the
GPU's capacity, whether it fits, the predicted tokens/s/GPU and MFU (Calculon's
``total_efficiency``: useful model FLOPs over the datatype's peak), or why it
is skipped; then the counts.

    PYTHONPATH=$PWD python benchmarks/recipes_moe.py [--markdown]

``--markdown`` prints the predicted recipes as a Markdown table with the
figures "before" beside them: the same layouts without what issue 24's MoE
round counted (Megatron-Core's ``moe_act`` / ``mla_up_proj`` recompute off,
Kimi K2's ``dist_muon`` state unsharded as ``ddp.use_distributed_optimizer``
false reads), the table docs/validation.md shows.
"""
from __future__ import annotations

import argparse
import math

from autopar.model import evaluate_one
from autopar.studies import published_base as P
from autopar.studies import recipes_moe as R
from autopar.studies.published import _reason


def before(ex: dict) -> dict:
    """The layout as this round's mapping did not yet count it."""
    out = {**ex, "recompute_moe_act": False, "recompute_mla_up_proj": False}
    if ex.get("optimizer") == "muon":
        out.update(optimizer_sharding=False, unsharded_grads=False)
    return out


def figures(c, ex) -> dict:
    s = evaluate_one(c.model, c.system, ex)
    ok = bool(s["feasible"])
    return {"status": "fits" if ok else "no",
            "peak_gib": s["proc_mem_tier1_cap_req"] / P.GIB, "cap_gib": c.system.mem1.GiB,
            "tok": s["sample_rate"] * c.model.seq_size / ex["num_procs"] if ok else math.nan,
            "mfu": s["total_efficiency"] if ok else math.nan,
            "reason": "" if ok else _reason(s, c.system)}


def rows(with_before: bool = False):
    for name, c in R.cases():
        if isinstance(c, P.Skip):
            yield {"recipe": name, "status": "skipped", "reason": c.reason}
            continue
        r = {"recipe": name, **figures(c, c.execution)}
        if with_before:
            r["before"] = figures(c, before(c.execution))
        yield r


def _cell(f: dict) -> str:
    fit = "yes" if f["status"] == "fits" else "**no**"
    mfu = "-" if math.isnan(f["mfu"]) else f"{f['mfu'] * 100:.1f}%"
    return f"{fit} | {f['peak_gib']:.1f} | {mfu}"


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--markdown", action="store_true")
    args = a.parse_args(argv)
    out = list(rows(with_before=args.markdown))
    if args.markdown:
        print("| recipe | capacity GiB | before: fits | peak GiB | MFU | after: fits | peak GiB "
              "| MFU | tokens/s/GPU |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in out:
            if r["status"] != "skipped":
                tok = "-" if math.isnan(r["tok"]) else f"{r['tok']:.0f}"
                print(f"| {r['recipe'].removesuffix('_config')} | {r['cap_gib']:.0f} | "
                      f"{_cell(r['before'])} | {_cell(r)} | {tok} |")
    else:
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
    if args.markdown:
        nb = sum(r["status"] != "skipped" and r["before"]["status"] == "fits" for r in out)
        print(f"before: {nb} predicted to fit")


if __name__ == "__main__":
    main()
