"""Mixture of experts and multi-head latent attention, as layers of a block.

A model with ``moe`` (``autopar.io.specs.MoESpec``) has two kinds of block:
the first ``first_dense`` keep the dense MLP of ``feedforward``; the others
replace it by a mixture of experts.  ``routed_experts`` lays out the routed
part of an MoE block's feed-forward (the shared experts are a dense MLP of
``shared_feedforward``, laid out by ``autopar.model.block``):

* the router (a ``hidden x experts`` linear layer, then softmax or sigmoid
  scores and the top-k choice);
* dispatch: the tokens' copies travel to the processors holding their experts
  (all-to-all over the expert_par group: copies for peers in the same
  first-tier domain over the first tier, the others over the EP group's
  tier; or all-gather; or DeepEP's all-to-all, which sends a token once to
  each remote domain holding any of its experts), then an all-gather over
  the expert_tensor_par group; the combine is the reverse;
* the experts as grouped GEMMs: a processor holds ``experts / EP`` experts at
  ``1 / ETP`` of their width and processes ``ETP x T x top_k x load`` token
  copies (``T`` tokens per processor, ``load`` the busiest expert's share
  relative to balanced routing: the imbalance factor, or the capacity factor
  when experts are padded to capacity), each expert's GEMM at the matrix
  engine's efficiency for its own size (``m / groups`` tokens);
* the weighted sum of the experts' outputs;
* where the system states it (``time_overhead.moe_block_s``, or
  ``moe_host_op_s`` per op counted by ``autopar.model.overhead.moe_sync_ops``),
  the host time the block exposes per micro-batch (``host_sync``: dropless
  routing copies the per-expert counts to the host, and the launches after
  it wait).

Expert weights are counted with ``expert=True``: their gradients and
optimizer state are sharded over the expert-data-parallel group (see
``LayoutContext``) and synchronised over it (``data_parallel_sync``).

``mla_attention`` is DeepSeek's attention with low-rank query and joint
key/value compression: the down projections are replicated over tensor_par
(as Megatron's), the up projections split by heads.  ``stage_mix`` says how
many blocks of each kind a pipeline stage holds (dense and MoE: the dense
ones are the first blocks; multi-token-prediction modules add blocks to the
last stage; a hybrid model's kinds by its pattern), and ``mix`` weights the
kinds' sums by those counts.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np

from autopar.model.block_inputs import BlockInputs
from autopar.model.block_sums import KIND_SUMS, MAX_SUMS, BlockSums
from autopar.model.communication import tp_collective
from autopar.io.specs import HYBRID_SYMBOLS
from autopar.model.context import LayoutContext
from autopar.model.mamba import hybrid_kinds, layer_kinds
from autopar.model.overhead import moe_sync_ops
from autopar.model.sparse_attention import indexer_layers, sparse_core
from autopar.model.pipeline import chunk_spans, chunk_split, distinct_splits, uneven_rows
from autopar.model.layers import (STAGES, batched_matmul, finish, flash_attention, fork,
                                  offload_group,
                                  fp8_gemm, gelu, grouped_linear, layer, linear, no_tp_comm,
                                  original_input, rms_norm, rotary, softmax, swiglu)

# Vector FLOPs per score of the router: the score function (softmax: exp,
# sum, divide; sigmoid: exp, add, divide, plus normalising the chosen ones)
# and the top-k selection over the experts.
_ROUTER_FLOPS = {"softmax": 8.0, "sigmoid": 9.0}


def tokens_per_processor(ctx: LayoutContext, cols: dict):
    """Tokens of one micro-batch that a processor routes: its sequence-parallel
    share (an MoE model runs its MoE layers sequence-parallel over tensor_par;
    context parallelism splits the sequence too)."""
    B = cols["microbatch_size"].astype(float) * ctx.model.seq_size / ctx.cp
    return np.floor_divide(B, ctx.tp)


def expert_tokens(ctx: LayoutContext, cols: dict):
    """Token copies the busiest processor runs through its experts, per micro-batch."""
    moe = ctx.model.moe
    return ctx.etp * tokens_per_processor(ctx, cols) * moe.top_k * moe.load


def _ep_comm(ctx: LayoutContext, nbytes, tokens_bytes, hide, recompute, combine: bool):
    """Dispatch (or combine) of one micro-batch: its time on the expert tiers.

    ``nbytes``: the token copies a processor sends (all-to-all), already
    scaled by the load; ``tokens_bytes``: its own tokens (all-gather
    dispatcher).  All-to-all sends the (EP-1)/EP of the copies bound for other
    processors point to point; the all-gather dispatcher gathers every
    processor's tokens (and reduce-scatters the outputs back).  With
    expert_tensor_par the copies are all-gathered (reduce-scattered) over the
    ETP group.  With ``moe_overlap`` the transfer hides behind ``hide`` (the
    experts' compute of the same pass) and only the rest is exposed.
    """
    L = layer(ctx, recompute=recompute, stored=False)
    ep, etp = ctx.ep, ctx.etp
    local = ctx.ep_local
    # All-to-all: the copies for peers in the same first-tier domain go over
    # the first tier, the rest over the EP group's tier, both at once.
    near = ctx.net0.time("p2p", nbytes * (local - 1) / ep, 2)
    far = np.where(ep > local, ctx.ep_net.time("p2p", nbytes * (ep - local) / ep, 2), 0.0)
    a2a = np.where(ep > 1, np.maximum(near, far), 0.0)
    # DeepEP: a token crosses to each remote domain holding one of its
    # experts once, then is forwarded inside it.
    hits = remote_domains_hit(ctx)
    deep_far = np.where(ep > local, ctx.ep_net.time(
        "p2p", tokens_bytes * hits * ctx.model.moe.load, 2), 0.0)
    deep_near = ctx.net0.time("p2p", nbytes * (local - 1) / local, 2)
    deep = np.where(ep > 1, np.maximum(deep_near, deep_far), 0.0)
    a2a = np.where(ctx.moe_deepep, deep, a2a)
    group = ep * etp
    gathered = tokens_bytes * group
    op = "reduce_scatter" if combine else "all_gather"
    ag = np.where(group > 1, ctx.ep_net.time(op, gathered, np.maximum(group, 2)), 0.0)
    etp_op = np.where(etp > 1, ctx.etp_net.time(op, nbytes * etp, np.maximum(etp, 2)), 0.0)
    link = np.where(ctx.moe_allgather, ag, a2a + etp_op)
    L["kind"] = "epcomm"
    L["finish"] = _finish_ep_comm
    L["ep_link"] = link
    L["ep_hide"] = hide
    return L


def remote_domains_hit(ctx: LayoutContext):
    """Expected remote first-tier domains (nodes) a token's top-k experts
    fall in, under balanced routing: each of the ``ep / ep_local - 1`` remote
    domains holds ``experts * ep_local / ep`` experts and is hit unless all
    top-k choices miss it."""
    moe = ctx.model.moe
    E, k = moe.experts, moe.top_k
    out = np.zeros(ctx.n)
    for ep, local in set(zip(ctx.ep.tolist(), ctx.ep_local.tolist())):
        domains = int(round(ep / local))
        if domains <= 1:
            continue
        g = int(round(E * local / ep))
        miss = math.comb(E - g, k) / math.comb(E, k) if E - g >= k else 0.0
        out[(ctx.ep == ep) & (ctx.ep_local == local)] = (domains - 1) * (1.0 - miss)
    return out


def _idle(ctx: LayoutContext, L: dict) -> None:
    """A layer that computes nothing and has no tensor-parallel traffic (its
    own time is set by its finisher)."""
    for s in STAGES:
        L["time_" + s] = ctx.zeros
    no_tp_comm(ctx, L)


def _finish_ep_comm(ctx: LayoutContext, L: dict):
    _idle(ctx, L)
    link = L["ep_link"]
    for s in ("fw", "agrad"):
        hide = np.where(ctx.moe_overlap, L["ep_hide"][s], 0.0)
        L["time_" + s] = np.maximum(link - hide, 0.0)
    # Per block: the transfer of the forward and of the backward pass.
    L["ep_link_total"] = 2 * link
    L["ep_exposed_total"] = L["time_fw"] + L["time_agrad"]


# The forward's share of an MoE block's stated exposed host time
# (``moe_block_s``; the backward launches about twice the forward's kernels).
_HOST_FW_SHARE = 1.0 / 3.0


def host_sync(ctx: LayoutContext, recompute) -> dict:
    """The host time an MoE block exposes per micro-batch: dropless routing
    copies the per-expert token counts to the host, which empties the GPU's
    queue, so the kernels launched after it wait for the host.  Stated
    (``time_overhead.moe_block_s``: a third in the forward, two thirds in
    the backward) and / or counted (``time_overhead.moe_host_op_s`` per op
    of ``autopar.model.overhead.moe_sync_ops``: the ops after the sync,
    which grow with the processor's local experts); 0 unless stated."""
    L = layer(ctx, recompute=recompute, stored=False)
    L["kind"] = "hostsync"
    L["finish"] = _finish_host_sync
    return L


def _finish_host_sync(ctx: LayoutContext, L: dict):
    _idle(ctx, L)
    z = ctx.zeros
    fw = z + ctx.moe_host_s * _HOST_FW_SHARE
    bw = z + ctx.moe_host_s * (1.0 - _HOST_FW_SHARE)
    if ctx.moe_host_op_s > 0:
        fp8 = ctx.fp8 if ctx.fp8 is not None else False
        n_fw, n_bw = moe_sync_ops(ctx.model.moe.experts / ctx.ep, fp8)
        fw = fw + ctx.moe_host_op_s * n_fw
        bw = bw + ctx.moe_host_op_s * n_bw
    L["time_fw"] = fw
    L["time_agrad"] = bw


def routed_experts(ctx: LayoutContext, cols: dict, x: BlockInputs) -> list:
    """The routed part of an MoE block's feed-forward, as (layer, present)
    pairs; the experts' GEMMs fp8 where the layout's recipe says so."""
    g = partial(fp8_gemm, ctx)
    llama, full = x.llama, x.full
    moe = ctx.model.moe
    hidden = float(ctx.model.hidden)
    # LatentMoE (``moe.latent_size``): the experts, the dispatch and the
    # combine are at the latent width, between two projections of every
    # token (``_latent_projections``); the router scores the hidden state.
    h = float(moe.latent_size) if moe.latent_size else hidden
    E = float(moe.experts)
    k = float(moe.top_k)
    ffe = moe.expert_feedforward / ctx.etp
    b = ctx.elem_bytes
    T = tokens_per_processor(ctx, cols)
    M = expert_tokens(ctx, cols)
    groups = E / ctx.ep
    fc1_width = 2 * ffe if llama else ffe
    # The router's GEMM keeps its input (the norm's output) for its weight
    # gradient (Megatron's router GEMM, megatron/core/transformer/moe/
    # moe_utils.py RouterGatingLinearFunction, saves it); a shared expert's
    # first GEMM keeps the same tensor, so with one it is counted there.
    # Counted so under ``memory_overhead.autograd_inputs`` (measured with
    # PyTorch: benchmarks/memory_torch.py).
    keep = ctx.autograd_inputs and not moe.shared_feedforward
    down, up = _latent_projections(ctx, T, hidden, h, x) if moe.latent_size else (None, None)
    router = linear(ctx, T, hidden, E, **full, stored=keep and down is None, reused=True)
    router["dummy_wgrad"] = False       # Megatron's own parameter, not a TE module
    score = float(_ROUTER_FLOPS[moe.router])
    scores = layer(ctx, fw=score * T * E, agrad=score * T * E, inputs=T * E, outputs=T * E,
                   act=T * E, act_grads=T * E, **full)
    # Local permutation of the token copies (before and after the transfer).
    permute = layer(ctx, inputs=T * h, outputs=M * h, act_grads=M * h, **full)
    fc1 = g(grouped_linear(ctx, groups, M, h, fc1_width, **full))
    # ``recompute_moe_act`` (autopar.io.layouts): the activation runs again
    # in backward and the second GEMM keeps nothing of its input.
    act_fn = (swiglu if llama else gelu)(ctx, M * ffe, x.fused,
                                         recompute=x.recompute_full | x.recompute_moe_act)
    fc2 = g(grouped_linear(ctx, groups, M, ffe, h, **full, stored=~np.asarray(x.recompute_moe_act)))
    # The weighted sum keeps the experts' outputs for the gradient of the scores.
    combine = layer(ctx, fw=2 * M * h, agrad=3 * M * h, inputs=M * h, outputs=T * h,
                    act=M * h, act_grads=T * h, **full)
    if ctx.moe_probs_in_activation:
        # ``memory_overhead.moe_probs_in_activation``: the activation
        # weights its outputs by the probabilities and keeps them (one a
        # token copy); the combine keeps nothing (its traffic is as before).
        act_fn["act_b"] = act_fn["act_b"] + M * b
        combine["act_b"] = 0.0 * combine["act_b"]
    # The experts' compute that an overlapped transfer can hide behind.
    for L in (fc1, act_fn, fc2):
        finish(ctx, L)
    hide = {"fw": fc1["time_fw"] + act_fn["time_fw"] + fc2["time_fw"],
            "agrad": (fc1["time_agrad"] + fc1["time_wgrad"] + act_fn["time_agrad"]
                      + fc2["time_agrad"] + fc2["time_wgrad"])}
    half = {s: v / 2 for s, v in hide.items()}
    sent = T * k * moe.load * h * b
    own = T * h * b
    dispatch = _ep_comm(ctx, sent, own, half, x.recompute_full, combine=False)
    back = _ep_comm(ctx, sent, own, half, x.recompute_full, combine=True)
    # Fine-grained offload groups: ``expert_fc1`` and ``moe_act`` the first
    # GEMM and the activation; ``fused_group_mlp`` all three, what the
    # Transformer Engine op fuser's grouped MLP saves inside Megatron-Core's
    # offload context (NVIDIA/Megatron-LM@2a75ac1 megatron/core/transformer/
    # moe/experts.py ``TEGroupedMLP._fused_forward``: the context wraps the
    # fused fc1 -> scaled activation -> fc2 call; TransformerEngine
    # ops/fused/grouped_mlp.py saves fc1's input, the activation's input
    # and fc2's input).
    offload_group(fc1, "expert_fc1")
    offload_group(act_fn, "moe_act")
    offload_group([(fc1, True), (act_fn, True), (fc2, True)], "fused_group_mlp")
    seq = [(router, True), (scores, True), (dispatch, True), (permute, True),
           (fc1, True), (act_fn, True), (fc2, True), (back, True), (combine, True)]
    if down is not None:
        # (Megatron-Core's MoELayer.preprocess projects down before the
        # dispatcher's permutation; postprocess projects up after the combine)
        seq.insert(2, (down, True))
        seq.append((up, True))
    if ctx.moe_host_s > 0 or ctx.moe_host_op_s > 0:
        seq.insert(2, (host_sync(ctx, x.recompute_full), True))
    return seq


def _latent_projections(ctx: LayoutContext, T, hidden: float, latent: float,
                        x: BlockInputs):
    """LatentMoE's two projections of one MoE layer, as (down, up) layers.

    NVIDIA/Megatron-LM@2a75ac1 megatron/core/transformer/moe/moe_layer.py
    ``MoELayer.__init__``: ``fc1_latent_proj`` (hidden -> ``moe_latent_size``)
    and ``fc2_latent_proj`` (back) are Transformer Engine linear layers in
    ``parallel_mode="duplicated"``: every tensor-parallel rank holds the
    whole weight (not split over tensor_par, not an expert's: synchronised
    over the data-parallel group like a dense weight) and projects its own
    ``T`` sequence-parallel tokens.  ``MoELayer.preprocess`` runs the down
    projection after the router (which scores the hidden state) and before
    the dispatcher, so the dispatcher moves latent-width tokens
    (token_dispatcher.py: the flex dispatcher's buffers sized
    ``moe_latent_size or hidden_size``) and the experts take it
    (experts.py: their input size is ``moe_latent_size``);
    ``MoELayer.postprocess`` projects the combined output back up, before the
    shared experts' output (which ran on the hidden state) is added.  Each
    keeps its input for its weight gradient: the down projection the
    layer's normalised input (the router's; with shared experts their first
    GEMM keeps the same tensor, so it is counted there), the up projection
    the combined latent tokens."""
    g = partial(fp8_gemm, ctx)
    keep = not ctx.model.moe.shared_feedforward
    down = g(linear(ctx, T, hidden, latent, **x.full, stored=keep, reused=not keep))
    up = g(linear(ctx, T, latent, hidden, **x.full))
    return down, up


def mla_attention(ctx: LayoutContext, x: BlockInputs):
    """DeepSeek's multi-head latent attention, up to its output projection's
    collective (TP communication as separate collectives): the layers, those
    of its core, and the query and key widths per processor.  ``x.sq``: the
    local queries (context parallelism), attending to all ``seq_size`` keys."""
    m, a = ctx.model, ctx.model.mla
    h, s, H = float(m.hidden), float(m.seq_size), float(m.attn_heads)
    tp = ctx.tp
    heads_tp = H / tp
    dqk, dv, rope = float(a.qk_head_dim), float(a.v_head_dim), float(a.qk_rope_head_dim)
    kvr, qr = float(a.kv_lora_rank), float(a.q_lora_rank)
    A, B, mbs, sq = x.A, x.B, x.mbs, x.sq
    full, attn, shared_input = x.full, x.attn, x.shared_input
    g = partial(fp8_gemm, ctx)          # a GEMM of the block: fp8 where the recipe says so
    # ``recompute_mla_up_proj`` (autopar.io.layouts): the up projections and
    # the rotary embedding run again in backward; the core's query, key and
    # value are not kept (the rotary embedding keeps nothing anyway).
    up = x.recompute_up_proj
    up_rec = {"recompute": x.recompute_full | up}
    kept_qkv = ~np.asarray(up)
    seq = [
        (fork(ctx, x.A_tp, 2, **full, stored=True), True),
        (x.norm(ctx, x.A_tp, h, x.fused_norm, **full, **shared_input), True),
        (tp_collective(ctx, A, False, recomm=x.regather_attn), True),
        (fork(ctx, A, 2, recompute=x.regather_attn, stored=~x.regather_attn), True),
    ]
    if qr > 0:
        seq += [(g(linear(ctx, B, h, qr, **full, **shared_input)), True),
                (rms_norm(ctx, B * qr, qr, x.fused_norm, **full), True),
                (g(linear(ctx, B, qr, heads_tp * dqk, **up_rec)), True)]
    else:
        seq.append((g(linear(ctx, B, h, heads_tp * dqk, **up_rec, **shared_input)), True))
    seq += [
        (g(linear(ctx, B, h, kvr + rope, **full, **shared_input)), True),
        (rms_norm(ctx, B * kvr, kvr, x.fused_norm, **full), True),
        (g(linear(ctx, B, kvr, heads_tp * (a.qk_nope_head_dim + dv), **up_rec)), True),
        (rotary(ctx, B * (heads_tp * rope + rope), recompute=attn["recompute"] | up,
                stored=kept_qkv), True),
    ]
    core, kept = x.core, ~x.recompute_attn
    if a.sparse_index is not None:
        # DeepSeek Sparse Attention (autopar.model.sparse_attention): the
        # indexer on every local token, then the attention over the chosen
        # keys, whatever attention_impl the row names (DSA has its own kernels)
        idx = a.sparse_index
        rows = mbs * sq
        core_layers = [(L, True) for L in indexer_layers(ctx, rows, sq, x.span, mbs, **attn)]
        core_layers += [(L, True) for L in sparse_core(ctx, mbs, heads_tp, sq, x.span, x.impl,
                                                       kept_qkv, **full)]
        # The context-parallel all-gather: the one latent key/value of
        # kv_lora_rank + rope (no heads) and the indexer's key
        # (context_exchange counts K and V, 2 x kv_width).
        q_width = heads_tp * (kvr + rope)
        kv_width = (kvr + rope + float(idx.head_dim)) / 2
    else:
        core_layers = [
            (batched_matmul(ctx, mbs * heads_tp, sq, dqk, s, **attn, out_stored=kept), core),
            (softmax(ctx, heads_tp * sq * s * mbs, x.impl, True, **attn, out_stored=kept), core),
            (batched_matmul(ctx, mbs * heads_tp, sq, s, dv, **full), core),
            (flash_attention(ctx, mbs, heads_tp, sq, dqk, heads_tp * dqk, x.impl, sk=x.span,
                             dv=dv, kv_v=heads_tp * dv, **full, stored=kept_qkv), x.flash),
        ]
        q_width = kv_width = heads_tp * dqk
    seq += offload_group(core_layers, "core_attn")
    seq += [
        # (MultiLatentAttention sets save_original_input on its linear_proj
        # as Attention does: layers.original_input)
        (offload_group(original_input(ctx, g(linear(ctx, B, heads_tp * dv, h, **full))),
                       "attn_proj"), True),
        (tp_collective(ctx, A, True, recomm=x.recompute_full, stored=False), True),
    ]
    return seq, core_layers, q_width, kv_width


# ----------------------------------------------------------------------------
# Which blocks a stage holds.

# The suffix of a block kind run without the fp8 / fp4 recipe: the recipe's
# BF16 first and last blocks (``bf16_first_blocks`` / ``bf16_last_blocks``).
BF16 = "_bf16"


def bf16_blocks(cols: dict | None):
    """The recipe's BF16 blocks of each row, ``(first, last)`` counts (0
    where the row has no ``fp8_recipe``: they change nothing there), or None
    where no row has any (every block quantized, the model's blocks as
    before).  Megatron-Core keeps a layer out of the quantization context by
    its global index (megatron/core/fp8_utils.py ``is_first_last_bf16_layer``,
    fp4_utils.py ``get_fp4_context``): the first ``num_layers_at_start_in_bf16``
    and the last ``num_layers_at_end_in_bf16`` of the model."""
    if cols is None or "bf16_first_blocks" not in cols:
        return None
    first, last = cols["bf16_first_blocks"], cols["bf16_last_blocks"]
    if not (first.any() or last.any()):
        return None
    on = cols["fp8_recipe"] != 0
    first, last = np.where(on, first, 0), np.where(on, last, 0)
    if not (first.any() or last.any()):
        return None
    return first, last


def mixed_rows(model, cols: dict | None = None):
    """Whether a row's pipeline stages can hold blocks of different kinds
    (True, False, or a bool a row): a model with ``moe`` whose first
    ``first_dense`` blocks (some, not all) keep the dense MLP, a model with
    ``mtp`` modules (on the last stage: ``mtp_layers``), a hybrid pattern of
    more than one kind (``autopar.model.mamba.layer_kinds``), and the rows
    that keep the recipe's first or last blocks in BF16 (``bf16_blocks``).
    Such rows count their stages one by one at the default split as well
    (``autopar.model.pipeline.uneven_rows``); a model whose blocks are all
    alike keeps Calculon's count."""
    N = model.num_blocks
    if model.mtp:
        return True
    if model.moe is not None and 0 < model.moe.first_dense < N:
        return True
    if model.hybrid_pattern and len(set(layer_kinds(model))) > 1:
        return True
    bf = bf16_blocks(cols)
    if bf is None:
        return False
    return (bf[0] > 0) | (bf[1] > 0)


def mtp_layer_count(model) -> int:
    """The layers the ``mtp`` modules add to the last stage (``mtp_layers``,
    every kind together): blocks it runs beside its decoder blocks."""
    if not model.mtp:
        return 0
    kinds = hybrid_kinds(model) if model.hybrid_pattern else ("dense", "moe")
    return int(sum(mtp_layers(model, kinds)[0]))


def stage_counts(model, stages: np.ndarray, cols: dict | None = None,
                 pace_weights: dict | None = None) -> dict:
    """Blocks of each kind (``{who}_{kind}``) of the first stage, the last
    stage and the stage that paces the pipeline, per row.  Stage i holds
    blocks [i * bps, (i + 1) * bps) with ``bps = ceil(num_blocks / stages)``.
    A model with ``moe`` has kinds "dense" (the first ``first_dense``) and
    "moe"; the last stage also runs the ``mtp`` modules (``mtp_layers``: an
    MoE block each, as DeepSeek-V3's; attention and MoE in a hybrid model); the pace is the most MoE blocks, then the most blocks.
    A hybrid model (``hybrid_pattern``) has one kind per block
    (``autopar.model.mamba.layer_kinds``); its pace is the stage with the
    most work by ``pace_weights`` (a weight per kind).  Rows of ``cols`` that
    split the pipeline unevenly (``autopar.model.pipeline.stage_split``) hold
    their stages' blocks in order instead, and then the second stage's
    counts and each stage's blocks (``{w}_blocks``, without the mtp modules)
    are given too.  Rows with the recipe's BF16 blocks (``bf16_blocks``)
    count those as kinds of their own (each kind with ``BF16`` appended);
    the pace counts a BF16 block as its kind and, between stages of equal
    work, is the one with more BF16 blocks (the same work without the
    recipe's faster GEMMs).  Rows whose stages hold blocks of different
    kinds (``mixed_rows``) count their stages so at the default split too
    (Calculon's ceil split, ``autopar.model.pipeline.ceil_chunks``), with
    the second stage's counts and each stage's blocks."""
    N = model.num_blocks
    if model.hybrid_pattern:
        per_block, kinds = layer_kinds(model), hybrid_kinds(model)
        weights = pace_weights or {}

        def base_key(c):
            return (sum(n * weights.get(k, 1.0) for n, k in zip(c, kinds)), sum(c))
    else:
        k = model.moe.first_dense if model.moe is not None else N
        per_block, kinds = ("dense",) * k + ("moe",) * (N - k), ("dense", "moe")

        def base_key(c):
            return (c[1], c[0] + c[1])
    nk = len(kinds)
    bf = bf16_blocks(cols)
    all_kinds = kinds + (tuple(t + BF16 for t in kinds) if bf is not None else ())

    def pace_key(c):
        if bf is None:
            return base_key(c)
        return base_key([c[i] + c[i + nk] for i in range(nk)]) + (sum(c[nk:]),)
    # The last stage's multi-token-prediction layers by kind (``mtp_layers``)
    # and, with one module run ``mtp`` times (``mtp_repeated``), the layers
    # whose weights it holds (``{who}_{kind}@held``: ``mix``'s weight counts).
    add, held_add = mtp_layers(model, kinds)
    add = list(add) + [0] * (len(all_kinds) - nk)
    held_add = list(held_add) + [0] * (len(all_kinds) - nk)
    repeated = add != held_add
    split = uneven_rows(cols, mixed_rows(model, cols)) if cols is not None else None
    whos = ("first", "last", "pace") + (("second",) if split is not None else ())
    out = {f"{w}_{t}": np.zeros(len(stages)) for w in whos for t in all_kinds}
    if repeated:
        out.update({f"{w}_{t}@held": np.zeros(len(stages)) for w in whos for t in all_kinds})
    groups = []
    vp = cols.get("pipeline_interleaving") if cols is not None and model.hybrid_pattern \
        else None
    for pp in np.unique(stages):
        rows = stages == pp
        if split is not None:
            rows = rows & ~split
        if vp is not None and (vp[rows] > 1).any():
            # A hybrid model's interleaved stages hold their chunks' blocks
            # (``chunk_spans``), each kind counted over them.
            for v in np.unique(vp[rows]):
                spans = chunk_spans(chunk_split(N, int(pp), int(v), 0, 0, False, False, False))
                groups.append((rows & (vp == v), spans or [-(-N // int(pp))] * int(pp)))
            continue
        groups.append((rows, [-(-N // int(pp))] * int(pp)))
    if split is not None:
        out.update({f"{w}_blocks": (-(-N // np.maximum(stages, 1))).astype(float)
                    for w in whos})
        at = np.flatnonzero(split)
        splits, inv = distinct_splits(cols, N, at, chunks=vp is not None)
        for j, per in enumerate(splits):
            rows = np.zeros(len(stages), dtype=bool)
            rows[at[inv == j]] = True
            groups.append((rows, per))
    if bf is not None:
        # (each group again by its rows' BF16 counts)
        pairs = bf[0] * (N + 1) + bf[1]
        groups = [(rows & (pairs == v), per) for rows, per in groups
                  for v in np.unique(pairs[rows])]
    for rows, per in groups:
        if not rows.any():
            continue
        held_kinds = per_block
        if bf is not None:
            i = np.flatnonzero(rows)[0]
            f, l = int(bf[0][i]), int(bf[1][i])
            held_kinds = tuple(t + BF16 if b < f or b >= N - l else t
                               for b, t in enumerate(per_block))
        if per and isinstance(per[0], list):
            spans, per = per, [sum(hi - lo for lo, hi in sp) for sp in per]
        else:
            spans, lo = [], 0
            for n in per:
                spans.append([(lo, min(lo + n, N))])
                lo = min(lo + n, N)
        counts, helds = [], []
        for i, sp in enumerate(spans):
            held = tuple(t for lo, hi in sp for t in held_kinds[lo:hi])
            c = [held.count(t) for t in all_kinds]
            w_c = list(c)
            if i == len(per) - 1:
                c = [a + b for a, b in zip(c, add)]
                w_c = [a + b for a, b in zip(w_c, held_add)]
            counts.append(tuple(c))
            helds.append(tuple(w_c))
        pace_at = max(range(len(counts)), key=lambda j: pace_key(counts[j]))
        at = {"first": 0, "last": len(counts) - 1, "pace": pace_at,
              "second": min(1, len(counts) - 1)}
        for w in whos:
            for t, n, nh in zip(all_kinds, counts[at[w]], helds[at[w]]):
                out[f"{w}_{t}"][rows] = n
                if repeated:
                    out[f"{w}_{t}@held"][rows] = nh
            if split is not None and split[rows].any():
                n = {"first": per[0], "last": per[-1], "second": per[min(1, len(per) - 1)],
                     "pace": max(per)}[w]
                out[f"{w}_blocks"][rows] = max(n, 1)
    return out


def mtp_layers(model, kinds: tuple) -> tuple[tuple, tuple]:
    """The multi-token-prediction layers the last stage runs, per block kind
    of ``kinds``, and those whose weights it holds.

    Without ``mtp_pattern`` each of the ``mtp`` modules is one block of the
    model's MoE (else dense) kind (DeepSeek-V3's), or in a hybrid model one
    attention and one MoE (else MLP) layer.  A hybrid model's module
    is the layers of its ``mtp_pattern`` (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/transformer/multi_token_prediction.py
    ``MultiTokenPredictionLayer.__init__``: a ``HybridStack`` built from
    ``mtp_layer_pattern``), run once per depth
    (``MultiTokenPredictionBlock.forward`` loops over ``mtp_num_layers``).
    With ``mtp_repeated`` (``mtp_use_repeated_layer``:
    ``MultiTokenPredictionBlock._build_layers`` builds one layer and the
    forward runs ``layers[0]`` at every depth) the weights are held once."""
    mtp = model.mtp
    per = [0] * len(kinds)
    if mtp and model.mtp_pattern:
        for sym in model.mtp_pattern:
            per[kinds.index(HYBRID_SYMBOLS[sym])] += 1
    elif mtp and model.hybrid_pattern:
        # a hybrid model without an MTP pattern (Qwen3-Next, which Megatron
        # runs as a GPT model): one transformer layer, an attention and an
        # MoE (or MLP) layer (multi_token_prediction.py
        # ``MultiTokenPredictionLayer``: its ``mtp_model_layer`` is a
        # ``TransformerLayer`` of the decoder's layer spec; Megatron-Bridge@067f987
        # qwen3_next_bridge.py maps ``mtp.layers.*.self_attn`` and
        # ``mtp.layers.*.mlp.experts``)
        per[kinds.index("attention")] += 1
        per[kinds.index("moe" if model.moe is not None else "mlp")] += 1
    elif mtp:
        per[kinds.index("moe" if model.moe is not None else "dense")] += 1
    held = 1 if model.mtp_repeated else mtp
    return tuple(n * mtp for n in per), tuple(n * held for n in per)


# The sums that scale with the weights a stage holds, not the layers it
# runs (one MTP module run several times: ``mtp_layers``).
HELD_SUMS = ("weight_space", "wgrad_space", "wgrad_space_full", "optimizer_space",
             "weight_space_full", "weight_unkept", "weight_unkept_full", "weight_copies",
             "weight_unsent", "x_weight_copies", "x_weight_unsent", "x_weight_space",
             "x_weight_unkept", "x_wgrad_space", "x_optimizer_space", "optim_flops", "optim_flops_time",
             "optim_mem", "optim_mem_time", "optim_time")


def mix(sums: dict, counts: dict, per_stage, held: dict | None = None) -> BlockSums:
    """Per-block sums of a stage holding ``counts[kind]`` blocks of each
    kind whose per-block sums are ``sums[kind]``, as the average block of its
    ``per_stage`` block slots (so that the batch composition's
    ``blocks_per_stage`` multiples give the stage's totals).  ``held``: the
    blocks whose weights the stage holds where they differ (``HELD_SUMS``;
    a repeated MTP module)."""
    kinds = list(sums)
    out = {}
    for key in sums[kinds[0]].given():
        vals = [getattr(sums[k], key) for k in kinds]
        if held is not None and key in HELD_SUMS:
            v = held[kinds[0]] * vals[0]
            for k, e in zip(kinds[1:], vals[1:]):
                v = v + held[k] * e
            out[key] = v / per_stage
            continue
        if key in KIND_SUMS:
            # once per block kind the stage holds (a stage total, as the
            # memory footprints read it); a kind's BF16 blocks have its shapes
            per_shape = {}
            for k, e in zip(kinds, vals):
                base = k[:-len(BF16)] if k.endswith(BF16) else k
                held = np.where(counts[k] > 0, e, 0.0)
                per_shape[base] = np.maximum(per_shape[base], held) if base in per_shape \
                    else held
            v = sum(per_shape.values())
        elif key in MAX_SUMS:
            v = np.where(counts[kinds[0]] > 0, vals[0], 0.0)
            for k, e in zip(kinds[1:], vals[1:]):
                v = np.maximum(v, np.where(counts[k] > 0, e, 0.0))
        else:
            v = counts[kinds[0]] * vals[0]
            for k, e in zip(kinds[1:], vals[1:]):
                v = v + counts[k] * e
            v = v / per_stage
        out[key] = v
    return BlockSums(**out)
