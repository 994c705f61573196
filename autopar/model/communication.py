"""Communication: tensor-parallel collectives, pipeline p2p, data-parallel sync.

Follows Calculon's ``network.py`` and the communication parts of its
``llm.py``.  Tensor-parallel communication enters the block as layers,
either separate collectives between the linear layers (``tp_collective``) or
inside a linear layer whose communication overlaps its compute tile by tile
(``tp_overlapped_linear``, Calculon's ring/pipe overlap).  Their times are
given for the *base* blocks of a pipeline chunk and for its *edge* block
(the last one, which with the p2p variant splits its collective like
sequence parallelism does).  Pipeline p2p and the data-parallel gradient
sync are batch-level: see ``pipeline_p2p`` and ``data_parallel_sync``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.model.block_inputs import ActivationSizes
from autopar.model.block_sums import BlockSums
from autopar.model.context import LayoutContext, choose, grad_scale, masked
from autopar.model.hardware import NetworkTier
from autopar.model.layers import STAGES, layer
from autopar.model.lookup import by_value


def tp_collective(ctx, size, conjugate, recomm, stored=True):
    """Tensor-parallel collective between layers (not overlapped)."""
    t = ctx.tp
    multi = t > 1
    part = np.where(multi, size * (t - 1) / t, 0.0)
    io = np.where(multi, size, 0.0)
    L = layer(ctx, fw=part if conjugate else 0.0, agrad=0.0 if conjugate else part,
              inputs=io, outputs=io, act=io, act_grads=io, recomm=recomm,
               stored=stored)
    b = ctx.elem_bytes
    rs = ctx.tp_rs_ag
    if conjugate:
        L["act_b"] = np.where(rs, io * b / t, io * b)
        L["agrad_b"] = np.where(rs, io * b / t, 0.0)
        L["mem_agrad"] = np.where(rs, L["mem_agrad"], 0.0)
    else:
        L["act_b"] = np.where(rs, io * b / t, 0.0)
        L["agrad_b"] = np.where(rs, io * b / t, io * b)
        L["mem_fw"] = np.where(rs, L["mem_fw"], 0.0)
    L["kind"] = "tpcomm"
    L["finish"] = finish_tp_collective
    L["conj"] = conjugate
    L["size"] = size
    return L


def finish_tp_collective(ctx: LayoutContext, L: dict):
    """Times of a separate TP collective for base and edge blocks: with
    sequence parallelism (and at the edges with the p2p variant) an
    all-reduce splits into reduce-scatter + all-gather."""
    t, b, net = ctx.tp, ctx.elem_bytes, ctx.tp_net
    multi = t > 1
    conj = L["conj"]
    nbytes = L["size"] * b
    # an all-gather's (ctx.tp_gather_bytes; the working datatype's by default)
    gbytes = nbytes if ctx.tp_gather_bytes is ctx.elem_bytes else L["size"] * ctx.tp_gather_bytes
    for s in STAGES:
        L["time_" + s] = ctx.zeros
    # The layer's own (vector) work, charged inside its communication time.
    own = {s: ctx.processing_time(L["flops_time_" + s], L["mem_time_" + s])
           for s in ("fw", "agrad", "wgrad")}
    tpeers = np.maximum(t, 2)
    for e in ("base", "edge"):
        split = ctx.tp_rs_ag | (ctx.tp_p2p & (e == "edge"))
        if conj:
            fw_b = nbytes + ctx.zeros
            ag_b = np.where(split, gbytes, 0.0)
            wg_b = np.where(L["recomm"], nbytes, 0.0)
            fw_op = np.where(split, net.time("reduce_scatter", fw_b, tpeers),
                             net.time("all_reduce", fw_b, tpeers))
            ag_op = np.where(split, net.time("all_gather", ag_b, tpeers), 0.0)
            wg_op = np.where(split, net.time("reduce_scatter", wg_b, tpeers),
                             net.time("all_reduce", wg_b, tpeers))
        else:
            fw_b = np.where(split, gbytes, 0.0)
            ag_b = nbytes + ctx.zeros
            wg_b = np.where(L["recomm"] & split, gbytes, 0.0)
            fw_op = np.where(split, net.time("all_gather", fw_b, tpeers), 0.0)
            ag_op = np.where(split, net.time("reduce_scatter", ag_b, tpeers),
                             net.time("all_reduce", ag_b, tpeers))
            wg_op = np.where(split, net.time("all_gather", wg_b, tpeers), 0.0)
        L[f"comm_bytes_fw_{e}"] = np.where(multi, fw_b, 0.0)
        L[f"comm_bytes_agrad_{e}"] = np.where(multi, ag_b, 0.0)
        L[f"comm_bytes_wgrad_{e}"] = np.where(multi, wg_b, 0.0)
        L[f"comm_time_fw_{e}"] = np.where(multi, fw_op + own["fw"], 0.0)
        L[f"comm_time_agrad_{e}"] = np.where(multi, ag_op + own["agrad"], 0.0)
        L[f"comm_time_wgrad_{e}"] = np.where(multi & L["recomm"], wg_op + own["wgrad"], 0.0)
        for s in ("fw", "agrad", "wgrad"):
            L[f"exposed_{s}_{e}"] = L[f"comm_time_{s}_{e}"]
    L["tp_bw_req_fw"] = L["tp_bw_req_agrad"] = ctx.zeros


def tp_overlapped_linear(ctx: LayoutContext, m, n, k, conjugate, recompute, recomm):
    """A linear layer whose TP communication is overlapped tile by tile."""
    t = ctx.tp
    rs = ctx.tp_rs_ag
    if not conjugate:
        k = k / t
        act = np.where(rs, m * n / t, m * n)
        agr = np.where(rs, m * k, 0.0)
    else:
        n = n / t
        act = np.where(rs, m * n, 0.0)
        agr = np.where(rs, 2 * (m * k / t), 2 * m * k)
    L = layer(ctx, fw=2 * m * n * k, agrad=2 * m * n * k, wgrad=2 * m * n * k,
              inputs=m * n, outputs=m * k, weight=n * k, weight_grads=n * k,
               act=act, act_grads=agr, optim=2 * n * k, recompute=recompute,
               recomm=recomm, matrix=True, factored=n + k)
    if ctx.tp_overlap_chunks:
        # torch's micro-pipelined async TP (TimeOverhead.tp_overlap_chunks):
        # the fused all-gather + matmul / matmul + reduce-scatter run the GEMM
        # as one chunk per TP rank (torch/distributed/_symmetric_memory
        # _pipelined_all_gather_and_consume / _pipelined_produce_and_all2all),
        # each at the efficiency of 1/tp of the GEMM (layers.finish).
        L["chunks"] = np.maximum(t, 1) + ctx.zeros
    L["kind"] = "overlapped"
    L["finish"] = finish_tp_overlapped
    L["conj"] = conjugate
    return L


def finish_tp_overlapped(ctx: LayoutContext, L: dict):
    """Times of a tile-overlapped linear layer: ``tp`` tiles, each tile's
    communication hidden behind the next tile's compute where it is shorter
    (the rest exposed), the compute slowed by the processor share the
    network tier uses."""
    t, b, net = ctx.tp, ctx.elem_bytes, ctx.tp_net
    conj = L["conj"]
    tpeers = np.maximum(t, 2)
    ag_size = L["inputs"] * b
    rs_size = L["outputs"] * b
    # What the all-gathers move (ctx.tp_gather_bytes): the gathered input in
    # the forward, the gathered output gradient in the backward.
    if ctx.tp_gather_bytes is ctx.elem_bytes:
        ag_in, ag_out = ag_size, rs_size
    else:
        ag_in = L["inputs"] * ctx.tp_gather_bytes
        ag_out = L["outputs"] * ctx.tp_gather_bytes

    def comm(e):
        split = ctx.tp_rs_ag | (ctx.tp_p2p & (e == "edge"))
        if conj:
            fw_b = rs_size
            ag_b = np.where(split, ag_out, 0.0)
            fw_t = np.where(split, net.time("reduce_scatter", fw_b, tpeers),
                            net.time("all_reduce", fw_b, tpeers))
            fw_t = fw_t + ctx.vector.time(fw_b / b * (t - 1) / t)
            ag_t = np.where(split, net.time("all_gather", ag_b, tpeers)
                            + 0.0, 0.0)
            wg_b = np.where(L["recomm"], fw_b, 0.0)
            wg_t = np.where(L["recomm"],
                            np.where(split, net.time("reduce_scatter", wg_b, tpeers),
                                     net.time("all_reduce", wg_b, tpeers)), 0.0)
        else:
            fw_b = np.where(split, ag_in, 0.0)
            ag_b = ag_size
            fw_t = np.where(split, net.time("all_gather", fw_b, tpeers), 0.0)
            ag_t = np.where(split, net.time("reduce_scatter", ag_b, tpeers),
                            net.time("all_reduce", ag_b, tpeers))
            ag_t = ag_t + ctx.vector.time(ag_b / b * (t - 1) / t)
            wg_b = np.where(L["recomm"], fw_b, 0.0)
            wg_t = np.where(L["recomm"] & split,
                            net.time("all_gather", wg_b, tpeers), 0.0)
        return {"fw": (fw_b, fw_t), "agrad": (ag_b, ag_t), "wgrad": (wg_b, wg_t)}

    cb, ce = comm("base"), comm("edge")
    for s in ("fw", "agrad", "wgrad"):
        L[f"comm_bytes_{s}_base"], L[f"comm_time_{s}_base"] = cb[s]
        L[f"comm_bytes_{s}_edge"], L[f"comm_time_{s}_edge"] = ce[s]

    usage = net.processor_usage
    exposed = {}
    for s in STAGES:
        ft, mt = L["flops_time_" + s], L["mem_time_" + s]
        nt = L[f"comm_time_{s}_base"] if s != "optim" else ctx.zeros
        fts = ft / (1 - usage)
        ct = ctx.processing_time(ft, mt)
        cts = ctx.processing_time(fts, mt)
        T = t
        infl = nt / T - fts / T
        hidden = ct / T + (T - 1) * ct / T + (T - 1) * (nt / T) * usage
        shown = ct / T + (T - 1) * cts / T
        time = np.where(infl > 0, shown, hidden)
        ex = np.where(infl > 0, (T - 1) * infl, 0.0)
        pipe_tile = np.where(ctx.tp_pipe_overlap, nt / T, 0.0)
        time = time + pipe_tile
        ex = ex + pipe_tile
        has = nt != 0
        L["time_" + s] = np.where(has, time, ct)
        exposed[s] = np.where(has, ex, 0.0)
    # Calculon reads the exposed time of the last processed stage: the
    # re-communication is reported with the forward pass's exposure.
    for e in ("base", "edge"):
        L[f"exposed_fw_{e}"] = exposed["fw"]
        L[f"exposed_agrad_{e}"] = exposed["agrad"]
        L[f"exposed_wgrad_{e}"] = exposed["fw"]
    with np.errstate(divide="ignore", invalid="ignore"):
        for s in ("fw", "agrad"):
            fts_tile = L["flops_time_" + s] / (1 - usage) / t
            L["tp_bw_req_" + s] = np.maximum(L[f"comm_bytes_{s}_base"] / t / fts_tile,
                                             L[f"comm_bytes_{s}_edge"] / t / fts_tile)


@dataclass(frozen=True)
class ContextExchange:
    """Context parallelism's K/V exchange per block and micro-batch: link and
    exposed seconds of the forward, the backward and the recompute, and the
    bytes a forward moves."""
    fw_link: np.ndarray
    fw_exp: np.ndarray
    bw_link: np.ndarray
    bw_exp: np.ndarray
    re_exp: np.ndarray
    fw_size: np.ndarray


def context_exchange(ctx: LayoutContext, cols: dict, mbs, sq, q_width, kv_width,
                     attn_fw, attn_bw, recompute_attn) -> ContextExchange:
    """K/V exchange of context parallelism, per block and micro-batch.

    Ring (``context_par_comm: p2p``, Megatron's default): in context_par - 1
    steps each processor passes the K/V chunk it holds to the next while it
    attends to the current one, so each step's transfer hides behind 1/cp of
    the attention compute; in backward K/V and their gradients travel (twice
    the bytes; the first of the cp steps K/V only, the last dK/dV only, each
    step's behind 1/cp of the attention's backward).  All-to-all (``a2a``): Q, K
    and V are re-split from sequence to heads before attention and the output
    back after it, not overlapped; backward moves their gradients likewise.
    Returns link and exposed times of forward, backward and recompute (the
    exchange runs again when the attention core is recomputed)."""
    cp = ctx.cp
    multi = cp > 1
    if not multi.any():
        z = ctx.zeros
        return ContextExchange(fw_link=z, fw_exp=z, bw_link=z, bw_exp=z, re_exp=z, fw_size=z)
    b, net = ctx.elem_bytes, ctx.cp_net
    steps = cp - 1
    chunk = 2 * mbs * sq * kv_width * b                     # local K and V
    step_fw = net.time("p2p", chunk, 2)
    step_bw = net.time("p2p", 2 * chunk, 2)
    ring_fw_exp = steps * np.maximum(step_fw - attn_fw / cp, 0.0)
    # Backward (TE AttnFuncWithCPAndKVP2P.backward): each of the cp steps
    # posts its send/receive before its attention backward and waits for it
    # before adding its dK/dV into the received buffer, so each transfer
    # hides behind 1/cp of the attention backward: step 0 sends K/V only,
    # steps 1..cp-2 K/V and the dK/dV accumulated so far, the last step the
    # dK/dV only (received whole before the last add: the exposed receive).
    middle = np.maximum(cp - 2, 0)
    ring_bw_link = 2 * step_fw + middle * step_bw
    ring_bw_exp = (2 * np.maximum(step_fw - attn_bw / cp, 0.0)
                   + middle * np.maximum(step_bw - attn_bw / cp, 0.0))
    qkvo = mbs * sq * (2 * q_width + 2 * kv_width) * b       # Q, K, V in; O out
    peers = np.maximum(cp, 2)
    a2a_t = net.time("all_gather", qkvo, peers)              # (cp-1)/cp of it leaves
    a2a = cols["context_par_comm"] == 1
    fw_link = np.where(a2a, a2a_t, steps * step_fw)
    bw_link = np.where(a2a, a2a_t, ring_bw_link)
    fw_exp = np.where(a2a, a2a_t, ring_fw_exp)
    bw_exp = np.where(a2a, a2a_t, ring_bw_exp)
    fw_size = np.where(a2a, qkvo, steps * chunk)
    if ctx.cp_ring_impl != "te":
        ring = cols["context_par_comm"] == 0
        t_link, t_exp, t_fw_link, t_fw_exp, t_size = torch_ring_exchange(
            ctx, net, cp, mbs, sq, q_width, attn_fw, attn_bw)
        fw_link, fw_exp = np.where(ring, t_fw_link, fw_link), np.where(ring, t_fw_exp, fw_exp)
        bw_link, bw_exp = np.where(ring, t_link, bw_link), np.where(ring, t_exp, bw_exp)
        fw_size = np.where(ring, t_size, fw_size)
    ag = cols["context_par_comm"] == 2
    if ag.any():
        # All-gather (``allgather``; DeepSeek Sparse Attention only, rules):
        # DSAttention gathers the keys over the context-parallel group before
        # the indexer and the kernel (dsa.py ``gather_from_sequence_parallel_
        # region`` on the indexer's key and the latent key), not overlapped;
        # autograd's backward of the gather reduce-scatters their gradients.
        whole = cp * chunk
        ag_fw = net.time("all_gather", whole, peers)
        ag_bw = net.time("reduce_scatter", whole, peers)
        fw_link, fw_exp = np.where(ag, ag_fw, fw_link), np.where(ag, ag_fw, fw_exp)
        bw_link, bw_exp = np.where(ag, ag_bw, bw_link), np.where(ag, ag_bw, bw_exp)
        fw_size = np.where(ag, steps * chunk, fw_size)
    z = ctx.zeros
    return ContextExchange(
        fw_link=np.where(multi, fw_link, z), fw_exp=np.where(multi, fw_exp, z),
        bw_link=np.where(multi, bw_link, z), bw_exp=np.where(multi, bw_exp, z),
        re_exp=np.where(multi & recompute_attn, fw_exp, z),
        fw_size=np.where(multi, fw_size, z))


def torch_ring_exchange(ctx: LayoutContext, net, cp, mbs, sq, q_width, attn_fw, attn_bw):
    """PyTorch's ring attention's K/V traffic (``TimeOverhead.cp_ring_impl``
    ``torch_allgather`` / ``torch_alltoall``), per block and micro-batch:
    (backward link, backward exposed, forward link, forward exposed,
    forward bytes).  Counted from ``torch/distributed/tensor/experimental/
    _attention.py`` of late 2024 (``_templated_ring_attention`` and its
    backward; ``_AllGatherRotater`` / ``_AllToAllRotater``):

    * K and V travel at the query heads' width (torchtitan's Llama calls
      SDPA on ``repeat_kv``'s K/V: torchtitan/models/llama/model.py at
      9dec370), in the working precision.
    * all-gather: the forward issues one all-gather of every rank's K/V
      before its first SDPA call and waits for it before the second, so it
      hides behind step 0's attention (1/cp of it); the backward gathers
      K/V again, likewise behind step 0's attention backward.
    * all-to-all: one ``permute_tensor`` of the local K/V per step (cp - 1),
      each behind one step's attention, as TE's ring.
    * backward, both: the accumulated dK/dV travel in fp32 (``accum_dtype``
      float32 under ``convert_to_f32``) by ``permute_tensor`` after every
      one of the cp steps, each waited for after the next step's SDPA
      backward (behind 1/cp of it); the last is waited for after the loop:
      exposed whole."""
    b = ctx.elem_bytes
    steps = cp - 1
    chunk = 2 * mbs * sq * q_width * b                      # local K and V, heads repeated
    peers = np.maximum(cp, 2)
    gather = net.time("all_gather", cp * chunk, peers)
    step = net.time("p2p", chunk, 2)
    dkv = net.time("p2p", chunk * 4.0 / b, 2)               # fp32 dK, dV
    if ctx.cp_ring_impl == "torch_allgather":
        fw_link = gather
        fw_exp = np.maximum(gather - attn_fw / cp, 0.0)
        kv_bw_link, kv_bw_exp = gather, np.maximum(gather - attn_bw / cp, 0.0)
        fw_size = steps * chunk
    else:
        fw_link = steps * step
        fw_exp = steps * np.maximum(step - attn_fw / cp, 0.0)
        kv_bw_link, kv_bw_exp = fw_link, steps * np.maximum(step - attn_bw / cp, 0.0)
        fw_size = steps * chunk
    bw_link = kv_bw_link + cp * dkv
    bw_exp = kv_bw_exp + steps * np.maximum(dkv - attn_bw / cp, 0.0) + dkv
    return bw_link, bw_exp, fw_link, fw_exp, fw_size


# ----------------------------------------------------------------------------
# The transformer block: attention then MLP.  Layers that exist only for some
# rows (e.g. overlapped vs. separate TP communication) carry a presence mask;
# the sequence is a superset whose order agrees with every variant, so running
# sums over the sequence equal the running sums over each row's own layers.


# ----------------------------------------------------------------------------
# Pipeline point-to-point and data-parallel gradient synchronisation.

def pipeline_p2p(ctx: LayoutContext, cols: dict, acts: ActivationSizes, networks):
    """Bytes one block boundary sends to the next stage (forward, backward)
    and the p2p time of one chunk boundary on the pipeline's network tier."""
    stages = cols["pipeline_par"]
    sequence_split = ctx.tp_rs_ag | ctx.tp_p2p
    fw_bytes = masked(np.where(sequence_split, acts.A_split, acts.A) * ctx.elem_bytes,
                      stages > 1)
    bw_bytes = ctx.if_training(fw_bytes)
    net = NetworkTier(networks, cols["pipeline_par_net"])
    return fw_bytes, bw_bytes, net.time("p2p", fw_bytes, 2), net.time("p2p", bw_bytes, 2)


def weight_gathers(ctx: LayoutContext, cols: dict, sums: BlockSums, sched, networks) -> dict:
    """ZeRO-3 / FSDP: every block's weights are all-gathered from their
    shards before its forward and again before its backward, for every
    micro-batch; the gather of the next block is prefetched while the current
    one computes, so a block's gather is exposed only where it outlasts the
    block's compute, and the first block's gather of each pass is exposed
    whole.  Returns link and exposed times per batch."""
    ws = ctx.weight_shards
    on = (ws > 1) & ctx.training
    pgo = cols["param_gather_overlap"] & ctx.training if "param_gather_overlap" in cols \
        else np.zeros(ctx.n, dtype=bool)
    if not on.any() and not pgo.any():
        return {"link": 0.0, "exposed": 0.0}
    dp = cols["data_par"]
    net = NetworkTier(networks, np.where(dp > 1, cols["data_par_net"], cols["context_par_net"]))
    peers = np.maximum(np.where(on, ws, ctx.optim_shards), 2)
    xw = sums.x_weight_space
    if xw is not None and np.any(on & (np.asarray(xw) > 0)):
        # Megatron-FSDP with experts: a unit's dense and expert parameters
        # are gathered as separate bucket groups (param_and_grad_buffer.py
        # ``_get_parameter_groups``: buckets grouped by (fsdp_unit_id,
        # is_expert_param)), the dense ones over data_par, the experts' over
        # their expert-data-parallel group (``expert_weight_shards``; none
        # where it is one rank), one after the other on the gather stream.
        xws = ctx.expert_weight_shards
        x_bytes = gathered_bytes(sums, xw, expert=True)
        dense = net.time("all_gather", gathered_bytes(sums, sums.weight_space_full) - x_bytes,
                         peers)
        experts = np.where(xws > 1, net.time("all_gather", x_bytes, np.maximum(xws, 2)), 0.0)
        g = np.where(on, dense + experts, net.time(
            "all_gather", gathered_bytes(sums, sums.weight_space_full), peers))
    else:
        g = net.time("all_gather", gathered_bytes(sums, sums.weight_space_full), peers)
    fw_hidden = np.maximum(g - sums.fw_time, 0.0)
    bw_hidden = np.maximum(g - (sums.agrad_time + sums.wgrad_time + sums.re_time), 0.0)
    micro = sched.microbatches
    blocks = sched.blocks_per_stage
    link = np.where(on, micro * blocks * 2 * g, 0.0)
    exposed = np.where(on, micro * ((blocks - 1) * (fw_hidden + bw_hidden) + 2 * g), 0.0)
    outer = cols.get("optimizer_outer_sharding")
    if outer is not None and np.any(outer & on):
        go = outer_weight_gather(ctx, sums, net)
        # Once a step, before the first micro-batch's forward, each block's
        # gather starts with the gather over the instances: the block's
        # inner gather waits for it, and both hide behind the block before.
        first_hidden = np.maximum(g + go - sums.fw_time, 0.0)
        on_outer = outer & on
        link = link + np.where(on_outer, blocks * go, 0.0)
        exposed = exposed + np.where(on_outer, (blocks - 1) * (first_hidden - fw_hidden) + go,
                                     0.0)
    # Megatron's overlap_param_gather: once a step, during the first forward.
    link = np.where(pgo, blocks * g, link)
    exposed = np.where(pgo, (blocks - 1) * fw_hidden + g, exposed)
    return {"link": link, "exposed": exposed}


def outer_weight_gather(ctx: LayoutContext, sums: BlockSums, net: NetworkTier):
    """Seconds of one block's all-gather over the distributed-optimizer
    instances under ``optimizer_outer_sharding`` (Megatron-FSDP's
    ``outer_dp_sharding_strategy="optim"``): the optimizer updated a
    1 / data_par x context_par shard, and each instance's inner-DP shard (the
    block's gathered bytes / ``weight_shards``; the experts' / their
    ``expert_weight_shards``) is gathered from the instances' pieces
    (NVIDIA/Megatron-LM@2a75ac1 megatron/core/distributed/fsdp/src/
    megatron_fsdp/megatron_fsdp.py ``_all_gather_module_weights``:
    ``outer_fsdp_group_param_gather`` when ``microbatch_count == 0``;
    param_and_grad_buffer.py ``AllGatherPipeline.all_gather_params``:
    ``all_gather_into_tensor`` of ``hfsdp_helper_wbuf`` over the outer
    group, dense and expert bucket groups one after the other, before the
    inner gather).  The instances: ``optim_shards / weight_shards``."""
    inst = np.maximum(ctx.optim_shards / np.maximum(ctx.weight_shards, 1.0), 2.0)
    dense = gathered_bytes(sums, sums.weight_space_full)
    xw = sums.x_weight_space
    if xw is None or not np.any(np.asarray(xw) > 0):
        return net.time("all_gather", dense / ctx.weight_shards, inst)
    x_bytes = gathered_bytes(sums, xw, expert=True)
    experts = np.where(x_bytes > 0, net.time(
        "all_gather", x_bytes / np.maximum(ctx.expert_weight_shards, 1.0), inst), 0.0)
    return net.time("all_gather", (dense - x_bytes) / ctx.weight_shards, inst) + experts


def parameter_bytes(sums: BlockSums, weights, expert=False):
    """The parameters' bytes (working precision) in a block's ``weights``
    (``weight_space_full`` / ``x_weight_space``): less the quantized weight
    copies of fp8 / fp4 recipes (Transformer Engine's weight workspaces),
    which are no parameters.  What the gradient reduce-scatter / all-reduce
    moves (times ``grad_scale``): Megatron-Core's gradient buffer holds one
    element a parameter (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/distributed/param_and_grad_buffer.py, ``grad_data`` of
    ``numel`` elements of ``grad_dtype``)."""
    copies = sums.x_weight_copies if expert else sums.weight_copies
    return weights if copies is None else weights - copies


def gathered_bytes(sums: BlockSums, weights, expert=False):
    """The bytes a parameter all-gather (the distributed optimizer's after
    the step, Megatron's overlap_param_gather, ZeRO-3 / FSDP's before use)
    moves of a block's ``weights``: the parameters (``parameter_bytes``), of
    a quantized-only weight its quantized bytes (layers._gathered_bytes)."""
    unsent = sums.x_weight_unsent if expert else sums.weight_unsent
    held = parameter_bytes(sums, weights, expert)
    return held if unsent is None else held - unsent


def data_parallel_sync(ctx: LayoutContext, cols: dict, sums: BlockSums, sched, chunk,
                       p2p_bw_time, networks) -> dict:
    """Gradient synchronisation over data_par: its link time, the part not
    hidden behind backward compute, and the bandwidth overlap would need.

    Without optimizer sharding the gradients are all-reduced; with it they
    are reduce-scattered and the updated weights all-gathered.  With
    ``data_par_overlap`` the sync of a chunk runs during the backward pass
    of the chunks after it (``interleaving - 1`` windows) and the last
    chunk's sync runs during the rest of its own backward pass; what does not
    fit, and the processor share the network takes from compute, is exposed.
    """
    training = ctx.training
    stages, dp = cols["pipeline_par"], cols["data_par"]
    sharded = cols["optimizer_sharding"]
    base = sched.base_blocks
    # Time of a block's backward in which the sync can hide (not memory-bound work).
    optim_free = np.where(sharded, 0.0, sums.optim_time - sums.optim_mem_time)
    grad_mem = chunk["grad_mem_time"]
    base_window = chunk["bw_base"] - (grad_mem + sums.re_mem_time) + optim_free
    edge_window = chunk["bw_edge"] - (grad_mem + sums.re_mem_time) + optim_free
    block_compute = (sums.agrad_flops_time + sums.wgrad_flops_time
                     + sums.re_flops_time + np.where(sharded, 0.0, sums.optim_flops_time))
    # Sharing the tensor-parallel tier, it waits for the TP traffic.
    same_tp = cols["data_par_net"] == cols["tensor_par_net"]
    base_window = base_window - np.where(
        same_tp, sums.base_recomm_time + sums.base_agrad_tp_time, 0.0)
    edge_window = edge_window - np.where(
        same_tp, sums.edge_recomm_time + sums.edge_agrad_tp_time, 0.0)
    chunk_window = base * base_window + 1.0 * edge_window
    chunk_compute = sched.blocks_per_chunk * block_compute

    # Gradients are reduced over data_par x context_par (the context-parallel
    # ranks hold the same weights), on the data-parallel tier (or the
    # context-parallel one when data_par is 1).
    cp = cols["context_par"] if "context_par" in cols else 1
    extended = np.any(cp != 1) or "sharding_group" in cols and np.any(cols["sharding_group"] > 0) \
        or "weight_sharding" in cols and np.any(cols["weight_sharding"]) \
        or "fp32_grads" in cols and np.any(cols["fp32_grads"]) \
        or "param_gather_overlap" in cols and np.any(cols["param_gather_overlap"])
    tier = cols["data_par_net"]
    if extended:
        tier = np.where(dp > 1, tier, cols["context_par_net"])
    net = NetworkTier(networks, tier)
    group = dp * cp if extended else dp
    peers = np.maximum(group, 2)
    active = (group > 1) & training
    # Routed experts' gradients sync over the expert-data-parallel group instead.
    # The gradients move the parameters' bytes, the parameter all-gather the
    # gathered ones (no quantized weight copies: ``parameter_bytes``).
    weights = sums.weight_space_full if sums.weight_space_full is not None else sums.weight_space
    x_weights = sums.x_weight_space if sums.x_weight_space is not None else 0.0
    full = parameter_bytes(sums, weights)
    expert_bytes = parameter_bytes(sums, x_weights, expert=True)
    full_gathered = gathered_bytes(sums, weights)
    expert_gathered = gathered_bytes(sums, x_weights, expert=True)
    if ctx.frozen is not None:
        # Fine-tuning with adapters: only the adapters' gradients are synced
        # (of the working datatype: the weight gradients count 4 bytes an
        # element before sharding); the frozen experts' none.
        full = np.where(ctx.frozen, sums.wgrad_space_full / 4.0 * ctx.elem_bytes, full)
        expert_bytes = np.where(ctx.frozen, 0.0, expert_bytes)
        full_gathered = np.where(ctx.frozen, full, full_gathered)
        expert_gathered = np.where(ctx.frozen, 0.0, expert_gathered)
    block_bytes = masked(full - expert_bytes, active)
    gather_bytes = masked(full_gathered - expert_gathered, active)
    wire_scale = np.where(sharded, net.scale("reduce_scatter") + net.scale("all_gather"),
                          net.scale("all_reduce"))
    if not extended:
        block_time = np.where(active, np.where(
            sharded, net.time("reduce_scatter", block_bytes, peers)
            + net.time("all_gather", gather_bytes, peers),
            net.time("all_reduce", block_bytes, peers)), 0.0)
    else:
        # Hybrid sharding: reduce-scatter / all-gather inside a group of
        # sharding_group x context_par ranks, then all-reduce the shard
        # across the data_par / sharding_group replicas.  ZeRO-3 / FSDP
        # gathers weights before each use (see ``weight_gathers``), not after
        # the step.
        g = cols["sharding_group"]
        hybrid = sharded & (g > 0)
        inner = np.maximum(choose(hybrid, g * cp, group), 2)
        replicas = np.maximum(choose(hybrid, by_value(lambda d, x: d // np.maximum(x, 1), dp, g),
                                     1), 2) if hybrid.any() else 2
        gather = np.where(cols["weight_sharding"] | cols["param_gather_overlap"], 0.0,
                          net.time("all_gather", gather_bytes, inner))
        cross = np.where(hybrid, net.time("all_reduce", block_bytes / inner, replicas), 0.0)
        # Gradients reduced in fp32 move 4 bytes an element.
        scale = grad_scale(cols)
        grad_bytes = block_bytes if scale is None else block_bytes * scale
        if "optimizer_outer_sharding" in cols and np.any(cols["optimizer_outer_sharding"]):
            # Megatron-FSDP's outer_dp_sharding_strategy "optim": on the last
            # micro-batch the instance's reduced gradient shard is
            # reduce-scattered over the instances (the optimizer's shard of
            # the whole data-parallel group) instead of all-reduced
            # (megatron_fsdp/param_and_grad_buffer.py
            # ``GradReducePipeline._bucket_group_gradient_reduce``,
            # ``outer_fsdp_group_grad_reduce``); the updated weights come
            # back by the gather over the instances in the next step's first
            # forward (``outer_weight_gather``).
            cross = np.where(hybrid & cols["optimizer_outer_sharding"],
                             net.time("reduce_scatter", grad_bytes / inner, replicas), cross)
        block_time = np.where(active, np.where(
            sharded, net.time("reduce_scatter", grad_bytes, inner) + gather + cross,
            net.time("all_reduce", grad_bytes, peers)), 0.0)
    x_bytes = np.asarray(expert_bytes) > 0
    x_active = (ctx.edp > 1) & training & x_bytes if x_bytes.any() else False
    if np.any(x_active):
        x_peers = np.maximum(ctx.edp, 2)
        scale = grad_scale(cols)
        x_grads = expert_bytes if scale is None else expert_bytes * scale
        x_gather = net.time("all_gather", expert_gathered, x_peers)
        if "weight_sharding" in cols and np.any(cols["weight_sharding"]):
            # ZeRO-3 / Megatron-FSDP gathers the experts before each use
            # (``weight_gathers``), not after the step.
            x_gather = np.where(cols["weight_sharding"], 0.0, x_gather)
        block_time = block_time + np.where(x_active, np.where(
            sharded, net.time("reduce_scatter", x_grads, x_peers) + x_gather,
            net.time("all_reduce", x_grads, x_peers)), 0.0)
        block_bytes = block_bytes + np.where(x_active, expert_bytes, 0.0)
        active = active | x_active
    usage = net.processor_usage
    overlapped_chunks = sched.interleaving - 1
    last_blocks = sched.blocks_per_chunk - 1
    stages_f = stages.astype(float)
    window = stages_f * chunk_window
    window_compute = stages_f * chunk_compute
    chunk_time = sched.blocks_per_chunk * block_time
    same_pp = cols["data_par_net"] == cols["pipeline_par_net"]
    leftover = sched.leftover
    with np.errstate(divide="ignore", invalid="ignore"):
        # On the pipeline's tier the sync also waits for backward p2p transfers.
        p2p_waits = np.where(same_pp, np.minimum(np.floor_divide(chunk_time, chunk["bw"]),
                                                 choose(leftover == 0, stages, leftover)),
                             0.0)
        inflation = chunk_time - (window - p2p_waits * p2p_bw_time) + window_compute * usage
        windows_exposed = np.where(inflation > 0, overlapped_chunks * inflation,
                                   overlapped_chunks * chunk_time * usage)
        windows_time = (window + window_compute * usage
                        - np.where(same_pp, p2p_bw_time, 0.0)) * overlapped_chunks
        req_chunk = np.where(windows_time > 0,
                             sched.blocks_per_chunk * block_bytes / windows_time * wire_scale,
                             0.0)
        last_window = np.where(base > 0, chunk_window - p2p_bw_time
                               - (chunk["bw_base"] + chunk["bw_edge"]) / 2 + optim_free, 0.0)
        last_inflation = last_blocks * block_time + (block_compute * usage - last_window)
        last_exposed = np.where(last_inflation > 0, last_inflation,
                                last_blocks * block_time * usage)
        tail_time = last_window + last_blocks * block_time * usage
        req_tail = np.where(tail_time > 0,
                            sched.blocks_per_chunk * block_bytes / tail_time * wire_scale, 0.0)
    overlap = active & cols["data_par_overlap"]
    link = np.where(active, sched.blocks_per_stage * block_time, 0.0)
    exposed = np.where(overlap, block_time + windows_exposed + last_exposed, link)
    return {"link": link, "exposed": exposed, "block_bytes": block_bytes,
            "req_chunk": np.where(overlap, req_chunk, 0.0),
            "req_tail": np.where(overlap, req_tail, 0.0)}
