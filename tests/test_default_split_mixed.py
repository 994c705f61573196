"""The default pipeline split of a model whose stages hold blocks of different
kinds (dense first blocks, MoE blocks, MTP modules on the last stage),
counted stage by stage as the split path counts it (docs/validation.md,
"The default pipeline split for models with mixed blocks, counted"): the
default layout, the explicit layout that states the same stages and the
equivalent first / last fields give the same figures, the stages' blocks
and kinds by hand, and which stage is fullest."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from autopar.io.layouts import to_columns
from autopar.io.specs import load_execution, load_model, load_system
from autopar.model.evaluate import STATS, evaluate_columns
from autopar.model.memory import (MEMORY_PARTS, first_stage_in_flight, second_stage_in_flight,
                                  stage_needs)
from autopar.model.moe import mixed_rows, mtp_layer_count, stage_counts
from autopar.model.pipeline import ceil_chunks, chunk_split, schedule

ROOT = Path(__file__).resolve().parents[1]
DSV3 = load_model(ROOT / "models" / "deepseek-v3.json")
B300 = load_system(ROOT / "systems" / "b300_nvl8.json")     # 268 GiB: the rows fit
GPT3 = load_model(ROOT / "models" / "gpt3-175B.json")
LLAMA70 = load_model(ROOT / "models" / "llama3-70B.json")


def small(blocks: int, first_dense: int, mtp: int = 1):
    """DeepSeek-V3's shapes on ``blocks`` blocks, the first ``first_dense``
    dense, ``mtp`` MTP modules."""
    return dataclasses.replace(DSV3, num_blocks=blocks, mtp=mtp,
                               moe=dataclasses.replace(DSV3.moe, first_dense=first_dense))


def execution(pp: int, vp: int = 1, **split) -> dict:
    return {"num_procs": 8 * pp, "tensor_par": 1, "pipeline_par": pp, "data_par": 8,
            "tensor_par_net": 0, "pipeline_par_net": 1, "data_par_net": 0,
            "batch_size": 128, "microbatch_size": 1, "datatype": "bfloat16",
            "fused_activation": True, "attention_type": "multihead",
            "activation_recompute": "none", "pipeline_interleaving": vp,
            "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
            "tensor_par_overlap": "none", "seq_par_ag_redo": False,
            "data_par_overlap": True, "weight_offload": False,
            "activations_offload": False, "optimizer_offload": False, "training": True,
            "attention_impl": "flash_v2", "fused_norm": True, "expert_par": 8, **split}


def evaluate(model, executions: list) -> dict:
    rows = [load_execution(e, model=model, system=B300, source="test") for e in executions]
    return evaluate_columns(model, B300, to_columns(rows), stats=STATS + MEMORY_PARTS)


def assert_rows_equal(out: dict, i: int, j: int) -> None:
    for k in STATS + MEMORY_PARTS:
        assert out[k][i] == pytest.approx(out[k][j], rel=1e-12, abs=1e-9), k


def test_ceil_chunks_by_hand():
    # 10 blocks on 4 stages: ceil 3 a stage, the last lacking 2
    assert ceil_chunks(10, 4, 1) == [[3], [3], [3], [1]]
    # 15 blocks on 4 stages x 2 chunks: virtual stages of 2 in Megatron's
    # order (k = j * 4 + s), the last virtual stage (7: rank 3's chunk 1)
    # holds the 15th block alone
    assert ceil_chunks(15, 4, 2) == [[2, 2], [2, 2], [2, 2], [2, 1]]
    # every split field at its default is that split; the rule on the interleaving
    assert chunk_split(10, 4, 1, 0, 0, False, False, 0) == ceil_chunks(10, 4, 1)
    assert ceil_chunks(10, 2, 2).startswith("infeasible: pipeline_interleaving must divide")


def test_which_models_count_the_default_stage_by_stage():
    assert mixed_rows(small(10, 2)) is True
    assert mixed_rows(small(10, 0, mtp=1)) is True          # MTP on the last stage
    assert mixed_rows(small(10, 2, mtp=0)) is True          # dense first blocks
    assert mixed_rows(small(10, 0, mtp=0)) is False         # every block MoE
    assert mixed_rows(GPT3) is False
    assert mtp_layer_count(small(10, 2)) == 1 and mtp_layer_count(small(10, 2, mtp=0)) == 0


def test_default_equals_its_explicit_layout_and_first_last_fields():
    """10 blocks (2 dense, 8 MoE, 1 MTP module) on 4 stages: Calculon's split
    3, 3, 3, 1 -- the layout Ettt|ttt|ttt|tmL and first 3 / last 1 state the
    same stages: every statistic equal, time and memory."""
    m = small(10, 2)
    out = evaluate(m, [execution(4), execution(4, pipeline_layout="Ettt|ttt|ttt|tmL"),
                       execution(4, first_stage_blocks=3, last_stage_blocks=1)])
    assert out["feasible"].tolist() == [True, True, True]
    assert_rows_equal(out, 0, 1)
    assert_rows_equal(out, 0, 2)
    # a row's figures do not depend on the rows beside it
    alone = evaluate(m, [execution(4)])
    for k in ("proc_mem_tier1_cap_req", "total_time", "mem_static_first", "mem_transient_first"):
        assert alone[k][0] == pytest.approx(out[k][0], rel=1e-12), k


def test_interleaved_default_equals_its_explicit_layout():
    """15 blocks on 4 stages x 2 chunks: virtual stages of 2, the last of 1
    (Ett|tt|tt|tt|tt|tt|tt|tmL); the in-flight micro-batches counted chunk
    by chunk on both."""
    m = small(15, 3)
    out = evaluate(m, [execution(4, 2),
                       execution(4, 2, pipeline_layout="Ett|tt|tt|tt|tt|tt|tt|tmL")])
    assert out["feasible"].tolist() == [True, True]
    assert_rows_equal(out, 0, 1)


def test_stage_blocks_and_kinds_by_hand():
    """10 blocks, the first 2 dense, on 4 stages: stage 0 holds blocks 0-2
    (2 dense, 1 MoE), stages 1 and 2 three MoE blocks, stage 3 block 9 and
    the MTP module (an MoE block); a middle stage paces the pipeline, the
    missing blocks are 2."""
    m = small(10, 2)
    ex = load_execution(execution(4), model=m, system=B300, source="test")
    cols = to_columns([ex])
    c = stage_counts(m, cols["pipeline_par"], cols)
    assert (c["first_dense"][0], c["first_moe"][0]) == (2, 1)
    assert (c["second_dense"][0], c["second_moe"][0]) == (0, 3)
    assert (c["last_dense"][0], c["last_moe"][0]) == (0, 2)
    assert (c["pace_dense"][0], c["pace_moe"][0]) == (0, 3)
    assert [c[f"{w}_blocks"][0] for w in ("first", "second", "last", "pace")] == [3, 3, 1, 3]
    typed = {k: np.asarray(v) for k, v in cols.items()}
    sched = schedule(typed, m.num_blocks, mixed_rows(m, typed))
    assert sched.uneven and sched.missing_blocks[0] == 2
    assert (sched.blocks_first[0], sched.blocks_second[0], sched.blocks_last[0],
            sched.blocks_per_stage[0]) == (3, 3, 1, 3)
    # 1F1B: rank r holds p - r micro-batches (16 a replica here): 4 and 3
    assert first_stage_in_flight(sched)[0] == 4 and second_stage_in_flight(sched)[0] == 3


def test_the_second_stage_is_the_fullest_by_hand():
    """12 blocks on 4 stages of 3, no recompute, no MTP module.  Stage 1
    holds blocks 3-5, all MoE, for any first_dense up to 3, with 3
    micro-batches in flight (1F1B: rank r holds p - r); stage 3 three MoE
    blocks, the output layer and one micro-batch's logits; stage 0 holds
    the dense blocks and the embedding with 4 micro-batches.  With
    first_dense 1, 2 or 3 the second stage is the fullest (stage 0's dense
    blocks keep less than the MoE blocks they replace, and one micro-batch
    more of two or fewer MoE blocks is less than the second stage's three):
    the same need for the three, though their first stages differ.  With
    first_dense 0 stage 0 holds the second stage's three MoE blocks with one
    micro-batch more and the embedding: a larger need.  The last stage is
    below the second.  (Counting the first and last stage only, as the
    default did before, took the last stage's need, 83.9 GiB against the
    second stage's 90.8, for first_dense 1, 2 and 3.)"""
    out = {fd: evaluate(small(12, fd, mtp=0), [execution(4)]) for fd in (0, 1, 2, 3)}
    assert all(o["feasible"][0] for o in out.values())
    need = {fd: float(o["proc_mem_tier1_cap_req"][0]) for fd, o in out.items()}
    assert need[1] == pytest.approx(need[3], rel=1e-12)
    assert need[2] == pytest.approx(need[3], rel=1e-12)
    assert need[0] > need[3]
    # (the reported first-stage parts are then the second stage's: its
    # static state holds no embedding, less than stage 0's of first_dense 0)
    static = {fd: float(o["mem_static_first"][0]) for fd, o in out.items()}
    assert static[1] == pytest.approx(static[3], rel=1e-12) and static[0] > static[3]
    # the last stage (the same three MoE blocks, one micro-batch) is below it
    first, last = stage_needs({p: o[p] for p in MEMORY_PARTS for o in [out[3]]},
                              B300.memory_overhead)
    assert last[0] < first[0]


def test_homogeneous_default_keeps_calculon_arithmetic():
    """Llama 3 70B (blocks all alike): the default does not take the split
    path (Calculon's counts: tests/test_model.py), and a default row beside
    a split row is unchanged by it."""
    e = {k: v for k, v in execution(4).items() if k != "expert_par"}
    ex = load_execution(e, model=LLAMA70, system=B300, source="test")
    split = dict(ex, first_stage_blocks=24, last_stage_blocks=16)
    a = evaluate_columns(LLAMA70, B300, to_columns([ex]))
    assert a["feasible"][0]
    typed = {k: np.asarray(v) for k, v in to_columns([ex]).items()}
    assert mixed_rows(LLAMA70, typed) is False
    assert not schedule(typed, LLAMA70.num_blocks, mixed_rows(LLAMA70, typed)).uneven
    b = evaluate_columns(LLAMA70, B300, to_columns([ex, split]))
    assert a["total_time"][0] == b["total_time"][0]
    assert a["proc_mem_tier1_cap_req"][0] == b["proc_mem_tier1_cap_req"][0]
