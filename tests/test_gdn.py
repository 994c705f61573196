"""Gated DeltaNet layers of hybrid models (Qwen3-Next, Qwen3.5): hand counts
of one small layer (parameters, forward FLOPs, what it keeps for backward),
gated attention, tensor parallelism, bad values, and the Qwen3-Next file."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import bf16_one_proc_execution as execution

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, model_to_json
from autopar.model.gated_delta import delta_rule_flops
from autopar.model.params import parameter_counts

ROOT = Path(__file__).resolve().parent.parent

# One small layer: h 64, 2 key heads of 16, 4 value heads of 8, conv 4,
# chunk 16, on sequences of 32.
GDN = {"key_heads": 2, "value_heads": 4, "key_head_dim": 16, "value_head_dim": 8,
       "conv_kernel": 4, "chunk": 16}


def tiny(pattern="G*-G", **kw):
    shape = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
             "attn_size": 16, "num_blocks": len(pattern), "name": "tiny",
             "hybrid_override_pattern": pattern, "gdn": dict(GDN)}
    shape.update(kw)
    return load_model(shape)


def run(model, system, **kw):
    return M.evaluate_one(model, system, load_execution(execution(**kw)))


def test_round_trip_and_default():
    m = tiny(attention_output_gate=True)
    assert load_model(model_to_json(m)) == dataclasses.replace(m, source="dict")
    plain = load_model(ROOT / "models" / "qwen3-30B-A3B.json")
    assert plain.gdn is None and not plain.attention_output_gate
    assert "gdn" not in model_to_json(plain)


@pytest.mark.parametrize("change, field", [
    ({"gdn": None}, "gdn"),
    ({"gdn": dict(GDN, value_heads=3)}, "gdn.value_heads"),
    ({"gdn": dict(GDN, key_head_dim=0)}, "gdn.key_head_dim"),
    ({"gdn": dict(GDN, chunk="big")}, "gdn.chunk"),
    ({"gdn": dict(GDN, state=8)}, "gdn.state"),
    ({"hybrid_override_pattern": "M*-M", "mamba": {"heads": 4, "head_dim": 16, "state": 8}},
     "gdn"),
    ({"attention_output_gate": "yes"}, "attention_output_gate"),
])
def test_spec_errors(change, field):
    with pytest.raises(SpecError) as e:
        tiny(**change)
    assert e.value.field == field


def test_gate_needs_a_pattern():
    with pytest.raises(SpecError) as e:
        load_model({"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
                    "attn_size": 16, "num_blocks": 2, "attention_output_gate": True})
    assert e.value.field == "attention_output_gate"


def test_layer_parameters_by_hand(h100):
    """in_proj h (2 Hk dk + 2 Hv dv + 2 Hv) + conv1d (2 Hk dk + Hv dv) K (no
    bias) + dt_bias, A_log (Hv each) + out norm dv + out_proj Hv dv h + the
    pre-norm ('gpt' LayerNorm: 2 h)."""
    h, Hk, dk, Hv, dv, K = 64, 2, 16, 4, 8, 4
    hand = (h * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv) + (2 * Hk * dk + Hv * dv) * K
            + 2 * Hv + dv + Hv * dv * h + 2 * h)
    assert hand == 8704 + 384 + 8 + 8 + 2048 + 128 == 11280
    c = parameter_counts(tiny(), h100)
    assert c["gdn_block"] == hand
    assert c["total"] == 2 * hand + c["attention_block"] + c["mlp_block"]


def test_output_gate_parameters(h100):
    """Gated attention adds the gate's columns of linear_qkv: h x H d."""
    plain = parameter_counts(tiny(), h100)["attention_block"]
    gated = parameter_counts(tiny(attention_output_gate=True), h100)["attention_block"]
    assert gated - plain == 64 * 4 * 16


def test_delta_rule_flops_by_hand():
    """32 tokens, chunk 16, 4 value heads, dk 16, dv 8: k k^T 2 T C dk, the
    inverse 2 T C^2 / 3, w and u 2 T C (dk + dv), the states 4 T dk dv, the
    output 2 T (dk dv + C dk + C dv), per head."""
    T, C, H, dk, dv = 32, 16, 4, 16, 8
    f = delta_rule_flops(T, H, dk, dv, C)
    hand = H * (2 * T * C * dk + 2 * T * C * C / 3 + 2 * T * C * (dk + dv) + 4 * T * dk * dv
                + 2 * T * (dk * dv + C * dk + C * dv))
    assert f["fw"] == pytest.approx(hand, rel=1e-12)
    assert f["bw"] == 2 * f["fw"]
    assert f["recompute"] == H * (2 * T * C * (dk + dv) + 4 * T * dk * dv)


def test_layer_forward_flops_by_hand(h100):
    """LayerNorm 9 A, in_proj 2 T h W, conv (2K + 4) T ch, L2 norm 3 per q/k
    element and the gates 10 per value head, the delta rule, the out RMSNorm
    4 T Hv dv, the SiLU gate 5 T Hv dv, out_proj 2 T Hv dv h, dropout and
    residual A each."""
    s = run(tiny("GG"), h100)
    assert s["feasible"], M.REASONS[s["reason_code"]]
    T, h, Hk, dk, Hv, dv, K, C = 32, 64, 2, 16, 4, 8, 4, 16
    A, W, ch, vd = T * h, 2 * Hk * dk + 2 * Hv * dv + 2 * Hv, 2 * Hk * dk + Hv * dv, Hv * dv
    hand = (9 * A + 2 * T * h * W + (2 * K + 4) * T * ch + T * (3 * 2 * Hk * dk + 10 * Hv)
            + delta_rule_flops(T, Hv, dk, dv, C)["fw"] + 4 * T * vd + 5 * T * vd
            + 2 * T * vd * h + A + A)
    assert s["block_fw_flops"] == pytest.approx(hand, rel=1e-12)


def test_saved_for_backward_by_hand(h100):
    """Doubling the value heads (4 -> 8) adds per token: the conv input 32,
    the gates' inputs 2 x 4, the kernel's q and k repeated 2 x 64, v 32, g
    (fp32) and beta 3 x 4, the inverse 4 x 16; the norm's input 32, the
    gate and the normed output 2 x 32, out_proj's input 32 -- bf16 bytes."""
    one = run(tiny("GG"), h100)
    two = run(tiny("GG", gdn=dict(GDN, value_heads=8)), h100)
    per_token = 32 + 8 + (128 + 32 + 12 + 64) + 32 + 64 + 32
    assert per_token == 404
    assert two["block_act_storage_space"] - one["block_act_storage_space"] == 2 * 32 * per_token


def test_tensor_parallel_splits_heads(h100):
    m = tiny("GG")
    one = run(m, h100)
    two = run(m, h100, num_procs=2, tensor_par=2)
    assert two["feasible"], M.REASONS[two["reason_code"]]
    A = 32 * 64
    norms = 9 * A + 2 * A
    # all but the LayerNorm, dropout, residual and the out norm's... halve;
    # the all-reduce adds A / 2
    assert two["block_fw_flops"] - norms - A / 2 == pytest.approx(
        (one["block_fw_flops"] - norms) / 2, rel=1e-12)
    four = run(m, h100, num_procs=4, tensor_par=4)
    assert M.REASONS[four["reason_code"]] == \
        "invalid: gdn key and value heads must be divisible by tensor_par"


def test_context_parallel_refused(h100):
    s = run(tiny("GG"), h100, num_procs=2, context_par=2)
    assert not s["feasible"]
    assert "context_par" in M.REASONS[s["reason_code"]]


def test_qwen3_next_counts(h100):
    """Qwen3-Next-80B-A3B: 36 Gated DeltaNet and 12 gated attention layers,
    each followed by an MoE layer.  The checkpoint's 79,674,391,296 (and
    3,874,929,408 active) less what autopar does not count: q/k RMSNorm
    (12 x 2 x 256), the shared expert's gate (48 x 2048) and the final norm
    (2048) = 106,496 -- never more than the checkpoint."""
    m = load_model(ROOT / "models" / "qwen3-next-80B-A3B.json")
    assert m.hybrid_pattern.count("G") == 36 and m.hybrid_pattern.count("*") == 12
    c = parameter_counts(m, h100)
    missing = 12 * 2 * 256 + 48 * 2048 + 2048
    assert missing == 106_496
    assert c["total"] == 79_674_391_296 - missing
    assert c["active"] == 3_874_929_408 - missing


def test_hybrid_mtp_module_is_attention_and_moe(h100):
    """A hybrid model's mtp module is one transformer layer (attention and
    MoE blocks) plus the 2h -> h projection: parameters, and the step's
    weights and time grow by it."""
    moe = {"experts": 4, "top_k": 2, "expert_feedforward": 32}
    base = tiny("GE*E", moe=moe)
    one = tiny("GE*E", moe=moe, mtp=1)
    c0, c1 = parameter_counts(base, h100), parameter_counts(one, h100)
    assert c1["total"] - c0["total"] == c0["attention_block"] + c0["moe_block"] + 2 * 64 ** 2
    s0, s1 = run(base, h100), run(one, h100)
    assert s0["feasible"] and s1["feasible"], M.REASONS[s1["reason_code"]]
    assert s1["weight_space"] > s0["weight_space"]
    assert s1["total_time"] > s0["total_time"]


@pytest.mark.parametrize("fmt", ["megatron", "bridge", "torchtitan"])
def test_export_refuses_the_layer_kind_naming_the_field(fmt):
    from autopar.io import launch
    m = load_model(ROOT / "models" / "qwen3-next-80B-A3B.json")
    why = launch.get(fmt).refuse_model(m)
    assert why and why.startswith(fmt)
    assert ("gdn" in why) if fmt != "torchtitan" else ("hybrid_override_pattern" in why)


QWEN3_NEXT_HF = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
    "max_position_embeddings": 262144, "vocab_size": 151936, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "tie_word_embeddings": False}


def test_hf_import_is_the_shipped_file():
    import json
    from autopar.io import launch
    got = launch.get("hf").read(json.dumps(QWEN3_NEXT_HF), "config.json")
    m = load_model(dict(got.model, seq_size=4096, name="qwen3-next-80B-A3B"))
    shipped = load_model(ROOT / "models" / "qwen3-next-80B-A3B.json")
    assert dataclasses.replace(m, source="", description="") == \
        dataclasses.replace(shipped, source="", description="")
    assert any("multi-token" in n for n in got.notes)


@pytest.mark.parametrize("change, field", [
    ({"linear_num_value_heads": None}, "linear_num_value_heads"),
    ({"linear_key_head_dim": "128"}, "linear_key_head_dim"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
])
def test_hf_import_bad_values(change, field):
    import json
    from autopar.io import launch
    cfg = {k: v for k, v in QWEN3_NEXT_HF.items() if change.get(k, 0) is not None}
    cfg.update({k: v for k, v in change.items() if v is not None})
    with pytest.raises(SpecError) as e:
        launch.get("hf").read(json.dumps(cfg), "config.json")
    assert e.value.field == field


def test_space_keeps_gdn_layouts_valid(h100):
    """The search space offers only tensor_par values that divide both GDN
    head counts (key heads 2, value heads 4: 1 or 2), and every layout it
    builds passes the rules."""
    import numpy as np
    from autopar.search.space import Case, load_space
    moe = {"experts": 8, "top_k": 2, "expert_feedforward": 32}
    m = tiny("GE*E" * 2, moe=moe)
    sp = load_space(ROOT / "search_spaces" / "modern.yaml")
    parts = list(sp.enumerate(Case(m, h100, 8, 16, "bfloat16")))
    cols = {k: np.concatenate([c[k] for c in parts]) for k in parts[0]}
    assert set(cols["tensor_par"].tolist()) <= {1, 2}
    out = M.evaluate_columns(m, h100, cols, stats=("total_time",))
    bad = {M.REASONS[c] for c in np.unique(out["reason_code"])
           if M.REASONS[c].startswith("invalid:")}
    assert not bad, bad
    assert out["feasible"].any()
