"""The transformer block: a sequence of layers, summed per block.

Follows Calculon's ``llm.py`` (its attention and MLP block builders and the
per-block statistics).  ``block`` lays out the layers of one block for every
row at once: layers that exist only for some rows (separate vs overlapped TP
communication, multi-query, FlashAttention) carry a presence mask, and the
sequence is a superset whose order agrees with every variant, so running
sums over it equal the sums over each row's own layers.  ``accumulate``
sums the layers into the per-block quantities (``BlockSums``) with Calculon's
recompute rules.  ``autopar.model.speedups.BlockCache`` computes them once
per distinct block (a block depends on a handful of columns) and gathers
them back per row.
``head_time`` and ``head_memory`` are the embedding and the output layer
with its loss, for models that give a vocabulary.

The halves of the block read their inputs from one ``BlockInputs`` record
(``autopar.model.block_inputs``: the sizes ``B``, ``A``, ``A_tp`` of one
micro-batch and the rows' recompute and communication masks); ``h, f, s,
H, d, KV``: hidden, feed-forward, sequence, heads, head size, K/V heads.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np

from autopar.io.layouts import OFFLOAD_MODULES, offload_module_mask
from autopar.io.specs import MemoryOverhead, SystemSpec
from autopar.model.block_inputs import ActivationSizes, BlockInputs, block_inputs
from autopar.model.block_sums import BlockSums
from autopar.model.communication import context_exchange, tp_collective, tp_overlapped_linear
from autopar.model.context import LayoutContext, masked
from autopar.model.adapters import adapter_layers
from autopar.model.optimizers import head_state_bytes
from autopar.model.gated_delta import gdn_mixer
from autopar.model.mamba import mamba_mixer
from autopar.model.memory import whole_pipeline_grads
from autopar.model.moe import mla_attention, routed_experts
from autopar.model.layers import (batched_matmul, context_parallel_elementwise, dropout, finish, flash_attention, fork,
                                  offload_group,
                                  fp8_gemm, gelu, layer, linear, original_input, projections,
                                  residual, rotary, softmax, swiglu)


def block(ctx: LayoutContext, cols: dict, kind: str = "dense"):
    """Per-block sums of one micro-batch for every row of ``cols``.

    The GPT block with default options is exactly Calculon's layer sequence.
    A LLaMA block (``model.block == "llama"``) has RMSNorm, rotary embeddings,
    grouped-query attention (``kv_heads``), no dropout and a SwiGLU MLP whose
    first matrix is two matrices wide.  ``attention_impl`` replaces the
    attention core by a fused softmax or a FlashAttention kernel, and
    ``fused_norm`` the norm by a fused kernel.

    ``kind == "moe"`` (a model with ``moe``): the MLP is the shared experts
    (a dense MLP of ``shared_feedforward``, absent when 0) followed by the
    routed experts (``autopar.model.moe``).  A model with ``mla`` has
    multi-head latent attention.  A hybrid model's block is one layer of
    ``kind`` "mamba", "gdn", "attention", "mlp" or "moe" (``_hybrid_layer``).
    """
    m = ctx.model
    x = block_inputs(ctx, cols)
    if m.hybrid_pattern:
        seq, core_layers = _hybrid_layer(ctx, cols, x, kind)
        q_width, kv_width = float(m.attn_heads) * float(m.attn_size) / ctx.tp, x.kv_width
        n_attn = len(seq) if kind == "attention" else 0
        # (a hybrid layer is all mixer or all rest for the CUDA graphs' split)
        n_mixer = len(seq) if kind in ("attention", "mamba", "gdn") else 0
    else:
        if m.mla is not None:
            seq, core_layers, q_width, kv_width = mla_attention(ctx, x)
        else:
            seq, core_layers = _attention(ctx, x)
            q_width, kv_width = float(m.attn_heads) * float(m.attn_size) / ctx.tp, x.kv_width
        n_attn = n_mixer = len(seq)
        moe = kind == "moe"
        f = float(m.moe.shared_feedforward) if moe else float(m.feedforward)
        seq += _mlp(ctx, x, f)
        if moe:
            seq += routed_experts(ctx, cols, x)
        if not x.llama:
            seq.append((dropout(ctx, x.A_tp, **x.full), True))
        seq.append((residual(ctx, x.A_tp, x.A_tp, **x.full, **x.shared_input), True))
    acc = accumulate(ctx, cols, seq, x.recompute_full, offload_masks(cols, m))
    if ctx.selective_saves != "layers" and x.llama and not m.hybrid_pattern \
            and m.mla is None and kind != "moe" and np.any(x.mlp_only):
        # (the policy's matmul order is a Llama block's: other blocks keep
        # the model's own count)
        rows = x.mlp_only & ctx.training
        kept = op_policy_saves(ctx, x, eager=ctx.selective_saves == "op_eager")
        acc = replace(acc, act_storage=np.where(rows, kept, acc.act_storage),
                      act_storage_all=np.where(rows, kept, acc.act_storage_all))
    # The attention core's own times, which the K/V exchange can hide behind.
    attn_fw, attn_bw = ctx.zeros.copy(), ctx.zeros.copy()
    for L, present in core_layers:
        if "time_fw" not in L:          # no row has it
            continue
        attn_fw += np.where(present, L["time_fw"], 0.0)
        attn_bw += np.where(present, L["time_agrad"] + L["time_wgrad"], 0.0)
    cx = context_exchange(ctx, cols, x.mbs, x.sq, q_width, kv_width, attn_fw, attn_bw,
                          x.recompute_attn)
    return replace(acc, cp_fw_link=cx.fw_link, cp_fw_exp=cx.fw_exp, cp_bw_link=cx.bw_link,
                   cp_bw_exp=cx.bw_exp, cp_re_exp=cx.re_exp, cp_fw_size=cx.fw_size,
                   **framework_terms(ctx, seq[:n_attn], seq[n_attn:], n_mixer))


def framework_terms(ctx: LayoutContext, attn_layers, rest_layers, n_mixer=None) -> dict:
    """The block's sums of two framework memory terms (``BlockSums``), used
    only where the framework's ``memory_overhead`` asks for them:

    * ``dummy_attn`` / ``dummy_rest``: bytes of Transformer Engine's cached
      dummy weight gradients (``memory_overhead.dummy_wgrad``).  With
      Megatron's gradient-accumulation fusion (on by default) a TE linear
      layer writes its weight gradient into the fp32 ``main_grad`` and
      returns to autograd a placeholder of the weight's shape and dtype from
      ``get_dummy_wgrad``, which allocates one tensor per distinct
      (shape, dtype) and keeps it (NVIDIA/TransformerEngine v2.11
      transformer_engine/pytorch/module/base.py ``get_dummy_wgrad``; called
      from module/linear.py, layernorm_linear.py and grouped_linear.py
      backward, ``fuse_wgrad_accumulation``).  A block's GEMM weights have
      distinct shapes (the fused QKV, the output projection, the MLP's two;
      a grouped GEMM's experts share one shape each), so a block kind holds
      one copy of its trained GEMM weights in the working precision, a
      grouped GEMM one expert's.  The attention's are apart because every
      block kind of a model shares them.  The MoE router's weight is
      Megatron's own parameter (megatron/core/transformer/moe/router.py),
      not a TE module: not counted.
    * ``op_grads``: the largest input gradient + output gradient of one op
      of the block in backward (bytes), what autograd holds beside the saved
      activations while the op runs (``memory_overhead.backward_transient``
      "op"; each gradient is freed once the op before has consumed it), less
      the op's output where the op after it saved that as its input: that
      op has run its backward and released it (the SwiGLU's output, saved by
      the second MLP GEMM, is gone when the SwiGLU's backward holds its two
      gradients).
    * ``op_grads_mixer`` / ``op_grads_rest`` (only under
      ``memory_overhead.cuda_graphs`` "scoped"): that op over the block's
      first ``n_mixer`` layers (the attention, or a hybrid model's mixer
      layer: attention, Mamba, Gated DeltaNet) and over the rest (the MLP,
      the experts).  The stage holds the largest of each, added
      (memory._stage): one part runs in CUDA graphs captured into one shared
      memory pool, the other eagerly from PyTorch's caching allocator, and
      neither reuses the other's free blocks (NVIDIA/TransformerEngine
      transformer_engine/pytorch/graph.py ``_make_graphed_callables``: every
      capture ``pool=mempool``, one pool for all the callables; a private
      graph pool serves only captures into it), so the pool keeps, beside
      the saved activations, its own largest backward op while the eager
      part's runs.
    """
    b = ctx.elem_bytes
    tr = ctx.training

    def dummy(layers):
        total = ctx.zeros.copy()
        for L, present in layers:
            if not L["matrix"] or not L.get("dummy_wgrad", True):
                continue
            w = L["weight_grads"] / L["groups"] if "groups" in L else L["weight_grads"]
            total += np.where(present & tr, w, 0.0)
        return total * b

    out = {}
    if ctx.dummy_wgrad:
        out["dummy_attn"], out["dummy_rest"] = dummy(attn_layers), dummy(rest_layers)
    if ctx.backward_by_op:
        # the largest op of the mixer part and of the rest
        layers = list(attn_layers) + list(rest_layers)
        n_mixer = len(attn_layers) if n_mixer is None else n_mixer
        op = {True: ctx.zeros.copy(), False: ctx.zeros.copy()}
        kept_next = ctx.zeros.copy()    # what the next present layer saved of its input
        for i in reversed(range(len(layers))):
            L, present = layers[i]
            freed = np.minimum(L["outputs"] * b, kept_next)
            mixer = i < n_mixer
            op[mixer] = np.maximum(op[mixer], np.where(
                present & tr, (L["inputs"] + L["act_grads"]) * b - freed, 0.0))
            kept_next = np.where(present, np.where(L["stored"], L["act_b"], 0.0), kept_next)
        out["op_grads"] = np.maximum(op[True], op[False])
        if ctx.cuda_graphs == "scoped":
            out["op_grads_mixer"], out["op_grads_rest"] = op[True], op[False]
    return out


def op_policy_saves(ctx: LayoutContext, x: BlockInputs, eager: bool):
    """Bytes one dense block keeps for backward per micro-batch under
    torchtitan's per-op selective activation checkpointing
    (``memory_overhead.selective_saves``; pytorch/torchtitan
    torchtitan/parallelisms/parallelize_llama.py ``_save_list`` and
    ``_apply_ac_to_transformer_block`` at 9dec370, torchtitan/distributed/
    activation_checkpoint.py now): the policy saves the outputs of the SDPA
    kernels (the attention output and its fp32 log-sum-exp per head), of the
    reduce-scatters and of every odd-numbered ``aten.mm`` of the block, and
    recomputes every other op; the checkpoint's input is kept.  A Llama
    block's matmuls run wq, wk, wv, wo, w1, w3, w2, so it keeps the block's
    input, wq's and wv's outputs, the attention output, w1's output and,
    run eagerly, w2's output (whole partial sums under tensor parallelism,
    before their reduce-scatter); under torch.compile the partitioner drops
    w2's output, which no backward reads.  With sequence parallelism the
    input and the reduce-scatters' outputs are split over tensor_par.
    Measured with PyTorch on CPU (benchmarks/memory_sac_torch.py):
    tensor_par 1 only; float8's ``_scaled_mm`` is not ``aten.mm``, so the
    count is the bf16 one."""
    m = ctx.model
    tp = ctx.tp
    q = float(m.attn_heads) * float(m.attn_size) / tp
    ff = float(m.feedforward) / tp
    B = x.B
    rs = masked(2.0 * B * float(m.hidden) / tp, ctx.tp_rs_ag & (tp > 1))
    elems = x.A_tp + B * (q + x.kv_width + q + ff) + rs
    if eager:
        elems = elems + x.A
    lse = B * float(m.attn_heads) / tp * 4.0
    return elems * ctx.elem_bytes + lse


def _hybrid_layer(ctx: LayoutContext, cols: dict, x: BlockInputs, kind: str):
    """One layer of a hybrid model (``autopar.model.mamba``): a pre-norm
    residual layer holding only a Mamba-2 mixer, only a Gated DeltaNet
    (``autopar.model.gated_delta``), only attention, only an MLP or only a
    mixture of experts (its shared experts, then the routed ones); the layers
    and the attention core's, as (layer, rows that have it) pairs."""
    m = ctx.model
    core_layers = []
    if kind == "attention":
        seq, core_layers = _attention(ctx, x)       # (with its dropout)
        if m.attention_output_gate:
            seq = seq + _output_gate(ctx, x)
    else:
        if kind == "mamba":
            seq = mamba_mixer(ctx, x)
        elif kind == "gdn":
            seq = gdn_mixer(ctx, x)
        elif kind == "mlp":
            seq = _mlp(ctx, x, float(m.feedforward), after_attention=False)
        elif kind == "moe":
            seq = (_mlp(ctx, x, float(m.moe.shared_feedforward), after_attention=False)
                   + routed_experts(ctx, cols, x))
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
        if not x.llama:
            seq.append((dropout(ctx, x.A_tp, **x.full), True))
    seq.append((residual(ctx, x.A_tp, x.A_tp, **x.full, **x.shared_input), True))
    return seq, core_layers


def _output_gate(ctx: LayoutContext, x: BlockInputs) -> list:
    """Gated attention (Megatron-Core ``attention_output_gate``,
    NVIDIA/Megatron-LM@2a75ac1 ``megatron/core/transformer/attention.py``:
    ``linear_qkv`` also gives a gate per query element, and the core
    attention's output is multiplied by its sigmoid before ``linear_proj``):
    the gate's columns of the projection (``h -> H d / t``, on the same
    gathered input as q, k, v) and the product, which keeps the gate and the
    attention output."""
    m = ctx.model
    h, B = float(m.hidden), x.B
    q = float(m.attn_heads) * float(m.attn_size) / ctx.tp
    gate = layer(ctx, fw=B * q * (4.0 + 1.0), agrad=B * q * (5.0 + 2.0), inputs=B * 2 * q,
                 outputs=B * q, act=B * 2 * q, act_grads=B * q, recompute=x.recompute_full)
    return [(fp8_gemm(ctx, linear(ctx, B, h, q, **x.full, **x.shared_input)), True),
            (gate, True)]


def _attention(ctx: LayoutContext, x: BlockInputs):
    """The attention half of the block, up to (not including) its residual,
    and the layers of its core (which a K/V exchange can hide behind), as
    (layer, rows that have it) pairs."""
    m = ctx.model
    h, s, H, d = float(m.hidden), float(m.seq_size), float(m.attn_heads), float(m.attn_size)
    KV = float(m.kv_heads or m.attn_heads)
    tp = ctx.tp
    A, A_tp, B, mbs, sq, kv = x.A, x.A_tp, x.B, x.mbs, x.sq, x.kv_width
    full, attn, shared_input = x.full, x.attn, x.shared_input
    separate, overlapped, multiquery = x.tp_separate, x.tp_overlapped, x.multiquery
    heads_tp = H / tp
    scores = heads_tp * sq * s * mbs
    g = partial(fp8_gemm, ctx)          # a GEMM of the block: fp8 where the recipe says so
    seq = [
        (fork(ctx, A_tp, 2, **full, stored=True), True),
        (x.norm(ctx, A_tp, h, x.fused_norm, **full, **shared_input), True),
        (tp_collective(ctx, A, False, recomm=x.regather_attn, stored=x.keep_shard_attn),
         separate),
        (fork(ctx, A, 3, recompute=x.regather_attn, stored=x.keep_qkv_input), separate),
        (g(linear(ctx, B, h, H * d / tp, **full, **shared_input)), separate),
        (g(projections(tp_overlapped_linear(ctx, B, h, (H + 2 * KV) * d, False,
                                            x.recompute_full, x.regather_attn),
                       (H, KV, KV))), overlapped & ~multiquery),
        (g(tp_overlapped_linear(ctx, B, h, H * d, False, x.recompute_full, x.regather_attn)),
         overlapped & multiquery),
        (fork(ctx, A, 2, recompute=x.regather_attn, stored=~x.regather_attn),
         overlapped & multiquery),
        (g(linear(ctx, B, h, kv, **full, **shared_input)), separate | multiquery),
        (g(linear(ctx, B, h, kv, **full, **shared_input)), separate | multiquery),
    ]
    seq += adapter_layers(ctx, B, (("q", h, H * d / tp), ("k", h, kv), ("v", h, kv),
                                   ("qkv", h, H * d / tp + 2 * kv)), **full)
    if x.llama:
        seq.append((rotary(ctx, B * (H * d / tp + kv), **attn), True))
    core, kept = x.core, ~x.recompute_attn
    core_layers = [
        (batched_matmul(ctx, mbs * heads_tp, sq, d, s, **attn, out_stored=kept), core),
        (softmax(ctx, scores, x.impl, x.llama, **attn, out_stored=kept), core),
    ]
    if not x.llama:
        core_layers.append((dropout(ctx, scores, **attn, stored=kept), core))
    core_layers += [
        (batched_matmul(ctx, mbs * heads_tp, sq, s, d, **full), core),
        (flash_attention(ctx, mbs, heads_tp, sq, d, kv, x.impl, sk=x.span, **full), x.flash),
    ]
    seq += offload_group(core_layers, "core_attn")
    # Context parallelism's merges and copies beside the kernel (TE's CP
    # attention function; after the ring, so not hiding its transfers).
    seq.append((context_parallel_elementwise(ctx, mbs, heads_tp, sq, d, kv, **full),
                x.flash & (ctx.cp > 1)))
    seq += [
        (offload_group(original_input(ctx, g(linear(ctx, B, H * d / tp, h, **full))),
                       "attn_proj"), separate),
        (tp_collective(ctx, A, True, recomm=x.recompute_full, stored=False), separate),
        (offload_group(original_input(ctx, g(tp_overlapped_linear(
            ctx, B, H * d, h, True, x.recompute_full, x.recompute_full))), "attn_proj"),
         overlapped),
    ]
    seq += adapter_layers(ctx, B, (("o", H * d / tp, h),), **full)
    if not x.llama:
        seq.append((dropout(ctx, A_tp, **full), True))
    return seq, core_layers


def _mlp(ctx: LayoutContext, x: BlockInputs, f: float, after_attention: bool = True) -> list:
    """The attention's residual (``after_attention``: in the attention + MLP
    block) and the MLP half of the block of feed-forward width ``f`` (none
    when 0), up to (not including) its dropout and residual, as (layer, rows
    that have it) pairs."""
    h, tp = float(ctx.model.hidden), ctx.tp
    A, A_tp, B = x.A, x.A_tp, x.B
    full, shared_input = x.full, x.shared_input
    separate, overlapped = x.tp_separate, x.tp_overlapped
    ff_in = 2 * f if x.llama else f           # SwiGLU: gate and up projections
    gate_up = (1.0, 1.0) if x.llama else (1.0,)
    g = partial(fp8_gemm, ctx)
    seq = [
        (residual(ctx, A_tp, A_tp, **full, **shared_input), after_attention),
        (fork(ctx, A_tp, 2, **full, stored=True), True),
        (x.norm(ctx, A_tp, h, x.fused_norm, **full, **shared_input), True),
    ]
    if f > 0:
        seq += [
            (tp_collective(ctx, A, False, recomm=x.regather_mlp, stored=x.keep_shard_mlp),
             separate),
            (g(projections(linear(ctx, B, h, ff_in / tp, recompute=x.recompute_mlp,
                                  stored=~x.regather_mlp), gate_up)), separate),
            (g(projections(tp_overlapped_linear(ctx, B, h, ff_in, False, x.recompute_mlp,
                                                x.regather_mlp), gate_up)), overlapped),
            *adapter_layers(ctx, B, (("mlp", h, ff_in / tp),), recompute=x.recompute_mlp),
            ((swiglu if x.llama else gelu)(ctx, f * B / tp, x.fused, recompute=x.recompute_mlp,
                                           stored=~x.mlp_only), True),
            (g(linear(ctx, B, f / tp, h, **full, stored=~x.mlp_only)), separate),
            (tp_collective(ctx, A, True, recomm=x.recompute_full, stored=False), separate),
            (g(tp_overlapped_linear(ctx, B, f, h, True, x.recompute_full, x.recompute_full)),
             overlapped),
            *adapter_layers(ctx, B, (("mlp", f / tp, h),), **full),
        ]
    return seq


def offload_masks(cols: dict, model) -> dict | None:
    """{module: rows that offload it} for the ``activation_offload_modules``
    that some row of ``cols`` sets, or None where none does (every row as
    Calculon: no ``act_offload`` sum)."""
    codes = cols.get("activation_offload_modules") if hasattr(cols, "get") else None
    if codes is None or not np.any(codes):
        return None
    training = np.asarray(cols["training"], dtype=bool)
    return {name: offload_module_mask(codes, name) & training for name in OFFLOAD_MODULES}


# The sums the layers add up (the others are set after the sum: the K/V
# exchange, the stored activations of a whole block, the gathered weights,
# the offloaded modules' saved tensors).
_ACCUMULATED = tuple(name for name in BlockSums.__dataclass_fields__
                     if name not in ("act_offload", "bw_offload", "fw_offload_window",
                                     "act_offload_max",
                                     "act_storage_all",
                                     "weight_space_full", "weight_unkept_full", "cp_fw_link",
                                     "cp_fw_exp", "cp_bw_link", "cp_bw_exp", "cp_re_exp",
                                     "cp_fw_size", "dummy_attn", "dummy_rest", "op_grads",
                                     "op_grads_mixer", "op_grads_rest"))


def _rows_of(mask):
    """True if ``mask`` holds for every row, False for none, else the mask."""
    mask = np.asarray(mask)
    if mask.all():
        return True
    return mask if mask.any() else False


def accumulate(ctx: LayoutContext, cols: dict, seq, recompute_full,
               offload: dict | None = None) -> BlockSums:
    """Per-block sums over the layer sequence, for one micro-batch;
    ``offload`` ({module: rows}, ``offload_masks``): also ``act_offload``,
    the stored activations of the layers of the offloaded modules."""
    z = ctx.zeros
    acc = BlockSums(**{name: z.copy() for name in _ACCUMULATED})
    if offload is not None:
        acc.act_offload, acc.bw_offload = z.copy(), z.copy()
    tr = ctx.training
    for L, present in seq:
        p = np.broadcast_to(present, z.shape)
        if not p.any():
            continue
        finish(ctx, L)
        pt = p & tr

        # Each mask classified once per layer: every row, none, or some.
        on, on_t = _rows_of(p), _rows_of(pt)

        def add(total, val, which=on):
            """``total += val`` in place, on the rows ``which``."""
            if which is True:
                total += val
            elif which is not False:
                total += np.where(which, val, 0.0)

        add(acc.fw_flops, L["fw"])
        add(acc.fw_flops_time, L["flops_time_fw"])
        add(acc.fw_mem, L["mem_fw"])
        add(acc.fw_mem_time, L["mem_time_fw"])
        add(acc.fw_time, L["time_fw"])
        add(acc.useful_fw, L["fw"])
        add(acc.base_fw_tp_size, L["comm_bytes_fw_base"])
        add(acc.base_fw_tp_time, L["comm_time_fw_base"])
        add(acc.base_fw_tp_exp, L["exposed_fw_base"])
        add(acc.edge_fw_tp_size, L["comm_bytes_fw_edge"])
        add(acc.edge_fw_tp_time, L["comm_time_fw_edge"])
        add(acc.edge_fw_tp_exp, L["exposed_fw_edge"])
        acc.tp_bw_req = np.maximum(acc.tp_bw_req, np.where(p, L["tp_bw_req_fw"], 0.0))
        # Calculon adds the running forward totals (not the layer's own) to the
        # recompute sums; its recompute time is the layer's own.
        r = _rows_of(pt & L["recompute"])
        add(acc.re_flops, acc.fw_flops, r)
        add(acc.re_flops_time, acc.fw_flops_time, r)
        add(acc.re_mem, acc.fw_mem, r)
        add(acc.re_mem_time, acc.fw_mem_time, r)
        add(acc.re_time, L["time_fw"], r)
        rc = _rows_of(pt & L["recomm"])
        add(acc.base_recomm_size, L["comm_bytes_wgrad_base"], rc)
        add(acc.base_recomm_time, L["comm_time_wgrad_base"], rc)
        add(acc.base_recomm_exp, L["exposed_wgrad_base"], rc)
        add(acc.base_agrad_tp_size, L["comm_bytes_agrad_base"], on_t)
        add(acc.base_agrad_tp_time, L["comm_time_agrad_base"], on_t)
        add(acc.base_agrad_tp_exp, L["exposed_agrad_base"], on_t)
        add(acc.edge_recomm_size, L["comm_bytes_wgrad_edge"], rc)
        add(acc.edge_recomm_time, L["comm_time_wgrad_edge"], rc)
        add(acc.edge_recomm_exp, L["exposed_wgrad_edge"], rc)
        add(acc.edge_agrad_tp_size, L["comm_bytes_agrad_edge"], on_t)
        add(acc.edge_agrad_tp_time, L["comm_time_agrad_edge"], on_t)
        add(acc.edge_agrad_tp_exp, L["exposed_agrad_edge"], on_t)
        add(acc.agrad_flops, L["agrad"], on_t)
        add(acc.agrad_flops_time, L["flops_time_agrad"], on_t)
        add(acc.agrad_mem, L["mem_agrad"], on_t)
        add(acc.agrad_mem_time, L["mem_time_agrad"], on_t)
        add(acc.agrad_time, L["time_agrad"], on_t)
        add(acc.wgrad_flops, L["wgrad"], on_t)
        add(acc.wgrad_flops_time, L["flops_time_wgrad"], on_t)
        add(acc.wgrad_mem, L["mem_wgrad"], on_t)
        add(acc.wgrad_mem_time, L["mem_time_wgrad"], on_t)
        add(acc.wgrad_time, L["time_wgrad"], on_t)
        add(acc.optim_flops, L["optim_flops"], on_t)
        add(acc.optim_flops_time, L["flops_time_optim"], on_t)
        add(acc.optim_mem, L["mem_optim"], on_t)
        add(acc.optim_mem_time, L["mem_time_optim"], on_t)
        add(acc.optim_time, L["time_optim"], on_t)
        add(acc.useful_bw, L["agrad"] + L["wgrad"], on_t)
        acc.tp_bw_req = np.maximum(acc.tp_bw_req, np.where(pt, L["tp_bw_req_agrad"], 0.0))
        add(acc.weight_space, L["weight_b"])
        if "unkept_b" in L:
            add(acc.weight_unkept, L["unkept_b"])
            if L["expert"]:
                add(acc.x_weight_unkept, L["unkept_b"])
        if "copy_b" in L:
            add(acc.weight_copies, L["copy_b"])
            if "unsent_b" in L:
                add(acc.weight_unsent, L["unsent_b"])
            if L["expert"]:
                add(acc.x_weight_copies, L["copy_b"])
                if "unsent_b" in L:
                    add(acc.x_weight_unsent, L["unsent_b"])
        add(acc.act_working, L["act_b"], _rows_of(p & ~L["reused"]))
        group = offload is not None and L.get("offload_module")
        if group:
            before = acc.act_storage.copy()
        add(acc.act_storage, L["act_b"])
        add(acc.act_storage, -L["out_b"], _rows_of(pt & ~L["out_stored"]))
        add(acc.act_storage, -L["act_b"], _rows_of(pt & ~L["stored"]))
        if "keep_b" in L:       # intermediates a kernel keeps beyond Calculon's count
            add(acc.act_storage, L["keep_b"])
            add(acc.act_working, L["keep_b"])
        if group:
            rows = _rows_of(pt & np.logical_or.reduce([offload[m] for m in group]))
            add(acc.act_offload, acc.act_storage - before, rows)
            add(acc.bw_offload, L["time_agrad"] + L["time_wgrad"], rows)
        add(acc.wgrad_space, L["wgrad_sh"], on_t)
        add(acc.wgrad_space_full, L["wgrad_full"], on_t)
        add(acc.act_grad_space, L["agrad_b"], on_t)
        add(acc.optimizer_space, L["optimizer"], on_t)
        if L["expert"]:
            add(acc.x_weight_space, L["weight_b"])
            add(acc.x_wgrad_space, L["wgrad_sh"], on_t)
            add(acc.x_optimizer_space, L["optimizer"], on_t)
        if "ep_link_total" in L:
            add(acc.ep_link, np.where(tr, L["ep_link_total"], L["ep_link_total"] / 2))
            add(acc.ep_exposed, np.where(tr, L["ep_exposed_total"], L["time_fw"]))
    # What a block keeps when it does not recompute (for recompute_layers).
    acc.act_storage_all = acc.act_storage
    acc.act_storage = np.where(recompute_full, 0.0, acc.act_storage)
    if offload is not None:
        acc.act_offload = np.minimum(np.where(recompute_full, 0.0, acc.act_offload),
                                     acc.act_storage)
        acc.fw_offload_window = acc.fw_time.copy()
        acc.act_offload_max = acc.act_offload
    return acc


# Batch level: pipeline schedule, bubbles, DP communication, offload, memory.


def head_microbatch_time(ctx: LayoutContext, B) -> np.ndarray:
    """Seconds of the output layer and its loss (and the multi-token-prediction
    modules) for one micro-batch of ``B`` tokens; a model with a vocabulary.
    It depends on the block's columns only, so ``BlockCache`` computes it once
    per distinct block."""
    V = float(ctx.model.vocab_size)
    training = ctx.training
    out = finish(ctx, linear(ctx, B, float(ctx.model.hidden), V / ctx.tp))
    logits = B * V / ctx.tp
    loss = finish(ctx, layer(ctx, fw=5 * logits, agrad=3 * logits, inputs=logits,
                             outputs=logits))
    out_wgrad = out["time_wgrad"]
    if ctx.frozen is not None:
        # A frozen output layer (fine-tuning with adapters) skips its
        # weight-gradient GEMM.
        out_wgrad = out_wgrad * ctx.trainable
    per_mb = out["time_fw"] + loss["time_fw"] + np.where(
        training, out["time_agrad"] + out_wgrad + loss["time_agrad"], 0.0)
    mtp = ctx.model.mtp
    if mtp:
        # Each multi-token-prediction module projects [hidden; embedding]
        # (2 x hidden) back to hidden and passes the output layer again.
        proj = finish(ctx, linear(ctx, B, 2.0 * ctx.model.hidden, ctx.model.hidden))
        per_mb = per_mb * (1 + mtp) + mtp * (proj["time_fw"] + np.where(
            training, proj["time_agrad"] + proj["time_wgrad"], 0.0))
    return per_mb


def head_time(ctx: LayoutContext, microbatches, stages, per_mb):
    """Time of the output layer with its loss over one batch (0 without a
    vocabulary): it runs on the last pipeline stage for every micro-batch;
    that stage paces the pipeline, so the extra time is paid in each of the
    ``microbatches + stages - 1`` schedule slots.  ``per_mb``:
    ``head_microbatch_time`` of the rows (``BlockCache.head``)."""
    if float(ctx.model.vocab_size) <= 0:
        return 0.0
    return (microbatches + stages - 1) * per_mb


def head_memory(ctx: LayoutContext, cols: dict, acts: ActivationSizes, stages,
                system: SystemSpec):
    """Memory of the embedding and the output layer with its loss.

    Only for models that give ``vocab_size`` (Calculon models none).  The
    first stage holds the embedding, the last the output matrix and one
    micro-batch's logits (with the fp32 copies the system's
    ``memory_overhead`` says the loss keeps); with one stage, both.
    """
    V = float(ctx.model.vocab_size)
    if V <= 0:
        return {"first": 0.0, "last": 0.0, "op_grads": 0.0, "trained_first": 0.0,
                "trained_last": 0.0,
                "logits": {"total": 0.0, "fp32_copies": 0.0, "fp32_copy": 0.0}}
    tp, b = ctx.tp, ctx.elem_bytes
    B = acts.B
    mtp = ctx.model.mtp
    params = V * ctx.model.hidden / tp
    grad_b = b
    if "fp32_grads" in cols and np.any(cols["fp32_grads"]):
        # Megatron's fp32 main_grad (b + (4 - b) * mask: exact for the byte
        # counts, and a fifth of the time of np.where on a mask that changes
        # from row to row)
        grad_b = b + (4.0 - b) * cols["fp32_grads"]
    # (grad_shards is 1 where the gradients stay whole: x / 1.0 is x)
    grads = grad_b / ctx.grad_shards
    over = system.memory_overhead or MemoryOverhead()
    whole_grads = whole_pipeline_grads(over, stages, ctx)
    if whole_grads is not None:
        # Whole gradients between a pipelined step's micro-batches.
        grads = np.where(whole_grads, grad_b, grads)
    # moments (autopar.model.optimizers: Adam's two) + master copy
    moments = head_state_bytes(ctx) * (ctx.moment_bytes / 4.0)
    optim_b = np.where(b < 4, moments + ctx.master_bytes, moments)
    trained = grads + optim_b / ctx.optim_shards
    if ctx.frozen is not None:
        # Frozen (adapters): the weights only.
        trained = trained * ctx.trainable
    held_b, gathered = b, 0.0
    if over.head_weights_sharded and np.any(ctx.weight_shards > 1):
        # Megatron-FSDP: each matrix held sharded over the weight shards,
        # the output layer's gathered whole at the last stage's peak
        # (memory_overhead.head_weights_sharded)
        sharded = ctx.weight_shards > 1
        held_b = np.where(sharded, b / ctx.weight_shards, b)
        gathered = np.where(sharded, params * b, 0.0)
    per_param = held_b + ctx.if_training(trained)
    matrix = params * per_param
    whole = B * V / (1.0 if over.logits_gathered else tp)
    copy = ctx.if_training(whole * 4.0)
    copies = over.logits_fp32_copies * copy
    last = matrix * (1.0 + (stages == 1)) + gathered     # both matrices on a single stage
    if mtp:
        # each module's projection of [hidden; embedding] (2 x hidden) to
        # hidden; one module's with ``mtp_repeated`` (moe.mtp_layers)
        held = 1 if ctx.model.mtp_repeated else mtp
        last = last + 2.0 * ctx.model.hidden * ctx.model.hidden * held * per_param
    if over.dummy_wgrad:
        # The output layer's cached dummy weight gradient: Megatron's
        # column-parallel output layer takes its placeholder from TE's
        # get_dummy_wgrad when TE is installed (megatron/core/tensor_parallel/
        # layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward);
        # the embedding's gradient is a plain one, freed after it is added.
        dummy = ctx.if_training(params * b)
        last = last + (dummy * ctx.trainable if ctx.frozen is not None else dummy)
    logits = whole * b
    if over.logits_kept == "pipelined":
        # The working-datatype logits are freed before the loss's backward
        # unless a pipeline stage caches them as its output (the fp32 copies
        # then stand for the whole peak).
        logits = masked(logits, ~ctx.training | (stages > 1))
    if mtp:
        # Each MTP depth's loss keeps its logits-sized tensor (working
        # precision) until backward: NVIDIA/Megatron-LM@2a75ac1
        # multi_token_prediction.py ``process_mtp_loss`` computes every
        # depth's logits and loss in the forward and ties the loss to the
        # hidden states (``MTPLossAutoScaler``), and the fused cross entropy
        # keeps the logits' gradient in their place for the backward.
        logits = logits + ctx.if_training(mtp * whole * b)
    out = {"first": matrix, "last": last,
           "logits": {"total": logits + copies, "fp32_copies": copies, "fp32_copy": copy}}
    if over.backward_transient == "op":
        # the output layer's input gradient: its op in backward, the logits'
        # gradient being the logits, in place (memory._stage)
        out["op_grads"] = ctx.if_training(B * ctx.model.hidden * b)
    if over.optimizer_step_bytes:
        # Parameters of the embedding / output matrix the optimizer steps
        # (none where they are frozen; before sharding and the training
        # mask: memory.trained_parameters)
        trained = params if ctx.frozen is None else params * ctx.trainable
        out["trained_first"] = trained
        out["trained_last"] = trained * (1.0 + (stages == 1))
    return out
