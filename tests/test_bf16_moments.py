"""bf16 Adam moments (Megatron-Core's precision-aware optimizer,
``optimizer_moment_bytes`` 2): the optimizer state and the step's memory
traffic counted by hand on a small GPT block, bad values named, the
Megatron-LM and Megatron-Bridge formats written and read back, torchtitan and
DeepSpeed refusing with their reasons."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.io.errors import SpecError
from autopar.io.launch import get
from autopar.io.launch.expressible import full
from autopar.io.specs import load_execution, load_model
from autopar.model import evaluate_one
from tests.conftest import launch_round_trip, one_proc_execution

h, f, BLOCKS = 1024, 4096, 8
GPT = {"hidden": h, "feedforward": f, "seq_size": 2048, "attn_heads": 16,
       "attn_size": 64, "num_blocks": BLOCKS}
# One GPT block: Q, K, V, O (h x h), the MLP (h x f, f x h), two LayerNorms.
P = 4 * h * h + 2 * h * f + 2 * 2 * h


@pytest.fixture(scope="module")
def gpt():
    return load_model(dict(GPT, name="gpt-small"))


def run(model, system, **kw):
    s = evaluate_one(model, system, one_proc_execution(**kw))
    assert s["feasible"], s
    return s


@pytest.mark.parametrize("optimizer,fp32_state,bf16_state", [
    # float16 weights: the 4-byte fp32 master copy plus the moments
    ("adam", 4 + 2 * 4, 4 + 2 * 2),          # exp_avg, exp_avg_sq
    ("sgd", 4 + 4, 4 + 2),                   # momentum
])
def test_bf16_moments_by_hand(gpt, roomy, optimizer, fp32_state, bf16_state):
    fp32 = run(gpt, roomy, optimizer=optimizer)
    bf16 = run(gpt, roomy, optimizer=optimizer, optimizer_moment_bytes=2)
    assert fp32["block_optimizer_space"] == fp32_state * P
    assert bf16["block_optimizer_space"] == bf16_state * P
    assert bf16["optimizer_space"] == BLOCKS * bf16_state * P
    # the step reads the (smaller) state once
    assert bf16["block_optim_mem_accessed"] == bf16_state * P
    assert bf16["block_optim_time"] < fp32["block_optim_time"]
    # nothing else moves
    for k in ("fw_time", "bw_time", "weight_space", "weight_grad_space", "act_space"):
        assert bf16[k] == fp32[k], k


def test_bf16_moments_sharded_and_on_the_head(roomy):
    """With a vocabulary (embedding and output layer) and the optimizer state
    sharded over 8 data-parallel ranks, the moments shrink by 4 bytes an
    element everywhere, divided by the shards."""
    model = load_model(dict(GPT, name="gpt-v", vocab_size=32000))
    ex = dict(one_proc_execution(), num_procs=8, data_par=8, batch_size=32,
              optimizer_sharding=True)
    a = evaluate_one(model, roomy, ex)
    b = evaluate_one(model, roomy, dict(ex, optimizer_moment_bytes=2))
    assert b["block_optimizer_space"] == pytest.approx(8 * P / 8, rel=1e-12)
    assert a["block_optimizer_space"] == pytest.approx(12 * P / 8, rel=1e-12)
    # everything held across the step: the blocks' and the head's moments
    # (embedding and output layer, V x h each, 2 x 2 bytes saved / 8 shards)
    head = 2 * 32000 * h
    saved = (BLOCKS * P + head) * 2 * 2 / 8
    assert a["proc_mem_tier1_cap_req"] - b["proc_mem_tier1_cap_req"] == \
        pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("value", [3, 1, 8, 0, "bf16", True])
def test_bad_moment_bytes_name_the_field(value):
    with pytest.raises(SpecError) as e:
        load_execution(one_proc_execution(optimizer_moment_bytes=value), source="x.json")
    assert "optimizer_moment_bytes" in str(e.value)


# ------------------------------------------------------------------ launch formats

ROOT = Path(__file__).resolve().parents[1]
LLAMA = load_model(ROOT / "models" / "llama2-7B.json")
BASE = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 1, "data_par": 4,
        "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
        "batch_size": 64, "microbatch_size": 2, "datatype": "bfloat16",
        "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": "none", "pipeline_interleaving": 1,
        "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": True,
        "weight_offload": False, "activations_offload": False, "optimizer_offload": False,
        "training": True, "attention_impl": "flash_v2", "fused_norm": True,
        "unsharded_grads": True, "fp32_grads": True}


def _round(fmt, ex):
    text, back = launch_round_trip(fmt, LLAMA, ex)
    return text, back.execution


def test_megatron_writes_and_reads_bf16_moments():
    text, back = _round("megatron", {**BASE, "optimizer_moment_bytes": 2})
    assert "--use-precision-aware-optimizer" in text
    assert "--exp-avg-dtype bf16" in text and "--exp-avg-sq-dtype bf16" in text
    assert back["optimizer_moment_bytes"] == 2
    # fp32 moments: nothing written, read back as 4
    text, back = _round("megatron", dict(BASE))
    assert "--exp-avg-dtype" not in text and "--use-precision-aware-optimizer" not in text
    assert back.get("optimizer_moment_bytes", 4) == 4


def test_bridge_writes_and_reads_bf16_moments():
    text, back = _round("bridge", {**BASE, "optimizer_moment_bytes": 2})
    lines = set(text.splitlines())
    assert {"optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_dtype=bf16",
            "optimizer.exp_avg_sq_dtype=bf16"} <= lines
    assert back["optimizer_moment_bytes"] == 2
    # the recipes' torch spellings read too
    spelled = text.replace("exp_avg_dtype=bf16", "exp_avg_dtype=bfloat16") \
        .replace("exp_avg_sq_dtype=bf16", "exp_avg_sq_dtype=torch.bfloat16")
    assert get("bridge").read(spelled, "r").execution["optimizer_moment_bytes"] == 2


@pytest.mark.parametrize("edit,field", [
    # moments of two widths
    (("exp_avg_sq_dtype=bf16", "exp_avg_sq_dtype=float32"), "optimizer.exp_avg_sq_dtype"),
    # an fp8 moment autopar does not count
    (("exp_avg_dtype=bf16", "exp_avg_dtype=fp8"), "optimizer.exp_avg_dtype"),
    # bf16 moments without the precision-aware optimizer (Megatron asserts)
    (("use_precision_aware_optimizer=true", "use_precision_aware_optimizer=false"),
     "optimizer.use_precision_aware_optimizer"),
])
def test_bridge_bad_moment_settings_name_the_key(edit, field):
    text = get("bridge").write(LLAMA, {**BASE, "optimizer_moment_bytes": 2})
    with pytest.raises(SpecError) as e:
        get("bridge").read(text.replace(*edit), "r")
    assert e.value.field == field


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_megatron_core_refuses_bf16_moments_beside_another_optimizer(fmt):
    why = get(fmt).refuse_layout(LLAMA, full({**BASE, "optimizer": "sgd",
                                              "optimizer_moment_bytes": 2}))
    assert why and why.startswith(f"{fmt}: optimizer_moment_bytes=2") and "Adam" in why, why


@pytest.mark.parametrize("fmt,extra", [
    ("torchtitan", {"fp32_grads": True, "unsharded_grads": False, "weight_sharding": True}),
    ("deepspeed", {"seq_par_ag_redo": True})])
def test_torchtitan_and_deepspeed_refuse_bf16_moments(fmt, extra):
    F = get(fmt)
    ex = full({**BASE, **extra})
    assert F.refuse_layout(LLAMA, ex) is None, F.refuse_layout(LLAMA, ex)
    why = F.refuse_layout(LLAMA, {**ex, "optimizer_moment_bytes": 2})
    assert why and "optimizer_moment_bytes" in why and "moments" in why, why


def test_dense_table_recipe_with_bf16_moments_mapped():
    """The dense table's spelling (optimizer.use_precision_aware_optimizer=True,
    optimizer.exp_avg_dtype=torch.bfloat16) maps too, through the MoE path
    of a hybrid MoE row; fp32 rows keep 4."""
    from autopar.studies import published_base as P
    from autopar.studies import recipes as R
    from autopar.studies.recipe_table import read
    rows = {str(r["recipe"]): r for _, r in read(R.CSV).iterrows()}
    c = R.recipe_case(rows["nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config"])
    assert not isinstance(c, P.Skip), c
    assert c.execution["optimizer_moment_bytes"] == 2
    others = [R.recipe_case(r) for n, r in rows.items() if n.startswith("llama3_8b")]
    assert others and all(not isinstance(o, P.Skip) and
                          o.execution.get("optimizer_moment_bytes", 4) == 4 for o in others)
