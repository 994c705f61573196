"""NVFP4 / MXFP4 training (issue 28): ``fp8_recipe: nvfp4 | mxfp4`` runs the
block's linear-layer GEMMs at the system's fp4 rate, charges the casts as
memory traffic and keeps the quantized weight copies.  The figures of one
small GPT block are counted here by hand from the recipe (bytes per element
of each tensor the recipe quantizes), not from the model's constants."""
from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from autopar.io.specs import SpecError, load_execution, load_model, load_system
from autopar.model import evaluate_one
from tests.conftest import REPO_ROOT, one_proc_execution

H, FF, SEQ, BLOCKS = 1024, 4096, 2048, 8
GPT = {"hidden": H, "feedforward": FF, "seq_size": SEQ, "attn_heads": 16,
       "attn_size": 64, "num_blocks": BLOCKS}
M = SEQ                                      # tokens of a micro-batch of 1, no TP
# The block's linear layers as the model lays them out without TP overlap
# (Calculon's separate Q, K, V): (input width, output width) of each.
LINEARS = [(H, H), (H, H), (H, H), (H, H), (H, FF), (FF, H)]
B16 = 2.0                                    # bytes of a bf16 element


@pytest.fixture(scope="module")
def gpt():
    return load_model(dict(GPT, name="gpt-small"))


@pytest.fixture(scope="module")
def b200():
    return load_system(REPO_ROOT / "systems" / "b200_nvl8.json")


def exe(**kw):
    base = dict(num_procs=8, data_par=8, batch_size=16, microbatch_size=1,
                datatype="bfloat16", data_par_net=0)
    base.update(kw)
    return one_proc_execution(**base)


def run(model, system, **kw):
    s = evaluate_one(model, system, exe(**kw))
    assert s["feasible"], s
    return s


def _flat(system, bf16=2000.0, fp4=8000.0):
    """``system`` with flat (efficiency 1) matrix curves for bf16 and the fp4
    rates and a flat HBM curve, so times are FLOPs / peak and bytes / bandwidth."""
    m = dict(system.matrix)
    flat = ((0.0, 1.0),)
    m["bfloat16"] = dataclasses.replace(m["bfloat16"], tflops=bf16, gflops_efficiency=flat)
    for d in ("nvfp4", "mxfp4"):
        m[d] = dataclasses.replace(m[d], tflops=fp4, gflops_efficiency=flat)
    mem1 = dataclasses.replace(system.mem1, MB_efficiency=flat)
    return dataclasses.replace(system, matrix=m, mem1=mem1)


def test_blackwell_files_list_the_dense_fp4_rates():
    # Dense FP4 tensor-core PFLOPS from NVIDIA's datasheets, per GPU.
    want = {"b200_nvl8": 9000, "b300_nvl8": 13125, "gb200_nvl72": 10000,
            "gb300_nvl72": 15000}
    for name, tflops in want.items():
        s = load_system(REPO_ROOT / "systems" / f"{name}.json")
        assert s.matrix["nvfp4"].tflops == tflops
        assert s.matrix["mxfp4"].tflops == tflops
        assert s.matrix["nvfp4"].tflops == 2 * s.matrix["mxfp8"].tflops or name.startswith(
            ("b300", "gb300"))                     # Blackwell Ultra raises fp4 only
        assert "nvfp4" not in s.datatypes          # a GEMM rate, not a working datatype


def test_one_block_fp4_gemm_time_by_hand(gpt, b200):
    system = _flat(b200)
    base = run(gpt, system)
    fp4 = run(gpt, system, fp8_recipe="nvfp4")
    # Forward GEMM FLOPs of the linear layers: 2 m n k each.
    gemm = sum(2 * M * n * k for n, k in LINEARS)
    assert gemm == 2 * M * (4 * H * H + 2 * H * FF)
    want = gemm / 2000e12 - gemm / 8000e12      # bf16 time less the fp4 time
    got = base["block_fw_flops_time"] - fp4["block_fw_flops_time"]
    assert got == pytest.approx(want, rel=1e-9)
    # The attention core's batched matmuls stay bf16: the rest is unchanged.
    mx = run(gpt, system, fp8_recipe="mxfp4")
    assert mx["block_fw_flops_time"] == pytest.approx(fp4["block_fw_flops_time"], rel=1e-12)


def test_one_block_cast_bytes_and_time_by_hand(gpt, b200):
    system = _flat(b200)
    base = run(gpt, system)
    fp4 = run(gpt, system, fp8_recipe="nvfp4")
    q16 = 0.5 + 1 / 16            # an fp4 value and its E4M3 scale per 16 elements
    q256 = 0.5 + 1 / 256          # a weight: one scale per 16x16 block
    inputs = sum(M * n for n, _ in LINEARS)
    weights = sum(n * k for n, k in LINEARS)
    grads = sum(M * k for _, k in LINEARS)
    # Input: amax read + row-wise quantize + column-wise Hadamard quantize;
    # weight: amax read + one 2D quantize writing both orientations.
    fw = inputs * (3 * B16 + 2 * q16) + weights * (2 * B16 + 2 * q256)
    assert fp4["block_fw_mem_accessed"] - base["block_fw_mem_accessed"] == pytest.approx(fw)
    # Output gradient: amax read + row-wise and column-wise (Hadamard) quantize.
    bw = grads * (3 * B16 + 2 * q16)
    assert fp4["block_agrad_mem_accessed"] - base["block_agrad_mem_accessed"] == \
        pytest.approx(bw)
    # The casts are memory-bound: bytes over HBM bandwidth (flat curve).
    bps = system.mem1.GBps * 1e9
    assert fp4["block_fw_mem_time"] - base["block_fw_mem_time"] == pytest.approx(fw / bps)
    # MXFP4: two quantizations of everything, no amax pass, 1x32 E8M0 scales.
    mx = run(gpt, system, fp8_recipe="mxfp4")
    q32 = 0.5 + 1 / 32
    fw_mx = (inputs + weights) * 2 * (B16 + q32)
    assert mx["block_fw_mem_accessed"] - base["block_fw_mem_accessed"] == pytest.approx(fw_mx)


def test_weight_copies_and_saved_inputs_by_hand(gpt, b200):
    base = run(gpt, b200)
    fp4 = run(gpt, b200, fp8_recipe="nvfp4")
    weights = sum(n * k for n, k in LINEARS)
    # Both orientations of each linear weight in fp4 (16x16 block scales) beside bf16.
    copies = BLOCKS * weights * 2 * (0.5 + 1 / 256)
    assert fp4["weight_space"] - base["weight_space"] == pytest.approx(copies)
    assert fp4["weight_space"] - base["weight_space"] == 101_449_728
    mx = run(gpt, b200, fp8_recipe="mxfp4")
    assert mx["weight_space"] - base["weight_space"] == pytest.approx(
        BLOCKS * weights * 2 * (0.5 + 1 / 32))
    # The weight-gradient GEMM's saved input is its fp4 cast: fewer bytes kept
    # than in bf16, and fewer than mxfp8's 1-byte cast.
    fp8 = run(gpt, b200, fp8_recipe="mxfp8")
    assert fp4["act_space"] < fp8["act_space"] < base["act_space"]
    # Kept per block: the inputs of the output projection, fc1 and fc2 (Q, K
    # and V read the norm's output, which the norm keeps in bf16).
    kept = M * (H + H + FF)
    assert fp8["act_space"] - fp4["act_space"] == pytest.approx(
        BLOCKS * kept * (1 - (0.5 + 1 / 16)))


def test_fp8_recipes_unchanged_by_the_fp4_table(gpt, b200):
    # mxfp8 as before: two 1-byte casts per element of input, weight and gradient.
    base = run(gpt, b200)
    fp8 = run(gpt, b200, fp8_recipe="mxfp8")
    inputs = sum(M * n for n, _ in LINEARS)
    weights = sum(n * k for n, k in LINEARS)
    assert fp8["block_fw_mem_accessed"] - base["block_fw_mem_accessed"] == pytest.approx(
        2 * (B16 + 1) * (inputs + weights))
    assert fp8["weight_space"] - base["weight_space"] == pytest.approx(BLOCKS * weights * 2)


def test_a_system_without_fp4_refuses_it(gpt, h100):
    s = evaluate_one(gpt, h100, exe(fp8_recipe="nvfp4"))
    assert not s["feasible"]
    from autopar.model.rules import REASONS
    assert "fp8_recipe" in REASONS[int(s["reason_code"])]
    with pytest.raises(SpecError, match="fp8_recipe.*nvfp4 matrix rate"):
        load_execution(exe(fp8_recipe="nvfp4"), system=h100)
    with pytest.raises(SpecError, match="fp8_recipe.*mxfp4"):
        load_execution(exe(fp8_recipe="mxfp4"), system=h100)


def test_fp4_is_not_a_working_datatype(gpt, b200):
    with pytest.raises(SpecError, match="datatype.*GEMM rate"):
        load_execution(exe(datatype="nvfp4"), system=b200)
    # Not a datatype the system runs, even where a file lists a vector rate.
    v = dict(b200.vector, nvfp4=b200.vector["bfloat16"])
    odd = dataclasses.replace(b200, vector=v)
    assert not evaluate_one(gpt, odd, exe(datatype="nvfp4"))["feasible"]
    # An fp4 recipe needs a 16-bit working datatype.
    assert not evaluate_one(gpt, b200, exe(datatype="float32", fp8_recipe="nvfp4"))["feasible"]


def test_spaces_derive_fp4_where_the_system_has_the_rate(gpt, b200, h100):
    from autopar.io.layouts import CHOICES
    from autopar.model import evaluate_columns
    from autopar.model.rules import REASONS
    from autopar.search.space import Case, load_space
    space = load_space(REPO_ROOT / "search_spaces" / "modern.yaml")
    names = CHOICES["fp8_recipe"]
    for system, want in ((b200, {"none", "tensorwise", "rowwise", "mxfp8", "nvfp4", "mxfp4"}),
                         (h100, {"none", "tensorwise", "rowwise"})):
        case = Case(gpt, system, 8, 8, "bfloat16", batch_policy="fixed")
        seen = set()
        for cols in space.enumerate(case):
            out = evaluate_columns(gpt, system, cols, stats=("sample_rate",))
            bad = [REASONS[c] for c in out["reason_code"] if REASONS[c].startswith("invalid")]
            assert not bad, bad[:3]
            seen |= {names[c] for c in set(cols["fp8_recipe"].tolist())}
        assert seen == want


# ------------------------------------------------------------ command line

SPACE = """name: fp4
description: fp8 and fp4 recipes over a few layouts.
batch_policy: max
params:
  tensor_par: [1, 2]
  pipeline_par: [1]
  activation_recompute: [none, full]
  microbatch_size: {max: 2}
  fp8_recipe: derived
fixed:
  tensor_par_net: 0
  pipeline_par_net: 0
  data_par_net: 0
  optimizer_sharding: true
  tensor_par_comm_type: rs_ag
  pipeline_interleaving: 1
  seq_par_ag_redo: false
  data_par_overlap: true
  tensor_par_overlap: none
  weight_offload: false
  activations_offload: false
  optimizer_offload: false
  fused_activation: true
  attention_type: multihead
  attention_impl: flash_v2
"""

MODEL = "models/gpt3-5B.json"
SYSTEM = "systems/b200_nvl8.json"


def test_cli_exhaustive_tune_and_estimate_round_trip_fp4(cli, tmp_path):
    space = tmp_path / "fp4.yaml"
    space.write_text(SPACE)
    best, allp = tmp_path / "best.json", tmp_path / "all.parquet"
    r = cli("exhaustive", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 16,
            "--datatype", "bfloat16", "--space", space, "--output", best,
            "--all", allp, "--no-progress")
    assert r.returncode == 0, r.stderr
    table = pd.read_parquet(allp)
    recipes = set(table["fp8_recipe"].astype(str))
    assert {"none", "mxfp8", "nvfp4", "mxfp4"} <= recipes
    # fp4 is the fastest recipe for this model on B200: the best layout uses it.
    rec = json.loads(best.read_text())
    assert rec["fp8_recipe"] in ("nvfp4", "mxfp4")
    load_execution(best)
    e = cli("estimate", MODEL, SYSTEM, best, "--json")
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["sample_rate"] == pytest.approx(
        table["sample_rate"].max(), rel=1e-9)
    out = tmp_path / "tuned.json"
    t = cli("tune", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 16,
            "--datatype", "bfloat16", "--space", space, "--sampler", "random",
            "--trials", 24, "--seed", 0, "--output", out)
    assert t.returncode == 0, t.stderr
    tuned = json.loads(out.read_text())
    e = cli("estimate", MODEL, SYSTEM, out, "--json")
    assert e.returncode == 0, e.stderr
    assert tuned.get("fp8_recipe", "none") in recipes


def test_cli_estimate_refuses_fp4_on_hopper(cli, tmp_path):
    f = tmp_path / "exe.json"
    f.write_text(json.dumps(exe(fp8_recipe="nvfp4")))
    r = cli("estimate", MODEL, "systems/h100_80g_nvl8.json", f)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "fp8_recipe" in lines[0] and "nvfp4" in lines[0]


def test_cli_search_refuses_fp4_as_the_working_datatype(cli):
    r = cli("exhaustive", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 16,
            "--datatype", "nvfp4", "--space", "small", "--no-progress")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and ": datatype: 'nvfp4' is not supported" in lines[0]
