"""Nemotron 3 Super 120B-A12B and Ultra 550B-A55B model files
(models/nemotron3-super-120B-A12B.json, models/nemotron3-ultra-550B-A55B.json):
they load, their layer kinds and parameter counts match the published sizes,
and (where the mirrors are here) every shape field matches what Megatron-LM's
example configurations and Megatron-Bridge's performance recipes set
(docs/validation.md, "Nemotron 3 Super and Ultra model files (Megatron-LM
examples), counted")."""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path

import pytest

from autopar.io.specs import load_model
from autopar.model.mamba import layer_kinds
from autopar.model.params import parameter_counts

ROOT = Path(__file__).resolve().parent.parent
SUPER, ULTRA = "nemotron3-super-120B-A12B", "nemotron3-ultra-550B-A55B"
MEGATRON = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
MEGATRON_COMMIT = "d98e8a64dd"
BRIDGE = Path("/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo")
EXAMPLES = {SUPER: "examples/post_training/modelopt/conf/nvidia/"
                   "NVIDIA-Nemotron-3-Super-120B-A12B-BF16.sh",
            ULTRA: "examples/post_training/modelopt/conf/nvidia/"
                   "NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16.sh"}


def model(name):
    return load_model(ROOT / "models" / f"{name}.json")


def without_mtp(m):
    return dataclasses.replace(m, mtp=0, mtp_pattern="", mtp_repeated=False)


@pytest.mark.parametrize("name, kinds, total, active", [
    # (Mamba-2, MoE, attention layers); the names' billions
    (SUPER, (40, 40, 8), 120e9, 12e9),
    (ULTRA, (48, 48, 12), 550e9, 55e9),
])
def test_model_files_load_and_count_their_names(h100, name, kinds, total, active):
    """The names count the model without its MTP module, and the active
    parameters without the input embedding (a table lookup; the output layer
    is counted): Super 120.67B / 12.23B, Ultra 549.31B / 54.99B.  The MTP
    module (one '*E' module run at both depths) adds its attention and MoE
    layer and its 2h x h projection once."""
    m = model(name)
    assert len(m.hybrid_pattern) == m.num_blocks
    k = layer_kinds(m)
    assert (k.count("mamba"), k.count("moe"), k.count("attention")) == kinds
    assert (m.mtp, m.mtp_pattern, m.mtp_repeated) == (2, "*E", True)
    assert m.moe.latent_size > 0 and m.moe.router == "sigmoid"
    c = parameter_counts(without_mtp(m), h100)
    assert abs(c["total"] / total - 1) < 0.03, c["total"]
    assert abs((c["active"] - m.vocab_size * m.hidden) / active - 1) < 0.03, c["active"]
    full = parameter_counts(m, h100)
    module = full["attention_block"] + full["moe_block"] + 2.0 * m.hidden ** 2
    assert full["total"] - c["total"] == pytest.approx(module)


def test_ultra_count_is_the_released_checkpoint(h100):
    """The BF16 checkpoint's model.safetensors.index.json gives total_size
    1,121,049,257,984 bytes (nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16, as
    quoted by a public document): 560,524,628,992 two-byte values.  The file
    with its one MTP module counts 560,525,447,168 (0.0001% more: the 'gpt'
    block's LayerNorm bias); a vocabulary other than 131072 would move it by
    2 x 8192 per token."""
    c = parameter_counts(model(ULTRA), h100)
    assert abs(c["total"] / 560_524_628_992 - 1) < 1e-5


def _git_show(repo: Path, rev: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={repo}", "show", f"{rev}:{path}"],
                          check=True, capture_output=True, text=True).stdout


def _model_args(text: str) -> dict:
    """``--flag value`` / ``--flag`` pairs of a Megatron-LM launch script's
    MODEL_ARGS."""
    body = text.split('MODEL_ARGS="', 1)[1].split('"', 1)[0].replace("\\\n", " ")
    out, toks = {}, shlex.split(body)
    for i, t in enumerate(toks):
        if t.startswith("--"):
            nxt = toks[i + 1] if i + 1 < len(toks) else ""
            out[t[2:]] = nxt if nxt and not nxt.startswith("--") else True
    return out


@pytest.mark.skipif(not MEGATRON.is_dir(), reason="no Megatron-LM mirror (CI): the files are committed")
@pytest.mark.parametrize("name", [SUPER, ULTRA])
def test_model_file_is_the_megatron_lm_example(name):
    """Every shape flag of examples/post_training/modelopt/conf/nvidia/*.sh
    (NVIDIA/Megatron-LM@d98e8a64dd) is the file's; the Mamba state, groups,
    conv kernel and chunk the scripts do not set are Megatron-Core's defaults
    (transformer_config.py mamba_state_dim 128, mamba_num_groups 8;
    ssm/mamba_mixer.py d_conv 4, chunk_size 128)."""
    a = _model_args(_git_show(MEGATRON, MEGATRON_COMMIT, EXAMPLES[name]))
    m = model(name)
    pattern = a.get("hybrid-layer-pattern") or a["hybrid-override-pattern"]
    assert pattern == m.hybrid_pattern
    if "num-layers" in a:
        assert int(a["num-layers"]) == m.num_blocks
    assert (int(a["hidden-size"]), int(a["num-attention-heads"]), int(a["num-query-groups"]),
            int(a["kv-channels"])) == (m.hidden, m.attn_heads, m.kv_heads, m.attn_size)
    assert int(a["ffn-hidden-size"]) == m.feedforward == m.moe.expert_feedforward
    assert (int(a["num-experts"]), int(a["moe-router-topk"]),
            int(a["moe-shared-expert-intermediate-size"]), int(a["moe-latent-size"])) == \
        (m.moe.experts, m.moe.top_k, m.moe.shared_feedforward, m.moe.latent_size)
    assert a["moe-router-score-function"] == m.moe.router
    assert (int(a["mamba-num-heads"]), int(a["mamba-head-dim"])) == \
        (m.mamba.heads, m.mamba.head_dim)
    assert (m.mamba.state, m.mamba.groups, m.mamba.conv_kernel, m.mamba.chunk) == (128, 8, 4, 128)
    assert a["squared-relu"] is True and a["untie-embeddings-and-output-weights"] is True
    assert int(a["seq-length"]) == m.seq_size


@pytest.mark.skipif(not MEGATRON.is_dir(), reason="no Megatron-LM mirror (CI): the files are committed")
@pytest.mark.parametrize("name", [SUPER, ULTRA])
def test_autopar_import_reads_the_megatron_lm_example(tmp_path, name):
    """`autopar import` of the example script's arguments (RMSNorm with
    --squared-relu on a hybrid model: Nemotron-H's MLP, the gpt block) gives
    the model file but what the script does not state: MTP and the
    tokenizer's vocabulary."""
    import json

    from autopar.cli import main
    a = _model_args(_git_show(MEGATRON, MEGATRON_COMMIT, EXAMPLES[name]))
    args = " ".join(f"--{k}" if v is True else f"--{k} {shlex.quote(str(v))}"
                    for k, v in a.items() if "$" not in str(v))
    if "num-layers" not in a:
        args += f" --num-layers {model(name).num_blocks}"
    (tmp_path / "run.sh").write_text(f"torchrun pretrain_mamba.py {args}\n")
    assert main(["import", str(tmp_path / "run.sh"), "--model-out", str(tmp_path / "m.json")]) == 0
    got = json.loads((tmp_path / "m.json").read_text())
    want = json.loads((ROOT / "models" / f"{name}.json").read_text())
    unstated = {"description", "mtp", "mtp_hybrid_override_pattern", "mtp_use_repeated_layer",
                "vocab_size"}
    assert {k: v for k, v in got.items() if k not in unstated and v is not None} == \
        {k: v for k, v in want.items() if k not in unstated}


@pytest.mark.skipif(not MEGATRON.is_dir(), reason="no Megatron-LM mirror (CI): the files are committed")
def test_super_file_is_the_release_test_with_its_mtp_depths():
    """tests/functional_tests/test_cases/nemotron/nemotron3_super_release_gb200:
    88 layers, the pattern with two '/*E' MTP depths (hybrid_layer_allocation
    parse_hybrid_pattern: the parts after '/'), --mtp-num-layers 2."""
    import yaml
    cfg = yaml.safe_load(_git_show(
        MEGATRON, MEGATRON_COMMIT,
        "tests/functional_tests/test_cases/nemotron/nemotron3_super_release_gb200/"
        "model_config.yaml"))["MODEL_ARGS"]
    m = model(SUPER)
    main, *depths = cfg["--hybrid-layer-pattern"].split("/")
    assert main == m.hybrid_pattern and cfg["--num-layers"] == m.num_blocks
    assert depths == [m.mtp_pattern] * m.mtp and cfg["--mtp-num-layers"] == m.mtp
    assert (cfg["--moe-latent-size"], cfg["--num-experts"], cfg["--moe-router-topk"]) == \
        (m.moe.latent_size, m.moe.experts, m.moe.top_k)


@pytest.mark.skipif(not BRIDGE.is_dir(), reason="no Megatron-Bridge mirror (CI): the CSV is committed")
@pytest.mark.parametrize("name, gpu, recipe", [
    (SUPER, "gb200", "nemotron_3_super_pretrain_64gpu_gb200_fp8mx_config"),
    (SUPER, "h100", "nemotron_3_super_pretrain_64gpu_h100_bf16_config"),
    (ULTRA, "gb200", "nemotron_3_ultra_pretrain_256gpu_gb200_fp8mx_config"),
])
def test_perf_recipes_set_the_files_mtp_and_are_named_by_them(name, gpu, recipe):
    """Megatron-Bridge@067f987 perf_recipes/nemotronh/<gpu>/nemotronh.py: the
    recipe loads the checkpoint with AutoBridge and sets mtp_num_layers 2,
    mtp_use_repeated_layer (recipes/nemotronh/h100/nemotron_3_super.py,
    nemotron_3_ultra.py); the writer names the row by the model file."""
    import ast
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "write_recipe_table", ROOT / "benchmarks" / "write_recipe_table.py")
    W = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(W)
    src = W.Source(BRIDGE, W.COMMIT)
    path = f"src/megatron/bridge/perf_recipes/nemotronh/{gpu}/nemotronh.py"
    fn = next(n for n in src.tree(path).body if isinstance(n, ast.FunctionDef) and n.name == recipe)
    flat = W.flatten(W.Interpreter(src).call_function(path, fn, [], {}))
    m = model(name)
    assert (flat["model.mtp_num_layers"], flat["model.mtp_use_repeated_layer"]) == \
        (m.mtp, m.mtp_repeated)
    assert W.model_name(flat) == name
