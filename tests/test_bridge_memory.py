"""Megatron-Bridge's Megatron-Core + TE memory terms (issue 24, held-out
trust): what ``frameworks/megatron-bridge.json`` states and cites, the NeMo
25.04 rows on their own stack (``frameworks/nemo2-25-04.json``), the Bridge
rows per release, TE's re-gather under a full-recompute completion, and the
Bridge tables' throughput held where it is (docs/validation.md,
"Megatron-Bridge: the Megatron-Core + TE terms it runs")."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import one_proc_execution

from autopar.io.frameworks import load_framework
from autopar.io.specs import load_model, load_partial_execution, load_system
from autopar.search.partial import complete

BRIDGE = load_framework("megatron-bridge")
NEMO2 = load_framework("nemo2-25-04")
TERMS = ("logits_fp32_copies", "dummy_wgrad", "backward_transient",
         "moe_probs_in_activation", "cp_a2a_output_copy")


def test_bridge_states_the_te_terms_it_runs_with_their_sources():
    over = BRIDGE.memory_overhead
    assert (over.logits_fp32_copies, over.logits_gathered) == (0.0, False)
    assert over.dummy_wgrad and over.backward_transient == "op"
    assert over.moe_probs_in_activation and over.cp_a2a_output_copy
    # the same counted records SimuMax's B200 runs measured (0.3% median),
    # beside the fp8 / fp4 weights kept as the only copy (Bridge's precision
    # recipes' fp8_param_gather; Megatron-LM's default, the SimuMax runs' bf16:
    # off)
    assert over.fp8_primary_weights
    assert "fp8_param_gather" in BRIDGE.citations["memory_overhead.fp8_primary_weights"]
    # TE's userbuffers where a run overlaps its TP communication (Bridge's
    # recipes' tp_comm_overlap; Megatron-LM's --tp-comm-overlap)
    assert over.te_userbuffers
    # the output projection's saved input unquantized under fp8 / fp4
    # (Megatron-Core's set_save_original_input(linear_proj))
    assert over.proj_saves_original
    assert "set_save_original_input" in BRIDGE.citations["memory_overhead.proj_saves_original"]
    assert dataclasses.replace(over, fp8_primary_weights=False,
                               proj_saves_original=False) == \
        load_framework("megatron-core-te-ce").memory_overhead
    cite = {k: BRIDGE.citations[f"memory_overhead.{k}"] for k in TERMS}
    # the recipes' and performance scripts' fused loss, at Bridge commits
    assert "cross_entropy_fusion_impl = 'te'" in cite["logits_fp32_copies"]
    assert "Megatron-Bridge@067f987" in cite["logits_fp32_copies"]
    assert "perf_recipes/_common.py" in cite["logits_fp32_copies"]
    # gradient-accumulation fusion with TE from Bridge 25bc068 (r0.4.0), TE >= 2.3
    assert "25bc068" in cite["dummy_wgrad"] and "get_dummy_wgrad" in cite["dummy_wgrad"]
    assert "fusions.py" in cite["dummy_wgrad"]
    assert "engine.cpp" in cite["backward_transient"]
    assert "schedules.py" in cite["backward_transient"]
    # Megatron-Core 0.14 on, at the commit Bridge pins
    assert "Megatron-LM@cd4afff" in cite["moe_probs_in_activation"]
    assert "moe_apply_probs_on_input" in cite["moe_probs_in_activation"]
    assert "v2.8" in cite["cp_a2a_output_copy"] and "uv.lock" in cite["cp_a2a_output_copy"]


def test_nemo_25_04_runs_its_own_stack():
    """NeMo 2.3 (container 25.04) pinned Megatron-Core 0.12 and TE before
    2.3: no cached dummy gradients, one attention output under a2a CP, the
    native fused loss's fp32 copy; autograd's per-op gradients (PyTorch)."""
    over = NEMO2.memory_overhead
    assert (over.logits_fp32_copies, over.dummy_wgrad, over.cp_a2a_output_copy,
            over.moe_probs_in_activation) == (1.0, False, False, False)
    assert over.backward_transient == "op"
    assert "3cdfd61" in NEMO2.citations["memory_overhead.logits_fp32_copies"]
    assert "bee4649" in NEMO2.citations["memory_overhead.dummy_wgrad"]
    # the recipe settings are the Bridge file's (NeMo 2.3's own sources cited)
    assert NEMO2.defaults == BRIDGE.defaults
    assert all("NeMo@v2.3.0" in NEMO2.citations[f"defaults.{k}"]
               for k in ("optimizer_sharding", "data_par_overlap", "fp32_grads"))


def test_the_bridge_tables_run_what_each_release_ran(reference):
    from autopar.studies.published import TABLES, PublishedCase, cases
    seen = set()
    for _, c in cases(TABLES["bridge_qwen3_moe"]):
        assert isinstance(c, PublishedCase)
        release = c.label.split()[0]
        over = c.system.memory_overhead
        # 25.11 and 26.02 (Bridge r0.2.0 / r0.3.0) left gradient-accumulation
        # fusion off; every other term as the framework file says
        assert over.dummy_wgrad == (not release.startswith(("25.11", "26.02"))), c.label
        assert over.moe_probs_in_activation and over.logits_fp32_copies == 0
        assert c.execution["seq_par_ag_redo"] == (c.execution["tensor_par"] > 1)
        seen.add(over.dummy_wgrad)
    assert seen == {True, False}
    for _, c in cases(TABLES["nemo_long_cp"]):
        ex = c.execution
        if "B200" in c.label:      # NeMo 25.04
            assert c.system.memory_overhead == NEMO2.memory_overhead
            assert ex["seq_par_ag_redo"] == (ex["tensor_par"] > 1)
        else:                      # NeMo 24.03: Apex, not re-mapped here
            assert c.system.memory_overhead == load_framework("nemo1-apex").memory_overhead
            assert not ex["seq_par_ag_redo"]


def test_stated_regather_under_full_recompute_is_the_recompute_s_gather(repo_root):
    """A stated ``seq_par_ag_redo`` (TE's re-gather) with the recompute
    unknown: a full-recompute completion is counted (its forward gathers the
    input again anyway), with the flag off, as the model and rules want."""
    model = load_model(repo_root / "models/megatron-126M.json")
    system = load_system(repo_root / "systems/a100_80g.json")
    ex = one_proc_execution(num_procs=8, tensor_par=2, data_par=4, batch_size=16,
                            microbatch_size=1, datatype="bfloat16",
                            tensor_par_comm_type="rs_ag", seq_par_ag_redo=True,
                            activation_recompute="?")
    stated, unknown = load_partial_execution(ex)
    assert tuple(unknown) == ("activation_recompute",)
    opts = {"activation_recompute": ("none", "attn_only", "full")}
    res = complete(model, system, stated, unknown, opts)
    assert res.completions == 3
    full = complete(model, system, stated, unknown, {"activation_recompute": ("full",)})
    assert full.completions == 1 and full.best is not None
    assert full.best.execution["seq_par_ag_redo"] is False or \
        full.best.execution["seq_par_ag_redo"] == 0
    # without the stated flag the same three completions
    plain = dict(stated, seq_par_ag_redo=False)
    assert complete(model, system, plain, unknown, opts).completions == 3


def test_bridge_tables_throughput_held(reference):
    """The terms change memory only (and TE's backward all-gather on the NeMo
    2.3 TP rows): the Bridge tables' tokens/s stay where they were, every
    published layout predicted to run, with or without the unstated fields
    searched."""
    from autopar.studies.published import TABLES, predict
    nemo = predict(TABLES["nemo_long_cp"], rank=False, partial=True)
    qwen = predict(TABLES["bridge_qwen3_moe"], rank=False, partial=True)
    assert len(nemo) == 17 and nemo.feasible.all() and nemo.feasible_any.all()
    assert len(qwen) == 36 and qwen.feasible.all() and qwen.feasible_any.all()
    # (since the page's TFLOP/s are read with NeMo's whole-square count,
    # docs/validation.md "Long-context attention under context parallelism,
    # counted": 28.2% / 64.1%; since the NeMo 24.03 rows run FlashAttention-2
    # as the launcher's NVTE_FUSED_ATTN=0 made them, "Long-context rows,
    # round 2": 6.6% / 28.6%, the worst a B200 row; 6.6% / 27.1% since the
    # Blackwell files' matrix plateaus are the published best-shape rates,
    # "Blackwell system files: measured kernel efficiencies"; 6.6% / 26.9%
    # since the B200 files carry SimuMax's measured attention rates by call
    # size, "Attention kernel rates by shape (hardware record)": the worst
    # row, B200 32k, +27.1% -> +26.9%; 6.6% / 25.5% since TE's context-
    # parallel merges and copies are counted, "The context-parallel ring,
    # step by step, counted": B200 32k +26.9% -> +25.5%)
    assert nemo.tok_error.abs().median() == pytest.approx(0.066, abs=0.002)
    assert nemo.tok_error.abs().max() == pytest.approx(0.255, abs=0.002)
    # (the Qwen3 rows' figures since the MoE host time is counted per op
    # after the sync, docs/validation.md "MoE host time, counted": 4.8% /
    # 93.9% / best 24.9% with the flat per-block constant before; 9.8% /
    # 91.8% / best 24.2% on the H100-shaped Blackwell curves at 19.5 us;
    # 9.8% / 93.8% / best 24.2% on the best-shape plateaus with the host
    # time refitted there, 18.5 us: "Blackwell system files: measured
    # kernel efficiencies")
    assert qwen.tok_error.abs().median() == pytest.approx(0.098, abs=0.002)
    assert qwen.tok_error.abs().max() == pytest.approx(0.938, abs=0.002)
    assert nemo.best_tok_error.abs().median() == pytest.approx(0.074, abs=0.002)  # 0.287 before
    assert qwen.best_tok_error.abs().median() == pytest.approx(0.242, abs=0.002)
    # the Qwen3 rows' predicted peaks fell by the counted terms; the 25.11
    # H100 row (PP 2, VP 24, micro-batch 2) no longer sits at the 80 GiB edge
    # (62.48 GiB before the fp8 weights were counted as the only copy of the
    # blocks' linear weights, memory_overhead.fp8_primary_weights: Bridge's
    # fp8 precision recipes set fp8_param_gather from r0.1.0 on, and the
    # performance scripts of every release leave it)
    h100 = qwen[qwen.label == "25.11 DGX-H100 gbs512 mbs2 pp2 ep8 vp24"].iloc[0]
    # (58.26 GiB before the fp8 output projection's saved input was counted
    # in bf16, the attention output the core saves: memory_overhead.
    # proj_saves_original, docs/validation.md "Llama 3.1 405B recipes: memory
    # term by term against Megatron's own accounting")
    assert h100.pred_mem_gib == pytest.approx(59.73, abs=0.05)
    assert (qwen.feasible_completions == qwen.completions).all()
