"""Memory: footprints per stage, offloading to the second tier, and the need.

Follows the memory accounting of Calculon's ``llm.py``.  A processor holds
*static* state for its stage (weights, weight gradients, optimizer state)
and *transient* tensors (activations of the micro-batches in flight,
activation checkpoints under full recompute, gradients of activations, the
logits of a model with a vocabulary).  Offloading moves weights,
activations or optimizer state to the second tier, keeping two blocks'
worth in the first (double buffering).  A system's ``memory_overhead``
(a reserved amount, fragmentation on the transient part, the loss's fp32
logits, the optimizer step's temporaries) is charged here; Calculon's files
have none.

The need on tier 1 is that of the fuller of the first stage (most
micro-batches in flight, the embedding) and the last (one micro-batch, the
output layer and the logits); with one stage they are the same.
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES
from autopar.model.block_sums import BlockSums
from autopar.model.context import LayoutContext, choose, masked, pick
from autopar.model.pipeline import Schedule


def offload_traffic(ctx: LayoutContext, cols: dict, sums: BlockSums, checkpoint,
                    recompute_full) -> dict:
    """Bytes a block moves to or from tier 2 in forward and backward, and the time."""
    weights, acts, optim = (cols["weight_offload"], cols["activations_offload"],
                            cols["optimizer_offload"])
    act_bytes = np.where(recompute_full, checkpoint, sums.act_storage)
    fw_bytes = np.maximum(masked(sums.weight_space, weights), masked(act_bytes, acts))
    bw_bytes = ctx.if_training(masked(sums.weight_space, weights)
                               + masked(act_bytes, acts)
                               + masked(sums.optimizer_space, optim))
    return {"act_bytes": act_bytes, "fw_bytes": fw_bytes, "bw_bytes": bw_bytes,
            "fw_time": ctx.mem2.time(fw_bytes),
            "bw_time": ctx.if_training(ctx.mem2.time(bw_bytes))}


def offloaded_blocks(cols: dict, ctx: LayoutContext):
    """The rows' ``activation_offload_blocks`` where some row trains with it
    set (> 0), else None (every row as Calculon: no partial offload)."""
    k = cols.get("activation_offload_blocks") if hasattr(cols, "get") else None
    if k is None or not np.any(k > 0):
        return None
    k = np.where(ctx.training, np.maximum(k, 0), 0)
    return k if np.any(k > 0) else None


def partial_offload_exposed(ctx: LayoutContext, cols: dict, sums: BlockSums, sched: Schedule,
                            chunk: dict):
    """Exposed time of partial CPU activation offloading over the batch,
    forward and backward (``activation_offload_blocks`` N of a stage's L
    blocks), or None where no row sets it.

    Transformer Engine's ``DefaultOffloadSynchronizer``
    (transformer_engine/pytorch/cpu_offload.py, the TE Megatron-Bridge pins,
    NVIDIA/TransformerEngine@e7c550c, what Megatron-Core's ``cpu_offloading``
    runs) copies block ``i`` < N to host memory on its own stream, started
    when block ``i + 1``'s forward starts (``fwd_step`` -> ``start_offload``),
    one copy after another, and makes block ``L - N + i``'s forward wait for
    it (``finish_offload_map``); in backward block ``i``'s reload starts
    before the backward of block ``L - 1 - N + i`` (``start_reload_map``) and
    block ``i``'s backward waits for it (``pop_tensor``).  Both are the same
    chain: copy ``r`` may start ``r + 1`` block passes in and must end ``D +
    r`` passes in (``D = L - N``).  With ``c`` the copy of one block's saved
    activations over the second tier (``ctx.mem2``) and ``f`` a block pass
    (forward, or backward), the wait the compute stream sees per micro-batch
    is the longest path through that chain: ``max(0, c - (D - 1) f, N c -
    (L - 2) f)`` for ``D`` >= 2 (one run of back-to-back copies); ``N c``
    for ``D`` = 1 (every block waits for its own copy: TE warns that
    ``num_layers == model_layers - 1`` prevents overlap).  The copy is
    counted from the end of the block's pass (TE may start it on each
    tensor's event inside the pass: a bound from above)."""
    k = offloaded_blocks(cols, ctx)
    if k is None:
        return None
    n = k.astype(float)
    blocks = sched.blocks_per_stage.astype(float)
    d = blocks - n
    copy = ctx.mem2.time(sums.act_storage)

    def exposed(f):
        chained = np.maximum(np.maximum(copy - (d - 1) * f, n * copy - (blocks - 2) * f), 0.0)
        return np.where(k > 0, np.where(d <= 1, n * copy, chained), 0.0)

    micro = sched.microbatches.astype(float)
    return (micro * exposed(chunk["fw_base_no_offload"]),
            micro * exposed(chunk["bw_base_no_offload"]))


# Blocks' worth of the offloaded modules' saved tensors Megatron-Core keeps
# on the GPU beside those still being copied: the last group of each module
# of the micro-batch whose backward runs next (NVIDIA/Megatron-LM@2a75ac1
# megatron/core/pipeline_parallel/fine_grained_activation_offload.py
# ``ChunkOffloadHandler.should_bulk_offload``, ``post_warmup_callback``'s
# offload margin).
FINE_OFFLOAD_KEPT = 1


def fine_offload_resident(ctx: LayoutContext, sums: BlockSums, offloaded):
    """Blocks' worth of the offloaded modules' saved tensors still on tier 1
    at the end of a forward that offloaded ``offloaded`` blocks back to back
    (``activation_offload_modules``): the copies not yet done.  Megatron-Core
    copies each group on one device-to-host stream once the module's forward
    has run (``on_group_commit_forward``: the stream waits for the compute,
    ``bulk_offload_group`` copies every saved tensor of at least
    ``min_offloaded_tensor_size`` elements), and the GPU copy is freed when
    its copy is done (``record_stream`` on that stream); the compute stream
    never waits for it in forward (``fine_grained_offloading_max_inflight_offloads``
    unset).  With ``c`` one block's copy over the second tier and ``f`` a
    block's forward, copy ``i`` ends at ``max((i + 1) f, end of copy i - 1)
    + c``: at the end of the ``n``-th block ``n - floor(n f / c)`` copies
    are outstanding, at least the one of the block before (the last block's
    own is ``FINE_OFFLOAD_KEPT``)."""
    c = ctx.mem2.time(sums.act_offload)
    f = np.maximum(sums.fw_offload_window, 0.0)
    n = np.maximum(offloaded, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        done = np.where(c > 0, np.floor(n * np.minimum(f / c, 1.0)), n)
    return np.where(c > 0, np.minimum(n, np.maximum(1.0, n - done)), 0.0)


def fine_offload_exposed(ctx: LayoutContext, sums: BlockSums, sched: Schedule):
    """Exposed backward time of fine-grained activation offloading over the
    batch (``activation_offload_modules``), or None where no row sets it.

    Megatron-Core (fine_grained_activation_offload.py, NVIDIA/Megatron-LM@2a75ac1)
    reloads a block's groups on its host-to-device stream when the backward
    of the same module of the block after it has run
    (``on_group_start_backward`` -> ``bulk_reload``: one group ahead), after
    that group's own copy to the host is done (``wait_offload_event``), and
    the compute stream waits for the reload before the module's backward
    (``on_group_commit_backward``).  A reload of ``c`` (one block's offloaded
    tensors over the second tier, as the copy out) thus hides behind the
    backward of the block's other layers, ``w`` = a block's backward less
    the offloaded layers' (``bw_offload``); each of a micro-batch's ``L - 1``
    offloaded blocks exposes ``max(0, c - w)``, and the first waits as well
    for the copies out still queued when the forward ended, ``(L - 1) (c -
    f)`` where the copies are slower than the forward (``f``), less the
    backward before its reload starts.  The forward exposes nothing (its
    compute never waits for a copy out: memory only,
    ``fine_offload_resident``)."""
    if sums.act_offload is None:
        return None
    c = ctx.mem2.time(sums.act_offload)
    b = sums.agrad_time + sums.wgrad_time
    w = np.maximum(b - sums.bw_offload, 0.0)
    n = np.maximum(sched.blocks_per_stage.astype(float) - FINE_OFFLOAD_KEPT, 0.0)
    backlog = np.maximum(n * (c - sums.fw_offload_window) - (b - w), 0.0)
    per_mb = np.maximum(backlog + c - w, 0.0) + np.maximum(n - 1, 0.0) * np.maximum(c - w, 0.0)
    per_mb = np.where((sums.act_offload > 0) & ctx.training, per_mb, 0.0)
    return sched.microbatches.astype(float) * per_mb


def offload_bandwidth(ctx: LayoutContext, sums: BlockSums, chunk: dict, offload: dict) -> dict:
    """Tier-2 bandwidth each offload needs to hide behind a block's compute."""
    training = ctx.training
    with np.errstate(divide="ignore", invalid="ignore"):
        fw_window = np.minimum(chunk["fw_base_no_offload"], chunk["fw_edge_no_offload"]) \
            - sums.fw_mem_time
        bw_window = np.minimum(chunk["bw_base_no_offload"], chunk["bw_edge_no_offload"]) \
            - chunk["grad_mem_time"]
        return {
            "act_offload_bw_req": offload["act_bytes"] / fw_window,
            "weight_offload_bw_req": sums.weight_space / fw_window,
            "optim_offload_bw_req": np.where(
                training, (sums.wgrad_space + sums.optimizer_space) / bw_window, 0.0),
            "offload_mem_bw_req": np.where(
                training, np.maximum(offload["fw_bytes"] / fw_window,
                                     offload["bw_bytes"] / bw_window),
                offload["fw_bytes"] / fw_window)}


def recompute_share(cols: dict, recompute_full, blocks):
    """Share of a stage's blocks that run full recompute: recompute_layers of
    them when it is set (> 0), else all (Calculon)."""
    k = cols.get("recompute_layers") if hasattr(cols, "get") else None
    if k is None or not np.any(k > 0):
        return 1.0
    # (where it is not set, min(blocks, blocks) / blocks: exactly 1.0)
    counts = choose(recompute_full & (k > 0), k, blocks)
    return np.minimum(counts, blocks) / blocks


def _counted(sched: Schedule, which: int, formula):
    """``formula`` where a row's in-flight count is not counted chunk by
    chunk, else the count (``Schedule.in_flight``: an uneven split with
    interleaving, ``autopar.model.pipeline.split_in_flight``)."""
    if sched.in_flight is None:
        return formula
    counted = sched.in_flight[which]
    return np.where(np.isnan(counted), formula, counted)


def last_stage_in_flight(sched: Schedule):
    """Micro-batches whose activations the last stage holds at its peak, in
    units of a whole stage's blocks.

    Megatron's 1F1B schedule: the last stage runs each micro-batch's backward
    right after its forward, so it holds one.  With ``v`` > 1 model chunks per
    stage (interleaving) rank ``r`` of ``p`` warms up with ``(p - r - 1) * 2
    + (v - 1) * p`` chunk forwards (at most the ``m * v`` there are) and holds
    one more in the steady state; for the last rank that is ``(v - 1) * p +
    1`` chunks of ``1 / v`` of the stage's blocks.  The first stage's count,
    ``p + (p - 1) / v`` of them, is Calculon's.  The last stage matters only
    for a model with a vocabulary (it holds the output layer and the logits);
    without one the first stage is always at least as full.  With an uneven
    split the chunks of a stage can differ (the loss alone in the last
    chunk): there the count is chunk by chunk (``Schedule.in_flight``,
    ``autopar.model.pipeline.interleaved_peak``), the logits added on top
    (one micro-batch's: the loss chunk's backward follows its forward)."""
    p = sched.stages.astype(float)
    v = sched.interleaving.astype(float)
    m = sched.microbatches.astype(float)
    return _counted(sched, 2, np.minimum((v - 1) * p + 1, np.maximum(m, 1.0) * v) / v)


def second_stage_in_flight(sched: Schedule):
    """Micro-batches whose activations the second stage (rank 1) holds at its
    peak, in units of a whole stage's blocks: Megatron's 1F1B schedule
    (megatron/core/pipeline_parallel/schedules.py,
    ``forward_backward_pipelining_without_interleaving``: ``p - r - 1``
    warm-up forwards and one in the steady state, at most the ``m`` there
    are; with ``v`` chunks the interleaved schedule's warm-up as in
    ``last_stage_in_flight``; chunk by chunk where a split sets them,
    ``Schedule.in_flight``)."""
    p = sched.stages.astype(float)
    v = sched.interleaving.astype(float)
    m = np.maximum(sched.microbatches, 1).astype(float)
    plain = np.minimum(m, p - 1)
    chunked = np.minimum((p - 2) * 2 + (v - 1) * p + 1, m * v) / v
    return _counted(sched, 1, np.where(v > 1, chunked, plain))


def footprints(ctx: LayoutContext, cols: dict, sums: BlockSums, sched: Schedule, checkpoint,
               recompute_full, head: dict, overhead, sums_last: BlockSums | None = None,
               sums_second: BlockSums | None = None, boundary=None,
               userbuffers=None) -> dict:
    """Every memory statistic (Calculon's names) and the need on each tier.

    ``sums`` are the first stage's per-block sums; ``sums_last`` the last
    stage's where its blocks differ (a mixture-of-experts model with dense
    first blocks, multi-token prediction); the statistics describe the first.
    With an uneven split (``sched.uneven``) each stage counts its own
    blocks, and the second stage (``sums_second``) is weighed too:
    ``mem_*_first`` are the fuller of the first two stages.  ``boundary``:
    bytes of the tensor a stage sends the next per micro-batch (only read
    under ``memory_overhead.pipeline_recv_buffers`` and
    ``memory_overhead.cuda_graphs`` "te_layers"); ``userbuffers``: bytes of
    Transformer Engine's userbuffers on every stage (``userbuffer_bytes``;
    None: none).
    """
    even = not sched.uneven
    head_first = head["first"]
    S, static, tier2, transient_first, transient_last = _stage(
        ctx, cols, sums, sched, checkpoint, recompute_full, head, sched.blocks_first,
        overhead=overhead, boundary=boundary)
    static_last = static
    if sums_last is not None or not even:
        _, static_last, tier2_last, _, transient_last = _stage(
            ctx, cols, sums if sums_last is None else sums_last, sched, checkpoint,
            recompute_full, head, sched.blocks_last,
            overhead=overhead, boundary=boundary)
        tier2 = np.maximum(tier2, tier2_last)
    if not even:
        # An uneven split: the second stage, with more blocks than the first
        # and one micro-batch fewer in flight, can hold the most; where it
        # does, it stands for the stages before the last.
        _, static_2, tier2_2, transient_2, _ = _stage(
            ctx, cols, sums if sums_second is None else sums_second, sched, checkpoint,
            recompute_full, head, sched.blocks_second, rank=1, overhead=overhead,
            boundary=boundary)
        # (the embedding is the first stage's alone: the second holds none
        # of it)
        fuller = (static_2 + transient_2 > static + head_first + transient_first) \
            & (sched.stages > 2)
        static = pick(fuller, static_2, static + head_first)
        transient_first = pick(fuller, transient_2, transient_first)
        tier2 = np.maximum(tier2, tier2_2)
        head_first = 0.0
    logits = head["logits"]
    if getattr(overhead, "optimizer_step_bytes", 0.0):
        trained_first, trained_last = trained_parameters(ctx, sums, sums_last, sched, head)
    else:           # (only the optimizer step's temporaries read them)
        trained_first = trained_last = ctx.zeros
    if userbuffers is not None:
        static, static_last = static + userbuffers, static_last + userbuffers
    parts = {"mem_static_first": static + head_first, "mem_transient_first": transient_first,
             "mem_static_last": static_last + head["last"],
             "mem_transient_last": transient_last - logits["fp32_copies"],
             "mem_logits_fp32_copy": logits["fp32_copy"],
             "mem_trained_params_first": trained_first,
             "mem_trained_params_last": trained_last}
    S.update(parts)
    S["proc_mem_tier1_cap_req"] = tier1_need(parts, overhead)
    S["proc_mem_tier2_cap_req"] = tier2
    return S


def first_stage_in_flight(sched: Schedule, overhead=None):
    """Micro-batches whose activations the first stage holds at its peak, in
    units of a whole stage's blocks: Calculon's ``p + (p - 1) / v`` (``p``
    without interleaving, at most the ``m`` micro-batches there are).  Under
    ``memory_overhead.pipeline_in_flight`` ``capped`` the interleaved count
    is at most ``m`` too: the schedule's warm-up runs no more forwards than
    the ``m * v`` chunk passes of the step (torch.distributed.pipelining
    ``ScheduleInterleaved1F1B``: ``get_rank_warmup_ops`` returns
    ``min(warmup_ops, n_microbatches * n_local_stages)``; Megatron's
    interleaved schedule caps its warm-up at the micro-batches as well), so
    with ``m = p`` micro-batches and ``v = 2`` the first rank runs every
    forward before its first backward and holds the step's ``m``, not
    ``p + (p - 1) / v``.  Where an uneven split sets the chunks
    (``Schedule.in_flight``: the embedding alone in chunk 0 holds no block),
    the count is chunk by chunk, capped as the schedules cap it."""
    stages, interleaving = sched.stages, sched.interleaving
    in_flight = np.minimum(sched.microbatches, stages).astype(float)
    # (the factor is exactly 1 without interleaving: x * 0 added to 1)
    first = in_flight * (1 + (stages - 1) / (interleaving * stages.astype(float))
                         * (interleaving > 1))
    if getattr(overhead, "pipeline_in_flight", "calculon") == "capped":
        first = np.minimum(first, np.maximum(sched.microbatches, 1).astype(float))
    return _counted(sched, 0, first)


# Transformer Engine's userbuffers (NVIDIA/TransformerEngine transformer_engine/
# pytorch/module/base.py ``initialize_ub``): the GEMMs whose tensor-parallel
# communication it overlaps, one registered buffer each, and of them those
# whose buffer holds fp8 data (one byte an element, ``fp8_buf``: the
# all-gather side, ``layers_all_gather_overlap``) when the run quantizes
# (``UserBufferQuantizationMode.FP8``); the others bf16 (``dtype`` default).
UB_GEMMS = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
            "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad")
UB_FP8_GEMMS = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop",
                "fc1_dgrad", "fc2_dgrad", "fc2_wgrad")
UB_BF16_BYTES = 2.0
# The reduce-scatters of the output projections (``memory_overhead.
# te_userbuffers_rs``), among UB_GEMMS and not among UB_FP8_GEMMS.
UB_OUTPUT_RS = ("proj_fprop", "fc2_fprop")


def userbuffer_bytes(ctx: LayoutContext, cols: dict, tokens_x_hidden, overhead):
    """Bytes of Transformer Engine's userbuffers on each processor of the rows
    that overlap their tensor-parallel communication (tensor_par > 1,
    ``tensor_par_overlap`` not "none") under ``memory_overhead.te_userbuffers``
    (None where no row holds them).

    Megatron-LM (``megatron/training/initialize.py``
    ``_initialize_tp_communicators``) and Megatron-Bridge
    (``src/megatron/bridge/training/initialize.py``, the same) call TE's
    ``initialize_ub`` with the shape [seq_length x micro_batch /
    context_par, hidden] (``tokens_x_hidden`` elements: the micro-batch's
    tokens on the rank, whole over tensor_par), with
    ``UserBufferQuantizationMode.FP8`` where the run has an fp8 recipe
    (``config.fp8`` set: tensorwise, rowwise, mxfp8; an fp4 recipe leaves it
    None) and a second, unquantized set beside it where fp8 runs keep their
    first / last blocks in bf16.  ``initialize_ub`` adds one communicator
    per GEMM of ``UB_GEMMS`` (methods ring_exchange, pipeline, bulk and
    external by default), each registering one buffer of that shape
    (transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp
    ``CommOverlapBase::initialize`` / ``CommOverlapP2PBase::initialize``:
    ``get_buffer_size_bytes`` of the shape; a ring-exchange reduce-scatter,
    which no default uses, 2 tp - 1 chunks of tp), kept for the run.
    Per element: 12 x 2 bytes unquantized; 8 x 1 + 4 x 2 in fp8 mode.
    ``memory_overhead.te_userbuffers_rs`` changes the two output
    projections' reduce-scatter buffers (``UB_OUTPUT_RS``), as a
    Megatron-Bridge overlap config (``ub_cfgs``) does: "pipeline_fp8", 1
    byte each in fp8 mode (TE ``initialize_ub``: ``fp8_buf`` is the config's
    for a GEMM of the pipeline method, and Bridge's PipelineOverlapCfg
    leaves it the truthy tuple (False,)); "ring_exchange", (2 tp - 1) / tp
    of the shape each in bf16 (``CommOverlapP2PBase::initialize``)."""
    if overhead is None or not getattr(overhead, "te_userbuffers", False):
        return None
    rows = (cols["tensor_par"] > 1) & (cols["tensor_par_overlap"]
                                       != CHOICES["tensor_par_overlap"].index("none"))
    if not np.any(rows):
        return None
    rs = getattr(overhead, "te_userbuffers_rs", "pipeline")
    n_rs = len(UB_OUTPUT_RS)
    rs_bf16 = n_rs * UB_BF16_BYTES             # the output projections' buffers, bf16
    rs_fp8 = n_rs * (1.0 if rs == "pipeline_fp8" else UB_BF16_BYTES)
    if rs == "ring_exchange":
        chunks = (2.0 * ctx.tp - 1.0) / ctx.tp
        rs_bf16 = rs_fp8 = rs_bf16 * chunks
    others = len(UB_GEMMS) - len(UB_FP8_GEMMS) - n_rs   # the wgrad reduce-scatters
    bf16_set = (len(UB_GEMMS) - n_rs) * UB_BF16_BYTES + rs_bf16
    fp8_set = len(UB_FP8_GEMMS) * 1.0 + others * UB_BF16_BYTES + rs_fp8
    per_element = np.broadcast_to(bf16_set, (ctx.n,)).astype(float)
    if ctx.fp8 is not None:
        recipe = np.broadcast_to(ctx.fp8_recipe, (ctx.n,))
        fp8_mode = np.isin(recipe, [CHOICES["fp8_recipe"].index(r)
                                    for r in ("tensorwise", "rowwise", "mxfp8")])
        edges = (np.broadcast_to(cols.get("bf16_first_blocks", 0), (ctx.n,))
                 + np.broadcast_to(cols.get("bf16_last_blocks", 0), (ctx.n,))) > 0
        per_element = np.where(fp8_mode, fp8_set + np.where(edges, bf16_set, 0.0), bf16_set)
    return masked(per_element * tokens_x_hidden, rows)


def pipeline_recv_buffers(overhead, sched: Schedule, ctx: LayoutContext, boundary, rank: int = 0):
    """Bytes of a pipeline stage's receive buffers under
    ``memory_overhead.pipeline_recv_buffers`` (None where not counted):
    torch.distributed.pipelining's ``PipelineStage`` allocates, when the
    schedule first runs, one receive buffer per micro-batch of the step for
    the stage's input (``_prepare_forward_infra``: ``args_recv_info[chunk_id]``
    for every chunk, on every stage but the first) and one for its output's
    gradient (``_prepare_backward_infra``: ``grad_recv_info[mb_index]``, on
    every stage but the last), each the size of the tensor sent between
    stages (``boundary``: a block's input, its sequence-parallel shard where
    the blocks run sequence parallelism), and keeps them for the run (pytorch/
    pytorch torch/distributed/pipelining/stage.py).  A rank holds ``v``
    model chunks: the first and the last rank ``2 v - 1`` buffers a
    micro-batch in training (``v`` in inference), a rank between them
    (``rank`` 1) ``2 v``."""
    if not getattr(overhead, "pipeline_recv_buffers", False) or boundary is None:
        return None
    v = sched.interleaving.astype(float)
    m = np.maximum(sched.microbatches, 1).astype(float)
    grads = np.where(ctx.training, v - (rank == 0), 0.0)
    return masked(m * (v + grads) * boundary, sched.stages > 1)


def _stage(ctx: LayoutContext, cols: dict, sums: BlockSums, sched: Schedule, checkpoint,
           recompute_full, head: dict, blocks, rank: int = 0, overhead=None, boundary=None):
    """Statistics, static and tier-2 footprints, and the transient footprint
    of the first (or, ``rank`` 1, the second) and of the last stage, from one
    stage's per-block sums and ``blocks`` blocks."""
    training = ctx.training
    # The weights a stage holds: less the working-precision copies kept only
    # quantized (memory_overhead.fp8_primary_weights; None or 0 elsewhere).
    held = sums.weight_space if sums.weight_unkept is None else \
        sums.weight_space - sums.weight_unkept
    S = {"block_weight_space": held,
         "block_act_working_space": sums.act_working,
         "block_act_storage_space": sums.act_storage,
         "block_act_checkpoint_size": checkpoint,
         "block_weight_grad_space": sums.wgrad_space,
         "block_weight_grad_space_no_sharding": sums.wgrad_space_full,
         "block_act_grad_space": sums.act_grad_space,
         "block_optimizer_space": sums.optimizer_space}
    weight_space = held * blocks
    # Micro-batches in flight on the first stage (more with interleaving).
    in_flight_first = first_stage_in_flight(sched, overhead)

    share = recompute_share(cols, recompute_full, blocks)
    partial = np.any(share != 1.0)
    # ``memory_overhead.backward_transient`` "op": the block running in
    # backward holds what it saved (its whole storage where it was
    # recomputed), not Calculon's working space, and the gradients are the
    # largest op's (``block.framework_terms``), not every layer's.
    by_op = overhead is not None and overhead.backward_transient == "op"
    running = np.where(training, sums.act_storage_all, sums.act_working) if by_op \
        else sums.act_working

    def stage_activations(micro_batches):
        """Activations and checkpoints of a stage with ``micro_batches`` in flight."""
        act = running + masked(sums.act_storage * (blocks * micro_batches - 1),
                               training & ~recompute_full)
        # (the checkpoint is 0 where the block is not recomputed in training)
        ckpt = blocks * checkpoint * micro_batches
        if partial:
            # Blocks that do not recompute keep their activations.
            kept = blocks * (1 - share) * micro_batches
            act = act + masked(sums.act_storage_all * kept, training & recompute_full)
            ckpt = ckpt * share
        return act, ckpt

    if rank:
        in_flight_first = second_stage_in_flight(sched)
    act_first, ckpt_first = stage_activations(in_flight_first)
    act_last, ckpt_last = stage_activations(last_stage_in_flight(sched))
    graphs = getattr(overhead, "cuda_graphs", "none")
    if graphs == "te_layers" and boundary is not None:
        # TE's whole-layer CUDA graphs chained graph to graph: each graph's
        # static output, in the shared pool, is held from its capture until
        # the capture of its micro-batch's backward (NVIDIA/TransformerEngine
        # transformer_engine/pytorch/graph.py ``_make_graphed_callables``:
        # ``per_callable_static_outputs`` weak-referenced only after the
        # backward graph of the same callable and micro-batch, under
        # ``_reuse_graph_input_output_buffers``), beside the next layer's
        # static input it is copied into at replay (``static_input_surface
        # [i].copy_(inputs[i])``; Megatron-Core's TECudaGraphHelper
        # ``_get_sample_arguments`` allocates those inputs apart, reused
        # only once a micro-batch's backward is done): a block input per
        # block and micro-batch in flight.
        act_first = act_first + masked(boundary * blocks * in_flight_first, training)
        act_last = act_last + masked(boundary * blocks * last_stage_in_flight(sched), training)
    off = offloaded_blocks(cols, ctx)
    host_acts = 0.0
    if off is not None:
        # Partial CPU activation offloading (``partial_offload_exposed``):
        # L - N blocks' saved activations on tier 1 at once, the N others'
        # in pinned host buffers (TE's ``start_offload``), one micro-batch in
        # flight (the rules take it without pipeline stages or recompute).
        host_acts = masked(sums.act_storage * off, ~recompute_full)
        act_first = act_first - host_acts
        act_last = act_last - host_acts
    if sums.act_offload is not None:
        # Fine-grained activation offloading (``activation_offload_modules``):
        # of the blocks in flight, the offloaded modules' saved tensors stay
        # on tier 1 for the kept block and the copies not yet done
        # (``fine_offload_resident``); the host holds the others.
        def fine(micro_batches):
            total = blocks * micro_batches
            n = np.maximum(total - FINE_OFFLOAD_KEPT, 0.0)
            resident = np.minimum(FINE_OFFLOAD_KEPT + fine_offload_resident(ctx, sums, n), total)
            # (the resident groups are whole blocks of the kind that has
            # the module: ``act_offload_max``)
            return np.maximum(sums.act_offload * total - sums.act_offload_max * resident, 0.0)
        first_off, last_off = fine(in_flight_first), fine(last_stage_in_flight(sched))
        act_first = act_first - first_off
        act_last = act_last - last_off
        host_acts = host_acts + np.maximum(first_off, last_off)
    act_grad = ctx.if_training(sums.op_grads if by_op else sums.act_grad_space)
    if by_op and sums.op_grads_mixer is not None:
        # CUDA graphs of one part of each layer (memory_overhead.cuda_graphs
        # "scoped"): the graphs' pool keeps its largest op beside the eager
        # part's (block.framework_terms)
        act_grad = ctx.if_training(sums.op_grads_mixer + sums.op_grads_rest)
    # (the last stage's output layer runs its own op in backward)
    act_grad_last = np.maximum(act_grad, head["op_grads"]) if by_op else act_grad
    if by_op and graphs in ("layers", "te_layers"):
        # Whole layers in CUDA graphs, the output layer eager: the graphs'
        # pool and the caching allocator keep their free blocks apart
        # (block.framework_terms), so the output layer's op in backward is
        # held beside the largest op the blocks' pool keeps.
        act_grad_last = act_grad + ctx.if_training(head["op_grads"])
    # Calculon: one block's gradient whole in fp32 beside the (sharded)
    # others.  Under ``memory_overhead.wgrad_accumulation_fusion`` the weight-
    # gradient GEMMs write into the gradient buffer itself: where it stays
    # whole, every block's gradient is its slot there.
    first_grad = sums.wgrad_space_full
    if getattr(overhead, "wgrad_accumulation_fusion", False):
        first_grad = np.where(ctx.grad_shards == 1, sums.wgrad_space, first_grad)
    wgrad_space = ctx.if_training(first_grad + sums.wgrad_space * (blocks - 1))
    whole = whole_pipeline_grads(overhead, sched.stages, ctx)
    if whole is not None:
        # Every block of the stage holds its whole gradient between the
        # step's micro-batches (no sync until the last backward).
        wgrad_space = pick(whole, ctx.if_training(sums.wgrad_space_full * blocks),
                           wgrad_space)
    optimizer_space = ctx.if_training(sums.optimizer_space * blocks)
    # With offloading, tier 1 keeps two blocks' worth (double buffering).
    weight_min = held * 2
    act_min = sums.act_working + masked(sums.act_storage, ~recompute_full)
    ckpt_min = ctx.if_training(checkpoint * 2, np.nan)
    wgrad_min = ctx.if_training(sums.wgrad_space_full + sums.wgrad_space)
    optim_min = ctx.if_training(sums.optimizer_space * 2)
    S.update({
        "weight_space_with_offload": weight_min, "act_space_with_offload": act_min,
        "act_checkpoint_size_with_offload": ckpt_min, "act_grad_space_with_offload": act_grad,
        "weight_grad_space_with_offload": wgrad_min, "optimizer_space_with_offload": optim_min,
        "weight_space": weight_space, "act_space": act_first,
        "act_checkpoint_size": ckpt_first, "act_grad_space": act_grad,
        "weight_grad_space": wgrad_space, "optimizer_space": optimizer_space})

    # Tier 1 holds persistent state and transient tensors; fragmentation is
    # charged on the transient part.
    weights_off, acts_off, optim_off = (cols["weight_offload"], cols["activations_offload"],
                                        cols["optimizer_offload"])
    static = pick(weights_off, weight_min, weight_space)
    recv = pipeline_recv_buffers(overhead, sched, ctx, boundary, rank)
    if recv is not None:
        static = static + recv
    if overhead is not None and overhead.dummy_wgrad:
        # TE's cached dummy weight gradients (``block.framework_terms``):
        # one per block kind the stage holds, the attention's shared (none
        # on a stage of no blocks: an uneven split's embedding-only stage).
        static = static + ctx.if_training(
            np.where(blocks > 0, sums.dummy_attn + sums.dummy_rest, 0.0))
    if sums.weight_space_full is not None and np.any(ctx.weight_shards > 1):
        # ZeRO-3 / FSDP: the gathered block and the prefetched next one.
        whole = sums.weight_space_full if sums.weight_unkept_full is None else \
            sums.weight_space_full - sums.weight_unkept_full
        gathered = 2 * whole
        kept = kept_gathered(overhead, sched, ctx)
        if kept is not None:
            # A framework that does not reshard after forward keeps every
            # block of the stage gathered until its backward.
            gathered = gathered + masked(whole
                                         * np.maximum(blocks - 2, 0), kept)
        static = static + masked(gathered, ctx.weight_shards > 1)
    tier2 = masked(weight_space, weights_off)
    ckpt_offloaded = (np.where(acts_off & recompute_full, np.nan_to_num(ckpt_min), 0.0)
                      if np.any(acts_off) else 0.0)
    transient_first = pick(acts_off, act_min, act_first + ckpt_first) + ckpt_offloaded \
        + act_grad
    transient_last = pick(acts_off, act_min, act_last + ckpt_last) + ckpt_offloaded \
        + act_grad_last + head["logits"]["total"]
    if np.any(acts_off):
        tier2 = tier2 + masked(np.where(recompute_full, ckpt_first, act_first), acts_off)
    tier2 = tier2 + host_acts
    static = static + pick(optim_off, wgrad_min + optim_min, wgrad_space + optimizer_space)
    tier2 = tier2 + masked(sums.wgrad_space * blocks + optimizer_space, optim_off)
    return S, static, tier2, transient_first, transient_last


def trained_parameters(ctx: LayoutContext, sums: BlockSums, sums_last, sched: Schedule,
                       head: dict):
    """Parameters the optimizer steps on a processor of the first stage (the
    larger of the first two with an uneven split) and of the last: every
    block's trained weights (its fp32 weight-gradient footprint
    ``wgrad_space_full`` / 4: adapters only where the base is frozen) and
    the embedding / output matrix where they train, divided over the
    optimizer's shards; 0 where the row does not train."""
    per_block = sums.wgrad_space_full / 4.0
    per_block_last = per_block if sums_last is None else sums_last.wgrad_space_full / 4.0
    blocks_first = sched.blocks_first
    if sched.uneven:
        blocks_first = np.maximum(blocks_first, sched.blocks_second)
    first = (per_block * blocks_first + head["trained_first"]) / ctx.optim_shards
    last = (per_block_last * sched.blocks_last + head["trained_last"]) / ctx.optim_shards
    return ctx.if_training(first), ctx.if_training(last)


def kept_gathered(overhead, sched: Schedule, ctx: LayoutContext):
    """The rows whose framework keeps a weight-sharded block's gathered
    weights from its forward to its backward (``memory_overhead.fsdp_reshard``:
    ``never`` reshards after forward, ``unless_pipelined`` only without
    pipeline stages, as torchtitan's default policy; FSDP2's
    ``reshard_after_forward=False``), or None where every row reshards after
    forward (``always``, the default: one block gathered and the next one
    prefetched)."""
    policy = getattr(overhead, "fsdp_reshard", "always")
    if policy == "always":
        return None
    keep = ctx.training if policy == "never" else ctx.training & (sched.stages > 1)
    return keep if np.any(keep) else None


def whole_pipeline_grads(overhead, stages, ctx: LayoutContext):
    """The rows whose framework keeps each block's whole gradient (in the
    reduce datatype) from the step's first micro-batch backward to its last:
    weight-sharded rows with pipeline ``stages`` under
    ``memory_overhead.pipeline_grads`` ``whole`` (torch.distributed.pipelining
    ``PipelineStage.backward_maybe_with_nosync``: FSDP2's gradient sync off
    for every micro-batch's backward but the last, FSDP2's
    ``FSDPParam.to_accumulated_grad_if_needed`` accumulating the unsharded
    gradient in ``reduce_dtype``); None where no row does (``sharded``, the
    default: the count before)."""
    if getattr(overhead, "pipeline_grads", "sharded") != "whole":
        return None
    rows = ctx.training & (stages > 1) & (ctx.weight_shards > 1)
    return rows if np.any(rows) else None


# The parts of the need on tier 1 that a system's memory_overhead acts on
# (reported by evaluate_columns on request; autopar calibrate refits the
# overheads from them without evaluating the model again).
MEMORY_PARTS = ("mem_static_first", "mem_transient_first", "mem_static_last",
                "mem_transient_last", "mem_logits_fp32_copy", "mem_trained_params_first",
                "mem_trained_params_last")


def stage_needs(parts: dict, overhead):
    """Need on tier 1 of the first stage (the fuller of the first two with an
    uneven split) and of the last, each: static state, transient tensors
    grown by the fragmentation ``fraction``, on the last stage the loss's
    fp32 copies of the logits, and the reserved amount.  ``tier1_need`` is
    the larger of the two (``autopar report`` draws both).  Where the
    overhead counts the optimizer step's temporaries
    (``optimizer_step_bytes`` a trained parameter), a stage needs at least
    its static state, those temporaries and the reserved amount: the step
    runs after the last backward, with the activations freed."""
    if overhead is None:
        return (parts["mem_static_first"] + parts["mem_transient_first"],
                parts["mem_static_last"] + parts["mem_transient_last"]
                + parts["mem_logits_fp32_copy"])
    grow = 1.0 + overhead.fraction
    last = parts["mem_transient_last"] + overhead.logits_fp32_copies \
        * parts["mem_logits_fp32_copy"]
    reserved = overhead.reserved_GiB * 1024 ** 3
    first_need = parts["mem_static_first"] + parts["mem_transient_first"] * grow + reserved
    last_need = parts["mem_static_last"] + last * grow + reserved
    step = getattr(overhead, "optimizer_step_bytes", 0.0)
    if step:
        first_need = np.maximum(first_need, parts["mem_static_first"] + reserved
                                + step * parts["mem_trained_params_first"])
        last_need = np.maximum(last_need, parts["mem_static_last"] + reserved
                               + step * parts["mem_trained_params_last"])
    return first_need, last_need


def tier1_need(parts: dict, overhead):
    """Need on tier 1 of the fuller of the first and last stage
    (``stage_needs``).  (Adding the reserved amount to each stage before the
    maximum gives the same floating-point value as adding it after: rounding
    is monotonic.)"""
    return np.maximum(*stage_needs(parts, overhead))
