"""Derive ``systems/b200_nvl8_megatron.json``'s measured figures from SimuMax's
published B200 system configuration, and the Blackwell datasheet files'
matrix efficiency curves from them and a published best-shape benchmark.

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
  smallest measured GEMM (4 GFLOP) the H100 files' datasheet-shaped
  curve's fall-off (``systems/h100_80g_nvl8.json``, bf16; the shape every
  Blackwell file had before it took this curve), anchored at the 4-16 GFLOP
  median (no GEMM was measured there);
* the NVLink tier's efficiency: the reduce-scatter / all-gather fit (the
  collectives of the distributed optimizer and of sequence-parallel tensor
  parallelism), converted from SimuMax's GiB/s convention
  (``simumax/core/config.py``: ``size / (gbps * 1024**3 * efficient_factor)``)
  to autopar's GB/s (``bandwidth * 1e9 * efficiency``);
* the NVLink tier's latency: SimuMax's fitted latency of a reduce-scatter /
  all-gather over the tier's 8 GPUs (``latency_us * (n - 1) +
  fixed_latency_us``); autopar has one latency per tier.

``blackwell_curves`` gives the user-facing Blackwell files
(``BLACKWELL_FILES``) their matrix curves from a published measurement too:
the plateau is the GPU's and datatype's published maximum achievable matmul
rate as a fraction of its datasheet peak (``MAMF``: stas00/ml-engineering
@744d01e, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
comparison table"; a best-shape search with torch.matmul, as the A100
files' 85.9%), the fall-off below it the H100 files' shape (``FALLOFF_FILE``)
scaled to it.  SimuMax's shape-by-shape curve (above) is not used there: on
the tables it was not taken from (nemo_long_cp's B200 rows, the Bridge
Qwen3 rows) it predicts Blackwell runs too slow (docs/validation.md,
"Blackwell system files: measured kernel efficiencies"); ``shape_curves``
builds that alternative (the measured curve x the best-shape ratios) for
the comparison.  Assumptions (systems/README.md): GB300 (no figure
published) is GB200's (the same bf16 and fp8 peaks); mxfp8 runs at fp8's
rate and nvfp4/mxfp4 on fp8's curve (no block-scaled or fp4 figure is
published); fp16 and fp32 matrix on the bf16 curve.

    PYTHONPATH=$PWD python benchmarks/simumax_b200_system.py PATH/b200_bf16_ceperm.json
    PYTHONPATH=$PWD python benchmarks/simumax_b200_system.py --write   # the Blackwell files' curves
    PYTHONPATH=$PWD python benchmarks/simumax_b200_system.py --write-attention PATH/b200_bf16_ceperm.json

``attention_record`` turns the same file's measured TE attention (causal,
32 shapes) into the system files' ``attention`` record (kernel rates by the
size of a call and head size; ``ATTENTION_FILES``).
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

BINS = ((256, float("inf")), (16, 256), (4, 16))      # GFLOP per GEMM
TIER = 8                                              # GPUs on the NVLink tier
# The shape of the curve below the smallest measured GEMM: the H100 files'
# (datasheet-shaped, bf16).
FALLOFF_FILE = "systems/h100_80g_nvl8.json"
MEASURED_FILE = "systems/b200_nvl8_megatron.json"

# Published maximum achievable matmul rates (TFLOP/s, best shape of a search)
# and the datasheet peaks they are a fraction of: stas00/ml-engineering
# @744d01e compute/accelerator/README.md (B200 torch 2.7.1+cu128, as at
# @455112c; B300 2.9.1+cu130; GB200 2.10.0.dev20250916+cu130).
MAMF = {"b200": {"bf16": (1745.0, 2250.0), "fp8": (3432.5, 4500.0)},
        "b300": {"bf16": (1769.0, 2250.0), "fp8": (3353.3, 4500.0)},
        "gb200": {"bf16": (1822.0, 2500.0), "fp8": (3615.6, 5000.0)}}
# Each user-facing Blackwell file -> the GPU whose published rates it takes
# (GB300: none published; GB200's, the same bf16 and fp8 peaks).
# b200_nvl8_megatron keeps SimuMax's bf16 curve; its fp8 ones (SimuMax
# measured none) are b200_nvl8's.
BLACKWELL_FILES = {"b200_nvl8": "b200", "b300_nvl8": "b300", "gb200_nvl72": "gb200",
                   "gb300_nvl72": "gb200"}
# A file's matrix datatype -> the published rate it is scaled by.
MATRIX_RATE = {"bfloat16": "bf16", "float16": "bf16", "float32": "bf16",
               "float8": "fp8", "mxfp8": "fp8", "nvfp4": "fp8", "mxfp4": "fp8"}


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


def mamf_fraction(gpu: str, rate: str) -> float:
    """``gpu``'s published best-shape ``rate`` (bf16 | fp8) as a fraction of
    its datasheet peak."""
    m, peak = MAMF[gpu][rate]
    return m / peak


def blackwell_curves(falloff) -> dict:
    """``{file: {datatype: curve}}``: every matrix curve of the Blackwell
    files, the datasheet-shaped ``falloff`` curve scaled so that its plateau
    is the published best-shape fraction (``mamf_fraction``)."""
    top = max(e for _, e in falloff)
    return {f: {dt: [[x, round(e * mamf_fraction(gpu, r) / top, 4)] for x, e in falloff]
                for dt, r in MATRIX_RATE.items()}
            for f, gpu in BLACKWELL_FILES.items()}


def shape_curves(measured) -> dict:
    """The alternative not shipped: SimuMax's measured B200 bf16 curve
    ``measured`` x each GPU's and datatype's best-shape fraction over the
    B200's bf16 one."""
    b200 = mamf_fraction("b200", "bf16")
    return {f: {dt: [[x, round(e * mamf_fraction(gpu, r) / b200, 4)] for x, e in measured]
                for dt, r in MATRIX_RATE.items()}
            for f, gpu in BLACKWELL_FILES.items()}


# The files that take SimuMax's measured B200 attention (``attention_record``):
# the B200 ones only (docs/validation.md, "Attention kernel rates by shape
# (hardware record)"; systems/README.md).
ATTENTION_FILES = ("b200_nvl8_megatron", "b200_nvl8")


def attention_shape(key: str) -> tuple[int, float]:
    """(query/key head size, executed forward GFLOP) of one of SimuMax's
    measured causal attention calls: its ``test_fa_efficiency.py`` counts the
    forward as ``2 * b * s^2 * h * (qk_head_dim + v_head_dim)`` (the whole
    square); the causal kernel executes half of it."""
    f = dict(re.findall(r"(\w+)=([\w.]+)", key))
    b, s, h = int(f["batch"]), int(f["seq_len"]), int(f["head_num"])
    dq, dv = int(f["qk_head_dim"]), int(f["v_head_dim"])
    return dq, b * s * s * h * (dq + dv) / 1e9


def attention_record(cfg: dict) -> dict:
    """The system file's ``attention`` record from SimuMax's measured TE
    attention (``sdp_fwd`` / ``sdp_bwd``, rates of the whole-square count):
    per query/key head size, each pass's rate on the executed (causal) work
    (the measured rate / 2) at each measured call size, the mean of the
    calls of one size (q/k/v contiguous or not; GQA groupings of one head
    count), as a descending GFLOP table whose smallest size reads as 0."""
    op = cfg["accelerator"]["op"]
    out: dict = {}
    for name, p in (("sdp_fwd", "fwd"), ("sdp_bwd", "bwd")):
        pts: dict = {}
        for key, eff in op[name]["accurate_efficient_factor"].items():
            dq, g = attention_shape(key)
            # floored to 0.01 GFLOP: the measured call itself reads its own rate
            pts.setdefault(dq, {}).setdefault(math.floor(g * 100) / 100, []).append(eff / 2)
        for dq, by_size in pts.items():
            table = [[g, round(statistics.mean(v), 4)]
                     for g, v in sorted(by_size.items(), reverse=True)]
            table[-1][0] = 0
            out.setdefault(str(dq), {})[p] = table
    return {"bfloat16": dict(sorted(out.items()))}


def check_attention(path: str, write: bool = False) -> bool:
    """Print the attention record, whether each of ``ATTENTION_FILES`` holds
    it, and with ``write`` put it there."""
    rec = attention_record(json.loads(Path(path).read_text()))
    for dq, passes in rec["bfloat16"].items():
        for p, table in passes.items():
            print(f"attention head size {dq} {p} (GFLOP, rate):", table)
    ok = True
    for f in ATTENTION_FILES:
        p = Path("systems") / f"{f}.json"
        spec = json.loads(p.read_text())
        holds = spec.get("attention") == rec
        print(f"{f}: holds the attention record: {holds}")
        if write and not holds:
            spec["attention"] = rec
            p.write_text(json.dumps(spec, indent=2))
        ok &= holds
    return ok


def check_blackwell(write: bool = False) -> bool:
    """Print the Blackwell files' curves, whether each file holds them, and
    with ``write`` put them there."""
    falloff = json.loads(Path(FALLOFF_FILE).read_text())["matrix"]["bfloat16"]["gflops_efficiency"]
    for gpu in MAMF:
        print(f"{gpu}: best-shape bf16 {mamf_fraction(gpu, 'bf16'):.4f}, "
              f"fp8 {mamf_fraction(gpu, 'fp8'):.4f} of the datasheet peak")
    ok = True
    for f, curves in blackwell_curves(falloff).items():
        p = Path("systems") / f"{f}.json"
        spec = json.loads(p.read_text())
        mine = {dt: c for dt, c in curves.items() if dt in spec["matrix"]}
        holds = all(spec["matrix"][dt]["gflops_efficiency"] == c for dt, c in mine.items())
        print(f"{f} ({BLACKWELL_FILES[f]}): plateau bf16 {curves['bfloat16'][0][1]}, "
              f"fp8 {curves['float8'][0][1]}; file holds these: {holds}")
        if write and not holds:
            for dt, c in mine.items():
                spec["matrix"][dt]["gflops_efficiency"] = c
            p.write_text(json.dumps(spec, indent=2))
        ok &= holds
    return ok


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    ds = json.loads(Path(FALLOFF_FILE).read_text())
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
    check_blackwell()
    check_attention(path)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-attention":
        check_attention(sys.argv[2], write=True)
    elif len(sys.argv) != 2:
        sys.exit(__doc__)
    elif sys.argv[1] == "--write":
        check_blackwell(write=True)
    else:
        main(sys.argv[1])
