"""Hybrid state-space models: the Mamba-2 layer, and the layer kinds of a
hybrid pattern.

A model with ``hybrid_pattern`` (the model file's ``hybrid_override_pattern``,
Megatron-Core's notation: ``megatron/core/models/hybrid/
hybrid_layer_allocation.py``, ``Symbols``) is a stack of layers of four
kinds, one per block of the pipeline: ``M`` a Mamba-2 mixer, ``G`` a Gated
DeltaNet (``autopar.model.gated_delta``), ``*``
self-attention, ``-`` an MLP, ``E`` a mixture of experts.  Each layer is a
pre-norm residual layer of its own (Megatron's ``MambaLayer`` and the
``TransformerLayer`` with only attention or only an MLP): norm, mixer,
residual add.  ``autopar.model.block`` builds the attention, MLP and MoE
layers from its halves; this module builds the Mamba-2 mixer
(``mamba_mixer``) and says which kinds a model has (``layer_kinds``).

The Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", the SSD layer;
Megatron-Core ``megatron/core/ssm/mamba_mixer.py``, ``MambaMixer``), with
``h`` hidden, ``H`` heads of ``P`` (``d_inner = H x P``), ``G`` groups of
B and C with state ``N``, a causal convolution of kernel ``K`` and the SSD
chunk ``Q``, per processor of ``t``-way tensor parallelism (heads and groups
split over ``t``, as ``MambaMixer`` asserts):

* ``in_proj``: column-parallel linear ``h -> (2 d_inner + 2 G N + H) / t``
  (z, x, B, C, dt); with sequence parallelism its input is all-gathered
  first, as the attention's and the MLP's are;
* the causal depthwise ``conv1d`` over the ``(d_inner + 2 G N) / t``
  channels of x, B, C (kernel K, with bias), then SiLU;
* the SSD scan (``mamba_ssm/ops/triton/ssd_combined.py``,
  ``_mamba_chunk_scan_combined_fwd``, the paper's chunked algorithm, Sec. 6):
  per group ``C B^T`` within each chunk (``_bmm_chunk_fwd``: 2 Q N FLOPs a
  token); per head the decay-masked intra-chunk product with x
  (``_chunk_scan_fwd``'s diagonal block: 2 Q P a token), the chunk states
  ``B^T x`` (``_chunk_state_fwd``: 2 N P a token), the states passed from
  chunk to chunk (``_state_passing_fwd``: 2 N P a chunk) and their
  contribution to the outputs ``C h`` (2 N P a token).  Its backward
  computes the gradients of both operands of each product (twice the
  forward) and first recomputes ``C B^T``, the chunk states and their
  passing (``_mamba_chunk_scan_combined_bwd``);
* the gate ``y * SiLU(z)`` (inside the scan kernel, ``z=`` argument), the
  ``D`` skip and the ``dt`` softplus and cumulative decay (elementwise);
* the gated RMSNorm (``RMSNormGated``, ``norm_before_gate=False``: the norm
  of the gated output, one fused kernel);
* ``out_proj``: row-parallel linear ``d_inner / t -> h`` and its
  tensor-parallel reduce (all-reduce, or reduce-scatter with sequence
  parallelism), as the attention's output projection.

What training keeps for backward is what the fused function keeps
(``MambaSplitConv1dScanCombinedFn.forward``, ``ctx.save_for_backward``):
the in_proj output ``zxbcdt`` and the scan output before the gate
``out_x``; the convolution's output is recomputed in backward from
``zxbcdt`` (``causal_conv1d_fwd_function`` in its backward).  The norm
keeps its input, ``out_proj`` its input, ``in_proj`` its (gathered) input.
The recurrent state a layer carries between chunks is ``H P N`` values a
sequence (fp32 in the kernel); in training it lives only inside one pass
(the chunk states, counted as memory traffic of the scan).

Parameters (``MambaMixer.__init__``): in_proj ``h (2 d_inner + 2 G N + H)``,
conv1d ``(d_inner + 2 G N)(K + 1)`` (weight and bias), ``dt_bias``,
``A_log`` and ``D`` (``H`` each), the gated norm's weight ``d_inner``,
out_proj ``d_inner h``; and the layer's pre-norm.
"""
from __future__ import annotations

import numpy as np

from autopar.io.specs import HYBRID_SYMBOLS, ModelSpec
from autopar.model.block_inputs import BlockInputs
from autopar.model.communication import tp_collective, tp_overlapped_linear
from autopar.model.context import LayoutContext
from autopar.model.layers import fork, fp8_gemm, layer, linear, rms_norm

# Elementwise FLOPs per element (counted as the kernels compute them):
# SiLU x * sigmoid(x) = x / (1 + exp(-x)): negate, exp, add, divide;
# its gradient: sigmoid(x) * (1 + x (1 - sigmoid(x))): 4 more with the chain rule.
SILU_FW, SILU_BW = 4.0, 5.0
# The gate y * SiLU(z) (SiLU and a product) and the D skip (a multiply-add)
# per element of d_inner; per head and token, dt's bias and softplus
# log(1 + exp(x)) and the decay dt * A with its cumulative sum over the chunk.
_GATE_FW, _GATE_BW = SILU_FW + 1.0 + 2.0, SILU_BW + 2.0 + 2.0
_DT_FW, _DT_BW = 6.0, 8.0


def layer_kinds(model: ModelSpec) -> tuple[str, ...]:
    """The block kinds of a hybrid model, one per block (``HYBRID_SYMBOLS``)."""
    return tuple(HYBRID_SYMBOLS[c] for c in model.hybrid_pattern)


def hybrid_kinds(model: ModelSpec) -> tuple[str, ...]:
    """The distinct block kinds of a hybrid model, in ``HYBRID_SYMBOLS``' order."""
    present = set(model.hybrid_pattern)
    return tuple(k for c, k in HYBRID_SYMBOLS.items() if c in present)


def ssd_flops(tokens, heads, head_dim, state, groups, chunk) -> dict:
    """FLOPs of the chunked SSD scan over ``tokens`` tokens (whole sequences
    of chunks ``chunk``) for ``heads`` heads and ``groups`` groups:
    ``fw``, ``bw`` (the gradients of both operands of each product) and
    ``recompute`` (what the backward computes again first)."""
    T, Q = tokens, chunk
    cb = 2.0 * T * Q * state * groups                    # C B^T per chunk, per group
    diag = 2.0 * T * Q * head_dim * heads                # (C B^T o L) x
    decay = 1.0 * T * Q * heads                          # the decay mask L applied
    states = 2.0 * T * state * head_dim * heads          # B^T x per chunk
    passing = 2.0 * (T / Q) * state * head_dim * heads   # chunk to chunk
    out = 2.0 * T * state * head_dim * heads             # C h
    fw = cb + diag + decay + states + passing + out
    return {"fw": fw, "bw": 2.0 * fw, "recompute": cb + states + passing}


def mamba_mixer(ctx: LayoutContext, x: BlockInputs) -> list:
    """The Mamba-2 layer up to (not including) its residual, as (layer, rows
    that have it) pairs: pre-norm, in_proj, conv1d, SSD scan, gate, gated
    norm, out_proj, with the tensor-parallel collectives around the two
    projections (separate or tile-overlapped, as the MLP's)."""
    m = ctx.model
    mb = m.mamba
    tp = ctx.tp
    H, P, N, G = float(mb.heads), float(mb.head_dim), float(mb.state), float(mb.groups)
    K = float(mb.conv_kernel)
    di = H * P
    B, full = x.B, x.full
    Ht, Gt, dit = H / tp, G / tp, di / tp
    proj = 2 * di + 2 * G * N + H                 # z, x, B, C, dt
    conv_ch = dit + 2 * Gt * N                    # x, B, C per processor
    # (a sequence shorter than the chunk is one chunk of its own length)
    Q = np.minimum(float(mb.chunk), x.sq)
    rec = x.recompute_full
    middle = [
        (conv1d(ctx, B, conv_ch, K, proj / tp, rec), True),
        (_ssd_scan(ctx, B, Ht, P, N, Gt, Q, rec), True),
        (layer(ctx, fw=B * (_GATE_FW * dit + _DT_FW * Ht),
               agrad=B * (_GATE_BW * dit + _DT_BW * Ht), inputs=B * (2 * dit + Ht),
               outputs=B * dit, act=0.0, act_grads=B * dit, weight=3 * Ht,
               weight_grads=3 * Ht, optim=2 * 3 * Ht, recompute=rec), True),
        # RMSNormGated: one fused kernel; it keeps its input (the gated output).
        (rms_norm(ctx, B * dit, dit, True, **full), True),
    ]
    return projected_mixer(ctx, x, proj, di, middle)


def projected_mixer(ctx: LayoutContext, x: BlockInputs, proj, inner, middle: list) -> list:
    """A mixer between two projections, as Megatron-Core builds its Mamba-2
    and Gated DeltaNet layers (``MambaMixer``, ``_GDNBase``): the pre-norm,
    the column-parallel ``in_proj`` (``h -> proj / t``; with sequence
    parallelism its input all-gathered first), the ``middle`` layers, the
    row-parallel ``out_proj`` (``inner / t -> h``) and its reduce; the
    collectives separate or tile-overlapped, as the MLP's."""
    h, tp = float(ctx.model.hidden), ctx.tp
    A, A_tp, B = x.A, x.A_tp, x.B
    full, shared_input = x.full, x.shared_input
    separate, overlapped = x.tp_separate, x.tp_overlapped
    rec = x.recompute_full
    return [
        (fork(ctx, A_tp, 2, **full, stored=True), True),
        (x.norm(ctx, A_tp, h, x.fused_norm, **full, **shared_input), True),
        (tp_collective(ctx, A, False, recomm=x.regather_mlp, stored=x.keep_shard_mlp),
         separate),
        (fp8_gemm(ctx, linear(ctx, B, h, proj / tp, recompute=rec, stored=~x.regather_mlp)),
         separate),
        (fp8_gemm(ctx, tp_overlapped_linear(ctx, B, h, proj, False, rec, x.regather_mlp)),
         overlapped),
    ] + middle + [
        (fp8_gemm(ctx, linear(ctx, B, inner / tp, h, **full)), separate),
        (tp_collective(ctx, A, True, recomm=x.recompute_full, stored=False), separate),
        (fp8_gemm(ctx, tp_overlapped_linear(ctx, B, inner, h, True, rec, rec)), overlapped),
    ]


def conv1d(ctx: LayoutContext, B, channels, K, kept, recompute, bias=True):
    """The causal depthwise convolution (kernel ``K``, with a bias unless
    ``bias`` is False) and SiLU over ``channels`` channels of ``B`` tokens.
    It keeps ``kept`` elements a token (Mamba-2's fused function: the whole
    in_proj output, z and dt with x, B, C; Gated DeltaNet's fla
    ``causal_conv1d``: its input) and recomputes the convolution's output
    in backward."""
    n = B * channels
    b = 1.0 if bias else 0.0
    kb = K + b
    fw = n * (2 * K + b + SILU_FW)
    L = layer(ctx, fw=fw, agrad=n * (2 * K + SILU_BW), wgrad=n * (2 * K + b),
              inputs=n, outputs=n, act=B * kept, act_grads=n,
              weight=channels * kb, weight_grads=channels * kb,
              optim=2 * channels * kb, recompute=recompute)
    # The forward is run again in the backward (time, not useful work).
    L["time_scale"] = 1.0 + ctx.zeros
    L["agrad_extra"] = fw + ctx.zeros
    return L


def _ssd_scan(ctx: LayoutContext, B, Ht, P, N, Gt, Q, recompute):
    """The chunked SSD scan of ``B`` tokens, on the matrix engine (its
    products are tensor-core GEMMs of the Triton kernels); it keeps its
    output before the gate (``out_x``) for backward."""
    f = ssd_flops(B, Ht, P, N, Gt, Q)
    dit = Ht * P
    L = layer(ctx, fw=f["fw"], agrad=f["bw"], inputs=B * (dit + 2 * Gt * N + Ht),
              outputs=B * dit, act=B * dit, act_grads=B * dit, matrix=True,
              recompute=recompute)
    # The chunk states (fp32) are written and read again within the pass.
    states = (B / Q) * Ht * P * N * 4.0
    L["mem_fw"] = L["mem_fw"] + 2 * states
    L["mem_agrad"] = L["mem_agrad"] + 4 * states
    L["time_scale"] = 1.0 + ctx.zeros
    L["agrad_extra"] = f["recompute"] + ctx.zeros
    return L


def pace_weights(model: ModelSpec) -> dict:
    """Forward FLOPs per token of one layer of each kind of a hybrid model,
    counted from its sizes (the GEMMs, the attention's scores and the SSD
    scan over a whole sequence): which stage paces the pipeline is the one
    whose layers add up to the most (``autopar.model.moe.stage_counts``)."""
    h, s = float(model.hidden), float(model.seq_size)
    gated = 2.0 if model.block == "llama" else 1.0
    out = {}
    if model.mamba is not None:
        mb = model.mamba
        di, GN = float(mb.inner), float(mb.groups * mb.state)
        proj = 2 * di + 2 * GN + mb.heads
        scan = ssd_flops(1.0, mb.heads, mb.head_dim, mb.state, mb.groups,
                         min(mb.chunk, model.seq_size))["fw"]
        out["mamba"] = 2 * h * proj + 2 * di * h + scan
    H, d = float(model.attn_heads), float(model.attn_size)
    KV = float(model.kv_heads or model.attn_heads)
    gate = H if model.attention_output_gate else 0.0
    out["attention"] = 2 * h * (H + gate + 2 * KV) * d + 2 * H * d * h + 4 * s * H * d
    f = float(model.feedforward)
    out["mlp"] = 2 * h * f * (gated + 1)
    if model.moe is not None:
        moe = model.moe
        # (LatentMoE: the experts at the latent width, and its two projections)
        w = float(moe.latent_size or h)
        routed = moe.top_k * moe.load * 2 * w * moe.expert_feedforward * (gated + 1)
        if moe.latent_size:
            routed += 2 * 2 * h * w
        out["moe"] = (2 * h * moe.experts + routed
                      + 2 * h * moe.shared_feedforward * (gated + 1))
    return out
