"""The fp8 / fp4 recipe's BF16 first and last blocks (issue 28, NVFP4
follow-up): ``bf16_first_blocks`` / ``bf16_last_blocks`` blocks run without
the ``fp8_recipe`` (Megatron-Core's ``--first-last-layers-bf16`` with
``--num-layers-at-start-in-bf16`` / ``--num-layers-at-end-in-bf16``), as a
block kind of their own, so the stages holding them are costed and sized by
what they hold.  Figures are composed by hand from one block's counts."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.io.errors import SpecError
from autopar.io.layouts import to_columns
from autopar.io.specs import load_execution, load_model, load_system
from autopar.model import evaluate_columns, evaluate_one
from autopar.model.layers import NVFP4_WEIGHT_BYTES
from autopar.model.moe import stage_counts
from autopar.model.rules import REASONS
from tests.conftest import REPO_ROOT, one_proc_execution

H, FF, SEQ = 1024, 4096, 2048
GPT4 = {"hidden": H, "feedforward": FF, "seq_size": SEQ, "attn_heads": 16,
        "attn_size": 64, "num_blocks": 4, "name": "gpt-4-blocks"}
MICRO = 16 // 4                     # micro-batches: batch 16 over data_par 4, micro-batch 1
BF16_TF, FP4_TF = 2000.0, 8000.0
# Forward GEMM FLOPs of one block (Q, K, V, output projection, fc1, fc2: 2 m n k each).
GEMM_FW = 2.0 * SEQ * (4 * H * H + 2 * H * FF)
# The weights of the linear layers of one block (what the recipe quantizes).
LINEAR_WEIGHTS = 4 * H * H + 2 * H * FF


@pytest.fixture(scope="module")
def gpt():
    return load_model(GPT4)


@pytest.fixture(scope="module")
def flat():
    """B200 with flat (efficiency 1) bf16 and fp4 matrix curves: a GEMM's
    time is its FLOPs over the peak."""
    s = load_system(REPO_ROOT / "systems" / "b200_nvl8.json")
    m = dict(s.matrix)
    one = ((0.0, 1.0),)
    m["bfloat16"] = dataclasses.replace(m["bfloat16"], tflops=BF16_TF, gflops_efficiency=one)
    for d in ("nvfp4", "mxfp4"):
        m[d] = dataclasses.replace(m[d], tflops=FP4_TF, gflops_efficiency=one)
    return dataclasses.replace(s, matrix=m)


def exe(**kw):
    return one_proc_execution(num_procs=8, data_par=4, pipeline_par=2, batch_size=16,
                              microbatch_size=1, datatype="bfloat16", **kw)


def run(model, system, **kw):
    s = evaluate_one(model, system, exe(**kw))
    assert s["feasible"], REASONS[s["reason_code"]] if s["reason_code"] < len(REASONS) else s
    return s


def test_first_stage_is_one_bf16_block_plus_one_fp4_block(gpt, flat):
    bf16 = run(gpt, flat)                                  # every block without the recipe
    fp4 = run(gpt, flat, fp8_recipe="nvfp4")               # every block quantized
    mixed = run(gpt, flat, fp8_recipe="nvfp4", bf16_first_blocks=1)
    # One block of each kind, by hand: their GEMMs differ by the rates only.
    gemm_gap = GEMM_FW * (1 / (BF16_TF * 1e12) - 1 / (FP4_TF * 1e12))
    assert bf16["block_fw_flops_time"] - fp4["block_fw_flops_time"] == pytest.approx(gemm_gap)
    # The first stage (2 blocks: one BF16, one fp4) paces the pipeline: its
    # forward per micro-batch is one block of each kind.
    one_each = bf16["block_fw_time"] + fp4["block_fw_time"]
    assert mixed["fw_time"] == pytest.approx(MICRO * one_each, rel=1e-12)
    assert mixed["block_fw_flops_time"] == pytest.approx(
        (bf16["block_fw_flops_time"] + fp4["block_fw_flops_time"]) / 2, rel=1e-12)
    bw = lambda s: s["block_agrad_time"] + s["block_wgrad_time"]   # noqa: E731
    assert mixed["bw_time"] == pytest.approx(MICRO * (bw(bf16) + bw(fp4)), rel=1e-12)
    # Strictly between the two: the fp4 speed-up is no longer every block's.
    assert fp4["total_time"] < mixed["total_time"] < bf16["total_time"]


def test_first_stage_weights_hold_one_block_of_fp4_copies(gpt, flat):
    bf16 = run(gpt, flat)
    fp4 = run(gpt, flat, fp8_recipe="nvfp4")
    mixed = run(gpt, flat, fp8_recipe="nvfp4", bf16_first_blocks=1)
    # NVFP4 keeps both orientations of each quantized weight (0.5 + 1/256
    # bytes an element) beside the bf16 one: per block 2 x that x weights.
    copies = 2 * NVFP4_WEIGHT_BYTES * LINEAR_WEIGHTS
    assert fp4["weight_space"] - bf16["weight_space"] == pytest.approx(2 * copies)
    assert mixed["weight_space"] - bf16["weight_space"] == pytest.approx(copies)


def test_last_blocks_make_the_last_stage_pace(gpt, flat):
    first = run(gpt, flat, fp8_recipe="nvfp4", bf16_first_blocks=1)
    last = run(gpt, flat, fp8_recipe="nvfp4", bf16_last_blocks=1)
    # The same work, now on the last stage, which paces the pipeline.
    for k in ("fw_time", "bw_time", "block_fw_time"):
        assert last[k] == pytest.approx(first[k], rel=1e-12)
    # Its first stage is all fp4: sized as the all-fp4 layout's is.
    fp4 = run(gpt, flat, fp8_recipe="nvfp4")
    assert last["weight_space"] == fp4["weight_space"]
    # Two last blocks: the whole last stage in BF16 paces as the BF16 layout.
    both = run(gpt, flat, fp8_recipe="nvfp4", bf16_last_blocks=2)
    bf16 = run(gpt, flat)
    assert both["fw_time"] == pytest.approx(bf16["fw_time"], rel=1e-12)
    assert both["bw_time"] == pytest.approx(bf16["bw_time"], rel=1e-12)


def test_defaults_and_no_recipe_keep_the_meaning(gpt, flat):
    plain = run(gpt, flat)
    ignored = run(gpt, flat, bf16_first_blocks=1, bf16_last_blocks=2)     # no recipe
    assert plain == ignored
    fp4 = run(gpt, flat, fp8_recipe="nvfp4")
    zero = run(gpt, flat, fp8_recipe="nvfp4", bf16_first_blocks=0, bf16_last_blocks=0)
    assert fp4 == zero


def test_counts_must_fit_a_stage_given_execution(gpt):
    e = exe(fp8_recipe="nvfp4", bf16_last_blocks=3)
    with pytest.raises(SpecError) as err:
        load_execution(e, model=gpt)
    assert "bf16_last_blocks" in str(err.value) and "\n" not in str(err.value)
    assert load_execution(exe(fp8_recipe="nvfp4", bf16_last_blocks=2), model=gpt)
    # without a recipe they change nothing, as Megatron checks them only with one
    assert load_execution(exe(bf16_last_blocks=3), model=gpt)
    with pytest.raises(SpecError):
        load_execution(exe(fp8_recipe="nvfp4", bf16_first_blocks=-1), model=gpt)


def test_searched_rows_that_do_not_fit_get_a_reason(gpt, flat):
    rows = [exe(fp8_recipe="nvfp4", bf16_first_blocks=k) for k in (0, 2, 3)]
    out = evaluate_columns(gpt, flat, to_columns(rows))
    assert out["feasible"].tolist() == [True, True, False]
    assert REASONS[out["reason_code"][2]].startswith("invalid: bf16_first_blocks")


def _pipeline_columns(pp: list) -> dict:
    """The pipeline columns of rows on ``pp`` stages at the default split
    (stage_counts counts stages whose blocks differ one by one:
    autopar.model.pipeline.uneven_rows)."""
    from autopar.io.layouts import SPLIT_FIELDS
    n = len(pp)
    return {"pipeline_par": np.array(pp), "pipeline_interleaving": np.ones(n, dtype=np.int64),
            **{f: np.zeros(n, dtype=np.int64) for f in SPLIT_FIELDS}}


def test_stage_counts_of_bf16_kinds_moe_and_hybrid():
    from tests.test_mamba import tiny
    m = tiny("MM*-M--*")
    on = np.array([4, 4, 0], dtype=np.int8)              # nvfp4, nvfp4, no recipe
    cols = {"fp8_recipe": on, "bf16_first_blocks": np.array([1, 0, 1]),
            "bf16_last_blocks": np.array([2, 2, 2]), **_pipeline_columns([2, 2, 2])}
    c = stage_counts(m, np.array([2, 2, 2]), cols)
    # row 0: first stage M(bf16) M * -, last stage M - -(bf16) *(bf16)
    assert c["first_mamba_bf16"].tolist() == [1, 0, 0]
    assert c["first_mamba"].tolist() == [1, 2, 2]
    assert c["last_mlp_bf16"].tolist() == [1, 1, 0]
    assert c["last_attention_bf16"].tolist() == [1, 1, 0]
    assert c["last_mlp"].tolist() == [1, 1, 2]
    # A dense/MoE model: the first_dense block in BF16 is a dense BF16 block.
    moe_model = load_model(REPO_ROOT / "models" / "deepseek-v3.json")
    short = dataclasses.replace(moe_model, num_blocks=4, mtp=0,
                                moe=dataclasses.replace(moe_model.moe, first_dense=1))
    cols = {"fp8_recipe": np.array([1], dtype=np.int8), "bf16_first_blocks": np.array([1]),
            "bf16_last_blocks": np.array([1]), **_pipeline_columns([2])}
    c = stage_counts(short, np.array([2]), cols)
    assert (c["first_dense_bf16"][0], c["first_dense"][0], c["first_moe"][0]) == (1, 0, 1)
    assert (c["last_moe_bf16"][0], c["last_moe"][0]) == (1, 1)
    # the pace: equal MoE work on both stages, the one with more BF16 blocks
    assert c["pace_moe_bf16"][0] + c["pace_dense_bf16"][0] == 1


def test_hybrid_stages_sized_and_paced_by_what_they_hold(flat):
    """'M*M*' on two stages of 'M*': with both first blocks in BF16 the first
    stage is the BF16 layout's first stage, the last the fp4 one's."""
    from tests.test_mamba import tiny
    m = tiny("M*M*")
    kw = dict(num_procs=2, pipeline_par=2, data_par=1, batch_size=4, microbatch_size=1,
              datatype="bfloat16")
    s = {name: evaluate_one(m, flat, one_proc_execution(**kw, **extra)) for name, extra in (
        ("bf16", {}), ("fp4", {"fp8_recipe": "nvfp4"}),
        ("first", {"fp8_recipe": "nvfp4", "bf16_first_blocks": 2}),
        ("last", {"fp8_recipe": "nvfp4", "bf16_last_blocks": 2}))}
    assert all(r["feasible"] for r in s.values())
    assert s["bf16"]["fw_time"] != s["fp4"]["fw_time"]
    # equal work on both stages: the BF16 one paces
    for k in ("fw_time", "bw_time"):
        assert s["first"][k] == pytest.approx(s["bf16"][k], rel=1e-12)
        assert s["last"][k] == pytest.approx(s["bf16"][k], rel=1e-12)
    # the first stage's weights: what it holds
    assert s["first"]["weight_space"] == s["bf16"]["weight_space"]
    assert s["last"]["weight_space"] == s["fp4"]["weight_space"]


# ------------------------------------------------------------ command line

SPACE = """name: fp4-bf16-last
description: fp4 recipes with the recipe's last blocks in BF16.
batch_policy: max
params:
  tensor_par: [1, 2]
  pipeline_par: [1, 2]
  microbatch_size: {max: 2}
  fp8_recipe: derived
fixed:
  bf16_last_blocks: 2
  tensor_par_net: 0
  pipeline_par_net: 0
  data_par_net: 0
  activation_recompute: none
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


def test_cli_exhaustive_and_estimate_round_trip_bf16_blocks(cli, tmp_path):
    import json

    import pandas as pd
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    best, allp = tmp_path / "best.json", tmp_path / "all.parquet"
    r = cli("exhaustive", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 16,
            "--datatype", "bfloat16", "--space", space, "--output", best,
            "--all", allp, "--no-progress")
    assert r.returncode == 0, r.stderr
    table = pd.read_parquet(allp)
    # the fixed count on every row; where no recipe is, it changes nothing
    recipe = table["fp8_recipe"].astype(str)
    assert set(table["bf16_last_blocks"]) == {2}
    plain = table[(recipe == "none") & table["feasible"]].iloc[0]
    from autopar.io.layouts import execution_from_row
    ex = execution_from_row(plain)
    for k in (2, 0):
        f = tmp_path / f"plain{k}.json"
        f.write_text(json.dumps(dict(ex, bf16_last_blocks=k)))
        out = cli("estimate", MODEL, SYSTEM, f, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["sample_rate"] == pytest.approx(plain["sample_rate"],
                                                                       rel=1e-12)
    rec = json.loads(best.read_text())
    load_execution(best)
    e = cli("estimate", MODEL, SYSTEM, best, "--json")
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["sample_rate"] == pytest.approx(
        table["sample_rate"].max(), rel=1e-9)
    if rec.get("fp8_recipe", "none") != "none":
        assert rec["bf16_last_blocks"] == 2
    # a count beyond a stage's blocks: one line naming file and field, exit 2
    bad = dict(rec, fp8_recipe="nvfp4", bf16_last_blocks=99)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    r = cli("estimate", MODEL, SYSTEM, f)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bf16_last_blocks" in lines[0] and str(f) in lines[0]
