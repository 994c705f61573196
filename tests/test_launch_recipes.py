"""Issue 28's recipe fields in the launch formats: what each framework's
config states (Megatron-LM's --optimizer sgd, --fp4-format e2m1 --fp4-recipe
nvfp4) round-trips; what it cannot state (Muon, Adafactor, LoRA adapters,
MXFP4; in torchtitan and DeepSpeed any optimizer but Adam) is refused in one
line naming the format and the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.io.launch import get
from autopar.io.launch.expressible import full
from autopar.io.specs import load_model

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
    "torchtitan": {("optimizer", "muon"): "adam", ("optimizer", "adafactor"): "adam",
                   ("adapter", "lora"): "none", ("adapter", "qlora"): "none",
                   ("fp8_recipe", "mxfp4"): "mxfp8"},
    "deepspeed": {("optimizer", "adafactor"): "ZeRO", ("adapter", "lora"): "none",
                  ("adapter", "qlora"): "none", ("fp8_recipe", "mxfp4"): "none"},
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
