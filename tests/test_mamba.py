"""Hybrid Mamba-2 / attention / MoE models (issue 28, item 3): the layer
pattern, hand counts of one small Mamba-2 layer, pipeline stages holding
different layer kinds, the Nemotron-H model files, rules, spaces and the
commands."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import bf16_one_proc_execution as execution

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, model_to_json
from autopar.model.params import parameter_counts

ROOT = Path(__file__).resolve().parent.parent

# One small Mamba-2 layer: h 64, 4 heads of 16 (d_inner 64), 2 groups of
# state 8, conv kernel 4, chunk 16, on sequences of 32.
MAMBA = {"heads": 4, "head_dim": 16, "state": 8, "groups": 2, "conv_kernel": 4, "chunk": 16}


def tiny(pattern="M*-M", **kw):
    shape = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
             "attn_size": 16, "num_blocks": len(pattern), "name": "tiny",
             "hybrid_override_pattern": pattern, "mamba": dict(MAMBA)}
    shape.update(kw)
    return load_model(shape)


def run(model, system, **kw):
    return M.evaluate_one(model, system, load_execution(execution(**kw)))


def reason(s):
    return M.REASONS[s["reason_code"]]


# ----------------------------------------------------------------------------
# The model file


def test_calculon_meaning_without_a_pattern():
    m = load_model(ROOT / "models" / "nemotron-8B.json")
    assert m.hybrid_pattern == "" and m.mamba is None
    assert "hybrid_override_pattern" not in model_to_json(m)


def test_pattern_round_trip_and_kinds():
    from autopar.model.mamba import hybrid_kinds, layer_kinds
    m = load_model(ROOT / "models" / "nemotron-h-8B.json")
    assert load_model(model_to_json(m)) == dataclasses.replace(m, source="dict")
    kinds = layer_kinds(m)
    assert len(kinds) == m.num_blocks == 52
    assert (kinds.count("mamba"), kinds.count("attention"), kinds.count("mlp")) == (24, 4, 24)
    assert hybrid_kinds(m) == ("mamba", "attention", "mlp")


@pytest.mark.parametrize("change, field", [
    ({"hybrid_override_pattern": "M*-X"}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M*|-M"}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M*-"}, "hybrid_override_pattern"),
    ({"mamba": None}, "mamba"),
    ({"hybrid_override_pattern": "ME-M"}, "moe"),
    ({"mamba": {"heads": 4, "head_dim": 16, "state": 8, "groups": 3}}, "mamba.groups"),
    ({"mamba": {"heads": 4, "head_dim": 16}}, "mamba.state"),
    ({"mamba": {"heads": 0, "head_dim": 16, "state": 8}}, "mamba.heads"),
    # (a hybrid model's mtp module without mtp_hybrid_override_pattern is one
    # attention and one MoE / MLP layer: the pattern needs both kinds)
    ({"mtp": 1, "hybrid_override_pattern": "MM-M"}, "mtp"),
    ({"mla": {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}},
     "hybrid_override_pattern"),
])
def test_spec_errors(change, field):
    shape = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
             "attn_size": 16, "num_blocks": 4, "hybrid_override_pattern": "M*-M",
             "mamba": dict(MAMBA)}
    shape.update(change)
    with pytest.raises(SpecError) as e:
        load_model(shape)
    assert e.value.field == field


def test_mamba_without_a_pattern_is_refused():
    with pytest.raises(SpecError) as e:
        load_model({"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
                    "attn_size": 16, "num_blocks": 4, "mamba": dict(MAMBA)})
    assert e.value.field == "mamba"


# ----------------------------------------------------------------------------
# Hand counts of one small Mamba-2 layer


def test_mamba_layer_parameters_by_hand(h100):
    """in_proj h (2 di + 2 G N + H) + conv (di + 2 G N)(K + 1) + dt_bias, A_log,
    D (H each) + the gated norm (di) + out_proj di h + the pre-norm (the
    'gpt' block's LayerNorm: 2 h)."""
    h, H, P, N, G, K = 64, 4, 16, 8, 2, 4
    di = H * P
    hand = h * (2 * di + 2 * G * N + H) + (di + 2 * G * N) * (K + 1) + 3 * H + di + di * h + 2 * h
    assert hand == 64 * 164 + 96 * 5 + 12 + 64 + 4096 + 128 == 15276
    counts = parameter_counts(tiny(), h100)
    assert counts["mamba_block"] == hand
    # and the whole model: two Mamba layers, one attention, one MLP layer
    assert counts["total"] == 2 * hand + counts["attention_block"] + counts["mlp_block"]
    assert counts["mlp_block"] == 2 * 64 * 128 + 2 * 64      # two matrices + LayerNorm


def test_ssd_flops_by_hand():
    """The chunked SSD scan of 32 tokens, chunk 16, 4 heads of 16, 2 groups of
    state 8: C B^T 2 T Q N G, the masked diagonal products 2 T Q P H and the
    mask T Q H, chunk states 2 T N P H, their passing 2 (T/Q) N P H, the
    output from the states 2 T N P H."""
    from autopar.model.mamba import ssd_flops
    T, Q, H, P, N, G = 32, 16, 4, 16, 8, 2
    f = ssd_flops(T, H, P, N, G, Q)
    cb, diag, mask = 2 * T * Q * N * G, 2 * T * Q * P * H, T * Q * H
    states, passing, out = 2 * T * N * P * H, 2 * (T // Q) * N * P * H, 2 * T * N * P * H
    assert f["fw"] == cb + diag + mask + states + passing + out == 16384 + 65536 + 2048 \
        + 32768 + 2048 + 32768
    assert f["bw"] == 2 * f["fw"]
    assert f["recompute"] == cb + states + passing


def test_mamba_layer_forward_flops_by_hand(h100):
    """Forward FLOPs of the Mamba layer (a model of Mamba layers only), by
    hand: LayerNorm 9 A, in_proj 2 T h W, conv (2K + 1 + 4) T C, the scan,
    the gate 7 T di + 6 T H, the gated RMSNorm 4 T di, out_proj 2 T di h,
    dropout A and residual A."""
    from autopar.model.mamba import ssd_flops
    m = tiny("MM")
    s = run(m, h100)
    assert s["feasible"], reason(s)
    T, h, H, P, N, G, K, Q = 32, 64, 4, 16, 8, 2, 4, 16
    di, C, W = H * P, H * P + 2 * G * N, 2 * H * P + 2 * G * N + H
    A = T * h
    hand = (9 * A + 2 * T * h * W + (2 * K + 1 + 4) * T * C
            + ssd_flops(T, H, P, N, G, Q)["fw"] + 7 * T * di + 6 * T * H + 4 * T * di
            + 2 * T * di * h + A + A)
    assert s["block_fw_flops"] == pytest.approx(hand, rel=1e-12)


def test_tensor_parallel_splits_heads_and_groups(h100):
    """tensor_par 2: the projections', the convolution's and the scan's FLOPs
    per processor halve; the layer gains an all-reduce of its output
    (forward: its reduction adds A (t - 1) / t) and of its input gradient
    (backward)."""
    m = tiny("MM")
    one = run(m, h100)
    two = run(m, h100, num_procs=2, tensor_par=2)
    assert two["feasible"], reason(two)
    A = 32 * 64
    norms = 9 * A + 2 * A                      # LayerNorm, dropout, residual: not split
    assert two["block_fw_flops"] - norms - A / 2 == pytest.approx(
        (one["block_fw_flops"] - norms) / 2, rel=1e-12)
    assert one["baseblock_fw_tp_time"] == 0 and two["baseblock_fw_tp_time"] > 0
    # heads 4 and groups 2 split 2 ways, not 4
    four = run(m, h100, num_procs=4, tensor_par=4)
    assert reason(four) == "invalid: mamba heads and groups must be divisible by tensor_par"


def test_activations_kept_by_hand(h100):
    """What the Mamba layer keeps for backward grows with its width as the
    fused function, the norm and out_proj keep it: zxbcdt (T W), out_x, the
    gated norm's input and out_proj's input (T d_inner each)."""
    plain = run(tiny("MM"), h100)
    bigger = run(tiny("MM", mamba=dict(MAMBA, heads=8)), h100)
    # doubling the heads (d_inner 64 -> 128, W = 2 di + 2 G N + H 164 -> 296)
    # adds to the kept zxbcdt 132 T and to out_x, the gated norm's input and
    # out_proj's input 64 T each, in bytes of bf16
    T = 32
    assert (bigger["block_act_storage_space"] - plain["block_act_storage_space"]) == \
        2 * T * (132 + 3 * 64)


# ----------------------------------------------------------------------------
# Stages holding different layer kinds


def test_stage_counts_by_pattern():
    from autopar.model.moe import stage_counts
    m = tiny("MM*-M--*")
    c = stage_counts(m, np.array([1, 2, 4]))
    assert c["first_mamba"].tolist() == [3, 2, 2]
    assert c["first_attention"].tolist() == [2, 1, 0]
    assert c["last_mlp"].tolist() == [3, 2, 1]
    assert c["last_attention"].tolist() == [2, 1, 1]
    # uneven: 3 layers on the first stage, 5 on the last
    cols = {"first_stage_blocks": np.array([3]), "last_stage_blocks": np.array([0]),
            "pipeline_interleaving": np.array([1]), "embedding_in_split": np.array([False]),
            "loss_in_split": np.array([False]), "pipeline_layout": np.array([0]),
            "pipeline_par": np.array([2])}
    c = stage_counts(m, np.array([2]), cols)
    assert (c["first_mamba"][0], c["first_attention"][0], c["first_mlp"][0]) == (2, 1, 0)
    assert (c["last_mamba"][0], c["last_attention"][0], c["last_mlp"][0]) == (1, 1, 3)
    assert c["first_blocks"][0] == 3 and c["last_blocks"][0] == 5


def test_pace_is_the_stage_with_the_most_work():
    """Two stages of 'M-' and '**' on long sequences: the attention stage
    does more (its scores grow with the sequence) and paces the pipeline."""
    from autopar.model.mamba import pace_weights
    from autopar.model.moe import stage_counts
    m = tiny("M-**", seq_size=8192)
    w = pace_weights(m)
    assert 2 * w["attention"] > w["mamba"] + w["mlp"]
    c = stage_counts(m, np.array([2]), pace_weights=w)
    assert c["pace_attention"].tolist() == [2] and c["pace_mamba"].tolist() == [0]


def test_memory_per_stage_by_the_layers_it_holds(h100):
    """The stage of Mamba layers and the stage of MLP layers need different
    memory: the model's need is the larger stage's, and moving the layers
    between the stages changes it."""
    a = run(tiny("MMM---"), h100, num_procs=2, pipeline_par=2, batch_size=2)
    b = run(tiny("M-M-M-"), h100, num_procs=2, pipeline_par=2, batch_size=2)
    assert a["feasible"] and b["feasible"]
    # same layers, same total work, different stages
    assert a["proc_mem_tier1_cap_req"] != b["proc_mem_tier1_cap_req"]
    # the balanced split's stages are alike: its per-block footprint lies
    # between the uneven split's two stages
    m_only = run(tiny("MM"), h100)
    l_only = run(tiny("--", mamba=None, hybrid_override_pattern="--"), h100)
    lo, hi = sorted([m_only["block_weight_space"], l_only["block_weight_space"]])
    assert lo <= b["block_weight_space"] <= hi


def test_hybrid_rules(h100):
    m = tiny("M*-M")
    # virtual stages: one '|' segment each (select_pipeline_segment)
    s = run(m, h100, num_procs=2, pipeline_par=2, pipeline_interleaving=2, batch_size=2)
    assert s["feasible"], reason(s)
    s = run(tiny("M*-M*-M"), h100, num_procs=2, pipeline_par=2, pipeline_interleaving=2,
            batch_size=2)
    assert reason(s).startswith("infeasible: a hybrid model's blocks must divide")
    s = run(m, h100, num_procs=2, data_par=1, context_par=2)
    assert reason(s).startswith("invalid: a hybrid model's Mamba")
    # the loss counted in the split: the last segment one block fewer
    s = run(tiny("M*-"), h100, num_procs=2, pipeline_par=2, batch_size=2, loss_in_split=True)
    assert s["feasible"], reason(s)
    s = run(m, h100, num_procs=2, pipeline_par=2, batch_size=2, first_stage_blocks=1)
    assert s["feasible"], reason(s)


# ----------------------------------------------------------------------------
# Published model files


@pytest.mark.parametrize("name, total", [
    # Parameter counts of the published checkpoints (Hugging Face), less
    # the RMSNorm weights the 'gpt' block counts twice (LayerNorm's bias:
    # one hidden per layer, less the final norm the model leaves out)
    ("nemotron-h-8B", 8_100_852_736),
])
def test_published_sizes(h100, name, total):
    m = load_model(ROOT / "models" / f"{name}.json")
    counts = parameter_counts(m, h100)
    assert counts["total"] - m.num_blocks * m.hidden + m.hidden == total


def test_nemotron_h_56B_layers():
    """'54 Mamba-2, 54 MLP, and 10 Self-Attention layers' (NVIDIA's
    Nemotron-H page, research.nvidia.com/labs/adlr/nemotronh)."""
    from autopar.model.mamba import layer_kinds
    kinds = layer_kinds(load_model(ROOT / "models" / "nemotron-h-56B.json"))
    assert (kinds.count("mamba"), kinds.count("mlp"), kinds.count("attention")) == (54, 54, 10)


@pytest.mark.parametrize("name", ["nemotron-h-8B", "nemotron-h-47B", "nemotron-h-56B"])
def test_model_files_load(name, h100):
    m = load_model(ROOT / "models" / f"{name}.json")
    assert len(m.hybrid_pattern) == m.num_blocks
    total = parameter_counts(m, h100)["total"]
    billions = float(name.split("-")[-1].rstrip("B"))
    assert abs(total / 1e9 - billions) / billions < 0.06


def test_hybrid_moe_model_nemotron3_nano(h100, roomy):
    """Nemotron-3 Nano: 23 Mamba-2, 23 MoE and 6 attention layers, '3.5B
    active parameters and 30B parameters in total' (Megatron-Bridge's model
    page, docs/models/nemotron/nemotron3-nano.md); it runs with expert
    parallelism, and the MoE layers' weights are the experts'."""
    from autopar.model.mamba import layer_kinds
    m = load_model(ROOT / "models" / "nemotron3-nano-30B-A3B.json")
    kinds = layer_kinds(m)
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    c = parameter_counts(m, h100)
    assert abs(c["active"] / 3.5e9 - 1) < 0.03
    assert 30e9 <= c["total"] <= 32e9
    s = run(m, roomy, num_procs=8, data_par=8, expert_par=8, batch_size=8,
            optimizer_sharding=True)
    assert s["feasible"], reason(s)
    assert s["ep_comm_link_time"] > 0
    no_ep = run(m, roomy, num_procs=8, data_par=8, batch_size=8, optimizer_sharding=True)
    assert no_ep["weight_space"] > s["weight_space"]


# ----------------------------------------------------------------------------
# Search and the commands


def test_space_keeps_hybrid_layouts_valid(h100):
    from autopar.search.space import Case, load_space
    m = load_model(ROOT / "models" / "nemotron-h-8B.json")
    sp = load_space(ROOT / "search_spaces" / "modern.yaml")
    case = Case(m, h100, 32, 128, "bfloat16")
    parts = list(sp.enumerate(case))
    cols = {k: np.concatenate([c[k] for c in parts]) for k in parts[0]}
    # virtual stages (one '|' segment each), of equal blocks where no split
    # field is set; the embedding / loss counted in the split too
    v, pp = cols["pipeline_interleaving"], cols["pipeline_par"]
    even = ~(cols["loss_in_split"] | cols["embedding_in_split"]
             | (cols["pipeline_layout"] != 0))
    assert (v > 1).any() and cols["loss_in_split"].any()
    unequal = even & (v > 1) & (m.num_blocks % (pp * v) != 0)
    assert set(cols["tensor_par"].tolist()) <= {1, 2, 4, 8}
    out = M.evaluate_columns(m, h100, cols, stats=("total_time",))
    bad = {M.REASONS[c] for c in np.unique(out["reason_code"])
           if M.REASONS[c].startswith("invalid:")}
    assert not bad, bad
    assert out["feasible"].any()
    assert not out["feasible"][unequal].any()
    assert out["feasible"][(v > 1) & even].any()


def test_estimate_exhaustive_tune_round_trip(tmp_path):
    from autopar.cli import main
    model = str(ROOT / "models" / "nemotron-h-8B.json")
    system = str(ROOT / "systems" / "h100_80g_nvl8.json")
    ex = tmp_path / "ex.json"
    ex.write_text(json.dumps(execution(num_procs=16, tensor_par=2, pipeline_par=2, data_par=4,
                                       pipeline_par_net=1, data_par_net=1, batch_size=64,
                                       optimizer_sharding=True, tensor_par_comm_type="rs_ag")))
    assert main(["estimate", model, system, str(ex)]) == 0
    out = tmp_path / "ex.csv"
    assert main(["exhaustive", model, system, "--num-procs", "16", "--max-batch-size", "64",
                 "--datatype", "bfloat16", "--space", str(ROOT / "search_spaces" / "small.yaml"),
                 "--output", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 0
    best = tmp_path / "best.json"
    assert main(["tune", model, system, "--num-procs", "16", "--max-batch-size", "64",
                 "--datatype", "bfloat16", "--space", str(ROOT / "search_spaces" / "small.yaml"),
                 "--trials", "20", "--sampler", "random", "--seed", "1",
                 "--output", str(best)]) == 0
    assert json.loads(best.read_text())


def test_calculon_format_refuses_a_hybrid_model():
    from autopar.io.export import check_calculon_run
    m = tiny()
    with pytest.raises(SpecError) as e:
        check_calculon_run("calculon", m)
    assert "hybrid_override_pattern=M*-M" in str(e.value)
    check_calculon_run("autopar", m)
