"""Derive ``systems/b200_nvl8_megatron.json``'s measured figures from SimuMax's
published B200 system configuration.

SimuMax (github:MooreThreads/SimuMax @4dcaae5) ships the system file it
generated on the B200 machine of its measured runs,
``configs/system/b200_bf16_ceperm.json``: per-shape bf16 GEMM efficiencies
from a cuBLAS/TE shape sweep, FlashAttention (TE) efficiencies, and
collective bandwidth efficiencies and latencies fitted to nccl-tests
(``tools/b200/build_current_machine_system_config.py``; docs/b200/
b200_real_repro_guide.md, "Public B200 system config baseline").  They are
kernel and collective micro-benchmarks of the same machine, not fitted to
the step times that ``autopar validate published --table simumax_b200``
compares against.  This script reads that file (fetch it yourself; it is not
part of autopar) and prints what autopar's system file takes from it:

* the bf16 matrix efficiency curve: the median measured efficiency of the
  GEMMs in each of autopar's GFLOP bins (>= 256, 16-256, 4-16); below the
  smallest measured GEMM (4 GFLOP) the ``b200_nvl8`` curve's fall-off,
  anchored at the 4-16 GFLOP median (no GEMM was measured there);
* the NVLink tier's efficiency: the reduce-scatter / all-gather fit (the
  collectives of the distributed optimizer and of sequence-parallel tensor
  parallelism), converted from SimuMax's GiB/s convention
  (``simumax/core/config.py``: ``size / (gbps * 1024**3 * efficient_factor)``)
  to autopar's GB/s (``bandwidth * 1e9 * efficiency``);
* the NVLink tier's latency: SimuMax's fitted latency of a reduce-scatter /
  all-gather over the tier's 8 GPUs (``latency_us * (n - 1) +
  fixed_latency_us``); autopar has one latency per tier.

    PYTHONPATH=$PWD python benchmarks/simumax_b200_system.py PATH/b200_bf16_ceperm.json
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

BINS = ((256, float("inf")), (16, 256), (4, 16))      # GFLOP per GEMM
TIER = 8                                              # GPUs on the NVLink tier


def gemm_gflop(key: str) -> float:
    f = dict(re.findall(r"(\w+)=([\w.]+)", key))
    return 2 * int(f.get("b", 1)) * int(f["m"]) * int(f["k"]) * int(f["n"]) / 1e9


def derive(cfg: dict, datasheet_curve) -> dict:
    acc = cfg["accelerator"]["op"]["matmul"]["accurate_efficient_factor"]
    pts = [(gemm_gflop(k), v) for k, v in acc.items()]
    curve, counts = [], []
    for lo, hi in BINS:
        vals = [v for g, v in pts if lo <= g < hi]
        curve.append([lo, round(statistics.median(vals), 3)])
        counts.append((lo, hi, len(vals), min(vals), max(vals)))
    ds = dict((x, e) for x, e in datasheet_curve)
    anchor = curve[-1][1] / ds[BINS[-1][0]]
    curve += [[x, round(ds[x] * anchor, 4)] for x in sorted(ds, reverse=True) if x < BINS[-1][0]]
    ops = cfg["networks"]["high_intra_node"]["op"]
    gbps = cfg["networks"]["high_intra_node"]["bandwidth"]["gbps"]
    rs_ag = [ops[o] for o in ("reduce_scatter", "all_gather")]
    eff = statistics.mean(o["efficient_factor"] for o in rs_ag) * 2 ** 30 / 1e9
    lat = statistics.mean(o["latency_us"] * (TIER - 1) + o["fixed_latency_us"] for o in rs_ag)
    return {"curve": curve, "bins": counts, "nvlink_gbps": gbps,
            "nvlink_efficiency": round(eff, 4), "nvlink_latency_s": round(lat * 1e-6, 7),
            "all_reduce_efficiency": round(ops["all_reduce"]["efficient_factor"] * 2 ** 30 / 1e9, 4),
            "sdp_fwd": cfg["accelerator"]["op"]["sdp_fwd"]["efficient_factor"],
            "sdp_bwd": cfg["accelerator"]["op"]["sdp_bwd"]["efficient_factor"]}


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    ds = json.loads(Path("systems/b200_nvl8.json").read_text())
    d = derive(cfg, ds["matrix"]["bfloat16"]["gflops_efficiency"])
    for lo, hi, n, a, b in d["bins"]:
        print(f"GEMMs of {lo}-{hi} GFLOP: {n} measured, efficiency {a:.3f}-{b:.3f}")
    print("bf16 matrix curve:", d["curve"])
    print(f"NVLink ({d['nvlink_gbps']} GB/s): efficiency {d['nvlink_efficiency']} "
          f"(reduce-scatter/all-gather; all-reduce {d['all_reduce_efficiency']}), "
          f"latency {d['nvlink_latency_s'] * 1e6:.1f} us over {TIER} GPUs")
    print(f"TE attention (dense-count FLOPs): forward {d['sdp_fwd']:.3f}, "
          f"backward {d['sdp_bwd']:.3f} of the bf16 peak")
    ship = json.loads(Path("systems/b200_nvl8_megatron.json").read_text())
    same = (ship["matrix"]["bfloat16"]["gflops_efficiency"] == d["curve"]
            and ship["networks"][0]["efficiency"] == d["nvlink_efficiency"]
            and ship["networks"][0]["latency"] == d["nvlink_latency_s"])
    print("systems/b200_nvl8_megatron.json holds these figures:", same)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
