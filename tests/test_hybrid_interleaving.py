"""Interleaved pipelines for hybrid-pattern models, counted by hand
(docs/validation.md "Interleaved pipelines for hybrid models, counted")."""
from __future__ import annotations

import numpy as np

from autopar.model.moe import stage_counts
from autopar.model.pipeline import chunk_spans, chunk_split, interleaved_peak
from tests.test_mamba import reason, run, tiny

# 8 blocks over pipeline 2 x virtual 2: virtual stage k holds blocks
# [2k, 2k + 2) and sits on stage k % 2, so stage 0 holds "MM" and "M-",
# stage 1 "*-" and "*-" (without interleaving: "MM*-" and "M-*-").
PATTERN = "MM*-M-*-"


def _cols(v, **kw):
    n = 1
    cols = {"pipeline_par": np.array([2] * n), "pipeline_interleaving": np.array([v] * n),
            "first_stage_blocks": np.zeros(n, int), "last_stage_blocks": np.zeros(n, int),
            "embedding_in_split": np.zeros(n, bool), "loss_in_split": np.zeros(n, bool),
            "pipeline_layout": np.zeros(n, int)}
    cols.update({k: np.array([x]) for k, x in kw.items()})
    return cols


def test_chunks_in_megatron_order():
    assert chunk_spans(chunk_split(8, 2, 2, 0, 0, False, False, False)) == \
        [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    # the loss counted: the last virtual stage (stage 1's chunk 1) one block fewer
    assert chunk_spans(chunk_split(7, 2, 2, 0, 0, False, True, False)) == \
        [[(0, 2), (4, 6)], [(2, 4), (6, 7)]]


def test_stage_kinds_pp2_vp2_by_hand():
    m = tiny(PATTERN)
    c = stage_counts(m, np.array([2]), _cols(2))
    assert (c["first_mamba"][0], c["first_attention"][0], c["first_mlp"][0]) == (3, 0, 1)
    assert (c["last_mamba"][0], c["last_attention"][0], c["last_mlp"][0]) == (0, 2, 2)
    # without interleaving: contiguous halves
    c = stage_counts(m, np.array([2]), _cols(1))
    assert (c["first_mamba"][0], c["first_attention"][0], c["first_mlp"][0]) == (2, 1, 1)
    assert (c["last_mamba"][0], c["last_attention"][0], c["last_mlp"][0]) == (1, 1, 2)
    # the embedding counted on 7 blocks: 7 + 1 = 8 layers, 2 a virtual
    # stage, the first virtual stage one block fewer
    m7 = tiny(PATTERN[:7])
    c = stage_counts(m7, np.array([2]), _cols(2, embedding_in_split=True))
    # blocks: vs0 [0,1) "M", vs1 [1,3) "M*", vs2 [3,5) "-M", vs3 [5,7) "-*"
    assert (c["first_mamba"][0], c["first_attention"][0], c["first_mlp"][0]) == (2, 0, 1)
    assert (c["last_mamba"][0], c["last_attention"][0], c["last_mlp"][0]) == (1, 2, 1)
    assert c["first_blocks"][0] == 3 and c["last_blocks"][0] == 4


def test_in_flight_pp2_vp2_by_hand():
    """Rank 0 of 2, two chunks of 2 blocks, 4 micro-batches: warm-up
    2 * (2 - 0 - 1) + (2 - 1) * 2 = 4 forwards (mb 0, 1 on chunk 0, then on
    chunk 1), one more forward before the first backward: 5 chunk passes of
    2 blocks held, 10 blocks, 2.5 times the stage's 4.  Rank 1: warm-up 2,
    peak 3 chunk passes, 6 blocks."""
    assert interleaved_peak(2, 2, 4, 0, [2, 2]) == 10.0
    assert interleaved_peak(2, 2, 4, 1, [2, 2]) == 6.0
    # with the loss counted (rank 1's chunks of 2 and 1 blocks): warm-up
    # mb 0, 1 on chunk 0 (4); then F mb0/c1 (5) B mb0/c1 (4), F mb1/c1 (5)
    # B mb1/c1 (4), F mb2/c0 (6): three chunk-0 passes held at once, 6 blocks
    # (not the 5 of the first steady step)
    assert interleaved_peak(2, 2, 4, 1, [2, 1]) == 6.0
    assert interleaved_peak(2, 2, 2, 1, [2, 1]) == 5.0


def test_interleaving_moves_a_hybrid_models_stages(h100):
    """The same 8 blocks over 2 stages: interleaving puts 3 Mamba layers on
    stage 0 and both attention layers on stage 1, which changes the memory
    the model needs; both run."""
    m = tiny(PATTERN)
    a = run(m, h100, num_procs=2, pipeline_par=2, batch_size=4)
    b = run(m, h100, num_procs=2, pipeline_par=2, pipeline_interleaving=2, batch_size=4)
    assert a["feasible"] and b["feasible"], (reason(a), reason(b))
    assert a["proc_mem_tier1_cap_req"] != b["proc_mem_tier1_cap_req"]
    # the bubble with interleaving: (p - 1) chunk times, a chunk half a stage
    assert b["bubble_time"] < a["bubble_time"]


def test_megatron_pattern_segments_match_the_counted_chunks():
    """The Megatron export writes the virtual stages as '|' segments
    (select_pipeline_segment: segment ``vp_stage * pp + rank``); they are the
    chunks the model counts, stage ``k % pp`` holding segment ``k``."""
    from autopar.io.launch.mcore import hybrid_pattern
    m = tiny(PATTERN)
    ex = {"pipeline_par": 2, "pipeline_interleaving": 2}
    assert hybrid_pattern(m, ex) == "MM|*-|M-|*-"
    segs = hybrid_pattern(tiny(PATTERN[:7]), {**ex, "loss_in_split": True}).split("|")
    spans = chunk_spans(chunk_split(7, 2, 2, 0, 0, False, True, False))
    assert segs == [PATTERN[lo:hi] for j in range(2) for s in range(2)
                    for lo, hi in [spans[s][j]]]
