"""Launch configs out and real configs in (issue 25, items 1-2) for torchtitan,
DeepSpeed and Hugging Face model cards, and ``autopar import``.

* Round trip: every best layout of the shipped search spaces (small cases,
  the ten best of each) is either refused by a format in one line naming the
  field, or written and read back to the same layout (every field the format
  states; the fields it does not state are the module's ``UNSTATED`` or idle
  in that layout).  The same layouts with the framework spec's defaults
  applied make sure each format round-trips many layouts, not none.
* Hugging Face config.json fixtures (the published numbers of each model's
  config) give the model files autopar ships.
* The CLI: good input writes both files; bad input ends in one line, exit 2,
  nothing written.
* Where the framework's own config code installs (``launch-check`` extra),
  its config objects are built from the export.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework
from autopar.io.launch import get, read_config, settle
from autopar.io.launch.expressible import full
from autopar.io.layouts import ALL_FIELDS
from autopar.io.specs import load_model, model_to_json
from conftest import DeepSpeedMPU

ROOT = Path(__file__).resolve().parent.parent
SPACES = sorted(p.stem for p in (ROOT / "search_spaces").glob("*.yaml"))
FORMATS = ("torchtitan", "deepspeed")
FRAMEWORK = {"torchtitan": "torchtitan", "deepspeed": "deepspeed-zero1"}
# (model, system, processors, batch) per space: small cases, a few seconds each
CASES = {"moe": ("models/qwen3-30B-A3B.json", "systems/h100_80g_nvl8.json", 16, 64)}
DENSE = ("models/llama2-7B.json", "systems/h100_80g_nvl8.json", 16, 64)


@pytest.fixture(scope="module")
def best_layouts():
    """(space, model, execution) of the ten best layouts of every shipped space."""
    out = []
    for space in SPACES:
        model_path, system, procs, batch = CASES.get(space, DENSE)
        model = autopar.load_model(str(ROOT / model_path))
        table, summary = autopar.exhaustive(model, str(ROOT / system), num_procs=procs,
                                            max_batch_size=batch, datatype="bfloat16",
                                            space=space, top_n=10, progress=False)
        assert summary["best"] is not None, space
        from autopar.io.layouts import execution_from_row
        for _, row in table.iterrows():
            out.append((space, model, execution_from_row(row)))
    return out


def idle(field: str, ex: dict) -> bool:
    """A field with no effect in this layout, which a format need not state."""
    return field in ("tensor_par_comm_type", "seq_par_ag_redo") and ex["tensor_par"] == 1


def round_trip(fmt: str, model, ex: dict):
    """None when the format refuses the layout (after checking the reason's
    form), else the fields read back, checked against the layout."""
    F = get(fmt)
    why = F.refuse_layout(model, ex)
    if why is not None:
        assert why.startswith(f"{fmt}: ") and "\n" not in why
        assert any(f in why for f in ALL_FIELDS), why
        return None
    text = F.write(model, ex)
    imp = F.read(text, "exported")
    back = settle(fmt, imp.execution, model)
    want = full(ex)
    mod = sys.modules[f"autopar.io.launch.{fmt}"]
    for f in ALL_FIELDS:
        if f in back:
            assert back[f] == want[f], (fmt, f, back[f], want[f], text)
        else:
            assert f in mod.UNSTATED or idle(f, want), (fmt, f)
    assert imp.model.get("seq_size") == model.seq_size
    return back


def as_run_by(fmt: str, ex: dict) -> dict:
    """The layout with the framework spec's defaults, and for DeepSpeed the
    options its pipeline engine and Megatron-DeepSpeed have (no interleaving,
    no split, Megatron's redone all-gather): a layout that framework runs."""
    out = {**ex, **load_framework(FRAMEWORK[fmt]).defaults}
    if fmt == "deepspeed":
        out.update(pipeline_interleaving=1, pipeline_layout="even", embedding_in_split=False,
                   loss_in_split=False, tensor_par_overlap="none", sharding_group=0,
                   fp8_recipe="none", moe_overlap=False)
        if out["activation_recompute"] == "mlp_only":
            out["activation_recompute"] = "full"
        out["seq_par_ag_redo"] = out["tensor_par"] > 1 and out["tensor_par_comm_type"] == \
            "rs_ag" and out["activation_recompute"] != "full"
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_on_the_spaces_best_layouts(fmt, best_layouts):
    done = refused = 0
    for space, model, ex in best_layouts:
        for layout in (ex, as_run_by(fmt, ex)):
            if layout is not ex and layout["data_par"] == 1:
                continue                       # sharding needs data parallelism
            if round_trip(fmt, model, layout) is None:
                refused += 1
            else:
                done += 1
    assert done >= 20, (done, refused)          # many layouts, not none, go round
    assert refused >= 1                         # and the refusals were exercised


def test_refusals_name_the_field():
    model = load_model(str(ROOT / "models/llama2-7B.json"))
    base = {"num_procs": 16, "tensor_par": 2, "pipeline_par": 1, "data_par": 8,
            "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 1, "batch_size": 64,
            "microbatch_size": 2, "datatype": "bfloat16", "fused_activation": True,
            "attention_type": "multihead", "activation_recompute": "full",
            "pipeline_interleaving": 1, "optimizer_sharding": True,
            "tensor_par_comm_type": "rs_ag", "tensor_par_overlap": "none",
            "seq_par_ag_redo": False, "data_par_overlap": True, "weight_offload": False,
            "activations_offload": False, "optimizer_offload": False, "training": True,
            "attention_impl": "flash_v2", "fused_norm": True, "weight_sharding": True,
            "fp32_grads": True}
    tt, ds = get("torchtitan"), get("deepspeed")
    assert tt.refuse_layout(model, base) is None
    assert "weight_sharding" in tt.refuse_layout(model, {**base, "weight_sharding": False})
    assert "unsharded_grads" in tt.refuse_layout(model, {**base, "unsharded_grads": True})
    assert "mlp_only" in tt.refuse_layout(model, {**base, "activation_recompute": "mlp_only"})
    assert "float16" in tt.refuse_layout(model, {**base, "datatype": "float16"})
    assert "context_par_comm" in tt.refuse_layout(
        model, {**base, "context_par": 2, "data_par": 4, "context_par_comm": "a2a"})
    gpt = load_model(str(ROOT / "models/gpt3-175B.json"))
    assert "block" in tt.refuse_model(gpt)
    # DeepSpeed: ZeRO-3 with pipelines, Megatron's redone all-gather, interleaving
    assert ds.refuse_layout(model, base) is None
    assert "ZeRO stage 3" in ds.refuse_layout(
        model, {**base, "pipeline_par": 2, "data_par": 4})
    assert "pipeline_interleaving" in ds.refuse_layout(
        model, {**base, "pipeline_par": 2, "data_par": 4, "weight_sharding": False,
                "unsharded_grads": True, "pipeline_interleaving": 2})
    assert "seq_par_ag_redo" in ds.refuse_layout(model, {**base, "activation_recompute": "none"})
    assert ds.refuse_layout(model, {**base, "activation_recompute": "none",
                                    "seq_par_ag_redo": True}) is None
    # a search space that can only choose what the format cannot state
    from autopar.io.spaces import read_space
    small = read_space(str(ROOT / "search_spaces/small.yaml"))
    why = tt.refuse_space(model, small)
    assert why.startswith("torchtitan: space small has ") and "attention_impl" in why
    assert ds.refuse_space(model, small) is None


def test_torchtitan_reads_its_own_defaults_and_refuses_unknown_values(tmp_path):
    p = tmp_path / "train.toml"
    p.write_text('[parallelism]\ndata_parallel_shard_degree = 8\ntensor_parallel_degree = 2\n'
                 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
                 '[training]\nlocal_batch_size = 8\nseq_len = 8192\n'
                 '[activation_checkpoint]\nmode = "full"\n')
    fmt, imp = read_config(p)
    assert fmt == "torchtitan" and imp.framework == "torchtitan"
    ex = imp.execution
    assert (ex["num_procs"], ex["data_par"], ex["pipeline_interleaving"]) == (32, 8, 2)
    assert ex["batch_size"] == 64 and ex["microbatch_size"] == 1      # local x dp; pp mbs 1
    assert ex["embedding_in_split"] and ex["loss_in_split"]           # less_layers 1, 1
    assert imp.model == {"seq_size": 8192}
    llama3 = load_model(str(ROOT / "models/llama3-8B.json"))          # 32 + 2 over 4 stages
    assert settle("torchtitan", ex, llama3)["pipeline_layout"] == "balanced"
    p.write_text('[activation_checkpoint]\nmode = "sometimes"\n')
    with pytest.raises(SpecError) as e:
        read_config(p)
    assert e.value.field == "activation_checkpoint.mode" and e.value.source == str(p)
    p.write_text('[parallelism]\ntensor_parallel_degree = "two"\n')
    with pytest.raises(SpecError, match="expected an integer"):
        read_config(p)
    p.write_text("[parallelism\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        read_config(p)


def test_deepspeed_reads_hf_trainer_style_auto_and_stages(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": "auto", "bf16": {"enabled": True},
                             "zero_optimization": {"stage": 2}}))
    fmt, imp = read_config(p)
    assert fmt == "deepspeed" and imp.framework == "deepspeed-zero2"
    ex = imp.execution
    assert ex["optimizer_sharding"] and not ex["unsharded_grads"] and not ex["weight_sharding"]
    assert ex["microbatch_size"] == 4 and "batch_size" not in ex and "num_procs" not in ex
    assert ex["data_par_overlap"] is False                  # DeepSpeed's default below stage 3
    p.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 5}}))
    with pytest.raises(SpecError) as e:
        read_config(p)
    assert e.value.field == "zero_optimization.stage"
    p.write_text(json.dumps({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 4,
                             "autopar_launcher": {"world_size": 4}}))
    with pytest.raises(SpecError, match="DeepSpeed refuses it"):
        read_config(p)


# --------------------------------------------------------------------------
# Hugging Face config.json: the published configs' numbers

HF = {
    "llama2-70B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 8192, "intermediate_size": 28672,
                   "num_attention_heads": 64, "num_key_value_heads": 8,
                   "num_hidden_layers": 80, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "hidden_act": "silu",
                   "rms_norm_eps": 1e-05, "tie_word_embeddings": False},
    "llama3-8B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "hidden_act": "silu", "rope_theta": 500000.0},
    "mixtral-8x7B": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_hidden_layers": 32, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "sliding_window": None, "hidden_act": "silu",
                     "rope_theta": 1000000.0},
    "qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                      "vocab_size": 151936, "max_position_embeddings": 40960,
                      "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "norm_topk_prob": True, "use_sliding_window": False,
                      "sliding_window": None, "hidden_act": "silu"},
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "num_hidden_layers": 61, "vocab_size": 129280,
                    "max_position_embeddings": 163840, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8,
                    "topk_group": 4, "num_nextn_predict_layers": 1, "hidden_act": "silu"},
    "deepseek-v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "hidden_size": 5120, "intermediate_size": 12288,
                    "moe_intermediate_size": 1536, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "num_hidden_layers": 60, "vocab_size": 102400,
                    "max_position_embeddings": 163840, "n_routed_experts": 160,
                    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "scoring_func": "softmax", "topk_method": "group_limited_greedy",
                    "hidden_act": "silu"},
    "gpt-oss-120B": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                     "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
                     "num_attention_heads": 64, "num_key_value_heads": 8,
                     "num_hidden_layers": 36, "vocab_size": 201088,
                     "max_position_embeddings": 131072, "num_local_experts": 128,
                     "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18,
                     "hidden_act": "silu", "quantization_config": {"quant_method": "mxfp4"}},
}


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_config_gives_the_shipped_model(name, tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(HF[name]))
    fmt, imp = read_config(p)
    assert fmt == "hf" and imp.execution == {}
    shipped = json.loads((ROOT / "models" / f"{name}.json").read_text())
    got = dict(imp.model)
    # the card gives the context; the shipped files train at a shorter sequence
    got["seq_size"] = shipped["seq_size"]
    for key in ("name", "description"):
        shipped.pop(key, None)
    # the same model (defaults such as router "softmax" written or not)
    assert model_to_json(load_model(got)) == model_to_json(load_model(shipped))
    assert {k: v for k, v in got.items() if k != "moe"} == \
        {k: v for k, v in shipped.items() if k != "moe"}


def test_hf_refuses_what_autopar_cannot_state(tmp_path):
    p = tmp_path / "config.json"
    cases = [({**HF["llama3-8B"], "hidden_act": "gelu"}, "hidden_act"),
             ({**HF["llama3-8B"], "model_type": "falcon"}, "model_type"),
             ({**HF["qwen3-30B-A3B"], "decoder_sparse_step": 2}, "decoder_sparse_step"),
             ({**HF["qwen3-30B-A3B"], "mlp_only_layers": [5]}, "mlp_only_layers"),
             ({**HF["deepseek-v3"], "moe_layer_freq": 2}, "moe_layer_freq"),
             ({k: v for k, v in HF["llama3-8B"].items() if k != "hidden_size"}, "hidden_size")]
    for data, key in cases:
        p.write_text(json.dumps(data))
        with pytest.raises(SpecError) as e:
            read_config(p, "hf")
        assert e.value.field == key and e.value.source == str(p)
    # what autopar approximates is said, not refused: Mistral 7B v0.1's window
    mistral = {**HF["llama3-8B"], "model_type": "mistral", "vocab_size": 32000,
               "intermediate_size": 14336, "max_position_embeddings": 32768,
               "sliding_window": 4096}
    p.write_text(json.dumps(mistral))
    _, imp = read_config(p)
    assert imp.model["kv_heads"] == 8 and any("sliding_window 4096" in n for n in imp.notes)


# --------------------------------------------------------------------------
# The command line

def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "autopar.cli", "import", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_imports_a_torchtitan_export_with_a_model_card(tmp_path):
    model = load_model(str(ROOT / "models/llama3-8B.json"))
    ex = {"num_procs": 32, "tensor_par": 2, "pipeline_par": 2, "data_par": 8,
          "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 1, "batch_size": 64,
          "microbatch_size": 2, "datatype": "bfloat16", "fused_activation": True,
          "attention_type": "multihead", "activation_recompute": "full",
          "pipeline_interleaving": 2, "optimizer_sharding": True,
          "tensor_par_comm_type": "rs_ag", "tensor_par_overlap": "none",
          "seq_par_ag_redo": False, "data_par_overlap": True, "weight_offload": False,
          "activations_offload": False, "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2", "fused_norm": True, "weight_sharding": True,
          "fp32_grads": True, "sharding_group": 4, "pipeline_layout": "balanced",
          "embedding_in_split": True, "loss_in_split": True}
    assert get("torchtitan").refuse_layout(model, ex) is None
    (tmp_path / "train.toml").write_text(get("torchtitan").write(model, ex))
    (tmp_path / "config.json").write_text(json.dumps(HF["llama3-8B"]))
    r = cli("train.toml", "--model-card", "config.json", "--model-out", "m.json",
            "--execution-out", "e.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["seq_size"] == 8192 and m["num_blocks"] == 32          # the config's sequence
    e = json.loads((tmp_path / "e.json").read_text())
    for f in ("tensor_par", "pipeline_par", "data_par", "batch_size", "microbatch_size",
              "sharding_group", "pipeline_layout", "pipeline_interleaving"):
        assert e[f] == ex[f], f
    assert e["tensor_par_net"] is None                               # unstated: unknown
    assert "--framework torchtitan" in r.stdout
    # the files are what autopar reads: estimate --partial takes them
    r = subprocess.run([sys.executable, "-m", "autopar.cli", "estimate", "m.json",
                        str(ROOT / "systems/h100_80g_nvl8.json"), "e.json",
                        "--framework", "torchtitan"], capture_output=True, text=True,
                       cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode in (0, 1), r.stderr


@pytest.mark.parametrize("args, field", [
    (("missing.toml", "--execution-out", "e.json", "--num-procs", "8"), "missing.toml: (file)"),
    (("ds.json", "--model-out", "m.json", "--execution-out", "e.json"), "--model-card"),
    (("ds.json", "--execution-out", "e.json", "--format", "xla"), "--format"),
    (("ds.json", "--execution-out", "e.json", "--model-out", "e.json"), "--execution-out"),
    (("config.json", "--model-out", "m.json", "--execution-out", "e.json"), "--execution-out"),
    (("bad.toml", "--model-out", "m.json", "--execution-out", "e.json",
      "--model-card", "config.json", "--num-procs", "8"), "bad.toml: training.seq_len"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, args, field):
    (tmp_path / "ds.json").write_text(json.dumps(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
         "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
         "zero_optimization": {"stage": 3}, "autopar_launcher": {"world_size": 8}}))
    (tmp_path / "config.json").write_text(json.dumps(HF["llama2-70B"]))
    (tmp_path / "bad.toml").write_text('[training]\nseq_len = -4\n')
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "e.json").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_deepspeed_without_a_card_writes_the_execution_only(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
         "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
         "zero_optimization": {"stage": 3}, "autopar_launcher": {"world_size": 8}}))
    r = cli("ds.json", "--execution-out", "e.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    e = json.loads((tmp_path / "e.json").read_text())
    assert (e["num_procs"], e["data_par"], e["weight_sharding"]) == (8, 8, True)
    assert e["data_par_overlap"] is True                      # stage 3's default
    assert "deepspeed-zero3" in r.stdout


# --------------------------------------------------------------------------
# The frameworks' own config code (optional extra ``launch-check``; CI
# installs it where it can, .ci/run)

def _exported(fmt, best_layouts, limit=12):
    """Up to ``limit`` (model, layout) pairs the format writes, from the
    spaces' best layouts as that framework runs them."""
    out = []
    for _, model, ex in best_layouts:
        for layout in (ex, as_run_by(fmt, ex)):
            if layout["data_par"] > 1 and get(fmt).refuse_layout(model, layout) is None:
                out.append((model, layout))
    assert out, fmt
    step = max(1, len(out) // limit)
    return out[::step][:limit]


def test_torchtitan_builds_its_job_config_from_the_export(best_layouts, tmp_path):
    pytest.importorskip("tyro", reason="torchtitan's config code (extra launch-check) "
                                       "is not installed")
    cfg_mod = pytest.importorskip("torchtitan.config", reason="torchtitan 0.2.x (extra "
                                  "launch-check) is not installed")
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    seen_pp = 0
    for i, (model, ex) in enumerate(_exported("torchtitan", best_layouts)):
        p = tmp_path / f"{i}.toml"
        p.write_text(get("torchtitan").write(model, ex))
        job = cfg_mod.ConfigManager().parse_args(["--job.config_file", str(p)])
        par, tr = job.parallelism, job.training
        dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                            dp_shard=par.data_parallel_shard_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                            etp=par.expert_tensor_parallel_degree, world_size=ex["num_procs"])
        assert dims.dp_replicate * dims.dp_shard == ex["data_par"]
        assert tr.global_batch_size == ex["batch_size"] and tr.seq_len == model.seq_size
        assert job.activation_checkpoint.mode == ex["activation_recompute"]
        if ex["pipeline_par"] > 1:
            seen_pp += 1
            full_ex = full(ex)
            stages = ex["pipeline_par"] * ex["pipeline_interleaving"]
            # torchtitan's own split with the embedding / loss weights is the one written
            assert par.module_fqns_per_model_part == generate_llm_fqn_per_model_part(
                stages, model.num_blocks, int(full_ex["embedding_in_split"]),
                int(full_ex["loss_in_split"]))
            assert tr.local_batch_size // par.pipeline_parallel_microbatch_size \
                == ex["batch_size"] // ex["data_par"] // ex["microbatch_size"]
        else:
            assert tr.local_batch_size == ex["microbatch_size"]
    assert seen_pp >= 1                                # a pipelined split was checked


def test_deepspeed_builds_its_config_from_the_export(best_layouts, monkeypatch):
    dsc = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed (extra "
                              "launch-check) is not installed")
    # no process group here: DeepSpeed takes the data-parallel size from the mpu
    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    for model, ex in _exported("deepspeed", best_layouts):
        data = json.loads(get("deepspeed").write(model, ex))

        cfg = dsc.DeepSpeedConfig(data, mpu=DeepSpeedMPU(ex))      # DeepSpeed's own checks run
        full_ex = full(ex)
        assert cfg.train_batch_size == ex["batch_size"]
        assert cfg.train_micro_batch_size_per_gpu == ex["microbatch_size"]
        assert cfg.zero_optimization_stage == (0 if not ex["optimizer_sharding"] else
                                               3 if full_ex["weight_sharding"] else
                                               1 if full_ex["unsharded_grads"] else 2)
        assert bool(cfg.zero_config.overlap_comm) == ex["data_par_overlap"]
        assert cfg.bfloat16_config.enabled == (ex["datatype"] == "bfloat16")


def test_cli_torchtitan_leftover_shard_degree_takes_num_procs(tmp_path):
    """A job config as torchtitan's own ship (shard degree -1: the ranks left
    over, no global batch, selective AC): --num-procs settles the data
    parallelism and the batch; the recompute mode stays unknown (null)."""
    (tmp_path / "t.toml").write_text(
        '[job]\ndump_folder = "./outputs"\n[model]\nname = "llama3"\nflavor = "8B"\n'
        '[training]\nlocal_batch_size = 2\nseq_len = 8192\n'
        '[parallelism]\ndata_parallel_replicate_degree = 1\ndata_parallel_shard_degree = -1\n'
        'tensor_parallel_degree = 2\n'
        '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n')
    r = cli("t.toml", "--execution-out", "e.json", cwd=tmp_path)
    assert r.returncode == 2 and "--num-procs" in r.stderr
    r = cli("t.toml", "--execution-out", "e.json", "--num-procs", "16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    e = json.loads((tmp_path / "e.json").read_text())
    assert (e["num_procs"], e["data_par"], e["batch_size"], e["microbatch_size"]) == (16, 8, 16, 2)
    assert e["activation_recompute"] is None and e["weight_sharding"] is True
    assert "selective" in r.stdout                          # said, as a note
    r = cli("t.toml", "--execution-out", "e2.json", "--num-procs", "15", cwd=tmp_path)
    assert r.returncode == 2 and "data_parallel_shard_degree" in r.stderr
    assert not (tmp_path / "e2.json").exists()


def test_detect_tells_the_formats_apart():
    from autopar.io.launch import detect
    assert detect('[training]\nseq_len = 4096\n', "x.cfg") == "torchtitan"
    assert detect('{"model_type": "llama"}', "c.json") == "hf"
    assert detect('{"zero_optimization": {"stage": 1}}', "c.json") == "deepspeed"
    assert detect("torchrun pretrain_gpt.py --tensor-model-parallel-size 2", "run.sh") \
        == "megatron"
    assert detect("trainer.devices=8\nmodel.tensor_model_parallel_size=2\n", "o.txt") == "bridge"
    for text in ('{"hello": 1}', "just words"):
        with pytest.raises(SpecError, match="--format"):
            detect(text, "f")


def test_deepspeed_names_its_spec_only_within_the_specs_options(tmp_path):
    p = tmp_path / "ds.json"
    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 1},
           "autopar_launcher": {"world_size": 16, "tensor_model_parallel_size": 2,
                                "sequence_parallel": True, "recompute_granularity": "selective"}}
    p.write_text(json.dumps(cfg))
    _, imp = read_config(p)
    assert imp.framework is None and any("tensor / sequence" in n for n in imp.notes)
    ex = imp.execution
    assert (ex["data_par"], ex["tensor_par_comm_type"], ex["seq_par_ag_redo"],
            ex["activation_recompute"]) == (8, "rs_ag", True, "attn_only")
    options = load_framework("deepspeed-zero1").options
    assert options["tensor_par"] == [1] or tuple(options["tensor_par"]) == (1,)
    cfg["autopar_launcher"].update(tensor_model_parallel_size=1, world_size=8)
    p.write_text(json.dumps(cfg))
    assert read_config(p)[1].framework == "deepspeed-zero1"


def test_megatron_squared_relu_hybrid_is_the_gpt_block():
    """Megatron-LM's Nemotron 3 scripts: --normalization RMSNorm with
    --squared-relu (no --swiglu) on a hybrid model reads as the gpt block
    (Nemotron-H's squared-ReLU MLP, as the Hugging Face nemotron_h import);
    on a plain GPT model the pair is still refused."""
    base = ("torchrun pretrain_mamba.py --num-layers 4 --hidden-size 256 "
            "--num-attention-heads 4 --ffn-hidden-size 512 --seq-length 1024 "
            "--normalization RMSNorm --squared-relu ")
    m = get("megatron").read(base + "--is-hybrid-model --hybrid-layer-pattern 'M-M*'", "r.sh").model
    assert m["block"] == "gpt" and m["hybrid_override_pattern"] == "M-M*"
    with pytest.raises(SpecError, match="--normalization"):
        get("megatron").read(base, "r.sh")
