"""DeepSeek Sparse Attention (``mla.sparse_index``; autopar.model.sparse_attention):
hand counts of the lightning indexer's and the sparse kernel's FLOPs and of
the indexer's parameters on one small MLA block, the default (absent) as
today's dense MLA, bad values, all-gather context parallelism, and the
GLM-5 file against its published size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bf16_one_proc_execution as execution

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, model_to_json
from autopar.model.params import parameter_counts
from autopar.model.sparse_attention import sparse_keys

ROOT = Path(__file__).resolve().parent.parent

# One small MLA block: h 64, 4 heads, q rank 16, kv rank 8, 8 + 4 rope, values
# 8; the indexer 2 heads of 8 choosing 8 keys; sequences of 32.
MLA = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}
INDEX = {"n_heads": 2, "head_dim": 8, "topk": 8}


def tiny(index=INDEX, **kw):
    mla = dict(MLA)
    if index is not None:
        mla["sparse_index"] = dict(index)
    shape = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
             "attn_size": 8, "num_blocks": 2, "block": "llama", "name": "tiny", "mla": mla}
    shape.update(kw)
    return load_model(shape)


def run(model, system, **kw):
    ex = {"attention_impl": "flash_v2", "fused_norm": True, **kw}
    return M.evaluate_one(model, system, load_execution(execution(**ex)))


def test_round_trip_and_default():
    m = tiny()
    assert m.mla.sparse_index.topk == 8 and m.mla.sparse_index.loss
    assert load_model(model_to_json(m)) == m
    assert "sparse_index" not in model_to_json(tiny(None))["mla"]
    off = tiny(dict(INDEX, loss=False))
    assert model_to_json(off)["mla"]["sparse_index"]["loss"] is False


@pytest.mark.parametrize("change,field", [
    ({"topk": 0}, "mla.sparse_index.topk"),
    ({"n_heads": "2"}, "mla.sparse_index.n_heads"),
    ({"head_dim": 2}, "mla.sparse_index.head_dim"),       # < qk_rope_head_dim 4
    ({"width": 3}, "mla.sparse_index.width"),
    ({"loss": "yes"}, "mla.sparse_index.loss"),
])
def test_spec_errors(change, field):
    with pytest.raises(SpecError) as e:
        tiny(dict(INDEX, **change))
    assert e.value.field == field


def test_sparse_keys_by_hand():
    """Query p attends to min(p + 1, topk) keys: with 8 of 32, (1 + ... + 8 +
    24 x 8) / 32; a topk beyond the sequence is the dense causal mean."""
    assert sparse_keys(8, 32) == pytest.approx((36 + 24 * 8) / 32)
    assert sparse_keys(64, 32) == pytest.approx(33 / 2)


def test_indexer_parameters_by_hand(h100):
    """Per block: wq_b q_rank x n_heads x head_dim, wk h x head_dim, k_norm
    (LayerNorm) 2 x head_dim, weights_proj h x n_heads."""
    dense = parameter_counts(tiny(None), h100)["total"]
    sparse = parameter_counts(tiny(), h100)["total"]
    per_block = 16 * 2 * 8 + 64 * 8 + 2 * 8 + 64 * 2
    assert sparse - dense == 2 * per_block


def test_forward_flops_by_hand(h100):
    """The sparse block's forward against the dense one's, per block: plus
    the indexer (its three projections, the LayerNorm 9 per element, the
    rotary embedding 3 per rotated element, the scores 2 n_heads head_dim per
    query-key pair and relu / weight / head sum 3 n_heads + top-k 1 per pair,
    half the pairs executed) and the loss's target scores (2 x 4 heads x the
    chosen keys x (kv rank + rope)); the dense kernel's 2 x heads x s x s x
    (dqk + dv) replaced by the sparse one's over the chosen keys, on the
    absorbed widths (kv rank + rope for keys, kv rank for values)."""
    T, s, h, H = 32, 32, 64, 4
    nh, dh, topk, qr, kvr, rope, dqk, dv = 2, 8, 8, 16, 8, 4, 12, 8
    keys = (36 + 24 * 8) / 32
    indexer = (2 * T * qr * nh * dh + 2 * T * h * dh + 9 * T * dh + 2 * T * h * nh
               + 3 * T * (nh + 1) * rope + 2 * T * s * nh * dh + T * s * (3 * nh + 1) * 0.5)
    target = 2 * H * T * keys * (kvr + rope)
    dense_core = 2 * H * T * s * (dqk + dv)
    sparse_core = 2 * H * T * keys * ((kvr + rope) + kvr)
    d, sp = run(tiny(None), h100), run(tiny(), h100)
    assert d["feasible"] and sp["feasible"], M.REASONS[sp["reason_code"]]
    got = sp["block_fw_flops"] - d["block_fw_flops"]
    assert got == pytest.approx(indexer + target + sparse_core - dense_core, rel=1e-12)


def test_untrained_indexer_has_no_backward(h100):
    """Without the loss the indexer runs without gradients: no weight
    gradient, no backward of the scores, no target scores, nothing saved."""
    on, off = run(tiny(), h100), run(tiny(dict(INDEX, loss=False)), h100)
    assert off["block_fw_flops"] < on["block_fw_flops"]
    assert off["block_agrad_flops"] < on["block_agrad_flops"]
    assert off["block_wgrad_flops"] < on["block_wgrad_flops"]
    assert off["block_act_storage_space"] < on["block_act_storage_space"]


def test_allgather_context_parallelism_only_with_dsa(h100):
    """context_par_comm allgather is modelled for DSA only; with it the
    exchange is not hidden behind the attention (a ring's would be)."""
    kw = dict(num_procs=2, context_par=2, data_par=1, batch_size=1)
    bad = run(tiny(None), h100, context_par_comm="allgather", **kw)
    assert not bad["feasible"]
    assert "allgather" in M.REASONS[bad["reason_code"]]
    ag = run(tiny(), h100, context_par_comm="allgather", **kw)
    ring = run(tiny(), h100, context_par_comm="p2p", **kw)
    assert ag["feasible"] and ring["feasible"]
    # (the gather is exposed whole; the ring's transfers hide behind the
    # attention in part.  Compared with each one's own link time: on this
    # tiny model the ring's backward, two transfers under CP 2 as TE posts
    # them, each with its latency, exposes more in seconds than the gather,
    # docs/validation.md "The context-parallel ring, step by step, counted")
    assert ag["cp_comm_exposed_time"] == pytest.approx(ag["cp_comm_link_time"], rel=1e-12)
    assert ring["cp_comm_exposed_time"] < ring["cp_comm_link_time"]


def test_glm5_file_against_its_published_size(h100):
    """models/glm-5.json: 744B published (GLM-5 report; the count without
    the MTP module) -- autopar's count without MTP within 3%, with it the
    754B of the checkpoint's weights."""
    m = load_model(ROOT / "models" / "glm-5.json")
    a = m.mla.sparse_index
    assert (a.n_heads, a.head_dim, a.topk) == (32, 128, 2048)
    data = json.loads((ROOT / "models" / "glm-5.json").read_text())
    data["mtp"] = 0
    total = parameter_counts(load_model(data), h100)["total"]
    assert abs(total / 744e9 - 1) < 0.03, total


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_launch_writers_state_dsa_and_read_it_back(fmt):
    """Megatron-LM arguments / Bridge overrides carry the indexer
    (experimental_attention_variant dsa, dsa_indexer_*), the sparse loss and
    the fused kernels autopar counts; reading them back gives the model's
    sparse_index."""
    from conftest import launch_round_trip
    m = load_model(ROOT / "models" / "glm-5.json")
    ex = execution(attention_impl="flash_v2", fused_norm=True, fp32_grads=True)
    text, back = launch_round_trip(fmt, m, ex)
    for key in ("experimental", "dsa_indexer_n_heads", "dsa_indexer_topk", "dsa_kernel_backend"):
        assert key.replace("_", "-") in text or key in text, key
    assert back.model["mla"]["sparse_index"] == {"n_heads": 32, "head_dim": 128, "topk": 2048,
                                                 "loss": True}
    untrained = load_model(dict(model_to_json(m), mla=dict(
        model_to_json(m)["mla"], sparse_index={"n_heads": 32, "head_dim": 128, "topk": 2048,
                                               "loss": False})))
    _, back = launch_round_trip(fmt, untrained, ex)
    assert back.model["mla"]["sparse_index"]["loss"] is False


def test_torchtitan_refuses_dsa():
    from autopar.io.launch import get
    why = get("torchtitan").refuse_model(load_model(ROOT / "models" / "glm-5.json"))
    assert why and "sparse_index" in why
    assert get("torchtitan").refuse_model(load_model(ROOT / "models" / "deepseek-v3.json")) is None


# GLM-5's config.json keys (GlmMoeDsaConfig; the values the GLM-5 report and
# Megatron-Bridge's glm5 bridge test state), as `autopar import --format hf` reads them.
GLM5_CONFIG = {
    "model_type": "glm_moe_dsa", "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512,
    "q_lora_rank": 2048, "qk_rope_head_dim": 192, "qk_nope_head_dim": 192, "qk_head_dim": 256,
    "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 202752, "vocab_size": 154880,
    "scoring_func": "sigmoid", "num_nextn_predict_layers": 1}


def _import(cfg):
    from autopar.io.launch import get
    return get("hf").read(json.dumps(cfg), "config.json")


def test_hf_import_is_the_shipped_file():
    """glm_moe_dsa's config (its rope width recovered from qk_head_dim, as
    GLM-5.2's normalised qk_rope_head_dim needs) gives models/glm-5.json's
    shape; deepseek_v32 is DeepSeek-V3's import plus the indexer."""
    got = load_model(dict(_import(GLM5_CONFIG).model, seq_size=131072))
    want = load_model(ROOT / "models" / "glm-5.json")
    assert model_to_json(got) == {k: v for k, v in model_to_json(want).items()
                                  if k not in ("description", "name")}
    v32 = dict(GLM5_CONFIG, model_type="deepseek_v32", qk_rope_head_dim=64)
    del v32["qk_head_dim"]
    assert _import(v32).model["mla"]["sparse_index"] == {"n_heads": 32, "head_dim": 128,
                                                         "topk": 2048}


@pytest.mark.parametrize("change,field", [
    ({"index_topk_freq": 4}, "index_topk_freq"),
    ({"index_topk": 0}, "index_topk"),
    ({"qk_head_dim": 100}, "qk_head_dim"),
])
def test_hf_import_bad_values(change, field):
    with pytest.raises(SpecError) as e:
        _import(dict(GLM5_CONFIG, **change))
    assert e.value.field == field


def test_deepseek_v32_file_against_its_published_size(h100):
    """models/deepseek-v3.2.json: 685B published (deepseek-ai/DeepSeek-V3.2-Exp,
    with the MTP module), within 3%; the indexer adds to DeepSeek-V3's count
    exactly 61 + 1 (MTP) blocks of its weights."""
    m = load_model(ROOT / "models" / "deepseek-v3.2.json")
    total = parameter_counts(m, h100)["total"]
    assert abs(total / 685e9 - 1) < 0.03, total
    v3 = parameter_counts(load_model(ROOT / "models" / "deepseek-v3.json"), h100)["total"]
    per_block = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert total - v3 == 62 * per_block


def test_estimate_names_the_sparse_attention(tmp_path):
    """`autopar estimate` prints the indexer in the MoE model's line (the
    line that names MLA)."""
    import subprocess
    import sys
    ex = tmp_path / "ex.json"
    ex.write_text(json.dumps(execution(attention_impl="flash_v2", fused_norm=True)))
    model = tmp_path / "m.json"
    moe = {"experts": 4, "top_k": 2, "expert_feedforward": 32}
    model.write_text(json.dumps(model_to_json(tiny(moe=moe))))
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "estimate", str(model),
                          str(ROOT / "systems" / "h100_80g_nvl8.json"), str(ex)],
                         capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "MLA with sparse attention (indexer 2 x 8, top 8)" in out.stdout
