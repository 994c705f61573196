"""The per-block sums of one micro-batch: ``BlockSums``.

``autopar.model.block.accumulate`` sums a block's layers into these fields
(with Calculon's recompute rules; Calculon's ``llm.py`` keeps the same sums
as its per-block statistics), and the batch level (pipeline, communication,
memory, ``evaluate``) reads them by name.  Each field is an array over the
rows (or None where a gather left it out: ``autopar.model.speedups``
gathers only the sums a stage of the evaluation needs).  A field that
Calculon reports as a statistic names it in its metadata (``CALCULON``
collects them); the footprint fields are reported by ``memory`` after the
shard divisions, the others are autopar's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


def _sum(calculon: str | None = None):
    return field(default=None, metadata={"calculon": calculon} if calculon else {})


@dataclass
class BlockSums:
    """Per-block sums of one micro-batch on one processor, per row."""
    # forward pass: FLOPs, their time, memory accessed, its time, the pass's time
    fw_flops: np.ndarray = _sum("block_fw_flops")
    fw_flops_time: np.ndarray = _sum("block_fw_flops_time")
    fw_mem: np.ndarray = _sum("block_fw_mem_accessed")
    fw_mem_time: np.ndarray = _sum("block_fw_mem_time")
    fw_time: np.ndarray = _sum("block_fw_time")
    # tensor-parallel communication of the forward pass: bytes, link time,
    # exposed time, of a base block and of an edge block (next to a stage's
    # pipeline transfer)
    base_fw_tp_size: np.ndarray = _sum("baseblock_fw_tp_size")
    edge_fw_tp_size: np.ndarray = _sum("edgeblock_fw_tp_size")
    base_fw_tp_time: np.ndarray = _sum("baseblock_fw_tp_time")
    edge_fw_tp_time: np.ndarray = _sum("edgeblock_fw_tp_time")
    base_fw_tp_exp: np.ndarray = _sum("baseblock_fw_tp_time_exposed")
    edge_fw_tp_exp: np.ndarray = _sum("edgeblock_fw_tp_time_exposed")
    # recompute in backward (Calculon adds the running forward totals)
    re_flops: np.ndarray = _sum("block_re_flops")
    re_flops_time: np.ndarray = _sum("block_re_flops_time")
    re_mem: np.ndarray = _sum("block_re_mem_accessed")
    re_mem_time: np.ndarray = _sum("block_re_mem_time")
    re_time: np.ndarray = _sum("block_re_time")
    # tensor-parallel communication that recompute runs again
    base_recomm_size: np.ndarray = _sum("baseblock_recomm_size")
    edge_recomm_size: np.ndarray = _sum("edgeblock_recomm_size")
    base_recomm_time: np.ndarray = _sum("baseblock_recomm_time")
    edge_recomm_time: np.ndarray = _sum("edgeblock_recomm_time")
    base_recomm_exp: np.ndarray = _sum("baseblock_recomm_time_exposed")
    edge_recomm_exp: np.ndarray = _sum("edgeblock_recomm_time_exposed")
    # activation-gradient pass and its tensor-parallel communication
    agrad_flops: np.ndarray = _sum("block_agrad_flops")
    agrad_flops_time: np.ndarray = _sum("block_agrad_flops_time")
    agrad_mem: np.ndarray = _sum("block_agrad_mem_accessed")
    agrad_mem_time: np.ndarray = _sum("block_agrad_mem_time")
    agrad_time: np.ndarray = _sum("block_agrad_time")
    base_agrad_tp_size: np.ndarray = _sum("baseblock_bw_tp_size")
    edge_agrad_tp_size: np.ndarray = _sum("edgeblock_bw_tp_size")
    base_agrad_tp_time: np.ndarray = _sum("baseblock_agrad_tp_time")
    edge_agrad_tp_time: np.ndarray = _sum("edgeblock_agrad_tp_time")
    base_agrad_tp_exp: np.ndarray = _sum("baseblock_agrad_tp_time_exposed")
    edge_agrad_tp_exp: np.ndarray = _sum("edgeblock_agrad_tp_time_exposed")
    # weight-gradient pass
    wgrad_flops: np.ndarray = _sum("block_wgrad_flops")
    wgrad_flops_time: np.ndarray = _sum("block_wgrad_flops_time")
    wgrad_mem: np.ndarray = _sum("block_wgrad_mem_accessed")
    wgrad_mem_time: np.ndarray = _sum("block_wgrad_mem_time")
    wgrad_time: np.ndarray = _sum("block_wgrad_time")
    # optimizer step
    optim_flops: np.ndarray = _sum("block_optim_flops")
    optim_flops_time: np.ndarray = _sum("block_optim_flops_time")
    optim_mem: np.ndarray = _sum("block_optim_mem_accessed")
    optim_mem_time: np.ndarray = _sum("block_optim_mem_time")
    optim_time: np.ndarray = _sum("block_optim_time")
    # footprints (bytes; memory.footprints reports them as block_*_space)
    weight_space: np.ndarray = _sum()
    act_working: np.ndarray = _sum()
    act_storage: np.ndarray = _sum()
    wgrad_space: np.ndarray = _sum()
    wgrad_space_full: np.ndarray = _sum()
    act_grad_space: np.ndarray = _sum()
    optimizer_space: np.ndarray = _sum()
    # what a block keeps when it does not recompute (recompute_layers)
    act_storage_all: np.ndarray = _sum()
    # of act_storage, what the layers of the modules a row offloads store
    # (``activation_offload_modules``; None where no row sets it)
    act_offload: np.ndarray = _sum()
    # the backward time (activation and weight gradients) of those layers,
    # and the block's forward time, which their copies out run behind (a
    # footprint sum: the copies still running are on tier 1)
    bw_offload: np.ndarray = _sum()
    fw_offload_window: np.ndarray = _sum()
    # the largest act_offload of one block of the stage (a stage of block
    # kinds: the kept and in-flight groups are whole blocks of the kind
    # that has the module, not the average block)
    act_offload_max: np.ndarray = _sum()
    # a whole block's weights where ZeRO-3 / FSDP shards them (set with the
    # shard divisions)
    weight_space_full: np.ndarray = _sum()
    # the part of weight_space a framework does not hold: the working-
    # precision copy of weights kept only quantized
    # (``memory_overhead.fp8_primary_weights``), and the same of a whole
    # block where ZeRO-3 / FSDP shards the weights
    weight_unkept: np.ndarray = _sum()
    weight_unkept_full: np.ndarray = _sum()
    # within weight_space (a whole block's, not sharded): the quantized
    # weight copies of fp8 / fp4 recipes, which are no parameters and no
    # data-parallel collective moves, and the bytes of quantized-only
    # weights the parameter all-gather does not move (it moves the quantized
    # bytes); x_: the routed experts' share of each
    # (communication.data_parallel_sync, weight_gathers)
    weight_copies: np.ndarray = _sum()
    weight_unsent: np.ndarray = _sum()
    x_weight_copies: np.ndarray = _sum()
    x_weight_unsent: np.ndarray = _sum()
    # model FLOPs of the forward and backward passes (no recompute)
    useful_fw: np.ndarray = _sum()
    useful_bw: np.ndarray = _sum()
    # the routed experts' share of the footprints (sharded over expert-data-
    # parallel) and the dispatch/combine transfers (link and exposed time)
    x_weight_space: np.ndarray = _sum()
    # ... of weight_unkept (Megatron-FSDP shards it over expert-data-parallel)
    x_weight_unkept: np.ndarray = _sum()
    x_wgrad_space: np.ndarray = _sum()
    x_optimizer_space: np.ndarray = _sum()
    ep_link: np.ndarray = _sum()
    ep_exposed: np.ndarray = _sum()
    # the largest bandwidth a layer's overlapped TP communication needs
    tp_bw_req: np.ndarray = _sum("tp_bw_overlap_req")
    # context parallelism's K/V exchange (communication.context_exchange)
    cp_fw_link: np.ndarray = _sum()
    cp_fw_exp: np.ndarray = _sum()
    cp_bw_link: np.ndarray = _sum()
    cp_bw_exp: np.ndarray = _sum()
    cp_re_exp: np.ndarray = _sum()
    cp_fw_size: np.ndarray = _sum()
    # Transformer Engine's cached dummy weight gradients (bytes, one per
    # distinct weight shape: ``memory_overhead.dummy_wgrad``) of the
    # attention's GEMMs, which every block kind of a model shares, and of the
    # rest of the block; and the largest input + output gradients one op of
    # the block holds in backward (``memory_overhead.backward_transient``
    # "op").  Set by ``block.framework_terms``.
    dummy_attn: np.ndarray = _sum()
    dummy_rest: np.ndarray = _sum()
    op_grads: np.ndarray = _sum()
    # ... and, under ``memory_overhead.cuda_graphs`` "scoped", that op's
    # bytes in the block's mixer part (attention, Mamba, Gated DeltaNet) and
    # in the rest (MLP, experts): one part runs in the CUDA graphs' pool,
    # the other eagerly (``block.framework_terms``).
    op_grads_mixer: np.ndarray = _sum()
    op_grads_rest: np.ndarray = _sum()

    def given(self) -> dict:
        """The fields that are set (not None), by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


# The sums that combine by the larger value, not by adding.
MAX_SUMS = ("tp_bw_req", "dummy_attn", "op_grads", "op_grads_mixer", "op_grads_rest",
            "act_offload_max")
# The sums a stage holds once per block kind it has, however many blocks.
KIND_SUMS = ("dummy_rest",)
# Calculon's statistic -> the field that reports it.
CALCULON = {f.metadata["calculon"]: f.name for f in fields(BlockSums)
            if "calculon" in f.metadata}
