"""``benchmarks/simumax_b200_system.py``: how systems/b200_nvl8_megatron.json
takes SimuMax's measured B200 figures (docs/validation.md, "Fitted constants
replaced by published figures").  A small configuration in SimuMax's format
is enough to check the rules; the real one is not part of autopar."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO_ROOT


def _module():
    spec = importlib.util.spec_from_file_location(
        "simumax_b200_system", REPO_ROOT / "benchmarks" / "simumax_b200_system.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _gemm(m, k, n):
    return f"b=1, m={m}, k={k}, n={n}, layout=TN, accumulate=False, out_dtype=bf16"


def _config():
    # GFLOP = 2 m k n / 1e9: 4096^3 -> 137 (16-256 bin); 8192 x 4096 x 8192
    # -> 550 (>= 256); 1024 x 2048 x 2048 -> 8.6 (4-16)
    acc = {_gemm(4096, 4096, 4096): 0.50, _gemm(4096, 4096, 4095): 0.40,
           _gemm(4096, 4096, 4094): 0.70,
           _gemm(8192, 4096, 8192): 0.45, _gemm(8192, 4096, 8191): 0.55,
           _gemm(1024, 2048, 2048): 0.2}
    op = {"reduce_scatter": {"efficient_factor": 0.6, "latency_us": 10.0,
                             "fixed_latency_us": 20.0},
          "all_gather": {"efficient_factor": 0.8, "latency_us": 6.0,
                         "fixed_latency_us": 30.0},
          "all_reduce": {"efficient_factor": 0.9}}
    return {"accelerator": {"op": {"matmul": {"accurate_efficient_factor": acc},
                                   "sdp_fwd": {"efficient_factor": 0.7},
                                   "sdp_bwd": {"efficient_factor": 0.6}}},
            "networks": {"high_intra_node": {"bandwidth": {"gbps": 900.0}, "op": op}}}


def test_derive_takes_bin_medians_and_converts_the_collectives():
    m = _module()
    datasheet = [[256, 0.8], [64, 0.72], [16, 0.6], [4, 0.45], [1, 0.3], [0.1, 0.15], [0, 0.04]]
    d = m.derive(_config(), datasheet)
    curve = dict((x, e) for x, e in d["curve"])
    assert curve[256] == 0.5 and curve[16] == 0.5 and curve[4] == 0.2
    # below the smallest measured GEMM: the datasheet fall-off anchored there
    assert curve[1] == pytest.approx(0.3 * 0.2 / 0.45, abs=1e-4)
    assert [x for x, _ in d["curve"]] == [256, 16, 4, 1, 0.1, 0]
    # SimuMax divides by gbps * 2**30; autopar by bandwidth * 1e9
    assert d["nvlink_efficiency"] == pytest.approx(0.7 * 2 ** 30 / 1e9, abs=1e-4)
    # latency over the tier's 8 GPUs: latency_us * 7 + fixed, mean of RS and AG
    assert d["nvlink_latency_s"] == pytest.approx(((10 * 7 + 20) + (6 * 7 + 30)) / 2 * 1e-6)


def test_shipped_b200_file_is_measured_not_scaled():
    # The file no longer is "0.6x the datasheet curve": its bf16 curve is not
    # a multiple of the datasheet-shaped one, and it says where its figures
    # come from.
    ship = json.loads((REPO_ROOT / "systems" / "b200_nvl8_megatron.json").read_text())
    ds = json.loads((REPO_ROOT / "systems" / "h100_80g_nvl8.json").read_text())
    a = dict((x, e) for x, e in ship["matrix"]["bfloat16"]["gflops_efficiency"])
    b = dict((x, e) for x, e in ds["matrix"]["bfloat16"]["gflops_efficiency"])
    ratios = {round(a[x] / b[x], 3) for x in (256, 16, 4)}
    assert len(ratios) > 1
    assert "SimuMax" in ship["description"] and "Nothing in this file is fitted" in ship["description"]
    # fp8 (not measured by SimuMax) stays the assumed curve: 0.9x the
    # datasheet-shaped bf16 one (72% plateau), not the best-shape rate
    assert ship["matrix"]["float8"]["gflops_efficiency"] == [[x, round(0.9 * e, 4)] for x, e in
                                                            ds["matrix"]["bfloat16"]["gflops_efficiency"]]


def test_blackwell_curves_are_the_published_best_shape_rates():
    # Plateau = the GPU's published best-shape matmul rate over its datasheet
    # peak (stas00/ml-engineering @744d01e), fall-off = the H100 files' shape.
    m = _module()
    falloff = [[256, 0.8], [64, 0.72], [16, 0.6], [4, 0.45], [1, 0.3], [0.1, 0.15], [0, 0.04]]
    c = m.blackwell_curves(falloff)
    assert c["b200_nvl8"]["bfloat16"][0] == [256, round(1745.0 / 2250, 4)]
    assert c["b200_nvl8"]["float8"][0] == [256, round(3432.5 / 4500, 4)]
    assert c["gb200_nvl72"]["bfloat16"][0] == [256, round(1822.0 / 2500, 4)]
    assert c["b300_nvl8"]["float8"][0] == [256, round(3353.3 / 4500, 4)]
    # GB300 has no published figure: GB200's; fp4 and mxfp8 on fp8's curve
    assert c["gb300_nvl72"] == c["gb200_nvl72"]
    assert c["b200_nvl8"]["nvfp4"] == c["b200_nvl8"]["mxfp8"] == c["b200_nvl8"]["float8"]
    # the fall-off keeps its shape: every point scaled by the same factor
    assert c["b200_nvl8"]["bfloat16"][3] == [4, round(0.45 * (1745.0 / 2250) / 0.8, 4)]
    # the alternative from SimuMax's measured curve scales B200 bf16 by 1
    measured = [[256, 0.484], [16, 0.503], [4, 0.203]]
    assert m.shape_curves(measured)["b200_nvl8"]["bfloat16"] == measured


def test_shipped_blackwell_files_hold_the_curves():
    m = _module()
    falloff = json.loads((REPO_ROOT / "systems" / "h100_80g_nvl8.json").read_text())[
        "matrix"]["bfloat16"]["gflops_efficiency"]
    for f, curves in m.blackwell_curves(falloff).items():
        spec = json.loads((REPO_ROOT / "systems" / f"{f}.json").read_text())
        for dt, curve in curves.items():
            assert spec["matrix"][dt]["gflops_efficiency"] == curve, (f, dt)


def test_evidence_sets_and_variants():
    """benchmarks/blackwell_curves_evidence.py: the three sets of curves it
    compares, and the system variant it predicts a row on."""
    spec = importlib.util.spec_from_file_location(
        "blackwell_curves_evidence", REPO_ROOT / "benchmarks" / "blackwell_curves_evidence.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    sets = ev.curve_sets()
    assert set(sets) == {"h100", "best-shape", "simumax-shape"}
    # the H100 set is what the Blackwell files carried before: 0.8 / 0.72
    assert sets["h100"]["gb300_nvl72"]["bfloat16"][0] == [256, 0.8]
    assert sets["h100"]["b200_nvl8"]["nvfp4"][0] == [256, 0.72]
    # the shape set takes b200_nvl8_megatron's measured bf16 curve on B200
    ship = json.loads((REPO_ROOT / "systems" / "b200_nvl8_megatron.json").read_text())
    assert sets["simumax-shape"]["b200_nvl8"]["bfloat16"] == ship["matrix"]["bfloat16"]["gflops_efficiency"]
    from autopar.studies.published_base import system
    sy = system("b200_nvl8", "megatron-bridge")
    v = ev.variant(sy, sets["h100"], (0.36, 0.35))
    assert v.matrix["float8"].gflops_efficiency[0] == (256, 0.72)
    assert v.matrix["float8"].tflops == sy.matrix["float8"].tflops
    # attention at a rate of the peak: speed = rate / plateau; the backward
    # on the model's count (3 forwards) of FlashAttention's (2.5)
    assert v.time_overhead.attention_speed == pytest.approx(0.36 / 0.8, abs=1e-4)
    assert v.time_overhead.attention_backward_speed == pytest.approx(0.35 * 3 / 2.5 / 0.8, abs=1e-4)
    assert v.time_overhead.moe_host_op_s == sy.time_overhead.moe_host_op_s
    # other systems pass through unchanged
    h100 = system("h100_80g_nvl8", "megatron-bridge")
    assert ev.variant(h100, sets["h100"], (0.36, 0.35)) is h100
