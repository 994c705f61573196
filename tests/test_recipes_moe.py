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
# The count predicted to fit (held: may rise, must not fall).
FITS_AT_LEAST = 127
# The recipes predicted not to fit, each with what the recipe turns on that
# autopar does not count (docs/validation.md, "Megatron-Bridge performance
# recipes: do they fit? (MoE)"): none since recompute_moe_act /
# recompute_mla_up_proj are counted.
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
        if status == "fits" and name not in KNOWN_LOW_MFU:
            assert 0.10 <= s["total_efficiency"] <= 0.70, (name, s["total_efficiency"])
    for name in KNOWN_LOW_MFU:
        status, s = outcomes[name]
        assert status == "fits" and s["total_efficiency"] < 0.10, name
        # the data-parallel sync is most of the step
        assert s["dp_comm_exposed_time"] + s["weight_gather_exposed_time"] \
            > 0.5 * s["total_time"], name


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
    assert R.parse_layout("Et|(tt|)*2mL") == ["Et", "tt", "tt", "mL"]
    assert R.parse_layout("Et*3|(t*2|)*2L") == ["Ettt", "tt", "tt", "L"]
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
