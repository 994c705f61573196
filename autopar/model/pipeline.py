"""The pipeline schedule: stages, chunks, interleaving and the bubble.

Follows the batch-level time composition of Calculon's ``llm.py``.  The
blocks are spread over ``pipeline_par`` stages (``blocks_per_stage``, the
last stages lacking ``missing_blocks`` when the stages do not divide the
blocks); with interleaving, a stage holds ``chunks`` chunks of
``blocks_per_chunk`` blocks.  Within a chunk, the *edge* block (the last
one) also pays the p2p transfer to the next stage and, with the p2p TP
variant, split collectives; the others are *base* blocks.  Every
micro-batch passes every chunk; the bubble is ``pipeline_par - 1`` chunk
times, shortened by the missing blocks and lengthened when interleaving
meets micro-batches that do not fill the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from autopar.model.block_sums import BlockSums
from autopar.model.lookup import Ranges, by_value


@dataclass(frozen=True)
class Schedule:
    """How one data-parallel replica's batch runs through its pipeline."""
    stages: np.ndarray            # pipeline_par
    interleaving: np.ndarray      # pipeline_interleaving
    microbatches: np.ndarray      # per replica: batch / data_par / microbatch_size
    blocks_per_stage: np.ndarray  # ceil(num_blocks / stages)
    missing_blocks: np.ndarray    # stages * blocks_per_stage - num_blocks
    blocks_per_chunk: np.ndarray
    chunks: np.ndarray            # chunks per stage
    base_blocks: np.ndarray       # blocks of a chunk but its edge block (float)
    chunk_passes: np.ndarray      # microbatches * chunks: chunk passes per stage
    leftover: np.ndarray          # microbatches % stages

    def rows(self, sl) -> "Schedule":
        """The schedule of the rows ``sl`` (a slice, or positions)."""
        return Schedule(**{f.name: getattr(self, f.name)[sl] for f in fields(self)})


def schedule(cols: dict, num_blocks: int) -> Schedule:
    stages, interleaving = cols["pipeline_par"], cols["pipeline_interleaving"]

    def per_stage(p):
        return -(-num_blocks // p)

    # Functions of (stages, interleaving), which take few values: once per value.
    ranges = Ranges()
    blocks_per_stage = by_value(per_stage, stages, ranges=ranges)
    missing = by_value(lambda p: np.where(num_blocks % p != 0, p - num_blocks % p, 0), stages,
                       ranges=ranges)
    blocks_per_chunk = by_value(lambda p, v: np.maximum(per_stage(p) // v, 1),
                                stages, interleaving, ranges=ranges)
    chunks = by_value(lambda p, v: per_stage(p) // np.maximum(per_stage(p) // v, 1),
                      stages, interleaving, ranges=ranges)
    # (floor(floor(b / d) / m) is floor(b / (d m)) for positive integers: one
    # division instead of two, where the product stays within int64)
    dp, mbs = cols["data_par"], cols["microbatch_size"]
    if len(dp) and min(ranges(dp)[0], ranges(mbs)[0]) > 0 \
            and ranges(dp)[1] * ranges(mbs)[1] < 1 << 62:
        microbatches = cols["batch_size"] // (dp * mbs)
    else:
        microbatches = cols["batch_size"] // dp // mbs
    return Schedule(
        stages=stages, interleaving=interleaving, microbatches=microbatches,
        blocks_per_stage=blocks_per_stage, missing_blocks=missing,
        blocks_per_chunk=blocks_per_chunk, chunks=chunks,
        base_blocks=(blocks_per_chunk - 1).astype(float), chunk_passes=microbatches * chunks,
        leftover=microbatches % stages)


def per_batch(sched: Schedule, base_value, edge_value):
    """A per-block quantity over the batch: every micro-batch runs every chunk,
    each with ``base_blocks`` base blocks and one edge block."""
    return sched.chunk_passes * (sched.base_blocks * base_value + edge_value)


def chunk_times(sums: BlockSums, sched: Schedule, p2p_fw_time, p2p_bw_time,
                offload_fw_time, offload_bw_time) -> dict:
    """Forward and backward time of a base and an edge block, and of a chunk.

    Offloading to the second memory tier overlaps a block's compute; where
    the transfer (with the block's own memory traffic) takes longer than the
    block, the difference is an overhead (``*_offload``).  ``*_no_offload``
    are the times before it.
    """
    fw_base = sums.fw_time + sums.base_fw_tp_exp
    fw_edge = sums.fw_time + sums.edge_fw_tp_exp + p2p_fw_time
    fw_base_offload = np.maximum(0.0, offload_fw_time + sums.fw_mem_time - fw_base)
    fw_edge_offload = np.maximum(0.0, offload_fw_time + sums.fw_mem_time - fw_edge)
    bw_common = sums.re_time + sums.agrad_time + sums.wgrad_time
    bw_base = bw_common + sums.base_recomm_exp + sums.base_agrad_tp_exp
    bw_edge = bw_common + sums.edge_recomm_exp + sums.edge_agrad_tp_exp + p2p_bw_time
    grad_mem_time = sums.agrad_mem_time + sums.wgrad_mem_time
    bw_base_offload = np.maximum(0.0, offload_bw_time + grad_mem_time - bw_base)
    bw_edge_offload = np.maximum(0.0, offload_bw_time + grad_mem_time - bw_edge)
    t = {"fw_base_no_offload": fw_base, "fw_edge_no_offload": fw_edge,
         "bw_base_no_offload": bw_base, "bw_edge_no_offload": bw_edge,
         "fw_base_offload": fw_base_offload, "fw_edge_offload": fw_edge_offload,
         "bw_base_offload": bw_base_offload, "bw_edge_offload": bw_edge_offload,
         "fw_base": fw_base + fw_base_offload, "fw_edge": fw_edge + fw_edge_offload,
         "bw_base": bw_base + bw_base_offload, "bw_edge": bw_edge + bw_edge_offload,
         "grad_mem_time": grad_mem_time}
    t["fw"] = sched.base_blocks * t["fw_base"] + 1.0 * t["fw_edge"]
    t["bw"] = sched.base_blocks * t["bw_base"] + 1.0 * t["bw_edge"]
    return t


def bubble(sched: Schedule, chunk: dict):
    """Idle time of the pipeline over one batch."""
    stages = sched.stages
    chunk_time = chunk["fw"] + chunk["bw"]
    # Stages lacking blocks finish early: the bubble shrinks by their share.
    saved = np.where(sched.base_blocks > 0,
                     sched.missing_blocks * (chunk["fw_base"] + chunk["fw_edge"]
                                             + chunk["bw_base"] + chunk["bw_edge"]) / 2,
                     sched.missing_blocks * (chunk["fw_edge"] + chunk["bw_edge"]))
    # Interleaving with micro-batches that do not fill the pipeline idles more.
    leftover = sched.leftover
    extra = np.where(leftover != 0, (sched.interleaving - 1) * (stages - leftover), 0)
    return (stages - 1) * chunk_time + (extra * chunk_time - saved)
