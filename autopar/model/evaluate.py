"""The analytical performance model, array-native: ``evaluate_columns``.

``evaluate_columns(model, system, cols)`` predicts, for every layout of a
layout table (``autopar.io.layouts``) at once, the time and memory of one
training (or inference) batch in the method of Calculon (Isaev et al.,
SC'23), and reports every statistic by Calculon's name (``STATS``).  It
composes the model's parts:

* ``rules``: which layouts cannot run, and why (checked first; only the
  others are computed);
* ``block``: the transformer block as a sequence of ``layers`` (with its
  tensor-parallel ``communication``), summed per block, once per distinct block;
* ``pipeline``: the schedule of blocks, chunks and micro-batches, and the bubble;
* ``communication``: pipeline p2p and the data-parallel gradient sync;
* ``memory``: footprints per stage, offloading, the need on each tier
  (memory capacity is the last rule: it is checked before the times, which
  are computed only for the layouts that fit).

Every quantity is a numpy column with one entry per layout; a single layout is
a column of one.  Rows that are invalid or infeasible get ``feasible=False``,
a ``reason_code`` (index into ``REASONS``) and NaN statistics.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from autopar.io.layouts import to_columns
from autopar.io.specs import ModelSpec, SystemSpec
from autopar.model.block import head_memory, head_time
from autopar.model.block_inputs import ActivationSizes, activation_sizes
from autopar.model.block_sums import CALCULON, BlockSums
from autopar.model.communication import data_parallel_sync, pipeline_p2p, weight_gathers
from autopar.model.context import LayoutContext, masked
from autopar.model.memory import (MEMORY_PARTS, footprints, offload_bandwidth, offload_traffic,
                                  partial_offload_exposed, recompute_share, userbuffer_bytes,
                                  fine_offload_exposed)
from autopar.model.gated_delta import pace_weights
from autopar.model.mamba import hybrid_kinds
from autopar.model.moe import (BF16, bf16_blocks, mix, mixed_rows, mtp_layer_count,
                               stage_counts)
from autopar.model.finetune import real_tokens
from autopar.model.optimizers import newton_schulz
from autopar.model.overhead import launch_time
from autopar.model.pipeline import (Schedule, bubble, chunk_times, last_stage_slack, per_batch,
                                    schedule)
from autopar.model.rules import REASON_CODE, REASONS, check, normalize  # noqa: F401
from autopar.model.speedups import (CHUNK, BlockCache, direct_block_stats, distinct_codes,
                                    result_table, spans, subset, take_rows, write_chunk)

# Statistics reported, by Calculon's names, in Calculon's order.
STATS: tuple[str, ...] = (
    "block_fw_flops", "block_fw_flops_time", "block_fw_mem_accessed",
    "block_fw_mem_time", "block_fw_time",
    "baseblock_fw_tp_time", "edgeblock_fw_tp_time",
    "baseblock_fw_tp_time_exposed", "edgeblock_fw_tp_time_exposed",
    "block_re_flops", "block_re_flops_time", "block_re_mem_accessed",
    "block_re_mem_time", "block_re_time",
    "baseblock_recomm_time", "edgeblock_recomm_time",
    "baseblock_recomm_time_exposed", "edgeblock_recomm_time_exposed",
    "block_agrad_flops", "block_agrad_flops_time", "block_agrad_mem_accessed",
    "block_agrad_mem_time", "block_agrad_time",
    "baseblock_agrad_tp_time", "edgeblock_agrad_tp_time",
    "baseblock_agrad_tp_time_exposed", "edgeblock_agrad_tp_time_exposed",
    "block_wgrad_flops", "block_wgrad_flops_time", "block_wgrad_mem_accessed",
    "block_wgrad_mem_time", "block_wgrad_time",
    "block_optim_flops", "block_optim_flops_time", "block_optim_mem_accessed",
    "block_optim_mem_time", "block_optim_time",
    "baseblock_fw_tp_size", "edgeblock_fw_tp_size",
    "baseblock_bw_tp_size", "edgeblock_bw_tp_size",
    "baseblock_recomm_size", "edgeblock_recomm_size",
    "block_fw_pp_size", "block_bw_pp_size", "block_dp_size",
    "tp_bw_overlap_req", "dp_bw_overlap_req_chunk", "dp_bw_overlap_req_tail",
    "block_weight_space", "block_act_working_space", "block_act_storage_space",
    "block_act_checkpoint_size", "block_weight_grad_space",
    "block_weight_grad_space_no_sharding", "block_act_grad_space",
    "block_optimizer_space",
    "weight_space_with_offload", "act_space_with_offload",
    "act_checkpoint_size_with_offload", "act_grad_space_with_offload",
    "weight_grad_space_with_offload", "optimizer_space_with_offload",
    "weight_space", "act_space", "act_checkpoint_size", "act_grad_space",
    "weight_grad_space", "optimizer_space",
    "fw_time", "bw_time", "optim_step_time", "recompute_time",
    "recomm_link_time", "recomm_exposed_time", "bubble_time",
    "tp_comm_link_time", "pp_comm_link_time", "dp_comm_link_time",
    "tp_comm_exposed_time", "pp_comm_exposed_time", "dp_comm_exposed_time",
    "fw_offload_exposed_time", "bw_offload_exposed_time", "total_time",
    "act_offload_bw_req", "weight_offload_bw_req", "optim_offload_bw_req",
    "offload_mem_bw_req", "proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req",
    "useful_flops", "compute_efficiency", "system_efficiency",
    "total_efficiency", "sample_rate",
    # autopar's extensions (after Calculon's): context parallelism's K/V
    # exchange and ZeRO-3 / FSDP weight gathers (both 0 by default).
    "cp_comm_link_time", "cp_comm_exposed_time",
    "weight_gather_link_time", "weight_gather_exposed_time",
    # mixture-of-experts dispatch/combine over the whole batch (link time, and
    # the part not hidden, which fw_time/bw_time include).
    "ep_comm_link_time", "ep_comm_exposed_time",
)
# Statistics reported on request only (``evaluate_columns(stats=...)``): real
# tokens a second (sample_rate x seq_size; with padded sequences the
# sequence_fill share of them: autopar.model.finetune).  (Not among STATS: a
# column more in every result costs the model's throughput several per cent.)
ON_REQUEST: tuple[str, ...] = ("token_rate",)


# Per-block statistics: Calculon's name -> the block sum it reports.
_BLOCK_STATS = CALCULON


def batch_memory(ctx: LayoutContext, cols: dict, sums: BlockSums, acts: ActivationSizes,
                 system: SystemSpec, stage_sums: tuple | None,
                 sched: Schedule) -> tuple[dict, np.ndarray]:
    """The memory statistics of one batch per row (``footprints``: the
    per-block and per-stage footprints, ``MEMORY_PARTS`` and the need on each
    tier) and the per-block activation checkpoint, from the per-block sums
    ``sums`` (of the stage that paces the pipeline) and, for a model whose
    blocks differ, ``stage_sums``: those of the first and of the last stage
    (and of the second, with an uneven split);
    ``sched``: the rows' ``schedule``.  Computed for every row that passes
    the rules, before ``batch_time`` (only for the rows that fit)."""
    recompute_full = acts.recompute_full
    kept = acts.A
    if system.memory_overhead is not None and system.memory_overhead.checkpoint_split:
        kept = np.where(ctx.tp_rs_ag, acts.A_split, kept)
    checkpoint = masked(kept * ctx.elem_bytes, ctx.training & recompute_full)
    first, last, *second = stage_sums if stage_sums is not None else (sums, None)
    boundary = None
    over = system.memory_overhead
    if over is not None and (over.pipeline_recv_buffers or over.cuda_graphs == "te_layers"):
        # What a stage sends the next: a block's input, its sequence-parallel
        # shard where the blocks run sequence parallelism (also a CUDA
        # graph's static output).
        boundary = np.where(ctx.tp_rs_ag, acts.A_split, acts.A) * ctx.elem_bytes
    S = footprints(ctx, cols, first, sched, checkpoint, recompute_full,
                   head_memory(ctx, cols, acts, sched.stages, system),
                   over, sums_last=last,
                   sums_second=second[0] if second else None, boundary=boundary,
                   userbuffers=userbuffer_bytes(ctx, cols, acts.A, over))
    return S, checkpoint


def batch_time(ctx: LayoutContext, cols: dict, sums: BlockSums, acts: ActivationSizes,
               system: SystemSpec, head_per_mb, sched: Schedule, checkpoint,
               token_rate: bool = False) -> dict:
    """Every statistic of one batch per row but the memory ones
    (``batch_memory``) and the per-block sums (``_BLOCK_STATS``): times,
    communication, the bubble, offloading,
    efficiencies, from the pacing stage's per-block sums ``sums``;
    ``head_per_mb``: the output head's time per micro-batch (None without a
    vocabulary); ``sched``: the rows' ``schedule``; ``checkpoint``: the
    per-block activation checkpoint (``batch_memory``); ``token_rate``: also
    the ``ON_REQUEST`` real tokens a second."""
    training = ctx.training
    stages, micro = sched.stages, sched.microbatches
    recompute_full = acts.recompute_full
    S = {}

    # Communication of the whole batch.
    tp_fw = per_batch(sched, sums.base_fw_tp_time, sums.edge_fw_tp_time)
    tp_fw_exposed = per_batch(sched, sums.base_fw_tp_exp, sums.edge_fw_tp_exp)
    tp_bw = per_batch(sched, sums.base_agrad_tp_time, sums.edge_agrad_tp_time)
    tp_bw_exposed = per_batch(sched, sums.base_agrad_tp_exp, sums.edge_agrad_tp_exp)
    recomm = per_batch(sched, sums.base_recomm_time, sums.edge_recomm_time)
    recomm_exposed = per_batch(sched, sums.base_recomm_exp, sums.edge_recomm_exp)
    p2p_fw_bytes, p2p_bw_bytes, p2p_fw, p2p_bw = pipeline_p2p(ctx, cols, acts, system.networks)
    S["block_fw_pp_size"] = p2p_fw_bytes
    S["block_bw_pp_size"] = p2p_bw_bytes
    fw_transfers = sched.chunks * (stages > 1)
    bw_transfers = sched.chunks * ((stages > 1) & training)
    pp_link = micro * fw_transfers * p2p_fw + micro * bw_transfers * p2p_bw

    # Block and chunk times, offloading, the bubble, the data-parallel sync.
    offload = offload_traffic(ctx, cols, sums, checkpoint, recompute_full)
    chunk = chunk_times(sums, sched, p2p_fw, p2p_bw, offload["fw_time"], offload["bw_time"])
    bubble_time = bubble(sched, chunk)
    dp = data_parallel_sync(ctx, cols, sums, sched, chunk, p2p_bw, system.networks)
    S["block_dp_size"] = dp["block_bytes"]
    S["dp_bw_overlap_req_chunk"] = dp["req_chunk"]
    S["dp_bw_overlap_req_tail"] = dp["req_tail"]

    # Times of the whole batch.
    passes = sched.blocks_per_stage * micro       # block passes per stage
    fw_time = passes * sums.fw_time
    bw_time = passes * (sums.agrad_time + sums.wgrad_time)
    optim_time = sched.blocks_per_stage * sums.optim_time
    if ctx.optimizer is not None:
        # Muon's Newton-Schulz iterations and their exchanges.
        optim_time = optim_time + newton_schulz(ctx, cols, sched.blocks_per_stage,
                                                system.networks)
    fw_offload = per_batch(sched, chunk["fw_base_offload"], chunk["fw_edge_offload"])
    bw_offload = ctx.if_training(per_batch(sched, chunk["bw_base_offload"],
                                           chunk["bw_edge_offload"]))
    partial = partial_offload_exposed(ctx, cols, sums, sched, chunk)
    if partial is not None:
        # Some blocks' activations offloaded (activation_offload_blocks).
        fw_offload = fw_offload + partial[0]
        bw_offload = bw_offload + ctx.if_training(partial[1])
    fine = fine_offload_exposed(ctx, sums, sched)
    if fine is not None:
        # Modules' activations offloaded (activation_offload_modules).
        bw_offload = bw_offload + ctx.if_training(fine)
    # Full recompute of only recompute_layers blocks of each stage.
    share = recompute_share(cols, recompute_full, sched.blocks_per_stage)
    recompute_time = passes * sums.re_time * share
    recomm_exposed = ctx.if_training(recomm_exposed * share)
    # Context parallelism's K/V exchange; ZeRO-3 / FSDP weight gathers.
    if (cols["context_par"] > 1).any():
        S["cp_comm_link_time"] = passes * (sums.cp_fw_link + np.where(
            training, sums.cp_bw_link, 0.0))
        cp_exposed = passes * (sums.cp_fw_exp + np.where(
            training, sums.cp_bw_exp + sums.cp_re_exp * share, 0.0))
    else:
        S["cp_comm_link_time"] = cp_exposed = 0.0
    S["cp_comm_exposed_time"] = cp_exposed
    gathers = weight_gathers(ctx, cols, sums, sched, system.networks)
    S["weight_gather_link_time"] = gathers["link"] + ctx.zeros
    S["weight_gather_exposed_time"] = gathers["exposed"] + ctx.zeros
    S["fw_time"] = fw_time
    S["bw_time"] = bw_time
    S["optim_step_time"] = optim_time
    S["recompute_time"] = recompute_time
    S["recomm_link_time"] = ctx.if_training(recomm)
    S["recomm_exposed_time"] = recomm_exposed
    S["bubble_time"] = bubble_time
    S["tp_comm_link_time"] = tp_fw + tp_bw
    S["pp_comm_link_time"] = pp_link
    S["dp_comm_link_time"] = dp["link"]
    S["tp_comm_exposed_time"] = tp_fw_exposed + tp_bw_exposed
    S["dp_comm_exposed_time"] = dp["exposed"]
    S["fw_offload_exposed_time"] = fw_offload
    S["bw_offload_exposed_time"] = bw_offload
    total = (fw_time + bw_time + optim_time + fw_offload + bw_offload + recompute_time
             + recomm_exposed + bubble_time + S["tp_comm_exposed_time"] + pp_link
             + dp["exposed"])
    if "context_par" in cols and ((cols["context_par"] > 1).any()
                                  or cols["weight_sharding"].any()
                                  or cols["param_gather_overlap"].any()):
        total = total + cp_exposed + S["weight_gather_exposed_time"]
    slack = last_stage_slack(sched, chunk, mtp_layer_count(ctx.model))
    if slack is not None and head_per_mb is not None:
        # An uneven last stage runs the output layer in its spare time.
        head_per_mb = np.maximum(head_per_mb - slack, 0.0)
    total = total + head_time(ctx, micro, stages, head_per_mb)
    # An eager framework's host time where block passes are shorter than it.
    launch_s = system.time_overhead.launch_s if system.time_overhead else 0.0
    total = total + launch_time(ctx.model, cols, sums, share, passes, launch_s)
    # Pipelined steps run slower by the system's pipeline_fraction: at every
    # synchronising p2p exchange a stage waits for its neighbour.
    fraction = system.time_overhead.pipeline_fraction if system.time_overhead else 0.0
    pp_sync = np.where(stages > 1, fraction * total, 0.0)
    S["pp_comm_exposed_time"] = pp_link + pp_sync
    total = total + pp_sync
    S["total_time"] = total
    S["ep_comm_link_time"] = passes * sums.ep_link
    S["ep_comm_exposed_time"] = passes * sums.ep_exposed
    S.update(offload_bandwidth(ctx, sums, chunk, offload))

    useful = sums.useful_fw + sums.useful_bw + sums.optim_flops
    compute_time = fw_time + bw_time + optim_time
    perfect = passes * useful / ctx.matrix.peak
    with np.errstate(divide="ignore", invalid="ignore"):
        S["useful_flops"] = useful
        S["compute_efficiency"] = perfect / compute_time
        S["system_efficiency"] = compute_time / total
        S["total_efficiency"] = perfect / total
        S["sample_rate"] = cols["batch_size"] / total
        if token_rate:          # on request only (ON_REQUEST)
            S["token_rate"] = S["sample_rate"] * real_tokens(cols, float(ctx.model.seq_size))
    return S


_MEM1 = REASON_CODE["infeasible: mem tier1 capacity exceeded"]
_MEM2 = REASON_CODE["infeasible: mem tier2 capacity exceeded"]
_MEM_REQ = ("proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req")


def evaluate_columns(model: ModelSpec, system: SystemSpec, cols: Mapping,
                     stats=None) -> dict:
    """Every statistic for every layout of ``cols`` (a layout table).

    Returns a dict of columns: each name of ``STATS`` (or of ``stats``, a
    subset, when given, which may also name the ``MEMORY_PARTS`` and the
    ``ON_REQUEST`` statistics; NaN where the layout cannot run, except that a layout
    that fails on memory capacity keeps its two ``proc_mem_tier*_cap_req``
    requirements), ``feasible`` (bool) and ``reason_code`` (index in
    REASONS).  Only layouts that pass the rules are computed: the block once
    per distinct block, the batch level in chunks that stay in cache, each
    chunk's memory footprints first and its times only for the layouts that
    fit in memory.
    """
    names = STATS if stats is None else tuple(stats)
    tokens = "token_rate" in names
    unknown = [x for x in names if x not in STATS and x not in MEMORY_PARTS
               and x not in ON_REQUEST]
    if unknown:
        raise ValueError(f"unknown statistics: {', '.join(unknown)}")
    cols = normalize(cols)
    n = len(cols["tensor_par"])
    code, _ = check(model, system, cols)
    rows = np.flatnonzero(code == 0)
    every = len(rows) == n
    # One (statistic, layout) table; each statistic is a contiguous row of it.
    table = result_table(len(names), n)
    out = dict(zip(names, table))
    if not len(rows):
        table.fill(np.nan)
    else:
        # A layout that fails only on memory keeps its requirements and the
        # memory parts, so that the reason can say how much it needs; the
        # other statistics are NaN where the layout cannot run.
        kept = [name in _MEM_REQ or name in MEMORY_PARTS for name in names]
        valid = typed_columns(cols if every else take_rows(cols, rows))
        datatypes = distinct_codes(valid["datatype"])
        m = len(rows)
        ext = np.empty(min(CHUNK, m) + 1)          # a chunk's values, then NaN
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            caches = _block_caches(model, system, valid, datatypes)
            blocks = next(iter(caches.values()))
            sched = schedule(valid, model.num_blocks, mixed_rows(model, valid))
            direct = direct_block_stats(model) and len(caches) == 1
            for i in range(0, m, CHUNK):
                sl = slice(i, min(i + CHUNK, m))
                part = {f: v[sl] for f, v in valid.items()}
                shards = blocks.shards(sl)
                ctx = LayoutContext(model, system, part, datatypes, shards)
                foot, stage_sums = _stage_sums(
                    model, part, {k: c.rows(sl, "footprints") for k, c in caches.items()})
                acts = activation_sizes(ctx, part)
                rows_sched = sched.rows(sl)
                # Memory first: the times only of the rows that fit.
                mem, checkpoint = batch_memory(ctx, part, foot, acts, system, stage_sums,
                                               rows_sched)
                # (the first tier whose capacity is exceeded, by arithmetic
                # on the masks: several times faster than np.where on them)
                over1 = mem["proc_mem_tier1_cap_req"] > ctx.mem1.capacity
                over2 = mem["proc_mem_tier2_cap_req"] > ctx.mem2.capacity
                memory = over1 * np.int16(_MEM1) + (over2 & ~over1) * np.int16(_MEM2)
                code[sl if every else rows[sl]] = memory
                failed = memory != 0
                head = blocks.head(sl)
                fit = None
                times = None
                if not failed.any():
                    timed = sl
                    sums = _pace_sums(model, part, foot, caches, sl, direct)
                    times = batch_time(ctx, part, sums, acts, system, head, rows_sched,
                                       checkpoint, tokens)
                else:
                    fit = np.flatnonzero(~failed)
                    timed = sl.start + fit
                    if len(fit):
                        sub = subset(part, fit)
                        sub_ctx = LayoutContext(model, system, sub, datatypes, None if shards
                                                is None else tuple(c.take(fit) for c in shards))
                        foot_fit = BlockSums(**subset(foot.given(), fit))
                        sums = _pace_sums(model, sub, foot_fit, caches, timed, direct)
                        acts_fit = ActivationSizes(**subset(vars(acts), fit))
                        times = batch_time(sub_ctx, sub, sums, acts_fit,
                                           system, None if head is None else head.take(fit),
                                           rows_sched.rows(fit), checkpoint.take(fit),
                                           tokens)
                if times is not None and not direct:
                    times.update({name: getattr(sums, key) for name, key in _BLOCK_STATS.items()})
                write_chunk(table, kept, mem, times, names, ext,
                            spans(rows, sl, n, every, failed, fit),
                            (blocks.sum_tables(), timed) if direct else None)
    out["feasible"] = code == 0
    out["reason_code"] = code
    return out


def _block_caches(model: ModelSpec, system: SystemSpec, cols: dict, datatypes) -> dict:
    """One ``BlockCache`` per block kind of the model, the first with the
    output head's time: "dense" (and "moe" for a model with ``moe``); a
    hybrid model's kinds (``autopar.model.mamba.hybrid_kinds``); where some
    row keeps the recipe's first or last blocks in BF16
    (``autopar.model.moe.bf16_blocks``), each kind again as the same block
    without the ``fp8_recipe`` (named with ``BF16`` appended)."""
    if model.hybrid_pattern:
        kinds = hybrid_kinds(model)
    else:
        kinds = ("dense", "moe") if model.moe is not None else ("dense",)
    caches = {k: BlockCache(model, system, cols, datatypes, kind=k, head=i == 0)
              for i, k in enumerate(kinds)}
    if bf16_blocks(cols) is not None:
        # The recipe's BF16 blocks: each kind again, without the recipe.
        plain = dict(cols, fp8_recipe=np.zeros_like(cols["fp8_recipe"]))
        caches.update({k + BF16: BlockCache(model, system, plain, datatypes, kind=k, head=False)
                       for k in kinds})
    return caches


def _stage_sums(model: ModelSpec, cols: dict, sums: dict, stages: bool = True):
    """Per-block sums of the pacing stage, and (first, last) stage sums for
    memory (with ``stages``), from each block kind's sums ``sums``; a model
    whose blocks are all alike (no MoE, no MTP, no hybrid pattern) has one
    block."""
    if len(sums) == 1 and not model.mtp:
        return next(iter(sums.values())), None
    if "moe" not in sums and not model.hybrid_pattern:
        sums = dict(sums, moe=sums["dense"])
        if "dense" + BF16 in sums:
            sums["moe" + BF16] = sums["dense" + BF16]
    weights = pace_weights(model) if model.hybrid_pattern else None
    counts = stage_counts(model, cols["pipeline_par"], cols, pace_weights=weights)
    per_stage = -(-model.num_blocks // cols["pipeline_par"])
    # (an uneven split: each stage's sums over its own blocks, and the second
    # stage's too)
    whos = ("pace", "first", "last") + (("second",) if "second_blocks" in counts else ())
    kinds0 = next(iter(sums))
    pace, first, last, *second = (
        mix(sums, {k: counts[f"{w}_{k}"] for k in sums}, counts.get(f"{w}_blocks", per_stage),
            {k: counts[f"{w}_{k}@held"] for k in sums} if f"{w}_{kinds0}@held" in counts
            else None)
        if w == "pace" or stages else None for w in whos)
    return pace, ((first, last) + tuple(second) if stages else None)


def _pace_sums(model: ModelSpec, cols: dict, foot: BlockSums, caches: dict, at,
               direct: bool = False) -> BlockSums:
    """The pacing stage's per-block sums of the rows ``at`` (``cols``): its
    footprint sums ``foot`` (already gathered for memory) and the others
    (``direct``: only those the batch level computes with)."""
    part = "batch" if direct else "rest"
    rest, _ = _stage_sums(model, cols, {k: c.rows(at, part) for k, c in caches.items()},
                          stages=False)
    return replace(rest, **foot.given())


def evaluate_one(model: ModelSpec, system: SystemSpec, execution: Mapping) -> dict:
    """One execution -> what ``evaluate_columns`` returns, as Python values."""
    out = evaluate_columns(model, system, to_columns([execution]))
    return {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in out.items()}


def typed_columns(c: dict) -> dict:
    """The columns in the dtypes the model computes with."""
    typed = {}
    for f in ("tensor_par", "pipeline_par", "data_par", "microbatch_size",
              "pipeline_interleaving", "batch_size", "num_procs",
              "tensor_par_net", "pipeline_par_net", "data_par_net", "context_par",
              "context_par_net", "sharding_group", "recompute_layers",
              "expert_par", "expert_tensor_par", "expert_par_net", "expert_tensor_par_net",
              "first_stage_blocks", "last_stage_blocks", "adapter_rank", "sequence_fill",
              "bf16_first_blocks", "bf16_last_blocks", "attention_span",
              "optimizer_moment_bytes",
              "activation_offload_blocks"):
        typed[f] = c[f].astype(np.int64, copy=False)
    for f in ("fused_activation", "optimizer_sharding", "seq_par_ag_redo",
              "data_par_overlap", "weight_offload", "activations_offload",
              "optimizer_offload", "training", "fused_norm", "unsharded_grads",
              "weight_sharding", "fp32_grads", "param_gather_overlap", "moe_overlap",
              "embedding_in_split", "loss_in_split", "recompute_moe_act",
              "recompute_mla_up_proj", "optimizer_outer_sharding"):
        typed[f] = c[f].astype(bool, copy=False)
    for f in ("datatype", "attention_type", "activation_recompute", "tensor_par_comm_type",
              "tensor_par_overlap", "attention_impl", "context_par_comm", "fp8_recipe",
              "moe_dispatcher", "pipeline_layout", "optimizer", "adapter", "adapter_targets",
              "activation_offload_modules"):
        typed[f] = c[f].astype(np.int8, copy=False)
    return typed


def reason_text(out: Mapping, system: SystemSpec):
    """One reason per row of an ``evaluate_columns`` result, as a pandas
    Categorical ('' when feasible).  Memory failures say how much is needed
    against the tier's capacity."""
    import pandas as pd

    codes = np.asarray(out["reason_code"]).astype(np.int64)
    cats = list(REASONS)
    for tier, mem in ((1, system.mem1), (2, system.mem2)):
        need = out.get(f"proc_mem_tier{tier}_cap_req")
        rows = np.flatnonzero(codes == REASON_CODE[f"infeasible: mem tier{tier} capacity exceeded"])
        if need is None or not len(rows):
            continue
        gib = np.round(need[rows] / 1024 ** 3, 2)
        values, inverse = np.unique(gib, return_inverse=True)
        codes[rows] = len(cats) + inverse
        # (Python floats format as numpy's do, at a third of the time)
        head, tail = f"infeasible: mem tier{tier} needs ", f" GiB but has {mem.GiB:g} GiB"
        cats += [f"{head}{v:.2f}{tail}" for v in values.tolist()]
    return pd.Categorical.from_codes(codes, categories=pd.Index(cats, dtype=object))
