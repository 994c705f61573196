"""DeepSeek Sparse Attention (DSA): the lightning indexer and the attention
over the keys it chooses, as layers of an MLA block (``mla.sparse_index``,
``autopar.io.specs.SparseIndexSpec``; DeepSeek-V3.2, GLM-5).

Counted from Megatron-Core's implementation (NVIDIA/Megatron-LM at 2a75ac1,
the commit Megatron-Bridge 067f987 pins;
megatron/core/transformer/experimental_attention_variant/):

* dsa.py ``DSAIndexer.forward_before_topk``: on the block's input ``x`` and
  the compressed query ``qr`` (both detached: no gradient flows back into
  the block through the indexer), three projections duplicated on every
  tensor-parallel rank (``parallel_mode="duplicated"``): ``linear_wq_b``
  (q_lora_rank -> n_heads x head_dim), ``linear_wk`` (hidden -> head_dim)
  with a LayerNorm ``k_norm``, ``linear_weights_proj`` (hidden -> n_heads);
  the rotary embedding on the first ``qk_rope_head_dim`` of each query and
  key.  With sequence parallelism the indexer gathers the sequence, so every
  tensor-parallel rank runs it on all the tokens of its context-parallel
  share; with context parallelism the indexer's keys are all-gathered.
* ``_compute_index_scores`` / ``fused_qk_topk_naive``: for each query, one
  score per earlier key, ``sum_h w_h relu(q_h . k)`` (2 x n_heads x head_dim
  FLOPs per query-key pair, plus relu, the weighting and the head sum), then
  ``topk`` of the scores.  The kernels walk only the causal keys (the
  ``starts``/``ends`` bounds of ``dsa_masking.build_fused_indexer_varlen_bounds``):
  executed work is half the dense count, as a causal FlashAttention's.
* Training with ``dsa_indexer_loss_coeff`` > 0 (Bridge's GLM-5 bridge: 0.001,
  sparse loss): ``FusedDSAIndexerLoss`` saves the indexer's q, weights and
  keys and the top-k indices (``save_for_backward``), and its forward
  computes the KL target, the attention's own scores at the top-k keys
  (``compute_dsa_indexer_loss``: query . key over the chosen keys, every
  head).  Its backward (``bwd_fused_indexer_loss_naive``; the cuDNN backend's
  ``dense_indexer_backward_wrapper`` and ``sparse_attn_score_recompute_wrapper``)
  recomputes the index scores over all keys and the target scores at the
  top-k keys, then takes the gradients of q and k (two more products of the
  index-score size): 3 x the score GEMM and 1 x the target's.
* absorbed_mla.py ``AbsorbedMLASelfAttention`` (the DSA spec's attention,
  experimental_attention_variant_module_specs.py): the key up projection is
  absorbed into the query (one einsum per head, nope -> kv_lora_rank) and the
  value up projection applied to the kernel's latent output (kv_lora_rank ->
  v_head_dim per head); together the same FLOPs and weights as MLA's joint
  K/V up projection on the same tokens, which ``mla_attention`` keeps.  The
  sparse kernel (FlashMLA's sparse prefill through dsa_cudnn_kernels.py /
  dsa_kernels.py) attends each head's absorbed query (kv_lora_rank +
  qk_rope_head_dim) to the one shared latent key (the same width; its first
  kv_lora_rank are the value) at the chosen keys only: per query-key pair
  2 x (kv_lora_rank + qk_rope_head_dim) + 2 x kv_lora_rank FLOPs per head.

Megatron-LM's own FLOP count (megatron/training/training.py
``num_floating_point_operations``, both commits) counts DSA models as dense
MLA; autopar's MFU is its counted FLOPs over the batch time (what runs).
"""
from __future__ import annotations

import numpy as np

from autopar.model.context import LayoutContext
from autopar.model.layers import flash_attention, layer, layer_norm, rotary

# One comparison per score for the top-k selection, and relu, the head
# weight and the head sum per head and score (``_compute_index_scores``).
_SELECT_FLOPS = 1.0
_SCORE_VECTOR_FLOPS = 3.0
# The top-k indices as torch.topk returns them (int64; dsa.py
# ``fused_qk_topk_naive``), kept for the backward of the loss and the kernel.
_INDEX_BYTES = 8.0
# Executed share of the dense (all keys) score count: the causal keys.
_CAUSAL = 0.5


def sparse_keys(topk, s):
    """Keys a query attends to on average under DSA: the query at position
    p (0-based) of a causal sequence of ``s`` attends to min(p + 1, topk)."""
    s = np.asarray(s, dtype=float)
    k = np.minimum(float(topk), s)
    return (k * (k + 1) / 2 + (s - k) * k) / s


def indexer_layers(ctx: LayoutContext, rows, sq, keys, mbs, **kw):
    """The lightning indexer's layers for ``rows`` tokens (its queries; every
    tensor-parallel rank runs all of them), ``sq`` local queries per
    sequence attending to ``keys`` keys: its projections, the rotary
    embedding, and the index scores with the top-k selection (and, trained,
    the backward of the indexer loss).  ``kw``: the recompute keywords of
    the attention core (the indexer lives in Megatron's ``core_attention``)."""
    m, a = ctx.model, ctx.model.mla
    d = a.sparse_index
    h = float(m.hidden)
    qr = float(a.q_lora_rank or m.hidden)
    nh, dh, rope = float(d.n_heads), float(d.head_dim), float(a.qk_rope_head_dim)
    train = 1.0 if d.loss else 0.0

    def proj(n, k):
        # a duplicated linear layer on detached input: no activation
        # gradient; its weight gradient only where the indexer is trained
        f = 2 * rows * n * k
        return layer(ctx, fw=f, agrad=0.0, wgrad=train * f, inputs=rows * n,
                     outputs=rows * k, weight=n * k, weight_grads=train * n * k,
                     act=train * rows * n, act_grads=train * rows * k,
                     optim=2 * n * k, matrix=True, factored=n + k, **kw)

    out = [proj(qr, nh * dh), proj(h, dh)]
    norm = layer_norm(ctx, rows * dh, dh, True, **kw)
    out += [norm, proj(h, nh), rotary(ctx, rows * (nh + 1) * rope, **kw)]
    # The scores: one GEMM-like product over the (local queries x keys) per
    # head, the causal half executed; kept for the loss's backward: q,
    # weights and the gathered keys, and the top-k indices.
    pairs = mbs * sq * keys
    gemm = 2 * pairs * nh * dh
    S = layer(ctx, fw=gemm, agrad=train * 3 * gemm, inputs=rows * (nh * dh + nh) + mbs * keys * dh,
              outputs=rows * d.topk, act=train * (rows * (nh * dh + nh) + mbs * keys * dh),
              act_grads=0.0, matrix=True, **kw)
    S["keep_b"] = train * rows * d.topk * _INDEX_BYTES + ctx.zeros
    S["time_scale"] = _CAUSAL + ctx.zeros
    S["agrad_extra"] = ctx.zeros
    vec = pairs * (_SCORE_VECTOR_FLOPS * nh + _SELECT_FLOPS) * _CAUSAL
    sel = layer(ctx, fw=vec, agrad=train * vec, inputs=0.0, outputs=0.0, **kw)
    sel["mem_fw"] = sel["mem_agrad"] = ctx.zeros
    return out + [S, sel]


def sparse_core(ctx: LayoutContext, mbs, heads_tp, sq, span, impl, stored, **kw):
    """The attention over the chosen keys (FlashMLA's sparse kernel on the
    absorbed query and the shared latent key/value), and, trained with the
    indexer loss, the loss's target: the attention's scores at the chosen
    keys, computed in forward and again in backward.  ``kw``: the core's
    recompute keywords."""
    a = ctx.model.mla
    d = a.sparse_index
    kvr, rope = float(a.kv_lora_rank), float(a.qk_rope_head_dim)
    width = kvr + rope
    keys = sparse_keys(d.topk, span)
    core = flash_attention(ctx, mbs, heads_tp, sq, width, width, impl, sk=keys, dv=kvr,
                           kv_v=0.0, causal=False, stored=stored, **kw)
    layers = [core]
    if d.loss:
        f = 2 * mbs * heads_tp * sq * keys * width
        layers.append(layer(ctx, fw=f, agrad=f, matrix=True, **kw))
    return layers
