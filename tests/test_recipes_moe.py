"""Megatron-Bridge's MoE performance recipes (autopar/data/recipes/bridge_moe.csv):
every recipe NVIDIA ran as a benchmark is predicted (to fit, mostly) or
skipped with its reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.io.errors import SpecError
from autopar.model import evaluate_one
from autopar.studies import published_base as P
from autopar.studies import recipes_moe as R

ROOT = Path(__file__).resolve().parent.parent
MIRROR = Path(os.environ.get("BRIDGE_MIRROR", "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo"))
# The count predicted to fit (held: may rise, must not fall; 145 with
# DeepSeek-V3's hybrid-sharded recipe, optimizer_outer_sharding).
FITS_AT_LEAST = 145
# The recipes predicted not to fit, each with what the recipe turns on that
# autopar does not count (docs/validation.md, "Megatron-Bridge performance
# recipes: do they fit? (MoE)"): none.  The last, the 64-GPU DeepSeek-V3
# Megatron-FSDP bf16 recipe on GB300 (269.8 GiB against 268), offloads the
# attention core's and output projection's saved tensors (fine-grained
# activation offloading, offload_modules core_attn and attn_proj), counted
# since activation_offload_modules: 254.6 GiB (docs/validation.md,
# "Fine-grained activation offloading and the Grace host link, counted").
KNOWN_NOT_FIT: dict[str, str] = {}
# Fitting recipes predicted below 10% MFU, with why (docs/validation.md):
# one micro-batch of a quarter sequence a GPU a step, the data-parallel
# gradient reduce-scatter and parameter all-gather over the inter-node tier
# left exposed.  (The 64-GPU B300 MXFP8 / NVFP4 recipes left this list when
# the sync stopped counting Transformer Engine's quantized weight copies:
# 13.2% / 21.2%; docs/validation.md, "Data-parallel traffic under fp8
# recipes, counted".)
KNOWN_LOW_MFU = {
    "gpt_oss_20b_pretrain_512gpu_gb200_fp8mx_config": "exposed data-parallel sync",
    "gpt_oss_20b_pretrain_512gpu_gb300_fp8mx_config": "exposed data-parallel sync",
}
# Fitting recipes predicted below 10% MFU because the expert-parallel
# all-to-all is most of the step: Qwen3-Next's 512 experts over 64-128 GPUs
# (8-16 nodes) with overlap_moe_expert_parallel_comm not set by the recipe
# (docs/validation.md, "Gated DeltaNet layers (Qwen3-Next, Qwen3.5), counted").
KNOWN_LOW_MFU_EP = {
    "qwen3_next_80b_a3b_pretrain_128gpu_h100_bf16_config",
    "qwen3_next_80b_a3b_pretrain_128gpu_h100_fp8cs_config",
    "qwen3_next_80b_a3b_pretrain_64gpu_b200_bf16_config",
    "qwen3_next_80b_a3b_pretrain_64gpu_b200_fp8mx_config",
}


@pytest.fixture(scope="module")
def table():
    return R.read_recipes()


@pytest.fixture(scope="module")
def outcomes():
    out = {}
    for name, c in R.cases():
        if isinstance(c, P.Skip):
            out[name] = ("skip", c.reason)
        else:
            s = evaluate_one(c.model, c.system, c.execution)
            out[name] = ("fits" if s["feasible"] else "no", s)
    return out


def test_table_parses_and_names_real_models_and_systems(table):
    assert list(table.columns) == list(R.COLUMNS)
    assert len(table) >= 150
    assert table.recipe.is_unique
    assert set(table.gpu) <= set(R.RECIPE_SYSTEMS)          # vr200 not written
    for s in R.RECIPE_SYSTEMS.values():
        assert (P.SYSTEMS / f"{s}.json").is_file()
    known = {m for m in table.model if (P.MODELS / f"{m}.json").is_file()}
    assert {"deepseek-v3", "kimi-k2", "qwen3-30B-A3B", "qwen3-235B-A22B",
            "gpt-oss-120B"} <= known
    assert table.source.str.startswith("NVIDIA-NeMo/Megatron-Bridge@067f987 src/").all()


def test_every_recipe_predicted_or_skipped_with_a_reason(outcomes, table):
    assert set(outcomes) == set(table.recipe)
    for name, (status, info) in outcomes.items():
        if status == "skip":
            assert isinstance(info, str) and len(info) > 10, name
    fits = [n for n, (s, _) in outcomes.items() if s == "fits"]
    assert len(fits) >= FITS_AT_LEAST
    no = {n for n, (s, _) in outcomes.items() if s == "no"}
    assert no <= set(KNOWN_NOT_FIT), sorted(no - set(KNOWN_NOT_FIT))
    # the listed models of the brief are all predicted, none skipped for
    # want of a model file
    for name, (status, info) in outcomes.items():
        if status == "skip":
            assert not any(name.startswith(p) for p in ("kimi_k2", "qwen3_30b", "gpt_oss")) \
                or "FSDP" in info or "pipeline" in info or "expert parallel" in info, name


def test_fitting_recipes_run_at_a_plausible_mfu(outcomes):
    for name, (status, s) in outcomes.items():
        if status == "fits" and name not in KNOWN_LOW_MFU and name not in KNOWN_LOW_MFU_EP:
            assert 0.10 <= s["total_efficiency"] <= 0.70, (name, s["total_efficiency"])
    for name in KNOWN_LOW_MFU:
        status, s = outcomes[name]
        assert status == "fits" and s["total_efficiency"] < 0.10, name
        # the data-parallel sync is most of the step
        assert s["dp_comm_exposed_time"] + s["weight_gather_exposed_time"] \
            > 0.5 * s["total_time"], name
    for name in KNOWN_LOW_MFU_EP:
        status, s = outcomes[name]
        assert status == "fits" and s["total_efficiency"] < 0.10, name
        assert s["ep_comm_exposed_time"] > 0.5 * s["total_time"], name


def test_hand_check_deepseek_v3_h100_bf16(table):
    """deepseek/h100/deepseek_v3.py deepseek_v3_pretrain_1024gpu_h100_bf16_config:
    TP 2, PP 8, VP 4, CP 1, EP 64, SP, GBS 16384, MBS 1, recompute_modules
    mla_up_proj and mlp (granularity selective from _deepseek_v3_common),
    layout "Et|(tt|)*30mL", overlap_grad_reduce off, the base recipe's
    HybridEP flex dispatcher, bf16, grad_reduce_in_fp32 off (_benchmark_common)."""
    row = table.set_index("recipe").loc["deepseek_v3_pretrain_1024gpu_h100_bf16_config"]
    assert (row.model, row.gpu, row.precision, row.n_gpus) == ("deepseek-v3", "h100", "bf16", "1024")
    assert (row.tp, row.pp, row.cp, row.vp, row.ep, row.etp) == ("2", "8", "1", "4", "64", "1")
    assert (row.mbs, row.gbs, row.seq, row.sp) == ("1", "16384", "4096", "true")
    assert (row.recompute_granularity, row.recompute_modules) == ("selective", "mla_up_proj;mlp")
    assert row.dispatcher == "flex:hybridep" and row.cuda_graph == ""
    x = R.extra(row)
    assert x["pipeline_model_parallel_layout"] == "Et|(tt|)*30mL"
    assert x["ddp.overlap_grad_reduce"] == "false" and x["ddp.grad_reduce_in_fp32"] == "false"
    assert x["opt.exp_avg_dtype"] == "bfloat16" and x["mtp_num_layers"] == "1"
    c = R.recipe_case(row.rename(None).to_dict() | {"recipe": row.name})
    ex = c.execution
    assert (ex["tensor_par"], ex["pipeline_par"], ex["pipeline_interleaving"], ex["data_par"],
            ex["expert_par"]) == (2, 8, 4, 64, 64)
    assert ex["activation_recompute"] == "mlp_only" and ex["moe_dispatcher"] == "deepep"
    assert ex["data_par_overlap"] is False and ex["fp32_grads"] is False
    assert ex["tensor_par_comm_type"] == "rs_ag" and c.model.mtp == 1


def test_dist_muon_shards_the_state_over_data_parallel(table):
    """Kimi K2's recipes: dist_muon with ddp.use_distributed_optimizer off is
    Megatron-Core's layer-wise distributed Muon: state sharded, gradients whole."""
    row = table.set_index("recipe").loc["kimi_k2_pretrain_256gpu_gb200_bf16_config"]
    x = R.extra(row)
    assert x["opt.optimizer"] == "dist_muon" and x["ddp.use_distributed_optimizer"] == "false"
    ex = R.recipe_case(row.rename(None).to_dict() | {"recipe": row.name}).execution
    assert ex["optimizer"] == "muon" and ex["optimizer_sharding"] and ex["unsharded_grads"]


def test_layouts():
    assert R.parse_layout("Et|(tt|)*2mL") == ("Et", "tt", "tt", "mL")
    assert R.parse_layout("Et*3|(t*2|)*2L") == ("Ettt", "tt", "tt", "L")
    # Megatron's E + 61 blocks + L over 8 x 4 virtual stages: balanced with
    # the embedding and loss counted
    f = R.pipeline_layout_fields("Et|(tt|)*30mL", 61, 8, 4)
    assert f == {"embedding_in_split": True, "loss_in_split": True,
                 "pipeline_layout": "balanced"}
    # 4 blocks a virtual stage and 1 in the last: Calculon's split (8 x 7, 5)
    assert R.pipeline_layout_fields("Etttt|" + "tttt|" * 14 + "tmL", 61, 8, 2) == {}
    assert isinstance(R.pipeline_layout_fields("Et|tL", 61, 2, 1), str)
    assert isinstance(R.pipeline_layout_fields("Et|t|tL", 3, 2, 1), str)


def test_bad_table_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        R.read_recipes(tmp_path / "none.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("recipe,family\nx,y\n")
    with pytest.raises(SpecError, match="missing column"):
        R.read_recipes(bad)


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no Megatron-Bridge mirror (CI): the CSV is committed")
def test_writer_reproduces_the_committed_table(tmp_path):
    out = tmp_path / "moe.csv"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "write_recipe_table_moe.py"),
                        "--mirror", str(MIRROR), "--output", str(out)],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_text() == R.CSV.read_text()


# --- Nemotron 3 Nano and the models autopar cannot express (docs/validation.md,
# "Megatron-Bridge performance recipes: model files (Nemotron 3, ...)") ---

NANO = "nemotron3-nano-30B-A3B"
LIGHTNING = "nemotron3.5-lightning-30B-A3B"
# Nemotron 3.5 Lightning recipes predicted and fitting (held: may rise, must not
# fall); 2 of them run Megatron-FSDP beside expert parallelism.
LIGHTNING_FITS = 10
# Recipes of the dense table that name the Nano file (held: may rise, must not fall).
NANO_FITS = 14
# Nemotron 3 Super / Ultra recipes of the dense table predicted and fitting
# (held: may rise, must not fall): models/nemotron3-super-120B-A12B.json and
# models/nemotron3-ultra-550B-A55B.json (docs/validation.md, "Nemotron 3 Super
# and Ultra model files (Megatron-LM examples), counted").
SUPER, ULTRA = "nemotron3-super-120B-A12B", "nemotron3-ultra-550B-A55B"
# ULTRA_FITS 2 -> 1 (docs/validation.md, "Megatron-FSDP expert shards per
# instance and fused_group_mlp offloading, counted"): Megatron-FSDP's hybrid
# sharding without the outer strategy shards the experts' optimizer state
# and gradients over the instance's expert group only (NVIDIA/Megatron-LM@
# 2a75ac1 param_and_grad_buffer.py, "DP-Shard only"; mcore_fsdp_adapter.py
# _init_dist_index: the partial expert-data-parallel group), one rank on the
# GB200 recipe (TP 2, EP 64, DP 128 in 4 instances): 187.8 GiB of 184 with
# fused_group_mlp offloaded (tests/test_recipes.py NOT_FITTING).
SUPER_FITS, ULTRA_FITS = 13, 1
# Skipped for blocks autopar cannot express: model -> recipes.
NOT_EXPRESSED_COUNTS = {"deepseek-v4": 3}
# GLM-5.1's recipes predicted and fitting with models/glm-5.json (DeepSeek
# Sparse Attention; held: may rise, must not fall), GLM-5.2's skipped for
# IndexShare (docs/validation.md, "DeepSeek Sparse Attention (GLM-5,
# DeepSeek-V3.2), counted").
GLM51_FITS, GLM52_SKIPPED = 2, 2


def _writer():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "write_recipe_table", ROOT / "benchmarks" / "write_recipe_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nemotron_3_nano_recipes_fit_at_a_plausible_mfu():
    """The 14 Nemotron 3 Nano recipes of the dense table (perf_recipes/nemotronh)
    are predicted with models/nemotron3-nano-30B-A3B.json and fit; their MFU over
    the BF16 peak is in this table's 10-70% band, and over their GEMM datatype's
    peak the BF16 and FP8 ones are in the dense table's 15-75%.  The NVFP4 ones
    are below 15% of the NVFP4 peak (4-6x BF16's): in this 2688-wide model the
    quantized GEMMs are a small share of the step (docs/validation.md)."""
    from autopar.studies import recipes as RD
    dense = RD.read()
    rows = dense[dense.model == NANO]
    assert len(rows) == NANO_FITS
    assert set(rows.recipe.str[:16]) == {"nemotron_3_nano_"}
    for _, row in rows.iterrows():
        c = RD.recipe_case(row)
        assert isinstance(c, P.PublishedCase), (row.recipe, c)
        s = evaluate_one(c.model, c.system, c.execution)
        assert bool(s["feasible"]), row.recipe
        assert 0.10 <= float(s["total_efficiency"]) <= 0.70, row.recipe
        mfu = RD.mfu(s, c.system, c.execution["fp8_recipe"])
        if row.precision == "nvfp4":
            assert 0.05 < mfu < 0.15, (row.recipe, mfu)
        else:
            assert 0.15 <= mfu <= 0.75, (row.recipe, mfu)


def test_nemotron_3_nano_row_by_hand(table):
    """perf_recipes/nemotronh/b200/nemotronh.py nemotron_3_nano_pretrain_8gpu_b200_bf16_config:
    TP 1, PP 1, CP 1, EP 8, ETP 1, no SP, GBS 512, MBS 2, 8192 tokens (the Nano
    perf defaults), the flex dispatcher with HybridEP, no recompute
    (_apply_nemotron_3_nano_perf_defaults), BF16, gradients reduced in BF16
    (_benchmark_common), the base recipe's distributed optimizer."""
    from autopar.studies import recipes as RD
    dense = RD.read().set_index("recipe")
    row = dense.loc["nemotron_3_nano_pretrain_8gpu_b200_bf16_config"]
    assert (row.model, row.gpu, row.precision, row.n_gpus) == (NANO, "b200", "bf16", "8")
    assert (row.tp, row.pp, row.cp, row.ep, row.etp, row.mbs, row.gbs, row.seq) == \
        ("1", "1", "1", "8", "1", "2", "512", "8192")
    assert row.recompute_granularity == "" and row.dispatcher == "flex"
    c = R.recipe_case(row.rename(None).to_dict() | {"recipe": row.name})
    ex = c.execution
    assert (ex["tensor_par"], ex["pipeline_par"], ex["data_par"], ex["expert_par"]) == (1, 1, 8, 8)
    assert (ex["batch_size"], ex["microbatch_size"]) == (512, 2)
    assert ex["activation_recompute"] == "none" and ex["moe_dispatcher"] == "deepep"
    assert ex["fp32_grads"] is False and ex["optimizer_sharding"] and ex["fp8_recipe"] == "none"
    m = c.model
    assert m.hybrid_pattern.count("E") == 23 and m.moe.experts == 128 and m.moe.top_k == 6
    assert m.seq_size == 8192 and m.vocab_size == 131072


def test_writer_names_the_nano_provider_and_lightning_by_its_checkpoint():
    W = _writer()
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    nano = {"model": "HybridModelProvider", "model.num_layers": 52, "model.hidden_size": 2688,
            "model.hybrid_layer_pattern": pattern, "model.num_moe_experts": 128}
    assert W.model_name(nano) == NANO
    # another MoE hybrid of the same width is not the Nano
    assert W.model_name(nano | {"model.num_moe_experts": 64}) == "HybridModelProvider"
    assert W.model_name(nano | {"model.mtp_num_layers": 2}) == "HybridModelProvider"
    lightning = nano | {"model.mtp_num_layers": 2,
                        "model.hf_model_id": "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16"}
    assert W.model_name(lightning) == LIGHTNING
    # the dense Nemotron-H providers still map by (layers, hidden)
    assert W.model_name({"model": "HybridModelProvider", "model.num_layers": 118,
                         "model.hidden_size": 8192}) == "nemotron-h-56B"


def _nano_recipe_model_settings(name: str) -> tuple[str, dict]:
    """Function ``name`` of recipes/nemotronh/h100/nemotron_3_nano.py, run by
    the recipe table's writer on the mirror: the model file the writer names
    for it and its ``model.`` settings (prefix dropped)."""
    import ast
    W = _writer()
    src = W.Source(MIRROR, W.COMMIT)
    path = "src/megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py"
    fn = next(n for n in src.tree(path).body if isinstance(n, ast.FunctionDef)
              and n.name == name)
    flat = W.flatten(W.Interpreter(src).call_function(path, fn, [], {}))
    return W.model_name(flat), {k[len("model."):]: v for k, v in flat.items()
                                if k.startswith("model.")}


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no Megatron-Bridge mirror (CI): the CSV is committed")
def test_nano_model_file_is_the_recipes_provider():
    """models/nemotron3-nano-30B-A3B.json against the HybridModelProvider that
    recipes/nemotronh/h100/nemotron_3_nano.py builds (the perf recipes' base)."""
    import json
    named, g = _nano_recipe_model_settings("nemotron_3_nano_pretrain_8gpu_h100_bf16_config")
    f = json.loads((P.MODELS / f"{NANO}.json").read_text())
    assert g["hybrid_layer_pattern"] == f["hybrid_override_pattern"]
    assert (g["num_layers"], g["hidden_size"], g["seq_length"]) == \
        (f["num_blocks"], f["hidden"], f["seq_size"])
    assert (g["num_attention_heads"], g["num_query_groups"], g["kv_channels"]) == \
        (f["attn_heads"], f["kv_heads"], f["attn_size"])
    mb = f["mamba"]
    assert (g["mamba_num_heads"], g["mamba_head_dim"], g["mamba_state_dim"],
            g["mamba_num_groups"]) == (mb["heads"], mb["head_dim"], mb["state"], mb["groups"])
    moe = f["moe"]
    assert (g["num_moe_experts"], g["moe_router_topk"], g["moe_ffn_hidden_size"],
            g["moe_shared_expert_intermediate_size"], g["moe_router_score_function"]) == \
        (moe["experts"], moe["top_k"], moe["expert_feedforward"], moe["shared_feedforward"],
         moe["router"])
    assert g["ffn_hidden_size"] == f["feedforward"] and g["activation_func"] == "squared_relu"
    assert "mtp_num_layers" not in g            # the Nano has none; Lightning adds them
    assert named == NANO


def test_models_autopar_cannot_express_are_skipped_with_what_it_lacks():
    from autopar.studies import recipes as RD
    rows = RD.predict()
    counts = {}
    for name, n in NOT_EXPRESSED_COUNTS.items():
        assert not (P.MODELS / f"{name}.json").is_file()
        sel = rows[rows.model == name]
        counts[name] = len(sel)
        assert (sel.status == "skipped").all() and (sel.reason == R.NOT_EXPRESSED[name]).all()
    assert counts == NOT_EXPRESSED_COUNTS
    assert set(R.NOT_EXPRESSED) == set(NOT_EXPRESSED_COUNTS)
    glm = rows[rows.model == "glm5"]
    g51 = glm[glm.recipe.str.startswith("glm51_")]
    g52 = glm[glm.recipe.str.startswith("glm52_")]
    assert (g51.status != "skipped").all() and int(g51.fits.sum()) >= GLM51_FITS
    assert len(g52) == GLM52_SKIPPED and (g52.status == "skipped").all()
    assert (g52.reason == R.NOT_EXPRESSED_RECIPES["glm52_"]).all()
    # Nemotron 3 Super / Ultra have model files now: no row names the checkpoints
    assert not rows.model.str.startswith("nvidia/NVIDIA-Nemotron-3-").any()
    # no row is skipped for want of a model file any more
    assert not rows.reason.fillna("").str.startswith("no model file").any()


def test_qwen3_next_recipes_predicted(outcomes):
    """The 10 Qwen3-Next recipes are predicted and fit
    (models/qwen3-next-80B-A3B.json, Gated DeltaNet layers, with the
    recipes' MTP layer); the four GB200 / GB300 ones interleave a pipeline
    (pp 2 x vp 4) by their own layout of uneven virtual stages (4, 7, ...,
    8, 1 decoder layers of two blocks each), kept as an explicit
    pipeline_layout."""
    rows = {n: o for n, o in outcomes.items() if n.startswith("qwen3_next_80b_a3b")}
    assert len(rows) == 10
    fits = sorted(n for n, (st, _) in rows.items() if st == "fits")
    assert len(fits) == 10
    cases = dict(R.cases())
    for n in rows:
        if "gb200" in n or "gb300" in n:
            ex = cases[n].execution
            assert ex["pipeline_layout"] == "Et*4|(t*7|)*5t*8|tmL", n
            assert (ex["pipeline_par"], ex["pipeline_interleaving"]) == (2, 4), n
    c = dict(R.cases())["qwen3_next_80b_a3b_pretrain_128gpu_h100_bf16_config"]
    assert c.model.mtp == 1 and c.model.gdn is not None and c.model.attention_output_gate


def test_nemotron_3_5_lightning_recipes_fit_with_the_hybrid_mtp_module():
    """The 10 Lightning recipes (perf_recipes/nemotronh) name
    models/nemotron3.5-lightning-30B-A3B.json: the Nano file plus 2 passes of
    one shared '*E' MTP module (nemotron_3_5_lightning_pretrain_config).  All
    10 are predicted and fit at the Nano rows' plausible MFU (2 of them
    Megatron-FSDP with expert parallelism).  Each predicted row holds more than the same
    layout of the Nano (the module's weights once, its layers' activations
    and each depth's kept logits twice) and runs slower."""
    import dataclasses
    from autopar.studies import recipes as RD
    dense = RD.read()
    rows = dense[dense.model == LIGHTNING]
    assert len(rows) == 10
    fits, skipped = 0, []
    for _, row in rows.iterrows():
        c = RD.recipe_case(row)
        if not isinstance(c, P.PublishedCase):
            skipped.append(c.reason)
            continue
        m = c.model
        assert (m.mtp, m.mtp_pattern, m.mtp_repeated) == (2, "*E", True), row.recipe
        s = evaluate_one(m, c.system, c.execution)
        fits += bool(s["feasible"])
        assert 0.10 <= float(s["total_efficiency"]) <= 0.70, row.recipe
        nano = evaluate_one(dataclasses.replace(m, mtp=0, mtp_pattern="", mtp_repeated=False),
                            c.system, c.execution)
        assert s["proc_mem_tier1_cap_req"] > nano["proc_mem_tier1_cap_req"], row.recipe
        assert s["total_time"] > nano["total_time"], row.recipe
    assert fits >= LIGHTNING_FITS
    assert skipped == []


def test_nemotron_3_super_and_ultra_recipes_fit_with_latent_moe_and_mtp():
    """The 13 Super and 2 Ultra recipes (perf_recipes/nemotronh) name their
    model files, are predicted with LatentMoE and the two-depth '*E' MTP
    module the recipes set, and fit, at a BF16-peak efficiency in the MoE
    table's 10-70% band.  Each runs slower than the same layout of the model
    without its MTP module, and holds more memory where the one stage holds
    the module (the H100 recipe's pipeline of 2 peaks on its first stage)."""
    import dataclasses
    from autopar.studies import recipes as RD
    dense = RD.read()
    for name, want, n_rows in ((SUPER, SUPER_FITS, 13), (ULTRA, ULTRA_FITS, 2)):
        rows = dense[dense.model == name]
        assert len(rows) == n_rows
        fits = 0
        for _, row in rows.iterrows():
            c = RD.recipe_case(row)
            assert isinstance(c, P.PublishedCase), (row.recipe, c)
            m = c.model
            assert (m.mtp, m.mtp_pattern, m.mtp_repeated) == (2, "*E", True), row.recipe
            assert m.moe.latent_size in (1024, 2048) and m.moe.experts == 512
            s = evaluate_one(m, c.system, c.execution)
            fits += bool(s["feasible"])
            if not s["feasible"]:
                continue        # (the Ultra GB200 recipe: ULTRA_FITS)
            assert 0.10 <= float(s["total_efficiency"]) <= 0.70, row.recipe
            bare = evaluate_one(dataclasses.replace(m, mtp=0, mtp_pattern="", mtp_repeated=False),
                                c.system, c.execution)
            if c.execution["pipeline_par"] == 1:
                assert s["proc_mem_tier1_cap_req"] > bare["proc_mem_tier1_cap_req"], row.recipe
            else:
                # the module is on the last stage; 1F1B's first stage holds the peak
                assert s["proc_mem_tier1_cap_req"] >= bare["proc_mem_tier1_cap_req"], row.recipe
            assert s["total_time"] > bare["total_time"], row.recipe
        assert fits >= want, name


def test_nemotron_3_super_h100_row_by_hand():
    """perf_recipes/nemotronh/h100/nemotronh.py nemotron_3_super_pretrain_64gpu_h100_bf16_config
    on recipes/nemotronh/nemotron_3_super.py's 64-GPU H100 base: TP 1, PP 2,
    EP 32, sequence 4096, GBS 1280, MBS 1, selective recompute of layernorm,
    moe_act, moe and core_attn (core_attn -> attn_only, moe_act counted,
    layernorm and moe not autopar choices), the precision-aware optimizer's
    bf16 moments, the flex dispatcher, experts padded to a capacity of 1.10."""
    from autopar.studies import recipes as RD
    row = RD.read().set_index("recipe").loc["nemotron_3_super_pretrain_64gpu_h100_bf16_config"]
    assert (row.model, row.tp, row.pp, row.ep, row.mbs, row.gbs, row.seq) == \
        (SUPER, "1", "2", "32", "1", "1280", "4096")
    c = R.recipe_case(row.rename(None).to_dict() | {"recipe": row.name})
    ex = c.execution
    assert (ex["tensor_par"], ex["pipeline_par"], ex["data_par"], ex["expert_par"]) == (1, 2, 32, 32)
    assert ex["activation_recompute"] == "attn_only" and ex["recompute_moe_act"]
    assert ex["optimizer_moment_bytes"] == 2 and ex["moe_dispatcher"] == "deepep"
    assert c.model.seq_size == 4096 and c.model.moe.latent_size == 1024
    # moe_expert_capacity_factor 1.10 with moe_pad_expert_input_to_capacity:
    # every expert padded to 1.1 x the balanced load (Megatron-Core drop_and_pad)
    assert c.model.moe.capacity_factor == pytest.approx(1.1)
    unpadded = row.rename(None).to_dict() | {"recipe": row.name}
    unpadded["extra"] = unpadded["extra"].replace(
        "model.moe_pad_expert_input_to_capacity=True", "model.moe_pad_expert_input_to_capacity=False")
    u = R.recipe_case(unpadded)
    assert u.model.moe.capacity_factor is None
    s, su = (evaluate_one(x.model, x.system, x.execution) for x in (c, u))
    assert s["proc_mem_tier1_cap_req"] > su["proc_mem_tier1_cap_req"]
    assert s["total_time"] > su["total_time"] and bool(s["feasible"])


def test_lightning_file_is_the_nano_file_plus_its_mtp_module():
    import json
    nano = json.loads((P.MODELS / f"{NANO}.json").read_text())
    light = json.loads((P.MODELS / f"{LIGHTNING}.json").read_text())
    extra = {k: v for k, v in light.items() if k not in nano}
    assert extra == {"mtp": 2, "mtp_hybrid_override_pattern": "*E",
                     "mtp_use_repeated_layer": True}
    assert {k: v for k, v in light.items() if k in nano and k != "description"} == \
        {k: v for k, v in nano.items() if k != "description"}


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no Megatron-Bridge mirror (CI): the CSV is committed")
def test_lightning_model_file_is_the_recipes_provider():
    """models/nemotron3.5-lightning-30B-A3B.json's MTP keys against what
    recipes/nemotronh/h100/nemotron_3_nano.py nemotron_3_5_lightning_pretrain_config
    sets on the Nano provider (its other fields: the Nano test above)."""
    import json
    named, g = _nano_recipe_model_settings("nemotron_3_5_lightning_pretrain_config")
    f = json.loads((P.MODELS / f"{LIGHTNING}.json").read_text())
    assert (g["mtp_num_layers"], g["mtp_hybrid_override_pattern"],
            g["mtp_use_repeated_layer"]) == \
        (f["mtp"], f["mtp_hybrid_override_pattern"], f["mtp_use_repeated_layer"])
    assert g["hybrid_layer_pattern"] == f["hybrid_override_pattern"]
    assert named == LIGHTNING


def test_precision_aware_bf16_moments_mapped():
    """The recipes that set opt.use_precision_aware_optimizer with bfloat16
    exp_avg / exp_avg_sq (the DeepSeek-V3 ones) become
    optimizer_moment_bytes 2; the others keep fp32 moments (4)."""
    from autopar.studies.recipe_table import extra
    rows = {str(r["recipe"]): r for _, r in R.read(R.CSV).iterrows()}
    bf16 = 0
    for name, c in R.cases():
        if isinstance(c, P.Skip):
            continue
        x = extra(rows[name])
        want = 2 if (x.get("opt.use_precision_aware_optimizer") == "true"
                     and x.get("opt.exp_avg_dtype") == "bfloat16") else 4
        assert c.execution.get("optimizer_moment_bytes", 4) == want, name
        bf16 += want == 2
    assert bf16 >= 20
