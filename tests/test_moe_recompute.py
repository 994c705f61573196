"""Megatron-Core's output-discarding recompute of the experts' activation
(``recompute_moe_act``) and of MLA's up projections (``recompute_mla_up_proj``):
each frees exactly the tensors Megatron-Core frees, runs its layers again, and
changes nothing where it is off or where the model has no experts / no MLA."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.model import evaluate_one
from autopar.studies import published_base as P

BASE = {"num_procs": 8, "tensor_par": 1, "pipeline_par": 1, "data_par": 8,
        "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
        "batch_size": 64, "microbatch_size": 1, "datatype": "bfloat16",
        "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": "none", "pipeline_interleaving": 1,
        "optimizer_sharding": True, "tensor_par_comm_type": "ar",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": True,
        "weight_offload": False, "activations_offload": False, "optimizer_offload": False,
        "training": True, "attention_impl": "flash_v2", "fused_norm": True,
        "unsharded_grads": True, "expert_par": 8}


@pytest.fixture(scope="module")
def deepseek():
    m = P.model("deepseek-v3")
    # four blocks, every one MoE, no MTP: one block kind
    return dataclasses.replace(m, num_blocks=4, mtp=0, moe=dataclasses.replace(m.moe, first_dense=0))


def stats(model, **change):
    return evaluate_one(model, P.system("b200_nvl8"), {**BASE, **change})


def test_moe_act_frees_the_second_gemms_input(deepseek):
    off, on = stats(deepseek), stats(deepseek, recompute_moe_act=True)
    s, k, ffe = deepseek.seq_size, deepseek.moe.top_k, deepseek.moe.expert_feedforward
    # the activation's output: one row of the expert width per token copy, bf16
    freed = s * k * ffe * 2
    assert off["block_act_storage_space"] - on["block_act_storage_space"] == pytest.approx(freed)
    assert on["block_re_time"] > off["block_re_time"]    # the activation runs again
    assert on["sample_rate"] < off["sample_rate"]


def test_mla_up_proj_frees_the_cores_inputs(deepseek):
    off, on = stats(deepseek), stats(deepseek, recompute_mla_up_proj=True)
    a, s, H = deepseek.mla, deepseek.seq_size, deepseek.attn_heads
    dqk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = k = s * H * dqk
    v = s * H * a.v_head_dim
    # (the rotary embedding keeps nothing for backward: autopar.model.layers.rotary)
    freed = (q + k + v) * 2
    assert off["block_act_storage_space"] - on["block_act_storage_space"] == pytest.approx(freed)
    assert on["block_re_time"] > off["block_re_time"]    # up projections run again
    assert on["sample_rate"] < off["sample_rate"]


def test_off_by_default_and_idle_without_experts_or_mla():
    dense = P.model("llama3-8B")
    a, b = stats(dense, expert_par=1), stats(dense, expert_par=1, recompute_moe_act=False,
                                             recompute_mla_up_proj=False)
    assert a["feasible"] and a == b
    gqa_moe = P.model("qwen3-30B-A3B")
    off, on = stats(gqa_moe), stats(gqa_moe, recompute_mla_up_proj=True)
    assert off["proc_mem_tier1_cap_req"] == on["proc_mem_tier1_cap_req"]
    assert off["sample_rate"] == on["sample_rate"]
