"""Uneven pipelines as Megatron-Core runs them (issue 24): the split rules,
hand counts of stage blocks, bubble and per-stage memory, DeepSeek-V3's 61
blocks on pipeline 2 x virtual 8, the specs' checks, and a search that
finds an uneven split."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.export import export_execution
from autopar.io.layouts import to_columns
from autopar.io.specs import load_execution, load_model
from autopar.model.evaluate import REASONS, STATS, evaluate_one
from autopar.model.pipeline import schedule, stage_split

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dense80():
    """Llama 2 70B's 80 blocks without a vocabulary (no output layer)."""
    shape = json.loads((ROOT / "models" / "llama2-70B.json").read_text())
    del shape["vocab_size"]
    shape["name"] = "llama2-70B-blocks"
    return load_model(shape)


def dense_layout(**kw):
    run = dict(num_procs=1024, tensor_par=8, pipeline_par=8, data_par=16, tensor_par_net=0,
               pipeline_par_net=1, data_par_net=1, batch_size=1024, microbatch_size=1,
               datatype="bfloat16", fused_activation=True, attention_type="multihead",
               activation_recompute="none", pipeline_interleaving=1, optimizer_sharding=True,
               tensor_par_comm_type="rs_ag", tensor_par_overlap="none", seq_par_ag_redo=False,
               data_par_overlap=False, weight_offload=False, activations_offload=False,
               optimizer_offload=False, training=True, attention_impl="flash_v2")
    run.update(kw)
    return run


# ------------------------------------------------------------------ the split

def test_stage_split_follows_megatron():
    # num_layers_in_first/last_pipeline_stage: the middle stages share the rest
    assert stage_split(80, 8, 1, 7, 7, False, False, False) == [7] + [11] * 6 + [7]
    assert stage_split(80, 4, 1, 0, 17, False, False, False) == [21, 21, 21, 17]
    # 80 - 9 - 7 = 64 blocks do not split over 6 middle stages
    assert stage_split(80, 8, 1, 9, 7, False, False, False).startswith(
        "infeasible: the middle stages must share")
    # with interleaving the first/last counts and the middle share divide by it
    assert stage_split(80, 8, 2, 7, 7, False, False, False).startswith(
        "infeasible: first_stage_blocks and last_stage_blocks must be divisible")
    assert stage_split(80, 8, 2, 4, 4, False, False, False) == [4] + [12] * 6 + [4]
    # (80 - 4 - 10) / 6 = 11 blocks a middle stage: not 2 chunks of equal size
    assert stage_split(80, 8, 2, 4, 10, False, False, False).startswith(
        "infeasible: the middle stages' blocks must be divisible")
    # two stages: no middle stage, the two counts must add up
    assert stage_split(80, 2, 1, 41, 39, False, False, False) == [41, 39]
    assert isinstance(stage_split(80, 2, 1, 41, 38, False, False, False), str)
    # account_for_embedding/loss: N + 2 split evenly, one block fewer at the ends
    assert stage_split(78, 8, 1, 0, 0, True, True, False) == [9] + [10] * 6 + [9]
    assert stage_split(79, 8, 1, 0, 0, True, False, False) == [9] + [10] * 7
    assert isinstance(stage_split(80, 8, 1, 0, 0, True, True, False), str)
    # Megatron refuses first/last with the embedding/loss counted, layouts with
    # first/last, and a split needs a pipeline
    assert stage_split(80, 8, 1, 9, 0, True, False, False).startswith("invalid: first_stage")
    assert stage_split(80, 8, 1, 9, 0, False, False, True).startswith("invalid: pipeline_layout")
    assert stage_split(80, 1, 1, 0, 0, True, False, False).startswith("invalid: pipeline split")


def test_balanced_layout_counts_virtual_stages_by_hand():
    # 61 blocks over 2 x 8 = 16 virtual stages: 13 of 4 blocks, 3 of 3, in
    # order; virtual stage k on stage k % 2: stage 0 holds 0, 2, ..., 14 (seven
    # of 4, one of 3), stage 1 holds 1, ..., 15 (six of 4, two of 3)
    assert stage_split(61, 2, 8, 0, 0, False, False, True) == [31, 30]
    # with the embedding and loss counted: 63 layers, 15 of 4 and one of 3
    assert stage_split(61, 2, 8, 0, 0, True, True, True) == [4 * 8 - 1, 4 * 7 + 3 - 1]
    # too many virtual stages for the blocks
    assert stage_split(10, 4, 4, 0, 0, False, False, True).startswith("infeasible: pipeline_layout")


# ------------------------------------------------- the defaults are Calculon's

def test_explicit_even_split_predicts_what_the_default_does(dense80, roomy):
    base = evaluate_one(dense80, roomy, dense_layout())
    for ext in ({"first_stage_blocks": 10, "last_stage_blocks": 10},
                {"first_stage_blocks": 10}, {"pipeline_layout": "balanced"}):
        got = evaluate_one(dense80, roomy, dense_layout(**ext))
        assert got["feasible"] and base["feasible"]
        for name in STATS:
            assert got[name] == pytest.approx(base[name], rel=1e-12, nan_ok=True), (ext, name)


def test_default_rows_beside_uneven_rows_are_unchanged(dense80, roomy):
    """A table mixing default and uneven rows gives the default rows exactly
    what a table of them alone gives."""
    plain = [dense_layout(), dense_layout(pipeline_par=4, data_par=32)]
    uneven = [dense_layout(first_stage_blocks=7, last_stage_blocks=7)]
    alone = M.evaluate_columns(dense80, roomy, to_columns(plain))
    mixed = M.evaluate_columns(dense80, roomy, to_columns(plain + uneven))
    for name in STATS:
        np.testing.assert_array_equal(alone[name], mixed[name][:2], err_msg=name)
    assert mixed["feasible"][2]


# ------------------------------------------------------- hand counts, dense

def test_first7_last7_on_pp8_by_hand(dense80, roomy):
    run = dense_layout(first_stage_blocks=7, last_stage_blocks=7)
    sched = schedule(to_columns([run]), 80)
    assert sched.blocks_per_stage[0] == 11                 # the middle stages pace
    assert (sched.blocks_first[0], sched.blocks_second[0], sched.blocks_last[0]) == (7, 11, 7)
    assert sched.missing_blocks[0] == 8 * 11 - 80
    assert sched.chunks[0] == 1 and sched.base_blocks[0] == 10

    r = evaluate_one(dense80, roomy, run)
    assert r["feasible"]
    micro = 1024 // 16
    # the pacing stage's 11 blocks, every micro-batch
    assert r["fw_time"] == pytest.approx(11 * micro * r["block_fw_time"], rel=1e-12)
    # bubble: 7 slots of the pacing stage, less the 8 blocks the other
    # stages lack (Calculon's form); a block's forward + backward time, base
    # and edge (the edge one with the p2p transfers of a micro-batch)
    base = (r["block_fw_time"] + r["baseblock_fw_tp_time_exposed"] + r["block_agrad_time"]
            + r["block_wgrad_time"] + r["baseblock_agrad_tp_time_exposed"]
            + r["baseblock_recomm_time_exposed"])
    edge = (r["block_fw_time"] + r["edgeblock_fw_tp_time_exposed"] + r["block_agrad_time"]
            + r["block_wgrad_time"] + r["edgeblock_agrad_tp_time_exposed"]
            + r["edgeblock_recomm_time_exposed"] + r["pp_comm_link_time"] / micro)
    assert r["bubble_time"] == pytest.approx(7 * (10 * base + edge) - 8 * (base + edge) / 2,
                                             rel=1e-9)
    # memory: the first stage holds 7 blocks with 8 micro-batches in flight,
    # the second 11 with 7, the last 7 with 1 (1F1B); no vocabulary, no recompute
    W, G, G1, O = (r["block_weight_space"], r["block_weight_grad_space"],
                   r["block_weight_grad_space_no_sharding"], r["block_optimizer_space"])
    work, store, agrad = (r["block_act_working_space"], r["block_act_storage_space"],
                          r["block_act_grad_space"])

    def stage(b, in_flight):
        return W * b + G1 + G * (b - 1) + O * b + work + store * (b * in_flight - 1) + agrad
    need = max(stage(7, 8), stage(11, 7), stage(7, 1))
    assert need == stage(11, 7)                            # the second stage is fullest
    assert r["proc_mem_tier1_cap_req"] == pytest.approx(need, rel=1e-12)
    assert r["weight_space"] == pytest.approx(7 * W, rel=1e-12)
    even = evaluate_one(dense80, roomy, dense_layout())
    assert even["proc_mem_tier1_cap_req"] == pytest.approx(stage(10, 8), rel=1e-12)


def test_first9_last7_on_pp8_is_refused_as_megatron_does(dense80, roomy):
    r = evaluate_one(dense80, roomy, dense_layout(first_stage_blocks=9, last_stage_blocks=7))
    assert not r["feasible"]
    assert REASONS[r["reason_code"]].startswith("infeasible: the middle stages must share")


def test_loss_in_split_hides_the_output_layer_in_the_last_stage(h100):
    """Llama 2 70B with its vocabulary on 78 blocks: with the embedding and
    the loss counted the ends hold 9 blocks, the output layer runs in the
    last stage's spare block time, and the head's time shrinks by it."""
    shape = json.loads((ROOT / "models" / "llama2-70B.json").read_text())
    shape["num_blocks"] = 78
    model = load_model(shape)
    from autopar.studies.validate import unbounded
    roomy = unbounded(h100)
    even = evaluate_one(model, roomy, dense_layout(pipeline_par=2, data_par=64))
    split = evaluate_one(model, roomy, dense_layout(pipeline_par=2, data_par=64,
                                                    embedding_in_split=True,
                                                    loss_in_split=True))
    assert even["feasible"] and split["feasible"]
    # 78 + 2 = 80 layers: 40 a stage, 39 blocks on each
    assert split["fw_time"] == pytest.approx(even["fw_time"], rel=1e-12)
    # (78 / 2 = 39 either way: the same blocks, the same time)
    assert split["total_time"] == pytest.approx(even["total_time"], rel=1e-12)
    tail = evaluate_one(model, roomy, dense_layout(pipeline_par=8, data_par=16,
                                                   loss_in_split=True,
                                                   embedding_in_split=True))
    plain = evaluate_one(model, roomy, dense_layout(pipeline_par=8, data_par=16))
    assert tail["feasible"] and plain["feasible"]
    # [9, 10 x 6, 9] against Calculon's [10 x 7, 8]: the same pacing stage;
    # the output layer now hides in the last stage's one spare block
    assert tail["fw_time"] == pytest.approx(plain["fw_time"], rel=1e-12)
    assert tail["total_time"] < plain["total_time"]
    # the first stage holds one block fewer
    assert tail["weight_space"] == pytest.approx(plain["weight_space"] * 9 / 10, rel=1e-12)


# ------------------------------------------------------------- DeepSeek-V3

def dsv3_layout(**kw):
    run = dict(num_procs=1024, tensor_par=1, pipeline_par=2, data_par=512, tensor_par_net=0,
               pipeline_par_net=1, data_par_net=1, batch_size=4096, microbatch_size=1,
               datatype="bfloat16", fused_activation=True, attention_type="multihead",
               activation_recompute="full", pipeline_interleaving=8, optimizer_sharding=True,
               tensor_par_comm_type="rs_ag", tensor_par_overlap="none", seq_par_ag_redo=False,
               data_par_overlap=False, weight_offload=False, activations_offload=False,
               optimizer_offload=False, training=True, expert_par=64, expert_par_net=1,
               attention_impl="flash_v2")
    run.update(kw)
    return run


def test_deepseek_v3_61_blocks_on_pp2_vp8(h100):
    model = load_model(ROOT / "models" / "deepseek-v3.json")
    assert model.num_blocks == 61
    calculon = evaluate_one(model, h100, dsv3_layout())
    assert REASONS[calculon["reason_code"]] == \
        "infeasible: pipeline_interleaving must divide the blocks per processor"
    r = evaluate_one(model, h100, dsv3_layout(pipeline_layout="balanced"))
    assert r["feasible"], REASONS[r["reason_code"]]
    # against the same layout without interleaving (Calculon's 31 / 30 split):
    # the same blocks per stage, a bubble an eighth as long
    plain = evaluate_one(model, h100, dsv3_layout(pipeline_interleaving=1))
    assert plain["feasible"]
    assert r["fw_time"] == pytest.approx(plain["fw_time"], rel=0.02)
    assert r["bubble_time"] < plain["bubble_time"] / 4
    assert 0.8 * plain["total_time"] < r["total_time"] < plain["total_time"]
    # a sane rate: between 5% and 60% of the H100's peak on the useful work
    flops = 6 * 37e9 * 4096 * model.seq_size         # ~37B active parameters
    mfu = flops / r["total_time"] / 1024 / 989e12
    assert 0.05 < mfu < 0.6


# ------------------------------------------------------------------ specs

def test_specs_refuse_splits_no_layout_can_use(dense80):
    with pytest.raises(SpecError, match="first_stage_blocks"):
        load_execution(dense_layout(first_stage_blocks=9, embedding_in_split=True))
    with pytest.raises(SpecError, match="pipeline_layout"):
        load_execution(dense_layout(last_stage_blocks=9, pipeline_layout="balanced"))
    with pytest.raises(SpecError, match="needs pipeline_par > 1"):
        load_execution(dense_layout(pipeline_par=1, data_par=128, loss_in_split=True))
    with pytest.raises(SpecError, match="exceeds the model's 80 blocks"):
        load_execution(dense_layout(first_stage_blocks=50, last_stage_blocks=40),
                       model=dense80)
    with pytest.raises(SpecError, match="first_stage_blocks"):
        load_execution(dense_layout(first_stage_blocks=-1))
    with pytest.raises(SpecError, match="pipeline_layout"):
        load_execution(dense_layout(pipeline_layout="zigzag"))
    ok = load_execution(dense_layout(first_stage_blocks=7, last_stage_blocks=7))
    assert ok["first_stage_blocks"] == 7
    assert "pipeline_layout" not in load_execution(dense_layout(pipeline_layout="even"))
    with pytest.raises(SpecError, match="calculon"):
        export_execution(ok, "calculon")


# ------------------------------------------------------------------ search

def test_exhaustive_finds_an_uneven_split():
    """61 blocks of Llama 2 13B on 8 A100: no pipeline size but 1 divides the
    blocks, so Calculon's space has no pipeline; with the split fields the
    best layout is a balanced pipeline 8 x virtual 4."""
    import yaml
    from autopar.search.exhaustive import exhaustive
    shape = json.loads((ROOT / "models" / "llama2-13B.json").read_text())
    shape["num_blocks"], shape["name"] = 61, "llama2-13B-61"
    space = yaml.safe_load((ROOT / "search_spaces" / "small.yaml").read_text())
    _, plain = exhaustive(shape, ROOT / "systems" / "a100_80g.json", 8, 32, "bfloat16",
                          space=space, progress=False)
    space["name"] = "small-uneven"
    for f in ("pipeline_layout", "embedding_in_split", "loss_in_split",
              "first_stage_blocks", "last_stage_blocks"):
        space["params"][f] = "derived"
    table, found = exhaustive(shape, ROOT / "systems" / "a100_80g.json", 8, 32, "bfloat16",
                              space=space, top_n=5, progress=False)
    best = found["best"]["execution"]
    assert best["pipeline_par"] > 1 and best.get("pipeline_layout") == "balanced"
    assert 61 % (best["pipeline_par"] * best["pipeline_interleaving"]) != 0
    assert plain["best"] is None or found["best"]["sample_rate"] > plain["best"]["sample_rate"]
    # the search proposes each split once: no two of the top rows are the
    # same layout with the split fields at other values giving the same stages
    assert found["layouts"] > plain["layouts"]


def test_moe_stage_counts_follow_an_uneven_split():
    """DeepSeek-V3 (3 dense blocks first, 1 MTP module on the last stage) on
    PP 4 with first 13 / last 12: the middle stages hold (61 - 25) / 2 = 18."""
    from autopar.model.moe import stage_counts
    model = load_model(ROOT / "models" / "deepseek-v3.json")
    cols = {"pipeline_par": np.array([4, 4]), "pipeline_interleaving": np.array([1, 1]),
            "first_stage_blocks": np.array([13, 0]), "last_stage_blocks": np.array([12, 0]),
            "embedding_in_split": np.array([False, False]),
            "loss_in_split": np.array([False, False]), "pipeline_layout": np.array([0, 0])}
    c = stage_counts(model, cols["pipeline_par"], cols)
    # the uneven row: first 3 dense + 10 MoE, second 18 MoE, last 12 MoE + MTP
    assert (c["first_dense"][0], c["first_moe"][0]) == (3, 10)
    assert (c["second_dense"][0], c["second_moe"][0]) == (0, 18)
    assert (c["last_dense"][0], c["last_moe"][0]) == (0, 13)
    assert (c["pace_dense"][0], c["pace_moe"][0]) == (0, 18)
    assert [c[f"{w}_blocks"][0] for w in ("first", "second", "last", "pace")] == [13, 18, 12, 18]
    # the default row beside it: Calculon's ceil(61 / 4) = 16 a stage, 13 on the last
    assert (c["first_dense"][1], c["first_moe"][1]) == (3, 13)
    assert (c["last_dense"][1], c["last_moe"][1]) == (0, 13 + 1)
    assert c["first_blocks"][1] == 16
    alone = stage_counts(model, np.array([4]))
    assert (alone["first_moe"][0], alone["last_moe"][0], alone["pace_moe"][0]) == (13, 14, 16)


def test_calculon_format_refuses_a_space_that_searches_the_split():
    from autopar.io.export import check_calculon_run
    from autopar.search.space import load_space
    gpt = load_model(ROOT / "models" / "gpt3-13B.json")
    import yaml
    small = yaml.safe_load((ROOT / "search_spaces" / "small.yaml").read_text())
    check_calculon_run("calculon", gpt, load_space(small))
    for field, value in (("pipeline_layout", "derived"), ("first_stage_blocks", [0, 4])):
        space = dict(small, params={**small["params"], field: value})
        with pytest.raises(SpecError, match=f"searches {field}"):
            check_calculon_run("calculon", gpt, load_space(space))


def test_a_virtual_stage_holding_only_the_embedding(h100):
    """6 blocks with the embedding and loss counted over 2 x 4 virtual
    stages: one layer each, so the first virtual stage holds only the
    embedding and the last only the loss (Megatron builds 0 blocks there);
    each stage runs 3 chunks of blocks: the same as 3 virtual stages of one
    block each."""
    shape = json.loads((ROOT / "models" / "llama2-7B.json").read_text())
    shape["num_blocks"] = 6
    model = load_model(shape)
    assert stage_split(6, 2, 4, 0, 0, True, True, True) == [3, 3]
    run = dict(pipeline_par=2, data_par=64, pipeline_layout="balanced")
    four = evaluate_one(model, h100, dense_layout(pipeline_interleaving=4, embedding_in_split=True,
                                                  loss_in_split=True, **run))
    three = evaluate_one(model, h100, dense_layout(pipeline_interleaving=3, **run))
    assert four["feasible"] and three["feasible"]
    assert four["total_time"] == pytest.approx(three["total_time"], rel=1e-12)
    assert four["bubble_time"] > 0


# ------------------------------------- interleaved chunks: what each rank holds

def test_chunk_split_puts_the_embedding_and_loss_in_their_own_chunks():
    # 6 blocks + embedding + loss over 4 x 2 virtual stages: one layer each;
    # virtual stage j * p + s is chunk j of stage s
    from autopar.model.pipeline import chunk_split
    assert chunk_split(6, 4, 2, 0, 0, True, True, False) == [[0, 1], [1, 1], [1, 1], [1, 0]]
    assert stage_split(6, 4, 2, 0, 0, True, True, False) == [1, 2, 2, 1]
    # balanced: 10 layers (9 blocks and the embedding) over 4 virtual
    # stages, the first two with 3: virtual stage 0 the embedding and 2 blocks
    assert chunk_split(9, 2, 2, 0, 0, True, False, True) == [[2, 2], [3, 2]]
    # first / last counts: a stage's blocks spread evenly over its chunks
    assert chunk_split(80, 8, 2, 4, 4, False, False, False)[0] == [2, 2]
    assert chunk_split(80, 8, 2, 4, 4, False, False, False)[1] == [6, 6]


def test_interleaved_peak_by_hand_with_the_embedding_and_loss_in_the_split():
    """p = 4 ranks, v = 2 chunks, m = 8 micro-batches, chunks [[0, 1], [1, 1],
    [1, 1], [1, 0]] (the embedding alone in rank 0's chunk 0, the loss alone
    in rank 3's chunk 1).  Megatron-Core's table (groups of p = 4): entries
    0-3 chunk 0 (micro-batches 0-3), 4-7 chunk 1, 8-11 chunk 0 (4-7),
    12-15 chunk 1; a backward of entry k runs chunk 1 - chunk(k).

    rank 0: warm-up (4 - 0 - 1) * 2 + 1 * 4 = 10 forwards (entries 0-9):
      chunk 1 holds 4 micro-batches of its block, chunk 0 none -> 4; then
      F10 (chunk 0) 4, B0 (chunk 1) 3, F11 3, B1 2, F12 (chunk 1) 3, B2 2,
      F13 3, B3 2, F14 3, B4 (chunk 0) 3, F15 4: peak 4 (Calculon's count:
      min(m, p) (1 + (p - 1) / (v p)) = 5.5 stages of 1 block).
    rank 1: warm-up 2 * 2 + 4 = 8, F8 -> 9 blocks: 4.5 stages of 2 (as
      before).
    rank 3: warm-up 4 (entries 0-3, chunk 0) -> 4; F4 (the loss chunk) 4,
      B0 (loss) 4, ... F8 (chunk 0) 5, B4 (chunk 0) 4, ...: peak 5 blocks
      (before: ((v - 1) p + 1) / v = 2.5 stages of 1 block)."""
    from autopar.model.pipeline import interleaved_peak
    assert interleaved_peak(4, 2, 8, 0, [0, 1]) == 4
    assert interleaved_peak(4, 2, 8, 1, [1, 1]) == 9
    assert interleaved_peak(4, 2, 8, 3, [1, 0]) == 5
    # uniform chunks: Calculon's first-stage count and Megatron's warm-up + 1
    for p, v in ((4, 2), (8, 4), (16, 8)):
        m = 4 * p
        assert interleaved_peak(p, v, m, 0, [1] * v) == p * v + p - 1
        assert interleaved_peak(p, v, m, 1, [1] * v) == (p - 2) * 2 + (v - 1) * p + 1
        assert interleaved_peak(p, v, m, p - 1, [1] * v) == (v - 1) * p + 1
    # every forward before the first backward: the step's m micro-batches
    assert interleaved_peak(4, 3, 4, 0, [1, 2, 2]) == 4 * 5
    # the Llama 3.1 405B recipes: PP 16, VP 8, 384 micro-batches, one block a
    # chunk: rank 1 holds 141, rank 0 112 (its chunk 0 is the embedding),
    # the last rank 113 (its chunk 7 the loss)
    assert interleaved_peak(16, 8, 384, 1, [1] * 8) == 141
    assert interleaved_peak(16, 8, 384, 0, [0] + [1] * 7) == 112
    assert interleaved_peak(16, 8, 384, 15, [1] * 7 + [0]) == 113


def test_interleaved_stages_hold_what_the_schedule_keeps(roomy):
    """The hand count above through the model: 6 blocks without a vocabulary
    (no head), p = 4, v = 2, m = 8, the embedding and loss counted."""
    shape = json.loads((ROOT / "models" / "llama2-70B.json").read_text())
    del shape["vocab_size"]
    shape.update(num_blocks=6, name="six")
    model = load_model(shape)
    run = dense_layout(num_procs=64, tensor_par=8, pipeline_par=4, data_par=2, batch_size=16,
                       pipeline_interleaving=2, embedding_in_split=True, loss_in_split=True)
    sched = schedule(to_columns([run]), 6)
    assert (sched.blocks_first[0], sched.blocks_second[0], sched.blocks_last[0]) == (1, 2, 1)
    assert [float(c[0]) for c in sched.in_flight] == [4.0, 4.5, 5.0]
    r = evaluate_one(model, roomy, run)
    assert r["feasible"], REASONS[r["reason_code"]]
    W, G, G1, O = (r["block_weight_space"], r["block_weight_grad_space"],
                   r["block_weight_grad_space_no_sharding"], r["block_optimizer_space"])
    work, store, agrad = (r["block_act_working_space"], r["block_act_storage_space"],
                          r["block_act_grad_space"])

    def stage(b, in_flight):
        return W * b + G1 + G * (b - 1) + O * b + work + store * (b * in_flight - 1) + agrad
    # rank 0: 4 blocks held, rank 1: 9, rank 3: 5
    assert r["act_space"] == pytest.approx(work + store * 3, rel=1e-12)
    need = max(stage(1, 4), stage(2, 4.5), stage(1, 5))
    assert need == stage(2, 4.5)
    assert r["proc_mem_tier1_cap_req"] == pytest.approx(need, rel=1e-12)
    # without the split the same blocks per stage count Calculon's way
    even = schedule(to_columns([dense_layout(num_procs=32, tensor_par=8, pipeline_par=4,
                                             data_par=2, batch_size=16,
                                             pipeline_interleaving=2)]), 8)
    assert even.in_flight is None


def test_the_second_stage_holds_no_embedding(h100):
    """With a vocabulary the embedding's weights, gradients and optimizer
    state are the first stage's alone: where the second stage is the fuller
    one, its need is its own blocks and activations."""
    shape = json.loads((ROOT / "models" / "llama2-70B.json").read_text())
    shape.update(num_blocks=14, name="fourteen")
    model = load_model(shape)
    from autopar.studies.validate import unbounded
    roomy = unbounded(h100)
    run = dense_layout(num_procs=64, tensor_par=8, pipeline_par=4, data_par=2, batch_size=16,
                       pipeline_interleaving=2, embedding_in_split=True, loss_in_split=True)
    r = evaluate_one(model, roomy, run)
    assert r["feasible"], REASONS[r["reason_code"]]
    # 16 layers: stages of [3, 4, 4, 3] blocks; rank 1 holds 18 blocks'
    # activations (4.5 stages of 4), rank 0 (chunks of 1 and 2 blocks: the
    # embedding beside one) 15, the last rank (2 and 1: the loss beside one) 10
    sched = schedule(to_columns([run]), 14)
    assert (sched.blocks_first[0], sched.blocks_second[0]) == (3, 4)
    assert [float(c[0]) for c in sched.in_flight] == [5.0, 4.5, 10 / 3]
    W, G, G1, O = (r["block_weight_space"], r["block_weight_grad_space"],
                   r["block_weight_grad_space_no_sharding"], r["block_optimizer_space"])
    work, store, agrad = (r["block_act_working_space"], r["block_act_storage_space"],
                          r["block_act_grad_space"])
    second = W * 4 + G1 + G * 3 + O * 4 + work + store * (4 * 4.5 - 1) + agrad
    # the fullest stage, without the embedding's 32000 x 8192 / 8 parameters
    # (before: charged to it as well)
    assert r["proc_mem_tier1_cap_req"] == pytest.approx(second, rel=1e-12)
