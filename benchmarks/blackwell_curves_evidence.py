"""Which matrix curves the Blackwell datasheet files should carry: the
evidence, on the tables the curves were not taken from (issue 24).

Three sets of curves for ``b200_nvl8``, ``b300_nvl8``, ``gb200_nvl72`` and
``gb300_nvl72`` (``benchmarks/simumax_b200_system.py`` builds the last two):

* ``h100``: the H100 files' curves (bf16 plateau 80%, fp8 72%), assumed,
  what the files carried before;
* ``best-shape``: each GPU's published best-shape matmul rate as the
  plateau, the H100 fall-off below it (``blackwell_curves``: shipped);
* ``simumax-shape``: SimuMax's measured B200 bf16 curve over Megatron-LM's
  GEMM shapes (``b200_nvl8_megatron``'s), times each GPU's and datatype's
  best-shape ratio to the B200's bf16 (``shape_curves``).

Each with the model's attention (0.75 of the bf16 curve) and with SimuMax's
measured B200 attention (TE, causal: the median of its 32 measured shapes,
halved for the causal half; the forward and backward rates apart, on
FlashAttention's count, as ``published_base.system_attention_at`` sets a
published rate).  Printed per set: the B200 rows of ``nemo_long_cp`` (NeMo
25.04, Llama 3 8B, FP8: a table none of the measurements was taken from),
the Blackwell and H100 rows of ``bridge_qwen3_moe`` at the shipped MoE host
time and at the host time the fit (``published_moe.fit_host_op_time`` on
``BRIDGE_FIT_ROWS``) gives on those curves, with the two-way
leave-one-table-out figures against SimuMax's DeepSeek rows (which run on
``b200_nvl8_megatron`` and do not change with the set).

    PYTHONPATH=$PWD python benchmarks/blackwell_curves_evidence.py PATH/b200_bf16_ceperm.json

Needs ../shared/reference and SimuMax's configs/system/b200_bf16_ceperm.json
(MooreThreads/SimuMax @4dcaae5; for the attention rates).  About a minute.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from autopar.model import evaluate_one
from autopar.studies import published as P
from autopar.studies import published_moe as PM
from autopar.studies.published_base import KERNEL_BACKWARD_WORK, MODEL_BACKWARD_WORK

_spec = importlib.util.spec_from_file_location(
    "simumax_b200_system", Path(__file__).with_name("simumax_b200_system.py"))
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)

FILES = tuple(S.BLACKWELL_FILES)


def curve_sets() -> dict:
    """``{set: {file: {datatype: curve}}}`` for the three sets."""
    h100 = json.loads(Path(S.FALLOFF_FILE).read_text())["matrix"]
    measured = json.loads(Path(S.MEASURED_FILE).read_text())["matrix"]["bfloat16"]["gflops_efficiency"]
    # the H100 curves as the Blackwell files carried them (fp8 = 0.9 x bf16)
    before = {f: {dt: ([[x, round(0.9 * e, 4)] for x, e in h100["bfloat16"]["gflops_efficiency"]]
                       if r == "fp8" else h100["bfloat16"]["gflops_efficiency"])
                  for dt, r in S.MATRIX_RATE.items()} for f in FILES}
    return {"h100": before, "best-shape": S.blackwell_curves(h100["bfloat16"]["gflops_efficiency"]),
            "simumax-shape": S.shape_curves(measured)}


def attention_rates(path: str) -> tuple[float, float]:
    """SimuMax's measured TE attention, the median over its shapes of the
    forward and backward efficiency (dense count), halved: the causal
    kernel's rate on the work it executes."""
    op = json.loads(Path(path).read_text())["accelerator"]["op"]
    return tuple(statistics.median(op[k]["accurate_efficient_factor"].values()) / 2
                 for k in ("sdp_fwd", "sdp_bwd"))


def variant(system, curves, attention):
    """``system`` with a Blackwell file's ``curves`` and, where given, the
    attention kernel at (forward, backward) rates of the bf16 peak."""
    if system.name not in curves:
        return system
    matrix = {dt: dataclasses.replace(p, gflops_efficiency=tuple(map(tuple, curves[system.name][dt])))
              if dt in curves[system.name] else p for dt, p in system.matrix.items()}
    sy = dataclasses.replace(system, matrix=matrix)
    if attention is None:
        return sy
    plateau = max(e for _, e in sy.matrix["bfloat16"].gflops_efficiency)
    fw, bw = attention
    return dataclasses.replace(sy, time_overhead=dataclasses.replace(
        sy.time_overhead, attention_speed=round(fw / plateau, 4),
        attention_backward_speed=round(bw * MODEL_BACKWARD_WORK / KERNEL_BACKWARD_WORK / plateau, 4)))


def error(c, system, host=None) -> float:
    if host is not None:
        system = PM.with_moe_host_op_time(system, host)
    s = evaluate_one(c.model, system, c.execution)
    return s["sample_rate"] * c.model.seq_size / c.execution["num_procs"] \
        / c.measured["tokens_per_s_per_gpu"] - 1


def med(a) -> float:
    return 100 * float(np.median(np.abs(a)))


def main(path: str) -> None:
    nemo = [c for _, c in P.cases(P.TABLES["nemo_long_cp"])
            if isinstance(c, P.PublishedCase) and "B200" in c.label]
    bridge = [c for _, c in P.cases(P.TABLES["bridge_qwen3_moe"]) if isinstance(c, P.PublishedCase)]
    deepseek = PM.simumax_moe_cases()
    fit_rows = [c for c in bridge if re.match(PM.BRIDGE_FIT_ROWS, c.label)]
    ds_fit, _ = PM.fit_simumax_host_op_time()
    att = attention_rates(path)
    print(f"SimuMax's B200 attention (median of its shapes, causal): forward {att[0]:.3f}, "
          f"backward {att[1]:.3f} of the bf16 peak")
    print(f"MoE host time fitted on SimuMax's DeepSeek rows: {ds_fit * 1e6:.1f} us/op; "
          f"shipped (fitted on the Bridge rows): {PM.MOE_HOST_OP_S * 1e6:.1f} us/op\n")
    for name, curves in curve_sets().items():
        for attn in (None, att):
            tag = f"{name}, {'SimuMax attention' if attn else 'model attention'}"
            e = [error(c, variant(c.system, curves, attn)) for c in nemo]
            print(f"{tag}: nemo_long_cp B200 rows " + " ".join(f"{100 * x:+.1f}" for x in e)
                  + f"  (median |error| {med(e):.1f}%)")
            moved = [dataclasses.replace(c, system=variant(c.system, curves, attn)) for c in bridge]
            fit, _ = PM.fit_host_op_time([dataclasses.replace(c, system=variant(c.system, curves, attn))
                                          for c in fit_rows])
            for h, what in ((PM.MOE_HOST_OP_S, "shipped"), (fit, "refitted")):
                eb = np.array([error(c, c.system, h) for c in moved])
                by = {}
                for c, x in zip(moved, eb):
                    by.setdefault(c.label.split()[1].replace("DGX-", ""), []).append(x)
                print(f"  bridge_qwen3_moe at {h * 1e6:.1f} us/op ({what}): median {med(eb):.1f}%, "
                      f"worst {100 * np.abs(eb).max():.1f}%; "
                      + ", ".join(f"{k} {med(v):.1f}%" for k, v in by.items()))
            e_in = np.array([error(c, c.system, fit) for c in moved])
            e_out = np.array([error(c, c.system, ds_fit) for c in moved])
            d_in = np.array([error(c, c.system, ds_fit) for c in deepseek])
            d_out = np.array([error(c, c.system, fit) for c in deepseek])
            print(f"  leave one table out: Bridge {med(e_in):.1f}% at its fit, {med(e_out):.1f}% at "
                  f"the DeepSeek fit (ratio {med(e_out) / med(e_in):.2f}); DeepSeek {med(d_in):.1f}% "
                  f"at its fit, {med(d_out):.1f}% at the Bridge fit (ratio {med(d_out) / med(d_in):.2f})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
