"""MTP on a hybrid Mamba model (Nemotron 3 Super / Ultra / 3.5 Lightning):
the module's own layers (``mtp_hybrid_override_pattern``), one module run at
every depth (``mtp_use_repeated_layer``: weights once, compute per pass),
hand counts on a tiny model; bad values refused by field."""
from __future__ import annotations

import pytest

from conftest import bf16_one_proc_execution as execution
from conftest import launch_round_trip

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, model_to_json
from autopar.model.params import parameter_counts

BASE = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4, "attn_size": 16,
        "num_blocks": 3, "name": "hy", "vocab_size": 256, "hybrid_override_pattern": "M*E",
        "mamba": {"heads": 2, "head_dim": 64, "state": 16},
        "moe": {"experts": 4, "top_k": 2, "expert_feedforward": 32, "shared_experts": 1}}
MTP = {"mtp": 2, "mtp_hybrid_override_pattern": "*E"}


def run(model, system, **kw):
    return M.evaluate_one(model, system, load_execution(execution(**kw)))


def test_hybrid_mtp_parameters_hand_count(h100):
    """Two MTP depths of '*E': each holds an attention and an MoE layer and
    the 2h x h projection of [hidden; embedding]; repeated, one of each."""
    a = parameter_counts(load_model(BASE), h100)
    b = parameter_counts(load_model({**BASE, **MTP}), h100)
    c = parameter_counts(load_model({**BASE, **MTP, "mtp_use_repeated_layer": True}), h100)
    module = a["attention_block"] + a["moe_block"] + 2 * 64 * 64
    assert b["total"] - a["total"] == 2 * module
    assert c["total"] - a["total"] == module
    routed_off = a["routed"] * (1 - 2 / 4)         # the experts a token does not pass
    assert b["active"] - a["active"] == 2 * (module - routed_off)


def test_hybrid_mtp_compute_per_pass_weights_once(h100):
    """One stage: the MTP layers run at each depth (2 x ('*' + 'E') more
    layers' FLOPs and saved activations whether repeated or not); the
    repeated module's weights, gradients and optimizer state are one
    module's."""
    a = run(load_model(BASE), h100)
    b = run(load_model({**BASE, **MTP}), h100)
    c = run(load_model({**BASE, **MTP, "mtp_use_repeated_layer": True}), h100)
    attn = run(load_model({**BASE, "hybrid_override_pattern": "***", "moe": None,
                           "mamba": None}), h100)
    moe = run(load_model({**BASE, "hybrid_override_pattern": "EEE", "mamba": None}), h100)
    # (block sums are per block slot: the stage's 3 blocks)
    for key in ("block_fw_flops", "block_act_storage_space"):
        assert 3 * (b[key] - a[key]) == pytest.approx(2 * (attn[key] + moe[key])), key
        assert b[key] == c[key], key
    for key in ("block_weight_space", "block_optimizer_space"):
        assert 3 * (b[key] - a[key]) == pytest.approx(2 * (attn[key] + moe[key])), key
        assert 3 * (c[key] - a[key]) == pytest.approx(attn[key] + moe[key]), key
    assert c["total_time"] < b["total_time"]       # a smaller optimizer step


def test_hybrid_mtp_json_round_trip():
    m = load_model({**BASE, **MTP, "mtp_use_repeated_layer": True})
    assert (m.mtp, m.mtp_pattern, m.mtp_repeated) == (2, "*E", True)
    out = model_to_json(m)
    assert out["mtp_hybrid_override_pattern"] == "*E" and out["mtp_use_repeated_layer"] is True
    assert load_model(out) == m
    assert "mtp_use_repeated_layer" not in model_to_json(load_model({**BASE, **MTP}))


@pytest.mark.parametrize("change, field", [
    ({"mtp": 1, "mtp_hybrid_override_pattern": "*X"}, "mtp_hybrid_override_pattern"),
    ({"mtp": 1, "mtp_hybrid_override_pattern": "-"}, "mtp_hybrid_override_pattern"),
    ({"mtp": 1, "mtp_hybrid_override_pattern": ""}, "mtp_hybrid_override_pattern"),
    ({"mtp": 1, "mtp_hybrid_override_pattern": 3}, "mtp_hybrid_override_pattern"),
    ({"mtp_hybrid_override_pattern": "*E"}, "mtp_hybrid_override_pattern"),  # no mtp
    ({"mtp_use_repeated_layer": True}, "mtp_use_repeated_layer"),
    ({**MTP, "mtp_use_repeated_layer": "yes"}, "mtp_use_repeated_layer"),
])
def test_hybrid_mtp_bad_values_name_the_field(change, field):
    with pytest.raises(SpecError) as e:
        load_model({**BASE, **change})
    assert e.value.field == field


def test_hybrid_mtp_without_its_pattern_is_one_attention_and_one_moe_layer():
    """Without mtp_hybrid_override_pattern a hybrid model's module is the GPT
    MTP layer Megatron builds (Qwen3-Next's): one attention and one MoE layer
    a depth, each with weights of its own; the same as the pattern "*E"."""
    from autopar.model.mamba import hybrid_kinds
    from autopar.model.moe import mtp_layers
    plain = load_model({**BASE, "mtp": 2})
    named = load_model({**BASE, **MTP})
    kinds = hybrid_kinds(plain)
    assert mtp_layers(plain, kinds) == mtp_layers(named, kinds)
    add, held = mtp_layers(plain, kinds)
    assert add == held and add[kinds.index("attention")] == 2 and add[kinds.index("moe")] == 2
    with pytest.raises(SpecError) as e:        # no attention layer to build it from
        load_model({**BASE, "mtp": 1, "hybrid_override_pattern": "MME"})
    assert e.value.field == "mtp"


def test_mtp_pattern_needs_a_hybrid_model():
    dense = {k: v for k, v in BASE.items()
             if k not in ("hybrid_override_pattern", "mamba", "moe")}
    with pytest.raises(SpecError) as e:
        load_model({**dense, **MTP})
    assert e.value.field == "mtp_hybrid_override_pattern"


LAUNCH_BASE = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 1, "data_par": 4,
               "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
               "batch_size": 64, "microbatch_size": 2, "datatype": "bfloat16",
               "fused_activation": True, "attention_type": "multihead",
               "activation_recompute": "none", "pipeline_interleaving": 1,
               "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
               "tensor_par_overlap": "none", "seq_par_ag_redo": False,
               "data_par_overlap": True, "weight_offload": False,
               "activations_offload": False, "optimizer_offload": False, "training": True,
               "attention_impl": "flash_v2", "fused_norm": True, "unsharded_grads": True,
               "expert_par": 4, "expert_tensor_par": 1, "moe_dispatcher": "alltoall"}


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
@pytest.mark.parametrize("repeated", [False, True])
def test_latent_and_hybrid_mtp_round_trip_megatron_and_bridge(fmt, repeated):
    """Megatron-Core's names: ``moe_latent_size``, ``mtp_num_layers``,
    ``mtp_use_repeated_layer`` and the MTP depths after '/' in the hybrid
    layer pattern (hybrid_layer_allocation.py parse_hybrid_pattern)."""
    shape = {**BASE, "hidden": 256, "num_blocks": 4, "hybrid_override_pattern": "M*EE",
             "moe": {**BASE["moe"], "latent_size": 64}, **MTP}
    if repeated:
        shape["mtp_use_repeated_layer"] = True
    m = load_model(shape)
    ex = {**LAUNCH_BASE, **({"fp32_grads": True} if fmt == "bridge" else {})}
    text, back = launch_round_trip(fmt, m, ex)
    assert "M*EE/*E/*E" in text
    back = back.model
    assert back["moe"]["latent_size"] == 64
    assert back["mtp"] == 2 and back["mtp_hybrid_override_pattern"] == "*E"
    assert back.get("mtp_use_repeated_layer", False) is repeated
    got = load_model({**back, "name": "hy"})
    assert (got.moe.latent_size, got.mtp, got.mtp_pattern, got.mtp_repeated) == \
        (64, 2, "*E", repeated)


def test_unlike_mtp_depths_are_refused_on_import():
    from autopar.io.launch import get
    m = load_model({**BASE, **MTP})
    text = get("megatron").write(m, {**LAUNCH_BASE, "expert_par": 4})
    with pytest.raises(SpecError) as e:
        get("megatron").read(text.replace("M*E/*E/*E", "M*E/*E/E"), "x.sh")
    assert e.value.field == "--hybrid-layer-pattern"


# A nemotron_h config.json as Hugging Face's NemotronHConfig spells its keys,
# with the shipped Nemotron 3 Nano file's values (models/nemotron3-nano-30B-A3B.json).
NANO_HF = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
           "hidden_size": 2688, "intermediate_size": 1856, "num_hidden_layers": 52,
           "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
           "vocab_size": 131072, "max_position_embeddings": 262144,
           "hybrid_override_pattern":
               "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
           "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
           "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 128,
           "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "n_shared_experts": 1,
           "moe_shared_expert_intermediate_size": 3712, "mlp_hidden_act": "relu2",
           "mamba_hidden_act": "silu"}


def _hf(tmp_path, data):
    import json
    from autopar.io.launch import read_config
    p = tmp_path / "config.json"
    p.write_text(json.dumps(data))
    return read_config(p)


def test_hf_nemotron_h_config_gives_the_shipped_nano(tmp_path):
    import json
    from pathlib import Path
    fmt, imp = _hf(tmp_path, NANO_HF)
    assert fmt == "hf" and imp.execution == {}
    root = Path(__file__).resolve().parents[1]
    shipped = json.loads((root / "models" / "nemotron3-nano-30B-A3B.json").read_text())
    shipped.pop("description")
    got = dict(imp.model, seq_size=shipped["seq_size"])    # the card gives the context
    assert model_to_json(load_model(got)) == model_to_json(load_model(shipped))


def test_hf_nemotron_h_reads_the_latent_and_the_mtp_module(tmp_path):
    """``moe_latent_size`` and ``num_nextn_predict_layers`` depths of
    ``mtp_hybrid_override_pattern`` (or the list ``mtp_layers_block_type``),
    one repeated module unless the config says otherwise (Bridge's default)."""
    data = {**NANO_HF, "moe_latent_size": 1024, "num_nextn_predict_layers": 1,
            "mtp_hybrid_override_pattern": "*E"}
    m = load_model(dict(_hf(tmp_path, data)[1].model))
    assert (m.moe.latent_size, m.mtp, m.mtp_pattern, m.mtp_repeated) == (1024, 1, "*E", True)
    data = {k: v for k, v in data.items() if k != "mtp_hybrid_override_pattern"}
    data.update(mtp_layers_block_type=["attention", "moe"], mtp_use_repeated_layer=False)
    m = load_model(dict(_hf(tmp_path, data)[1].model))
    assert (m.mtp_pattern, m.mtp_repeated) == ("*E", False)


@pytest.mark.parametrize("change, field", [
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"hybrid_override_pattern": "ME"}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": None}, "hybrid_override_pattern"),
    ({"num_nextn_predict_layers": 2}, "mtp_hybrid_override_pattern"),
    ({"moe_latent_size": 0}, "moe_latent_size"),
    ({"layers_block_type": ["mamba", "conv"], "hybrid_override_pattern": None},
     "layers_block_type"),
])
def test_hf_nemotron_h_refusals_name_the_key(tmp_path, change, field):
    data = {k: v for k, v in {**NANO_HF, **change}.items() if v is not None}
    with pytest.raises(SpecError) as e:
        _hf(tmp_path, data)
    assert e.value.field == field


def test_held_sums_are_block_sums_of_weights():
    """Every sum ``mix`` counts by the weights held (a repeated MTP module)
    is a field of BlockSums, and none of the per-pass ones is among them."""
    from dataclasses import fields
    from autopar.model.block_sums import BlockSums
    from autopar.model.moe import HELD_SUMS
    names = {f.name for f in fields(BlockSums)}
    assert set(HELD_SUMS) <= names
    assert not {"fw_flops", "agrad_flops", "wgrad_flops", "act_storage", "useful_fw",
                "ep_link"} & set(HELD_SUMS)
