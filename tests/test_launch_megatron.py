"""Launch configs for Megatron-LM (``--format megatron``) and Megatron-Bridge
(``--format bridge``): round trips on the shipped spaces' best layouts,
refusals, the reader's syntax and the command line.

The argument and attribute names are checked against the framework's
documented names as facts (Megatron-Core does not build on CPU here; see
``NAMES_AS_FACTS``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework
from autopar.io.launch import get
from autopar.io.launch.mcore import NOT_SETTINGS
from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS
from autopar.io.specs import load_model
from autopar.model.pipeline import stage_split

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("megatron", "bridge")

# (space, model, GPUs, global batch, datatype): small cases, each space's own kind
CASES = [
    ("small", "llama2-7B", 8, 64, "bfloat16"),
    ("llama", "llama2-7B", 8, 64, "bfloat16"),
    ("modern", "llama2-7B", 16, 64, "bfloat16"),
    ("moe", "mixtral-8x7B", 16, 64, "bfloat16"),
    ("calculon", "gpt3-13B", 8, 64, "float16"),
    ("default", "gpt3-13B", 8, 64, "float16"),
]


def _filled(ex: dict, framework: str | None) -> dict:
    """Every field the formats express: stated, else the framework's default
    (a config read back: the framework fills what it leaves out), else
    autopar's (a layout found by a search)."""
    fw = load_framework(framework).defaults if framework else {}
    return {f: ex[f] if f in ex else fw.get(f, EXT_DEFAULTS.get(f))
            for f in ALL_FIELDS if f not in NOT_SETTINGS}


def _same_layout(model, a: dict, b: dict) -> None:
    split = ("embedding_in_split", "loss_in_split")
    diff = {f for f in a if a[f] != b[f]}
    if a["tensor_par"] == 1:
        # one TP rank: no TP traffic, sequence parallelism is refused by
        # TransformerConfig and not written; rs_ag and ar are the same run
        diff.discard("tensor_par_comm_type")
    if diff and diff <= set(split) and a["pipeline_layout"] == "balanced":
        # a balanced layout string is the same split either way (N % stages == 0)
        def per(x):
            return stage_split(model.num_blocks, x["pipeline_par"], x["pipeline_interleaving"],
                               0, 0, x["embedding_in_split"], x["loss_in_split"], True)
        assert per(a) == per(b)
        return
    assert not diff, {f: (a[f], b[f]) for f in diff}


@pytest.fixture(scope="module")
def best_layouts(h100):
    """Each case's top layouts (or the space's refusal per format)."""
    from autopar.search.exhaustive import exhaustive, top_json
    from autopar.search.space import load_space
    out = {}
    for space_name, model_name, n, batch, dt in CASES:
        model = load_model(ROOT / "models" / f"{model_name}.json")
        space = load_space(space_name)
        refused = {f: get(f).refuse_space(model, space) or
                   (get(f).refuse_datatype(dt, space) if get(f).refuse_datatype else None)
                   for f in FORMATS}
        top = {}
        if not all(refused.values()):
            table, _ = exhaustive(model, h100, n, batch, dt, space=space, top_n=4,
                                  batch_policy="fixed")
            top = top_json(table, 4)
        out[space_name] = (model, refused, [e["execution"] for e in top.values()])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("space_name", [c[0] for c in CASES])
def test_round_trip_best_layouts(best_layouts, fmt, space_name):
    model, refused, layouts = best_layouts[space_name]
    lf = get(fmt)
    if refused[fmt]:
        # refused before the search, in one line naming the format and a field
        assert refused[fmt].startswith(f"{fmt}: ") and "=" in refused[fmt]
        assert "\n" not in refused[fmt]
        return
    assert layouts, "the case found no layout"
    for ex in layouts:
        assert lf.refuse_layout(model, ex) is None, (ex, lf.refuse_layout(model, ex))
        text = lf.write(model, ex)
        back = lf.read(text, f"test.{fmt}")
        assert back.framework == lf.framework
        want, got = _filled(ex, None), _filled(back.execution, lf.framework)
        _same_layout(model, want, got)
        for f in ("num_blocks", "hidden", "feedforward", "attn_heads", "attn_size",
                  "seq_size"):
            assert back.model[f] == getattr(model, {"num_blocks": "num_blocks"}.get(f, f))
        if model.moe is not None:
            assert back.model["moe"]["experts"] == model.moe.experts
            assert back.model["moe"]["top_k"] == model.moe.top_k


def test_spaces_that_round_trip(best_layouts):
    """The Megatron-style spaces are written by both formats (not refused)."""
    for name in ("modern", "moe"):
        assert not any(best_layouts[name][1].values()), best_layouts[name][1]
    assert not best_layouts["small"][1]["megatron"]
    assert not best_layouts["llama"][1]["megatron"]


def _plain(**kw):
    ex = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 2, "data_par": 2,
          "tensor_par_net": 0, "pipeline_par_net": 1, "data_par_net": 1, "batch_size": 32,
          "microbatch_size": 2, "datatype": "bfloat16", "fused_activation": True,
          "attention_type": "multihead", "activation_recompute": "full",
          "pipeline_interleaving": 2, "optimizer_sharding": True,
          "tensor_par_comm_type": "rs_ag", "tensor_par_overlap": "none",
          "seq_par_ag_redo": False, "data_par_overlap": True, "weight_offload": False,
          "activations_offload": False, "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2", "fused_norm": True, "unsharded_grads": True,
          "fp32_grads": True}
    ex.update(kw)
    return ex


@pytest.fixture(scope="module")
def llama():
    return load_model(ROOT / "models" / "llama2-7B.json")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("change,field", [
    ({"weight_offload": True}, "weight_offload"),
    ({"activations_offload": True}, "activations_offload"),
    ({"training": False}, "training"),
    ({"tensor_par_comm_type": "p2p_rs_ag"}, "tensor_par_comm_type"),
    ({"tensor_par_overlap": "pipe"}, "tensor_par_overlap"),
    ({"attention_impl": "flash_v1"}, "attention_impl"),
    ({"datatype": "float8"}, "datatype"),
    ({"tensor_par_comm_type": "ar", "tensor_par_overlap": "ring"}, "tensor_par_overlap"),
    ({"sharding_group": 3, "data_par": 2}, "sharding_group"),
    ({"param_gather_overlap": True, "data_par_overlap": False}, "param_gather_overlap"),
    # Megatron-Core's EP all-to-all overlap rules (transformer_config.py)
    ({"moe_overlap": True, "expert_par": 1}, "moe_overlap"),
    ({"moe_overlap": True, "expert_par": 2, "activation_recompute": "attn_only",
      "pipeline_interleaving": 1}, "moe_overlap"),
    ({"moe_overlap": True, "expert_par": 2, "moe_dispatcher": "allgather"}, "moe_overlap"),
])
def test_refuse_layout(llama, fmt, change, field):
    lf = get(fmt)
    why = lf.refuse_layout(llama, _plain(**change))
    assert why and why.startswith(f"{fmt}: {field}="), why
    with pytest.raises(SpecError) as err:
        lf.write(llama, _plain(**change))
    assert field in str(err.value)


def test_bridge_refuses_what_its_recipes_fix(llama):
    lf = get("bridge")
    assert "fp32_grads" in lf.refuse_layout(llama, _plain(fp32_grads=False))
    assert "bridge: fused_norm=false" in lf.refuse_layout(llama, _plain(fused_norm=False))
    assert "bridge: attention_impl=unfused" in lf.refuse_layout(
        llama, _plain(fused_norm=False, attention_impl="unfused"))
    assert "datatype" in lf.refuse_datatype("float32")
    # Megatron-LM says both: --main-grads-dtype bf16 and the local layer spec
    mt = get("megatron")
    text = mt.write(llama, _plain(fp32_grads=False, fused_norm=False, attention_impl="unfused"))
    assert "--main-grads-dtype bf16" in text and "--transformer-impl local" in text
    assert "--no-masked-softmax-fusion" in text
    back = mt.read(text).execution
    assert (back["fp32_grads"], back["fused_norm"], back["attention_impl"]) == \
        (False, False, "unfused")
    # TP overlap is Transformer Engine's userbuffers: not with the local spec
    assert mt.refuse_layout(llama, _plain(fused_norm=False, attention_impl="fused_softmax",
                                          tensor_par_overlap="ring")).startswith(
        "megatron: tensor_par_overlap=ring")


def test_megatron_arguments_written(llama):
    text = get("megatron").write(llama, _plain(recompute_layers=2, context_par=1,
                                               param_gather_overlap=True, sharding_group=1,
                                               data_par=2))
    for arg in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
                "--num-virtual-stages-per-pipeline-rank 2", "--micro-batch-size 2",
                "--global-batch-size 32", "--sequence-parallel",
                "--recompute-granularity full", "--recompute-method block",
                "--recompute-num-layers 2", "--use-distributed-optimizer",
                "--overlap-grad-reduce", "--overlap-param-gather",
                "--num-distributed-optimizer-instances 2", "--bf16", "--attention-backend flash",
                "--num-layers 32", "--hidden-size 4096", "--seq-length 4096", "NUM_GPUS=8",
                "pretrain_gpt.py"):
        assert arg in text, arg


def test_balanced_layout_and_uneven_stages(llama):
    mt = get("megatron")
    ex = _plain(pipeline_par=4, data_par=1, tensor_par=2, pipeline_layout="balanced",
                pipeline_interleaving=3, embedding_in_split=True, loss_in_split=True)
    text = mt.write(llama, ex)
    layout = [a for a in text.split("\\\n") if "--pipeline-model-parallel-layout" in a][0]
    stages = layout.split()[-1].strip("'").split("|")
    assert len(stages) == 12 and stages[0].startswith("E") and stages[-1].endswith("L")
    assert sum(s.count("t") for s in stages) == 32
    back = mt.read(text).execution
    assert back["pipeline_layout"] == "balanced" and back["pipeline_interleaving"] == 3
    ex = _plain(pipeline_par=4, data_par=1, first_stage_blocks=6, last_stage_blocks=6,
                pipeline_interleaving=1, tensor_par=2)
    text = mt.write(llama, ex)
    assert "--decoder-first-pipeline-num-layers 6" in text
    assert "--decoder-last-pipeline-num-layers 6" in text
    back = mt.read(text).execution
    assert (back["first_stage_blocks"], back["last_stage_blocks"]) == (6, 6)


def test_read_megatron_script_syntax(tmp_path):
    mt = get("megatron")
    script = """#!/bin/bash
# a hand-written launch
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nnodes 2 --nproc_per_node 8 \\
    /opt/Megatron-LM/pretrain_gpt.py \\
    --num-layers=32 --hidden-size 4096 --num-attention-heads 32 \\
    --seq-length 4096 --max-position-embeddings 4096 \\
    --tensor-model-parallel-size=4 --pipeline-model-parallel-size 2 \\
    --num-layers-per-virtual-pipeline-stage 4 \\
    --micro-batch-size 1 --global-batch-size 512 \\
    --recompute-activations --use-distributed-optimizer \\
    --lr 3e-4 --data-path /data/x_text_document --save /ckpt --bf16
echo "done: $?"
"""
    got = mt.read(script, "launch.sh")
    ex = got.execution
    assert ex["num_procs"] == 16 and ex["data_par"] == 2
    assert (ex["tensor_par"], ex["pipeline_par"], ex["pipeline_interleaving"]) == (4, 2, 4)
    assert ex["activation_recompute"] == "attn_only"
    assert ex["optimizer_sharding"] and ex["unsharded_grads"]
    assert ex["batch_size"] == 512 and ex["datatype"] == "bfloat16" and ex["fp32_grads"]
    assert got.model["num_blocks"] == 32 and got.model["attn_size"] == 128
    # --num-query-groups without --group-query-attention is ignored, as Megatron does
    assert "kv_heads" not in mt.read(script.replace("--bf16", "--bf16 --num-query-groups 8"),
                                     "launch.sh").model
    assert mt.read(script.replace("--bf16", "--bf16 --group-query-attention "
                                  "--num-query-groups 8"), "launch.sh").model["kv_heads"] == 8


@pytest.mark.parametrize("fmt,text,field", [
    ("megatron", "pretrain_gpt.py --tensor-model-parallel-size two", "--tensor-model-parallel-size"),
    ("megatron", "pretrain_gpt.py --micro-batch-size $MBS", "--micro-batch-size"),
    ("megatron", "pretrain_gpt.py --recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 4", "--recompute-num-layers"),
    ("megatron", "pretrain_gpt.py --cp-comm-type a2a+p2p", "--cp-comm-type"),
    ("megatron", "pretrain_gpt.py --recompute-granularity selective --recompute-modules "
                 "moe_act layernorm", "--recompute-modules"),
    ("bridge", "model.pipeline_model_parallel_size=2\nmodel.sequence_parallel=maybe",
     "model.sequence_parallel"),
    ("bridge", "mixed_precision=bf16_with_nvfp4_mixed", "mixed_precision"),
])
def test_read_errors_name_the_argument(fmt, text, field):
    with pytest.raises(SpecError) as err:
        get(fmt).read(text, "cfg.txt")
    line = str(err.value)
    assert "cfg.txt" in line and field in line and "\n" not in line


def test_read_bridge_leaves_unstated_out():
    got = get("bridge").read("model.tensor_model_parallel_size=4\n"
                             "train.micro_batch_size=2  # a comment\n"
                             "model.recompute_granularity=selective\n"
                             "model.recompute_modules=[mlp]\n", "o.txt")
    assert got.execution["tensor_par"] == 4 and got.execution["microbatch_size"] == 2
    assert got.execution["activation_recompute"] == "mlp_only"
    for f in ("pipeline_par", "optimizer_sharding", "data_par_overlap", "datatype"):
        assert f not in got.execution
    assert got.framework == "megatron-bridge"


def test_cli_exhaustive_writes_megatron(cli, tmp_path):
    out = tmp_path / "best.sh"
    top = tmp_path / "top.json"
    r = cli("exhaustive", "models/llama2-7B.json", "systems/h100_80g_nvl8.json",
            "--num-procs", 8, "--max-batch-size", 64, "--datatype", "bfloat16",
            "--space", "small", "--format", "megatron", "--output", out, "--top", top)
    assert r.returncode == 0, r.stderr
    best = json.loads(top.read_text())["0"]["execution"]
    back = get("megatron").read(out.read_text(), str(out)).execution
    assert _filled(back, "megatron-core") == _filled(best, None)


@pytest.mark.parametrize("fmt,space,needle", [
    ("megatron", "calculon", "weight_offload"),
    ("bridge", "small", "bridge:"),
])
def test_cli_refuses_before_search(cli, tmp_path, fmt, space, needle):
    out = tmp_path / "best.txt"
    r = cli("exhaustive", "models/llama2-7B.json", "systems/h100_80g_nvl8.json",
            "--num-procs", 8, "--max-batch-size", 64, "--datatype", "bfloat16",
            "--space", space, "--format", fmt, "--output", out)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr and "layouts" not in r.stdout
    assert not out.exists()


def test_cli_missing_format_module_is_one_line(cli, tmp_path):
    import importlib.util
    if importlib.util.find_spec("autopar.io.launch.deepspeed") is not None:
        pytest.skip("the deepspeed format is present in this tree")
    r = cli("exhaustive", "models/llama2-7B.json", "systems/h100_80g_nvl8.json",
            "--num-procs", 8, "--max-batch-size", 64, "--datatype", "bfloat16",
            "--space", "small", "--format", "deepspeed", "--output", tmp_path / "ds.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "deepspeed" in r.stderr and "Traceback" not in r.stderr


def test_cli_estimate_converts(cli, tmp_path, llama):
    ex = tmp_path / "ex.json"
    ex.write_text(json.dumps(_plain(num_procs=8, tensor_par=8, pipeline_par=1, data_par=1,
                                    pipeline_interleaving=1, batch_size=8,
                                    microbatch_size=1, optimizer_sharding=False,
                                    unsharded_grads=False, data_par_overlap=False)))
    out = tmp_path / "ex.overrides"
    r = cli("estimate", "models/llama2-7B.json", "systems/h100_80g_nvl8.json", ex,
            "--format", "bridge", "--output", out)
    assert r.returncode == 0, r.stderr
    assert "model.tensor_model_parallel_size=8" in out.read_text()
    r = cli("estimate", "models/llama2-7B.json", "systems/h100_80g_nvl8.json", ex,
            "--format", "bridge")
    assert r.returncode == 2 and "--output" in r.stderr


# Names as the frameworks define them (NVIDIA/Megatron-LM@d98e8a6,
# NVIDIA-NeMo/Megatron-Bridge@067f987), quoted here as facts:
NAMES_AS_FACTS = {
    # megatron/training/arguments.py: explicit add_argument calls
    "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
    "--pipeline-model-parallel-layout", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32",
    "--main-grads-dtype", "--data-parallel-sharding-strategy",
    "--num-distributed-optimizer-instances", "--outer-dp-sharding-strategy",
    "--cp-comm-type", "--ckpt-format", "--optimizer-cpu-offload",
    "--optimizer-offload-fraction", "--use-precision-aware-optimizer",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--swiglu", "--num-experts", "--group-query-attention",
    # generated from TransformerConfig / ModelParallelConfig attributes
    # (argument_utils.py ArgumentGroupFactory: a_b -> --a-b)
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--context-parallel-size", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--sequence-parallel", "--tp-comm-overlap",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--recompute-modules", "--fp8-format", "--fp8-recipe", "--attention-backend",
    "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
    "--overlap-moe-expert-parallel-comm", "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split", "--decoder-last-pipeline-num-layers",
    "--cpu-offloading-num-layers",
}


def test_written_megatron_names_are_documented(llama):
    """Every ``--argument`` the format writes for the layout is one of the
    framework's names above (or a model/run argument of pretrain_gpt.py)."""
    model_args = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                  "--kv-channels", "--vocab-size", "--normalization",
                  "--position-embedding-type", "--disable-bias-linear", "--seq-length",
                  "--max-position-embeddings", "--num-query-groups", "--bf16", "--fp16",
                  "--transformer-impl", "--mock-data", "--tokenizer-type", "--train-iters",
                  "--lr", "--micro-batch-size", "--global-batch-size", "--use-megatron-fsdp",
                  "--nproc-per-node", "--nnodes"}
    import re
    for ex in (_plain(), _plain(optimizer_offload=True),
               _plain(pipeline_par=1, pipeline_interleaving=1, data_par=4,
                      activation_recompute="none", activation_offload_blocks=8),
               _plain(context_par=2, data_par=1, context_par_comm="a2a",
                                fp8_recipe="mxfp8", tensor_par_overlap="ring",
                                weight_sharding=True, unsharded_grads=False),
               _plain(pipeline_par=1, pipeline_interleaving=1, data_par=4,
                      weight_sharding=True, unsharded_grads=False, sharding_group=2,
                      optimizer_outer_sharding=True)):
        text = get("megatron").write(llama, ex)
        for arg in set(re.findall(r"(--[a-z0-9-]+)", text)):
            assert arg in NAMES_AS_FACTS or arg in model_args, arg


# ---------------------------------------------------------------------------
# Megatron-Core's own config objects built from the export (extra
# "launch-test": megatron-core on CPU).  Megatron-Bridge's overrides are
# Megatron-Core config attributes (ConfigContainer: model = a TransformerConfig
# subclass, ddp = DistributedDataParallelConfig, optimizer = OptimizerConfig);
# each dataclass's __post_init__ runs Megatron-Core's own checks (parallel
# sizes against heads and layers, virtual stages, recompute, layouts, ...).

# GPTModelProvider's fields beside TransformerConfig's (Megatron-Bridge
# src/megatron/bridge/models/gpt_provider.py): not TransformerConfig arguments
PROVIDER_ONLY = {"position_embedding_type", "vocab_size", "seq_length"}


def _megatron_core():
    try:
        import warnings
        warnings.filterwarnings("ignore", module="megatron")
        from megatron.core.transformer.transformer_config import TransformerConfig
        return TransformerConfig
    except ImportError as err:
        pytest.skip(f"megatron-core is not installed (extra 'launch-test'): {err}")


def _value(v: str):
    if v in ("true", "false"):
        return v == "true"
    if v == "null":
        return None
    if v.startswith("["):
        return [x for x in v.strip("[]").split(",") if x]
    v = v.strip("'")
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def _configs(text: str):
    """Megatron-Core's TransformerConfig, DistributedDataParallelConfig and
    OptimizerConfig from a Bridge override list."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig
    sec = {"model": {}, "ddp": {}, "optimizer": {}}
    for line in text.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        key, v = line.split("=", 1)
        s, _, attr = key.partition(".")
        if s in sec and attr not in PROVIDER_ONLY:
            sec[s][attr] = _value(v)
    if "attention_backend" in sec["model"]:
        sec["model"]["attention_backend"] = AttnBackend[sec["model"]["attention_backend"]]
    # the precision recipe's fields, as Megatron-Bridge's MixedPrecisionConfig.setup
    # puts them on the model config (mixed_precision.py bf16_mixed and the fp8 recipes)
    import torch
    from autopar.io.launch.bridge import READ_PRECISION
    name = next(line.split("=", 1)[1] for line in text.splitlines()
                if line.startswith("mixed_precision="))
    dt, fp8 = READ_PRECISION[name]
    torch_dt = torch.bfloat16 if dt == "bfloat16" else torch.half
    sec["model"].update({"bf16": dt == "bfloat16", "fp16": dt == "float16",
                         "params_dtype": torch_dt, "pipeline_dtype": torch_dt})
    if fp8 != "none":
        sec["model"].update(fp8="e4m3" if fp8 == "mxfp8" else "hybrid",
                            fp8_recipe={"tensorwise": "tensorwise", "rowwise": "blockwise",
                                        "mxfp8": "mxfp8"}[fp8])
    return (TransformerConfig(**sec["model"]), DistributedDataParallelConfig(**sec["ddp"]),
            OptimizerConfig(**sec["optimizer"]))


@pytest.mark.parametrize("space_name", ["modern", "moe"])
def test_megatron_core_builds_the_best_layouts(best_layouts, space_name, monkeypatch):
    _megatron_core()
    model, _, layouts = best_layouts[space_name]
    if model.moe is not None:
        # MoE with fp8 asks for Transformer Engine >= 1.7 (transformer_config.py);
        # TE does not install on CPU: its version check answers as such a TE,
        # every other check runs as it is
        import megatron.core.transformer.transformer_config as tcm
        monkeypatch.setattr(tcm, "is_te_min_version", lambda *a, **k: True)
    for ex in layouts:
        tc, ddp, opt = _configs(get("bridge").write(model, ex))
        assert tc.tensor_model_parallel_size == ex["tensor_par"]
        assert tc.pipeline_model_parallel_size == ex["pipeline_par"]
        assert tc.context_parallel_size == ex.get("context_par", 1)
        assert ddp.overlap_grad_reduce == ex["data_par_overlap"]


@pytest.mark.parametrize("change", [
    {},
    {"pipeline_par": 4, "data_par": 1, "pipeline_layout": "balanced",
     "pipeline_interleaving": 3, "embedding_in_split": True, "loss_in_split": True},
    {"pipeline_par": 4, "data_par": 1, "first_stage_blocks": 6, "last_stage_blocks": 6,
     "pipeline_interleaving": 1},
    {"pipeline_par": 2, "embedding_in_split": True, "loss_in_split": True,
     "pipeline_interleaving": 1},
    {"activation_recompute": "full", "recompute_layers": 3, "pipeline_interleaving": 1},
    {"activation_recompute": "mlp_only"},
    {"activation_recompute": "attn_only", "tensor_par_overlap": "ring"},
    {"context_par": 2, "data_par": 1, "context_par_comm": "a2a", "fp8_recipe": "rowwise"},
    {"weight_sharding": True, "unsharded_grads": False, "param_gather_overlap": True},
    {"sharding_group": 1, "data_par": 2, "fp8_recipe": "mxfp8"},
    {"optimizer_offload": True},
])
def test_megatron_core_builds_variants(llama, change, monkeypatch):
    _megatron_core()
    if change.get("optimizer_offload"):
        # the precision-aware optimizer asks Transformer Engine's version
        # (optimizer_config.py); TE does not install on CPU: answered as a
        # recent TE, every other check runs as it is
        import megatron.core.optimizer.optimizer_config as occ
        monkeypatch.setattr(occ, "is_te_min_version", lambda *a, **k: True)
    ex = _plain(**change)
    assert get("bridge").refuse_layout(llama, ex) is None
    tc, ddp, opt = _configs(get("bridge").write(llama, ex))
    assert tc.num_layers == llama.num_blocks
    if change.get("pipeline_layout") == "balanced":
        assert tc.pipeline_model_parallel_layout is not None
    if change.get("first_stage_blocks"):
        assert tc.num_layers_in_first_pipeline_stage == 6
    if change.get("optimizer_offload"):
        assert opt.optimizer_cpu_offload and opt.use_precision_aware_optimizer


def test_megatron_core_moe_dispatchers():
    _megatron_core()
    model = load_model(ROOT / "models" / "mixtral-8x7B.json")
    for disp in ("alltoall", "allgather", "deepep"):
        ex = _plain(num_procs=16, data_par=4, expert_par=8, moe_dispatcher=disp,
                    moe_overlap=disp != "allgather", activation_recompute="attn_only")
        tc, _, _ = _configs(get("bridge").write(model, ex))
        assert tc.num_moe_experts == model.moe.experts
        assert tc.moe_token_dispatcher_type == ("flex" if disp == "deepep" else disp)


def test_generated_megatron_arguments_are_config_attributes():
    """The arguments pretrain_gpt.py generates from TransformerConfig
    (a_b -> --a-b, argument_utils.py) name attributes of the installed
    Megatron-Core's config classes."""
    TransformerConfig = _megatron_core()
    import dataclasses
    from megatron.core.distributed import DistributedDataParallelConfig
    names = {f.name for f in dataclasses.fields(TransformerConfig)} | \
        {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    generated = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size", "--sequence-parallel", "--tp-comm-overlap",
                 "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                 "--recompute-modules", "--fp8-recipe", "--attention-backend",
                 "--moe-token-dispatcher-type", "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout",
                 "--overlap-grad-reduce", "--overlap-param-gather",
                 "--data-parallel-sharding-strategy", "--num-distributed-optimizer-instances",
                 "--use-distributed-optimizer")
    missing = [a for a in generated if a[2:].replace("-", "_") not in names]
    assert not missing, missing
