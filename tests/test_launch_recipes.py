"""Issue 28's recipe fields in the launch formats: what each framework's
config states (Megatron-LM's --optimizer sgd, --fp4-format e2m1 --fp4-recipe
nvfp4) round-trips; what it cannot state (Muon, Adafactor, LoRA adapters,
MXFP4; in torchtitan and DeepSpeed any optimizer but Adam) is refused in one
line naming the format and the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.io.errors import SpecError
from autopar.io.launch import get
from autopar.io.launch.expressible import full
from autopar.io.specs import load_model
from conftest import DeepSpeedMPU, launch_round_trip

ROOT = Path(__file__).resolve().parents[1]
LLAMA = load_model(ROOT / "models" / "llama2-7B.json")

BASE = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 1, "data_par": 4,
        "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
        "batch_size": 64, "microbatch_size": 2, "datatype": "bfloat16",
        "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": "none", "pipeline_interleaving": 1,
        "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": True,
        "weight_offload": False, "activations_offload": False, "optimizer_offload": False,
        "training": True, "attention_impl": "flash_v2", "fused_norm": True,
        "unsharded_grads": True}


# what torchtitan runs (FSDP2: everything sharded, fp32 gradients)
AS_RUN = {"torchtitan": {"fp32_grads": True, "unsharded_grads": False, "weight_sharding": True},
          "bridge": {"fp32_grads": True},
          "deepspeed": {"seq_par_ag_redo": True}}


def _megatron_back(ex):
    F = get("megatron")
    assert F.refuse_layout(LLAMA, ex) is None, F.refuse_layout(LLAMA, ex)
    text = F.write(LLAMA, ex)
    return text, F.read(text, "run.sh").execution


def test_megatron_writes_and_reads_sgd_and_nvfp4():
    text, back = _megatron_back({**BASE, "optimizer": "sgd", "fp8_recipe": "nvfp4"})
    assert "--optimizer sgd" in text
    assert "--fp4-format e2m1" in text and "--fp4-recipe nvfp4" in text
    assert "--fp8-format" not in text
    assert back["optimizer"] == "sgd" and back["fp8_recipe"] == "nvfp4"


def test_megatron_adam_is_its_default_and_not_written():
    text, back = _megatron_back(dict(BASE))
    assert "--optimizer" not in text and "--fp4" not in text
    assert back.get("optimizer", "adam") == "adam"


# what each format still cannot state (on BASE: ZeRO-1, no offload), and the
# word its reason names (the framework source it stands on)
REFUSED = {
    "megatron": {("optimizer", "adafactor"): "Adafactor", ("adapter", "lora"): "LoRA",
                 ("adapter", "qlora"): "LoRA", ("fp8_recipe", "mxfp4"): "MXFP4"},
    "bridge": {("optimizer", "adafactor"): "Adafactor", ("adapter", "qlora"): "NF4",
               ("fp8_recipe", "mxfp4"): "MXFP4"},
    "torchtitan": {("optimizer", "muon"): "DistMuon", ("optimizer", "adafactor"): "AdamW",
                   ("adapter", "lora"): "lora.py", ("adapter", "qlora"): "LoRA",
                   ("fp8_recipe", "mxfp4"): "mxfp8"},
    "deepspeed": {("optimizer", "adafactor"): "ZeRO", ("adapter", "lora"): "LoRAConfig",
                  ("adapter", "qlora"): "LoRAConfig", ("fp8_recipe", "mxfp4"): "recipe"},
}


@pytest.mark.parametrize("fmt,field,value", [(f, a, b) for f, d in REFUSED.items()
                                             for a, b in d])
def test_what_a_framework_cannot_state_is_refused(fmt, field, value):
    model = LLAMA
    ex = full({**BASE, **AS_RUN.get(fmt, {}), field: value})
    assert get(fmt).refuse_layout(model, full({**BASE, **AS_RUN.get(fmt, {})})) is None
    why = get(fmt).refuse_layout(model, ex)
    assert why is not None and why.startswith(f"{fmt}: ") and "\n" not in why
    assert field in why and REFUSED[fmt][(field, value)] in why, why


@pytest.mark.parametrize("fmt", ["torchtitan", "deepspeed", "bridge"])
def test_sgd_or_nvfp4_refused_where_the_format_does_not_write_them(fmt):
    F = get(fmt)
    if fmt != "bridge":
        assert "optimizer" in F.refuse_layout(LLAMA, full({**BASE, **AS_RUN.get(fmt, {}),
                                                            "optimizer": "sgd"}))
    assert "fp8_recipe" in F.refuse_layout(LLAMA, full({**BASE, **AS_RUN.get(fmt, {}),
                                                        "fp8_recipe": "nvfp4"}))


@pytest.mark.parametrize("fmt", ["torchtitan", "deepspeed"])
def test_hybrid_mamba_models_are_refused_in_one_line(fmt):
    why = get(fmt).refuse_model(load_model(ROOT / "models" / "nemotron-h-8B.json"))
    assert why is not None and why.startswith(f"{fmt}: ") and "\n" not in why


def test_derived_fields_are_cut_to_what_the_format_writes(tmp_path):
    """On B200 the modern space's derived fp8_recipe may be mxfp4 (the fastest
    here); under --format megatron the search keeps to what Megatron-LM
    launches (nvfp4), instead of refusing the space or the found layout."""
    import json
    import subprocess
    import sys
    base = [sys.executable, "-m", "autopar.cli", "exhaustive", str(ROOT / "models/llama2-7B.json"),
            str(ROOT / "systems/b200_nvl8.json"), "--num-procs", "8", "--max-batch-size", "64",
            "--datatype", "bfloat16", "--space", "modern"]
    plain = subprocess.run(base + ["--output", str(tmp_path / "best.json")], cwd=ROOT,
                           capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert json.loads((tmp_path / "best.json").read_text())["fp8_recipe"] == "mxfp4"
    run = subprocess.run(base + ["--format", "megatron", "--output", str(tmp_path / "best.sh")],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    back = get("megatron").read((tmp_path / "best.sh").read_text(), "best.sh").execution
    assert back["fp8_recipe"] == "nvfp4"


def test_megatron_writes_and_reads_the_recipes_bf16_blocks():
    """--first-last-layers-bf16 with the counts (Megatron-LM arguments.py)."""
    text, back = _megatron_back({**BASE, "fp8_recipe": "nvfp4", "bf16_first_blocks": 1,
                                 "bf16_last_blocks": 2})
    assert "--first-last-layers-bf16" in text
    assert "--num-layers-at-start-in-bf16 1" in text and "--num-layers-at-end-in-bf16 2" in text
    assert (back["bf16_first_blocks"], back["bf16_last_blocks"]) == (1, 2)
    text, back = _megatron_back({**BASE, "fp8_recipe": "tensorwise"})
    assert "--first-last-layers-bf16" not in text
    assert (back["bf16_first_blocks"], back["bf16_last_blocks"]) == (0, 0)


# ---------------------------------------------------------------------------
# Newly written (issue 28, launch exports): Muon, hybrid Mamba models, LoRA

NEMOTRON_H = load_model(ROOT / "models" / "nemotron-h-8B.json")
NANO = load_model(ROOT / "models" / "nemotron3-nano-30B-A3B.json")

# the arguments written for these workloads, as NVIDIA/Megatron-LM@d98e8a6
# names them (megatron/training/arguments.py: --optimizer choices,
# --muon-tp-mode, --hybrid-layer-pattern; transformer_config.py mamba_* fields,
# generated as --mamba-*); facts, since Megatron-LM's training code is not
# installed here
NEW_NAMES = {"--optimizer", "--muon-tp-mode", "--hybrid-layer-pattern", "--mamba-num-heads",
             "--mamba-head-dim", "--mamba-state-dim", "--mamba-num-groups"}


def test_megatron_writes_and_reads_muon():
    text, back = launch_round_trip("megatron", LLAMA, {**BASE, "optimizer": "muon"})
    assert "--optimizer muon" in text and "--muon-tp-mode distributed" in text
    # the layer-wise distributed optimizer is --use-distributed-optimizer with muon
    assert "--use-distributed-optimizer" in text
    ex = back.execution
    assert ex["optimizer"] == "muon" and ex["optimizer_sharding"] and ex["unsharded_grads"]
    # unsharded Muon: no --use-distributed-optimizer
    text, back = launch_round_trip("megatron", LLAMA, {**BASE, "optimizer": "muon",
                                            "optimizer_sharding": False})
    assert "--use-distributed-optimizer" not in text
    assert back.execution["optimizer_sharding"] is False
    # the deprecated dist_muon reads as Muon with the layer-wise sharding
    old = text.replace("--optimizer muon", "--optimizer dist_muon")
    ex = get("megatron").read(old, "old.sh").execution
    assert ex["optimizer"] == "muon" and ex["optimizer_sharding"]


@pytest.mark.parametrize("change,needle", [
    ({"unsharded_grads": False}, "Megatron-FSDP"),
    ({"unsharded_grads": False, "weight_sharding": True}, "Megatron-FSDP"),
    ({"sharding_group": 2, "data_par": 4}, "layer-wise"),
    ({"optimizer_offload": True}, "optimizer_cpu_offload")])
@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_muon_refused_where_megatron_core_does_not_run_it(fmt, change, needle):
    why = get(fmt).refuse_layout(LLAMA, full({**BASE, **AS_RUN.get(fmt, {}),
                                              "optimizer": "muon", **change}))
    assert why and why.startswith(f"{fmt}: optimizer=muon") and needle in why, why


def test_megatron_reads_other_emerging_optimizers_as_an_error():
    text = get("megatron").write(LLAMA, {**BASE, "optimizer": "muon"})
    with pytest.raises(SpecError) as err:
        get("megatron").read(text.replace("--optimizer muon", "--optimizer lion"), "x.sh")
    assert err.value.field == "--optimizer"
    with pytest.raises(SpecError) as err:
        get("megatron").read(text.replace("--muon-tp-mode distributed",
                                          "--muon-num-ns-steps 8"), "x.sh")
    assert err.value.field == "--muon-num-ns-steps"


def test_bridge_writes_and_reads_muon():
    text, back = launch_round_trip("bridge", LLAMA, {**BASE, "fp32_grads": True, "optimizer": "muon"})
    lines = set(text.splitlines())
    assert {"optimizer.optimizer=muon", "optimizer.muon_tp_mode=distributed",
            "optimizer.use_layer_wise_distributed_optimizer=true",
            "ddp.use_distributed_optimizer=false"} <= lines
    assert back.execution["optimizer"] == "muon" and back.execution["optimizer_sharding"]


def _blocks(model, ex):
    from autopar.model.pipeline import stage_split
    return stage_split(model.num_blocks, ex["pipeline_par"], ex.get("pipeline_interleaving", 1),
                       ex.get("first_stage_blocks", 0), ex.get("last_stage_blocks", 0),
                       ex.get("embedding_in_split", False), ex.get("loss_in_split", False),
                       ex.get("pipeline_layout") == "balanced")


HYBRID_SPLITS = [
    {},
    {"pipeline_par": 2, "data_par": 2},
    {"pipeline_par": 2, "data_par": 2, "pipeline_interleaving": 2},
    {"pipeline_par": 2, "data_par": 2, "pipeline_layout": "balanced", "loss_in_split": True,
     "pipeline_interleaving": 3},
    {"pipeline_par": 4, "data_par": 1, "first_stage_blocks": 10, "last_stage_blocks": 12},
    {"pipeline_par": 3, "data_par": 1, "num_procs": 6, "embedding_in_split": True,
     "loss_in_split": True, "pipeline_interleaving": 2},
]


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
@pytest.mark.parametrize("split", HYBRID_SPLITS)
def test_hybrid_model_round_trips(fmt, split):
    ex = {**BASE, **AS_RUN.get(fmt, {}), **split}
    text, back = launch_round_trip(fmt, NEMOTRON_H, ex)
    m, got = back.model, back.execution
    assert m["hybrid_override_pattern"] == NEMOTRON_H.hybrid_pattern
    assert m["num_blocks"] == NEMOTRON_H.num_blocks == 52
    mb = NEMOTRON_H.mamba
    assert m["mamba"] == {"heads": mb.heads, "head_dim": mb.head_dim, "state": mb.state,
                          "groups": mb.groups, "conv_kernel": 4, "chunk": 128}
    p, v = ex["pipeline_par"], ex.get("pipeline_interleaving", 1)
    key = "--hybrid-layer-pattern " if fmt == "megatron" else "model.hybrid_layer_pattern="
    pattern = next(x for x in text.splitlines() if key in x).split(key[-1] if fmt == "bridge"
                                                                    else key)[1]
    assert pattern.strip(" \\'").count("|") == (p * v - 1 if p * v > 1 else 0)
    assert got["pipeline_interleaving"] == v
    if p > 1:
        # the same blocks on every stage (equivalent spellings may differ)
        assert _blocks(NEMOTRON_H, {**ex, **got}) == _blocks(NEMOTRON_H, ex)
    assert ("--position-embedding-type none" if fmt == "megatron"
            else "model.position_embedding_type=none") in text
    if fmt == "megatron":
        assert "pretrain_hybrid.py" in text and "pretrain_gpt.py" not in text
        assert "--num-virtual-stages-per-pipeline-rank" not in text
        assert "--account-for-" not in text and "--decoder-first" not in text
        import re
        for arg in set(re.findall(r"(--[a-z0-9-]+)", text)) - set(re.findall(
                r"(--[a-z0-9-]+)", get("megatron").write(LLAMA, {**BASE, **split}))):
            assert arg in NEW_NAMES, arg


def test_hybrid_moe_model_round_trips():
    ex = {**BASE, "expert_par": 4, "expert_tensor_par": 1, "moe_dispatcher": "alltoall"}
    text, back = launch_round_trip("megatron", NANO, ex)
    assert back.model["hybrid_override_pattern"] == NANO.hybrid_pattern
    assert back.model["moe"]["experts"] == 128 and back.model["moe"]["top_k"] == 6
    assert "first_dense" not in back.model["moe"]
    assert back.execution["expert_par"] == 4


def test_megatron_reads_the_deprecated_mamba_script():
    """pretrain_mamba.py --hybrid-override-pattern (the deprecated spellings,
    arguments.py forwards the pattern)."""
    text = get("megatron").write(NEMOTRON_H, dict(BASE))
    old = text.replace("pretrain_hybrid.py", "pretrain_mamba.py").replace(
        "--hybrid-layer-pattern", "--hybrid-override-pattern").replace(
        "    --mamba-num-heads 128 \\\n", "")
    back = get("megatron").read(old, "old.sh")
    assert back.model["hybrid_override_pattern"] == NEMOTRON_H.hybrid_pattern
    # absent --mamba-num-heads: MambaMixer's expand 2 x hidden / head_dim
    assert back.model["mamba"]["heads"] == 2 * 4096 // 64


def test_hybrid_refusals_and_read_errors():
    import dataclasses
    odd = dataclasses.replace(NEMOTRON_H, mamba=dataclasses.replace(NEMOTRON_H.mamba,
                                                                     conv_kernel=3))
    for fmt in ("megatron", "bridge"):
        why = get(fmt).refuse_model(odd)
        assert why and why.startswith(f"{fmt}: ") and "mamba.conv_kernel=3" in why
    # the SSD chunk: fixed in Megatron-LM (MambaMixer), a provider field in Bridge
    big = dataclasses.replace(NEMOTRON_H, mamba=dataclasses.replace(NEMOTRON_H.mamba, chunk=256))
    assert "mamba.chunk=256" in get("megatron").refuse_model(big)
    text, back = launch_round_trip("bridge", big, {**BASE, "fp32_grads": True})
    assert "model.mamba_chunk_size=256" in text.splitlines()
    assert back.model["mamba"]["chunk"] == 256
    text = get("megatron").write(NEMOTRON_H, dict(BASE))
    pat = NEMOTRON_H.hybrid_pattern
    with pytest.raises(SpecError) as err:
        get("megatron").read(text.replace(pat, pat[:-1] + "G"), "x.sh")
    assert err.value.field == "--hybrid-layer-pattern" and "'G'" in str(err.value)
    two = text.replace("--pipeline-model-parallel-size 1", "--pipeline-model-parallel-size 2")
    two = two.replace("NUM_GPUS=8", "NUM_GPUS=16")
    # three segments on two stages
    with pytest.raises(SpecError) as err:
        get("megatron").read(two.replace(pat, pat[:20] + "|" + pat[20:30] + "|" + pat[30:]),
                             "x.sh")
    assert err.value.field == "--hybrid-layer-pattern" and "multiple" in str(err.value)
    # virtual stages of 20, 10, 12, 10 layers: no split autopar states but
    # an explicit layout of those layers
    four = "|".join((pat[:20], pat[20:30], pat[30:42], pat[42:]))
    ex = get("megatron").read(two.replace(pat, four), "x.sh").execution
    assert (ex["pipeline_layout"], ex["pipeline_interleaving"]) == \
        ("Et*20|t*10|t*12|t*10L", 2)
    # no pipes on two stages: Megatron-Core's even split (select_pipeline_segment),
    # or its first/last stage sizes
    ex = get("megatron").read(two, "x.sh").execution
    assert (ex["pipeline_layout"], ex["first_stage_blocks"], ex["pipeline_interleaving"]) == \
        ("even", 0, 1)
    ex = get("megatron").read(two.replace("--pipeline-model-parallel-size 2",
                                          "--pipeline-model-parallel-size 2 "
                                          "--decoder-first-pipeline-num-layers 20"),
                              "x.sh").execution
    assert ex["first_stage_blocks"] == 20
    # the deprecated spelling's errors name it
    with pytest.raises(SpecError) as err:
        get("megatron").read(two.replace(pat, pat[:20] + "|" + pat[20:30] + "|" + pat[30:])
                             .replace("--hybrid-layer-pattern", "--hybrid-override-pattern"),
                             "x.sh")
    assert err.value.field == "--hybrid-override-pattern"
    # 51 and 1: the first and last stage sizes
    ex = get("megatron").read(two.replace(pat, pat[:51] + "|" + pat[51:]), "x.sh").execution
    assert (ex["first_stage_blocks"], ex["last_stage_blocks"]) == (51, 1)


@pytest.mark.parametrize("targets,modules", [
    ("all", "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"),
    ("attention", "[linear_qkv,linear_proj]")])
def test_bridge_writes_and_reads_lora(targets, modules):
    ex = {**BASE, "fp32_grads": True, "adapter": "lora", "adapter_rank": 8,
          "adapter_targets": targets}
    text, back = launch_round_trip("bridge", LLAMA, ex)
    lines = text.splitlines()
    assert "peft.dim=8" in lines and f"peft.target_modules={modules}" in lines
    assert "--" not in text          # launcher flags would make the file read as Megatron's
    got = back.execution
    assert (got["adapter"], got["adapter_rank"], got["adapter_targets"]) == ("lora", 8, targets)
    # no peft keys: the recipe's (pre-training) adapters, left out
    plain = get("bridge").read("\n".join(x for x in lines if not x.startswith("peft.")), "x")
    assert "adapter" not in plain.execution


def test_bridge_lora_refusals_and_read_errors():
    F = get("bridge")
    why = F.refuse_layout(LLAMA, full({**BASE, "fp32_grads": True, "adapter": "lora",
                                       "adapter_targets": "qv"}))
    assert why and why.startswith("bridge: adapter_targets=qv") and "linear_qkv" in why
    with pytest.raises(SpecError) as err:
        F.read("model.tensor_model_parallel_size=2\npeft.target_modules=[linear_fc1]\n", "x")
    assert err.value.field == "peft.target_modules"
    # the fused projection alone is the ``qkv`` target (NeMo's default)
    ex = F.read("peft.dim=8\npeft.target_modules=[linear_qkv]\n", "x").execution
    assert (ex["adapter_rank"], ex["adapter_targets"]) == (8, "qkv")
    # LoRA's own defaults (lora.py: dim 32, every linear layer)
    ex = F.read("peft.dim=32\n", "x").execution
    assert (ex["adapter_rank"], ex["adapter_targets"]) == (32, "all")


def test_deepspeed_writes_and_reads_muon_and_adafactor():
    import json
    F = get("deepspeed")
    ex = {**BASE, **AS_RUN["deepspeed"], "optimizer": "muon"}
    text, back = launch_round_trip("deepspeed", LLAMA, ex)
    cfg = json.loads(text)
    assert cfg["optimizer"] == {"type": "Muon", "params": {"ns_method": "standard"}}
    assert back.execution["optimizer"] == "muon"
    assert not any("Gram" in n for n in back.notes)
    # DeepSpeed's default Gram Newton-Schulz: read, with a note
    cfg["optimizer"] = {"type": "Muon"}
    gram = F.read(json.dumps(cfg), "ds.json")
    assert gram.execution["optimizer"] == "muon" and any("Gram" in n for n in gram.notes)
    # Muon without ZeRO: refused (its Newton-Schulz step is ZeRO's)
    why = F.refuse_layout(LLAMA, full({**ex, "optimizer_sharding": False,
                                       "data_par_overlap": False}))
    assert why and "optimizer=muon" in why and "ZeRO" in why
    # Adafactor: plain data parallelism only
    ada = {**ex, "optimizer": "adafactor", "optimizer_sharding": False, "unsharded_grads": False,
           "data_par_overlap": False}
    text, back = launch_round_trip("deepspeed", LLAMA, ada)
    assert json.loads(text)["optimizer"] == {"type": "Adafactor"}
    assert back.execution["optimizer"] == "adafactor"
    cfg["optimizer"] = {"type": "Lion"}
    with pytest.raises(SpecError) as err:
        F.read(json.dumps(cfg), "ds.json")
    assert err.value.field == "optimizer.type"


def _space(tmp_path, name, **edits):
    """A copy of the finetune space with its fixed recipe changed."""
    text = (ROOT / "search_spaces" / "finetune.yaml").read_text()
    text = text.replace("name: finetune", f"name: {name}")
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["hybrid", "lora", "muon"])
def test_cli_exhaustive_export_import_round_trip(tmp_path, case):
    """exhaustive --format F writes the best layout; autopar import reads back
    the same layout (and model), which estimate --partial then predicts."""
    import json
    import subprocess
    import sys
    from autopar.io.launch.mcore import NOT_SETTINGS
    model, fmt, suffix = "llama2-7B", "megatron", "sh"
    if case == "hybrid":
        model, space = "nemotron-h-8B", "modern"
    elif case == "lora":
        fmt, suffix = "bridge", "overrides"
        space = _space(tmp_path, "lora", **{"fp32_grads: false": "fp32_grads: true"})
    else:
        # unsharded_grads searched: cut to what Megatron's Muon runs with
        # (no Megatron-FSDP) before the search, not refused after it
        space = _space(tmp_path, "muon", **{"adapter: lora": "adapter: none",
                                            "optimizer: adam": "optimizer: muon"})
    run = [sys.executable, "-m", "autopar.cli"]
    base = run + ["exhaustive", str(ROOT / f"models/{model}.json"),
                  str(ROOT / "systems/h100_80g_nvl8.json"), "--num-procs", "16",
                  "--max-batch-size", "64", "--datatype", "bfloat16", "--space", space]
    out = tmp_path / f"best.{suffix}"
    for args in (["--output", str(tmp_path / "best.json")],
                 ["--format", fmt, "--output", str(out)]):
        r = subprocess.run(base + args, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    r = subprocess.run(run + ["import", str(out), "--num-procs", "16", "--model-out",
                              str(tmp_path / "m.json"), "--execution-out",
                              str(tmp_path / "ex.json")], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    best = json.loads((tmp_path / "best.json").read_text())
    back = json.loads((tmp_path / "ex.json").read_text())
    text = out.read_text()
    for f, v in back.items():
        if v is None or f in NOT_SETTINGS or f not in best:
            continue
        if f == "tensor_par_comm_type" and best["tensor_par"] == 1:
            continue
        assert v == best[f], (f, v, best[f], text)
    got = json.loads((tmp_path / "m.json").read_text())
    if case == "hybrid":
        assert "pretrain_hybrid.py" in text
        assert got["hybrid_override_pattern"] == NEMOTRON_H.hybrid_pattern
        assert got["mamba"]["heads"] == NEMOTRON_H.mamba.heads
    elif case == "lora":
        # (an execution file leaves extension fields at their defaults out)
        assert (back["adapter"], back.get("adapter_rank", 16),
                back.get("adapter_targets", "all")) == ("lora", 16, "all")
        assert "peft.dim=16" in text
    else:
        assert back["optimizer"] == "muon" and "--optimizer muon" in text
    r = subprocess.run(run + ["estimate", str(tmp_path / "m.json"),
                              str(ROOT / "systems/h100_80g_nvl8.json"), str(tmp_path / "ex.json"),
                              "--framework", "megatron-bridge" if fmt == "bridge"
                              else "megatron-core", "--partial"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_muon_spaces_are_cut_to_what_the_format_runs(tmp_path):
    """A space that fixes Muon searches only the sharding the format writes
    with it; one that fixes what the format cannot run with Muon is refused
    naming the space's field."""
    from autopar.io.export import format_space
    from autopar.search.space import load_space
    muon = load_space(_space(tmp_path, "muon", **{"optimizer: adam": "optimizer: muon"}))
    assert muon.allowed["unsharded_grads"].ok(False)
    cut = format_space("megatron", muon)
    assert not cut.allowed["unsharded_grads"].ok(False) and cut.allowed["unsharded_grads"].ok(True)
    ds = format_space("deepspeed", muon)
    assert not ds.allowed["optimizer_sharding"].ok(False)
    ada = load_space(_space(tmp_path, "ada", **{"optimizer: adam": "optimizer: adafactor"}))
    assert not format_space("deepspeed", ada).allowed["optimizer_sharding"].ok(True)
    assert format_space("megatron", load_space("finetune")).allowed["unsharded_grads"].ok(False)
    offload = load_space(_space(tmp_path, "muon-offload", **{"optimizer: adam": "optimizer: muon",
                                                    "optimizer_offload: false":
                                                    "optimizer_offload: true"}))
    with pytest.raises(SpecError) as err:
        format_space("megatron", offload)
    assert err.value.field == "fixed.optimizer_offload"


@pytest.mark.parametrize("case", ["hybrid", "muon"])
def test_cli_tune_writes_megatron_for_the_new_workloads(tmp_path, case):
    """tune --format megatron writes the sampled best layout (a hybrid model's
    pretrain_hybrid.py; Muon with the sharding Megatron runs it with), which
    autopar import reads back."""
    import json
    import subprocess
    import sys
    model, space = ("nemotron-h-8B", "modern") if case == "hybrid" else (
        "llama2-7B", _space(tmp_path, "muon", **{"adapter: lora": "adapter: none",
                                                 "optimizer: adam": "optimizer: muon"}))
    run = [sys.executable, "-m", "autopar.cli"]
    out = tmp_path / "best.sh"
    r = subprocess.run(run + ["tune", str(ROOT / f"models/{model}.json"),
                              str(ROOT / "systems/h100_80g_nvl8.json"), "--num-procs", "16",
                              "--max-batch-size", "64", "--datatype", "bfloat16", "--space",
                              space, "--trials", "40", "--seed", "1", "--format", "megatron",
                              "--output", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(run + ["import", str(out), "--model-out", str(tmp_path / "m.json"),
                              "--execution-out", str(tmp_path / "ex.json")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    back = json.loads((tmp_path / "ex.json").read_text())
    if case == "hybrid":
        assert "pretrain_hybrid.py" in out.read_text()
        m = json.loads((tmp_path / "m.json").read_text())
        assert m["hybrid_override_pattern"] == NEMOTRON_H.hybrid_pattern
    else:
        assert back["optimizer"] == "muon"
        assert not back["optimizer_sharding"] or back["unsharded_grads"]


@pytest.mark.parametrize("fmt", ["megatron", "bridge", "torchtitan", "deepspeed"])
def test_sequence_fill_is_the_datas_and_not_refused(fmt):
    """Padded SFT sequences (sequence_fill < 100) are the data's: every
    format writes the layout (the same text as with packed sequences) and
    states nothing of it."""
    F = get(fmt)
    ex = full({**BASE, **AS_RUN.get(fmt, {})})
    assert F.refuse_layout(LLAMA, {**ex, "sequence_fill": 60}) is None
    assert F.write(LLAMA, {**ex, "sequence_fill": 60}) == F.write(LLAMA, ex)
    assert "sequence_fill" not in F.read(F.write(LLAMA, ex), "x").execution


# Megatron-Bridge's overrides built into Megatron-Core's config classes
# (extra "launch-test"; skipped with the reason without it), as
# tests/test_launch_megatron.py does for the other settings: the provider's
# own fields (HybridModelProvider: hybrid_layer_pattern, mamba_chunk_size,
# position_embedding_type) are not TransformerConfig's and are left out.
HYBRID_PROVIDER_ONLY = ("model.hybrid_layer_pattern=", "model.mamba_chunk_size=")


@pytest.mark.parametrize("case", ["muon", "muon_plain", "hybrid", "hybrid_muon_pp"])
def test_megatron_core_builds_bridge_muon_and_hybrid(case):
    from test_launch_megatron import _configs, _megatron_core
    _megatron_core()
    if "muon" in case:
        import dataclasses

        import megatron.core
        from megatron.core.optimizer import OptimizerConfig
        names = {f.name for f in dataclasses.fields(OptimizerConfig)}
        if not {"muon_tp_mode", "use_layer_wise_distributed_optimizer"} <= names:
            pytest.skip(f"the installed megatron-core {megatron.core.__version__} predates "
                        "Muon's OptimizerConfig fields, which the export writes as "
                        "Megatron-LM@d98e8a6 names them")
    model = NEMOTRON_H if case.startswith("hybrid") else LLAMA
    ex = {**BASE, "fp32_grads": True}
    if "muon" in case:
        ex["optimizer"] = "muon"
    if case == "muon_plain":
        ex["optimizer_sharding"] = False
    if case == "hybrid_muon_pp":
        ex.update(pipeline_par=2, data_par=2, pipeline_interleaving=2)
    text = get("bridge").write(model, ex)
    kept = "\n".join(x for x in text.splitlines() if not x.startswith(HYBRID_PROVIDER_ONLY))
    tc, ddp, opt = _configs(kept)
    if "muon" in case:
        assert opt.optimizer == "muon" and opt.muon_tp_mode == "distributed"
        assert opt.use_layer_wise_distributed_optimizer == (case != "muon_plain")
        assert not ddp.use_distributed_optimizer and not opt.use_distributed_optimizer
    if model is NEMOTRON_H:
        mb = NEMOTRON_H.mamba
        assert (tc.mamba_num_heads, tc.mamba_head_dim, tc.mamba_state_dim,
                tc.mamba_num_groups) == (mb.heads, mb.head_dim, mb.state, mb.groups)
        assert tc.num_layers == 52
        assert tc.virtual_pipeline_model_parallel_size == (2 if "pp" in case else None)


def test_deepspeed_builds_its_config_from_muon_and_adafactor(monkeypatch):
    """DeepSpeed's own DeepSpeedConfig (extra launch-check) reads the
    exports: Muon as its own optimizer (runtime/config.py lower-cases the
    names it has), Adafactor as a torch.optim class name (engine.py
    _configure_basic_optimizer falls back to getattr(torch.optim, name))."""
    import json
    dsc = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed (extra "
                              "launch-check) is not installed")
    import torch
    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    for opt, shard in (("muon", True), ("adafactor", False)):
        ex = full({**BASE, **AS_RUN["deepspeed"], "optimizer": opt, "optimizer_sharding": shard,
                   "data_par_overlap": shard})

        cfg = dsc.DeepSpeedConfig(json.loads(get("deepspeed").write(LLAMA, ex)),
                                  mpu=DeepSpeedMPU(ex))
        if opt == "muon":
            assert cfg.optimizer_name == dsc.MUON_OPTIMIZER
            assert cfg.optimizer_params == {"ns_method": "standard"}
            assert cfg.zero_optimization_stage == 1
        else:
            assert cfg.optimizer_name == "Adafactor" and cfg.zero_optimization_stage == 0
            assert hasattr(torch.optim, cfg.optimizer_name)


@pytest.mark.parametrize("fmt", ["torchtitan", "deepspeed"])
def test_recipe_fields_refused_before_the_search(fmt, tmp_path):
    """A space that fixes LoRA (the shipped finetune space) is refused by
    torchtitan and DeepSpeed before any search, with the reason."""
    from autopar.search.space import load_space
    why = get(fmt).refuse_space(LLAMA, load_space("finetune"))
    assert why and why.startswith(f"{fmt}: space finetune has adapter = lora") and "LoRA" in why
    muon = load_space(_space(tmp_path, "muon", **{"adapter: lora": "adapter: none",
                                                  "optimizer: adam": "optimizer: muon"}))
    why = get(fmt).refuse_space(LLAMA, muon)
    assert (why is None) == (fmt == "deepspeed"), why
