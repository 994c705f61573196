"""Fine-grained offloading of Megatron-Core's ``fused_group_mlp`` (issue 24):
the routed experts' whole fused grouped MLP, what the Transformer Engine op
fuser's fc1 -> probability-scaled activation -> fc2 saves inside the offload
context of ``TEGroupedMLP._fused_forward`` (NVIDIA/Megatron-LM@2a75ac1
megatron/core/transformer/moe/experts.py).  Hand counts on a small MoE block,
the rules, the launch formats and the Nemotron 3 Ultra recipes that set it
(docs/validation.md, "Megatron-FSDP expert shards per instance and
fused_group_mlp offloading, counted")."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import bf16_one_proc_execution
from test_fine_offload import _system

from autopar import model as M
from autopar.io.launch import get
from autopar.io.layouts import CHOICES, offload_modules_value
from autopar.io.specs import SpecError, load_execution, load_model

ROOT = Path(__file__).resolve().parent.parent
H, E, F, N = 64, 4, 32, 8        # hidden, experts, expert feed-forward, blocks
SEQ, TOP_K = 32, 2


def tiny_moe():
    return load_model({"hidden": H, "feedforward": 128, "seq_size": SEQ, "attn_heads": 4,
                       "attn_size": 16, "num_blocks": N, "block": "llama", "name": "tiny",
                       "moe": {"experts": E, "top_k": TOP_K, "expert_feedforward": F}})


def run(**kw):
    """One bf16 processor, one micro-batch of one sample, a host link fast
    enough that every copy is done within the next block's forward."""
    return M.evaluate_one(tiny_moe(), _system(1e6),
                          load_execution(bf16_one_proc_execution(**kw), model=tiny_moe()))


# Token copies through the experts per micro-batch (one processor, load 1).
TOKENS = SEQ * TOP_K
# Of the N blocks of the one micro-batch in flight, the last keeps its group
# and the one before it is still being copied: N - 2 blocks' groups moved.
MOVED = N - 2


def test_hand_count_whole_fused_mlp():
    """What the fused MLP saves per block, bf16 (2 bytes): fc1's input
    (TOKENS x H), the SwiGLU's input (fc1's output, TOKENS x 2F) and fc2's
    input (TOKENS x F) -- TransformerEngine ops/fused/grouped_mlp.py saves
    exactly these three for its backward."""
    plain = run()
    s = run(activation_offload_modules="fused_group_mlp")
    group = 2 * TOKENS * (H + 2 * F + F)
    assert s["proc_mem_tier2_cap_req"] == pytest.approx(MOVED * group, rel=1e-12)
    assert s["act_space"] == pytest.approx(plain["act_space"] - MOVED * group, rel=1e-12)
    # the compute is unchanged and a fast link hides the copies
    assert s["fw_time"] == plain["fw_time"] and s["bw_time"] == plain["bw_time"]
    assert s["bw_offload_exposed_time"] == 0
    # the partial expert modules are its parts: fc1's input, then the activation's
    fc1 = run(activation_offload_modules="expert_fc1")
    both = run(activation_offload_modules="expert_fc1+moe_act")
    assert fc1["proc_mem_tier2_cap_req"] == pytest.approx(MOVED * 2 * TOKENS * H)
    assert both["proc_mem_tier2_cap_req"] == pytest.approx(MOVED * 2 * TOKENS * (H + 2 * F))
    # with the attention core too, the two groups add up
    core = run(activation_offload_modules="core_attn")
    cf = run(activation_offload_modules="core_attn+fused_group_mlp")
    assert cf["proc_mem_tier2_cap_req"] == pytest.approx(
        core["proc_mem_tier2_cap_req"] + s["proc_mem_tier2_cap_req"])


def test_hand_count_with_the_activation_recomputed():
    """``recompute_moe_act``: fc2 keeps nothing of its input (the activation
    runs again in backward from its kept input), so the group is fc1's input
    and the activation's input."""
    plain = run(recompute_moe_act=True)
    s = run(recompute_moe_act=True, activation_offload_modules="fused_group_mlp")
    group = 2 * TOKENS * (H + 2 * F)
    assert s["proc_mem_tier2_cap_req"] == pytest.approx(MOVED * group, rel=1e-12)
    assert s["act_space"] == pytest.approx(plain["act_space"] - MOVED * group, rel=1e-12)


def test_values_and_rules():
    assert "fused_group_mlp" in CHOICES["activation_offload_modules"]
    assert "core_attn+attn_proj+fused_group_mlp" in CHOICES["activation_offload_modules"]
    # the twelve values before it keep their codes (files and tables unchanged)
    assert CHOICES["activation_offload_modules"][:3] == ("none", "core_attn",
                                                         "core_attn+attn_proj")
    assert not any("fused_group_mlp" in v and ("expert_fc1" in v or "moe_act" in v)
                   for v in CHOICES["activation_offload_modules"])
    assert offload_modules_value(["fused_group_mlp", "core_attn"]) == \
        "core_attn+fused_group_mlp"
    bad = offload_modules_value(["fused_group_mlp", "moe_act"])
    assert isinstance(bad, tuple) and "beside expert_fc1 or moe_act" in bad[1]
    with pytest.raises(SpecError) as e:
        load_execution(bf16_one_proc_execution(activation_offload_modules="fused_group_mlp"),
                       model=load_model(ROOT / "models" / "llama2-7B.json"), source="ex.json")
    assert e.value.field == "activation_offload_modules"
    assert "no routed experts" in e.value.message
    with pytest.raises(SpecError) as e:
        load_execution(bf16_one_proc_execution(
            activation_offload_modules=["expert_fc1", "fused_group_mlp"]), source="ex.json")
    assert e.value.field == "activation_offload_modules"


def test_a_dense_row_is_invalid():
    from autopar.io.layouts import to_columns
    dense = load_model(ROOT / "models" / "llama2-7B.json")
    cols = to_columns([load_execution(bf16_one_proc_execution(
        activation_offload_modules="fused_group_mlp"))])
    out = M.evaluate_columns(dense, _system(32), cols)
    assert "fused_group_mlp" in M.REASONS[int(out["reason_code"][0])]
    assert not out["feasible"][0]


def _qwen_layout(**kw):
    return bf16_one_proc_execution(**{
        "num_procs": 16, "data_par": 16, "data_par_net": 1, "batch_size": 64,
        "expert_par": 8, "attention_impl": "flash_v2", "fused_norm": True,
        "optimizer_sharding": True, "fp32_grads": True,
        "activation_offload_modules": "fused_group_mlp", **kw})


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_export_import_round_trip(fmt):
    """Megatron-LM: ``--offload-modules fused_group_mlp`` with
    ``--use-transformer-engine-op-fuser`` (TransformerConfig.__post_init__
    raises without it); Bridge: the same keys under ``model.``."""
    model = load_model(ROOT / "models" / "qwen3-30B-A3B.json")
    lf = get(fmt)
    ex = _qwen_layout()
    assert lf.refuse_layout(model, ex) is None
    text = lf.write(model, ex)
    if fmt == "megatron":
        assert "--offload-modules fused_group_mlp" in text
        assert "--use-transformer-engine-op-fuser \\" in text
    else:
        assert "model.use_transformer_engine_op_fuser=true" in text
        assert "fused_group_mlp" in text
    back = lf.read(text, f"test.{fmt}").execution
    assert back["activation_offload_modules"] == "fused_group_mlp"
    # without the op fuser Megatron-Core refuses it, and so does the reader
    if fmt == "megatron":
        bad = text.replace("    --use-transformer-engine-op-fuser \\\n", "")
    else:
        bad = text.replace("model.use_transformer_engine_op_fuser=true",
                           "model.use_transformer_engine_op_fuser=false")
    assert bad != text
    with pytest.raises(SpecError) as e:
        lf.read(bad, "t")
    assert e.value.field == ("--offload-modules" if fmt == "megatron"
                             else "model.offload_modules")
    assert "op_fuser" in e.value.message
    # other modules export no op-fuser flag
    plain = lf.write(model, _qwen_layout(activation_offload_modules="expert_fc1"))
    assert "op-fuser" not in plain and "op_fuser" not in plain


def test_a_table_agrees_with_single_rows():
    """90 rows (above the block cache's 64): expert parallelism, hybrid
    sharding with and without the outer strategy, the offloaded modules and
    the micro-batch varied; the shared-table path gives each row's memory
    and step time as evaluating it alone does."""
    import itertools

    import numpy as np

    from autopar.io.layouts import to_columns
    from test_fsdp_experts import fsdp_execution, tiny_moe as fsdp_moe
    model, system = fsdp_moe(), _system(32)
    rows = [load_execution(fsdp_execution(expert_par=ep, sharding_group=sg,
                                          optimizer_outer_sharding=outer,
                                          activation_offload_modules=mods,
                                          microbatch_size=mb), model=model)
            for ep, sg, outer, mods, mb in itertools.product(
                [1, 2, 4], [0, 2, 4], [False, True],
                ["none", "fused_group_mlp", "expert_fc1"], [1, 2]) if sg or not outer]
    assert len(rows) > 64
    out = M.evaluate_columns(model, system, to_columns(rows))
    for i, r in enumerate(rows):
        s = M.evaluate_one(model, system, r)
        for k in ("proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req", "total_time",
                  "optimizer_space", "weight_grad_space", "act_space"):
            assert np.isclose(out[k][i], s[k], rtol=1e-9, equal_nan=True), (i, k)
