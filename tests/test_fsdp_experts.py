"""Megatron-FSDP (``weight_sharding``) beside expert parallelism: the routed
experts' weights, gradients and optimizer state sharded over the
expert-data-parallel group, the other weights over data_par; each block's
dense and expert parameters gathered before its forward and its backward
over their own groups (docs/validation.md, "Megatron-FSDP with expert
parallelism, counted").  Hand counts on a small MoE block."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import bf16_one_proc_execution

from autopar import model as M
from autopar.io.specs import load_execution, load_model
from autopar.model.hardware import NetworkTier

H, E, F = 64, 4, 32                     # hidden, experts, expert feed-forward
# One block's dense parameters: Q, K, V, O (4 heads of 16), two RMS norms,
# the router (H x E).
DENSE = 4 * H * H + 2 * H + H * E


def tiny_moe():
    return load_model({"hidden": H, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
                       "attn_size": 16, "num_blocks": 2, "block": "llama", "name": "tiny",
                       "moe": {"experts": E, "top_k": 2, "expert_feedforward": F}})


def fsdp_execution(**kw):
    """Eight data-parallel ranks of one bf16 sample each, Megatron-FSDP
    (``weight_sharding``), with ``kw`` replacing fields."""
    return bf16_one_proc_execution(**{"num_procs": 8, "data_par": 8, "batch_size": 16,
                                      "optimizer_sharding": True, "weight_sharding": True,
                                      **kw})


def run(system, **kw):
    return M.evaluate_one(tiny_moe(), system,
                          load_execution(fsdp_execution(**{"expert_par": 2, **kw})))


def _net(system):
    return NetworkTier(system.networks, np.array([0]))


def test_sharded_memory_hand_count(roomy):
    """EP 2 over data_par 8: a processor holds 2 of the 4 experts (3 x H x F
    each), sharded over the expert-data-parallel group of 8 / 2 = 4; the
    dense weights over 8.  bf16 weights (2 bytes), gradients (2, sharded
    likewise) and Adam's fp32 master and moments (12 bytes a parameter)."""
    s = run(roomy)
    assert s["feasible"]
    experts = 2 * 3 * H * F
    assert s["block_weight_space"] == pytest.approx(2 * (experts / 4 + DENSE / 8))
    assert s["block_weight_grad_space"] == pytest.approx(2 * (experts / 4 + DENSE / 8))
    assert s["block_optimizer_space"] == pytest.approx(12 * (experts / 4 + DENSE / 8))
    # Without weight_sharding the weights are whole (the distributed optimizer's
    # gradients and state sharded as before).
    z = run(roomy, weight_sharding=False)
    assert z["block_weight_space"] == 2 * (experts + DENSE)
    assert z["block_optimizer_space"] == pytest.approx(s["block_optimizer_space"])
    # EP 8: a group of one rank, the experts' weights are not sharded at all.
    s8 = run(roomy, expert_par=4)      # (4 experts: EP 4, EDP 2, one expert each)
    one = 3 * H * F
    assert s8["block_weight_space"] == pytest.approx(2 * (one / 2 + DENSE / 8))
    s1 = run(roomy, expert_par=4, num_procs=4, data_par=4, batch_size=8)
    assert s1["block_weight_space"] == pytest.approx(2 * (one / 1 + DENSE / 4))


def test_gather_bytes_hand_count(roomy):
    """Before each block's forward and again before its backward, every
    micro-batch: the dense parameters all-gathered over data_par 8 and the
    experts' over the expert-data-parallel group of 4 (bf16 bytes of the
    whole block: the gather rebuilds what the processor computes with).
    The gradients are reduce-scattered over the same groups once a step,
    with no parameter all-gather after the step."""
    s = run(roomy)
    net = _net(roomy)
    experts = 2 * 3 * H * F
    dense_b, expert_b = 2.0 * DENSE, 2.0 * experts
    g = float(net.time("all_gather", np.array([dense_b]), np.array([8]))[0]
              + net.time("all_gather", np.array([expert_b]), np.array([4]))[0])
    micro, blocks = 16 // 8, 2
    assert s["weight_gather_link_time"] == pytest.approx(micro * blocks * 2 * g)
    rs = float(net.time("reduce_scatter", np.array([dense_b]), np.array([8]))[0]
               + net.time("reduce_scatter", np.array([expert_b]), np.array([4]))[0])
    assert s["dp_comm_link_time"] == pytest.approx(blocks * rs)
    # A stage holds its blocks' shards (the two whole blocks gathered at a
    # time are static memory beside them, memory.py).
    assert s["weight_space"] == pytest.approx(blocks * s["block_weight_space"])
    z = run(roomy, weight_sharding=False)
    assert z["weight_gather_link_time"] == 0.0


def test_edp_of_one_gathers_no_experts(roomy):
    """EP 4 over data_par 4 (one expert each, an expert-data-parallel group
    of one rank): only the dense parameters are gathered."""
    s = run(roomy, expert_par=4, num_procs=4, data_par=4, batch_size=8)
    net = _net(roomy)
    g = float(net.time("all_gather", np.array([2.0 * DENSE]), np.array([4]))[0])
    assert s["weight_gather_link_time"] == pytest.approx(2 * 2 * 2 * g)


def test_dense_model_unchanged_by_the_expert_count(roomy):
    """A model without experts: weight_sharding divides every weight over
    data_par, as before (the expert terms only apply to expert weights)."""
    m = load_model({"hidden": H, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
                    "attn_size": 16, "num_blocks": 2, "block": "llama", "name": "tiny"})
    ex = fsdp_execution()
    s = M.evaluate_one(m, roomy, load_execution(ex))
    mlp = 3 * H * 128
    assert s["block_weight_space"] == pytest.approx(2 * (4 * H * H + 2 * H + mlp) / 8)


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_launch_export_of_fsdp_with_experts_round_trips(fmt):
    """Megatron-LM's and Bridge's exports write Megatron-FSDP with
    optim_grads_params beside the expert sizes, and read back the same
    sharding and expert layout."""
    from pathlib import Path

    from autopar.io.launch import get
    root = Path(__file__).resolve().parent.parent
    model = load_model(root / "models" / "qwen3-30B-A3B.json")
    ex = fsdp_execution(num_procs=16, data_par=16, data_par_net=1, batch_size=64,
                        data_par_overlap=True, attention_impl="flash_v2", fused_norm=True,
                        unsharded_grads=False, fp32_grads=True, expert_par=8)
    lf = get(fmt)
    assert lf.refuse_layout(model, ex) is None
    text = lf.write(model, ex)
    if fmt == "megatron":
        assert "--use-megatron-fsdp" in text
        assert "--data-parallel-sharding-strategy optim_grads_params" in text
        assert "--expert-model-parallel-size 8" in text
    else:
        assert "use_megatron_fsdp=true" in text.lower()
        assert "optim_grads_params" in text
    back = lf.read(text, f"test.{fmt}").execution
    assert back["weight_sharding"] is True and back["optimizer_sharding"] is True
    assert back["expert_par"] == 8


def test_bridge_summary_row_with_fsdp_is_weight_sharded():
    """A row of the Bridge Qwen3 summary run with FSDP (none is at 067f987:
    every FSDP cell is 0 or empty) maps to weight_sharding, not to a skip."""
    from pathlib import Path

    import pandas as pd

    from autopar.studies import published_base as P
    from autopar.studies.published_moe import bridge_qwen3
    csv = Path(__file__).resolve().parent.parent / "autopar" / "data" / "published" / \
        "megatron_bridge_qwen3_30b_a3b.csv"
    table = pd.read_csv(csv)
    row = table.iloc[0].copy()
    plain = bridge_qwen3(row)
    row["fsdp"] = 1.0
    case = bridge_qwen3(row)
    assert isinstance(case, P.PublishedCase)
    assert not plain.execution["weight_sharding"]
    assert case.execution["weight_sharding"] and not case.execution["unsharded_grads"]
    assert case.execution["expert_par"] == plain.execution["expert_par"] > 1


def test_expert_weight_shards_by_hand():
    """The experts' divisor: EDP = TP x DP x CP / (EP x ETP) with
    weight_sharding; within one of Megatron-FSDP's hybrid instances
    (sharding_group) EDP / instances, at least 1; 1 without weight_sharding."""
    from autopar.model.context import expert_weight_shards
    cols = {"data_par": np.array([128, 128, 128, 64, 8]),
            "tensor_par": np.array([1, 1, 1, 1, 2]),
            "context_par": np.array([1, 1, 1, 1, 1]),
            "expert_par": np.array([32, 32, 32, 64, 4]),
            "expert_tensor_par": np.array([1, 1, 1, 1, 1])}
    # dense weights' divisors: whole DP, one of 4 instances (32), none, DP, DP
    ws = np.array([128.0, 32.0, 1.0, 64.0, 8.0])
    assert expert_weight_shards(cols, ws).tolist() == [4.0, 1.0, 1.0, 1.0, 4.0]


def test_many_rows_count_as_one_row_does(roomy):
    """More than a handful of layouts go through the block cache's shared
    tables (speedups.BlockCache): the same memory and gather times as each
    layout alone."""
    from autopar.io.layouts import to_columns
    base = {"num_procs": 8, "tensor_par": 1, "pipeline_par": 1, "data_par": 8,
            "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
            "batch_size": 16, "microbatch_size": 1, "datatype": "bfloat16",
            "fused_activation": True, "attention_type": "multihead",
            "activation_recompute": "none", "pipeline_interleaving": 1,
            "optimizer_sharding": True, "tensor_par_comm_type": "ar",
            "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": False,
            "weight_offload": False, "activations_offload": False, "optimizer_offload": False,
            "training": True}
    rows = []
    for i in range(80):
        ep = (1, 2, 4)[i % 3]
        ex = dict(base, expert_par=ep, weight_sharding=bool(i % 2),
                  microbatch_size=(1, 2)[(i // 6) % 2], batch_size=16 * (1 + i // 12))
        rows.append(load_execution(ex))
    model = tiny_moe()
    out = M.evaluate_columns(model, roomy, to_columns(rows))
    for i in (0, 1, 2, 3, 4, 5, 41, 79):
        one = M.evaluate_one(model, roomy, rows[i])
        for k in ("proc_mem_tier1_cap_req", "block_weight_space", "weight_gather_link_time",
                  "dp_comm_link_time", "total_time"):
            assert float(out[k][i]) == pytest.approx(one[k], rel=1e-12), (i, k)


@pytest.mark.parametrize("group, inner", [(2, 1), (4, 2)])
def test_hybrid_sharding_experts_per_instance_hand_count(roomy, group, inner):
    """Hybrid sharding without the outer strategy (``sharding_group`` alone,
    Megatron-FSDP's ``outer_dp_sharding_strategy="no_shard"``): EP 2 over
    data_par 8 in 8 / ``group`` instances.  The experts' weights, gradients
    and Adam state are all divided by the instance's expert group, 4 / (8 /
    group) ranks (``inner``), the dense ones by ``group``
    (NVIDIA/Megatron-LM@2a75ac1 param_and_grad_buffer.py: without HFSDP
    helper buffers the main buffers sit on ``get_fsdp_group``, the partial
    expert-data-parallel group of mcore_fsdp_adapter.py ``_init_dist_index``).
    Before this count the experts' gradients and state were divided by the
    whole expert-data-parallel group of 4."""
    s = run(roomy, sharding_group=group)
    assert s["feasible"]
    experts = 2 * 3 * H * F
    held = experts / inner + DENSE / group
    assert s["block_weight_space"] == pytest.approx(2 * held)
    assert s["block_weight_grad_space"] == pytest.approx(2 * held)
    assert s["block_optimizer_space"] == pytest.approx(12 * held)
    # with the outer strategy the state spreads over the whole groups again
    o = run(roomy, sharding_group=group, optimizer_outer_sharding=True)
    assert o["block_optimizer_space"] == pytest.approx(12 * (experts / 4 + DENSE / 8))
    assert o["block_weight_grad_space"] == pytest.approx(2 * held)
