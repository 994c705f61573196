"""The Gated DeltaNet linear-attention layer of a hybrid model (``G`` in the
pattern; Qwen3-Next, Qwen3.5).

Counted from the code that runs it: Megatron-Core
``megatron/core/ssm/gated_delta_net/common.py`` (``_GDNBase``) and
``gdn.py`` (``GatedDeltaNet``) at NVIDIA/Megatron-LM@2a75ac1 (the commit
Megatron-Bridge@067f987 pins), and the flash-linear-attention (fla) kernels
it calls: ``fla.modules.convolution.causal_conv1d``, ``fla.modules.l2norm``
and ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.  With ``h``
hidden, ``Hk`` key heads of ``dk``, ``Hv`` value heads of ``dv`` (the
query and key heads repeated to ``Hv``), a causal convolution of kernel
``K`` and the kernel's chunk ``C`` (64), per processor of ``t``-way tensor
parallelism (every head count divided by ``t``: ``qk_dim_local_tp``,
``v_dim_local_tp``, ``num_v_heads_local_tp``):

* the pre-norm and ``in_proj``: column-parallel ``h -> (2 Hk dk + 2 Hv dv +
  2 Hv) / t`` (q, k, v, the output gate z, beta, alpha; ``in_proj_dim``),
  with the same tensor-parallel collectives as the Mamba-2 layer
  (``autopar.model.mamba.projected_mixer``);
* ``conv1d``: depthwise causal over the ``(2 Hk dk + Hv dv) / t`` channels
  of q, k, v, no bias (``conv_bias=False``), then SiLU; fla's
  ``causal_conv1d`` keeps its input;
* the kernel's inputs (``_prepare_input_for_gated_delta_rule``, one jit
  fusion): the L2 norm of q and k (fla ``l2norm``, which keeps its output),
  q and k repeated to the value heads (copies), the decay
  ``g = -exp(A_log) softplus(alpha + dt_bias)`` in fp32 and
  ``beta = sigmoid(b)`` per value head;
* the chunked delta rule (``chunk_gated_delta_rule_fwd``) per value head and
  chunk of ``C`` tokens: ``k k^T`` scaled by beta and the decay
  (``chunk_scaled_dot_kkt_fwd``: 2 C dk a token), the triangular inverse
  (``solve_tril``: C^3 / 3 multiply-adds a chunk, 2 C^2 / 3 a token), the WY
  factors ``w = A (beta k e^g)`` and ``u = A (beta v)``
  (``recompute_w_u_fwd``: 2 C dk + 2 C dv), the state passed from chunk to
  chunk ``v' = u - w S``, ``S <- e^g S + k^T v'`` (``chunk_gated_delta_rule_
  fwd_h``: 4 dk dv a token) and the output ``q S e^g + (q k^T o mask) v'``
  (``chunk_fwd_o``: 2 dk dv + 2 C dk + 2 C dv); its backward
  (``chunk_gated_delta_rule_bwd``) takes the gradients of both operands of
  each product (twice the forward) after recomputing ``w, u`` and the
  states (``recompute_w_u_fwd``, ``chunk_gated_delta_rule_fwd_h``);
  ``ChunkGatedDeltaRuleFunction.forward`` keeps q, k, v, g, beta and the
  inverse ``A`` (C values a token and head); the per-chunk states
  ``(T / C) Hv dk dv`` are written and read within the pass (memory traffic);
* the gated output norm (``_apply_gated_norm``): an RMSNorm over each value
  head (weight ``dv``) times ``SiLU(z)``; it keeps its input and the gate;
* ``out_proj``: row-parallel ``Hv dv / t -> h`` and its reduce.

Parameters (``_GDNBase.__init__``): in_proj ``h (2 Hk dk + 2 Hv dv + 2 Hv)``,
conv1d ``(2 Hk dk + Hv dv) K``, ``dt_bias`` and ``A_log`` (``Hv`` each), the
out norm ``dv``, out_proj ``Hv dv h``; and the layer's pre-norm.
"""
from __future__ import annotations

import numpy as np

from autopar.io.specs import GatedDeltaNetSpec
from autopar.model.block_inputs import BlockInputs
from autopar.model.context import LayoutContext
from autopar.model.layers import layer, rms_norm
from autopar.model.mamba import SILU_BW, SILU_FW, conv1d, projected_mixer
from autopar.model.mamba import pace_weights as _layer_pace_weights

# Per element of q and k: the L2 norm (square, sum, reciprocal root, scale);
# per value head and token: alpha + dt_bias, softplus log(1 + exp(x)), times
# -exp(A_log) (3 + 1 + 1 + 1), and beta's sigmoid (4).
_L2_FW, _L2_BW = 3.0, 6.0
_GATES_FW, _GATES_BW = 6.0 + SILU_FW, 8.0 + SILU_BW


def in_proj_width(g: GatedDeltaNetSpec) -> float:
    """Outputs of ``in_proj``: q, k, v, z, beta, alpha (``_GDNBase.in_proj_dim``)."""
    return 2.0 * g.key_heads * g.key_head_dim + 2.0 * g.value_heads * g.value_head_dim \
        + 2.0 * g.value_heads


def delta_rule_flops(tokens, heads, key_dim, value_dim, chunk) -> dict:
    """FLOPs of fla's chunked gated delta rule over ``tokens`` tokens for
    ``heads`` value heads: ``fw``, ``bw`` (both operands of each product)
    and ``recompute`` (what the backward computes again first)."""
    T, C, dk, dv = tokens, chunk, key_dim, value_dim
    kkt = 2.0 * T * C * dk * heads                        # beta k k^T o decay
    inverse = 2.0 * T * C * C / 3.0 * heads               # solve_tril
    wy = 2.0 * T * C * (dk + dv) * heads                  # w, u
    states = 4.0 * T * dk * dv * heads                    # v' = u - w S; S update
    out = 2.0 * T * (dk * dv + C * dk + C * dv) * heads   # q S, (q k^T o mask) v'
    fw = kkt + inverse + wy + states + out
    return {"fw": fw, "bw": 2.0 * fw, "recompute": wy + states}


def gdn_mixer(ctx: LayoutContext, x: BlockInputs) -> list:
    """The Gated DeltaNet layer up to (not including) its residual, as
    (layer, rows that have it) pairs: pre-norm, in_proj, conv1d, the kernel's
    inputs, the chunked delta rule, the gated norm, out_proj."""
    g = ctx.model.gdn
    tp, B, full = ctx.tp, x.B, x.full
    rec = x.recompute_full
    dk, dv, K = float(g.key_head_dim), float(g.value_head_dim), float(g.conv_kernel)
    qk = float(g.key_heads) * dk / tp             # q (and k) per processor
    Hv = float(g.value_heads) / tp
    vd = Hv * dv
    conv_ch = 2 * qk + vd
    # (a sequence shorter than the chunk is one chunk of its own length)
    C = np.minimum(float(g.chunk), x.sq)
    f = delta_rule_flops(B, Hv, dk, dv, C)
    rep = Hv * dk                                 # q (and k) repeated to the value heads
    prep = layer(ctx, fw=B * (_L2_FW * 2 * qk + _GATES_FW * Hv),
                 agrad=B * (_L2_BW * 2 * qk + _GATES_BW * Hv), inputs=B * (2 * qk + 2 * Hv),
                 outputs=B * (2 * rep + 2 * Hv), act=B * (2 * qk + 2 * Hv),
                 act_grads=B * (2 * rep + 2 * Hv), weight=2 * Hv, weight_grads=2 * Hv,
                 optim=2 * 2 * Hv, recompute=rec)
    # kept: q, k (repeated), v, g (fp32: two elements), beta, the inverse A
    rule = layer(ctx, fw=f["fw"], agrad=f["bw"], inputs=B * (2 * rep + vd + 2 * Hv),
                 outputs=B * vd, act=B * (2 * rep + vd + 3 * Hv + Hv * C), act_grads=B * vd,
                 matrix=True, recompute=rec)
    states = (B / C) * Hv * dk * dv * ctx.elem_bytes
    rule["mem_fw"] = rule["mem_fw"] + 2 * states
    rule["mem_agrad"] = rule["mem_agrad"] + 4 * states
    rule["time_scale"] = 1.0 + ctx.zeros
    rule["agrad_extra"] = f["recompute"] + ctx.zeros
    # y = RMSNorm(o) * SiLU(z): the norm keeps its input, the product the
    # gate and the normed output
    gate = layer(ctx, fw=B * vd * (SILU_FW + 1), agrad=B * vd * (SILU_BW + 2),
                 inputs=B * 2 * vd, outputs=B * vd, act=B * 2 * vd, act_grads=B * vd,
                 recompute=rec)
    middle = [
        (conv1d(ctx, B, conv_ch, K, conv_ch, rec, bias=False), True),
        (prep, True),
        (rule, True),
        (rms_norm(ctx, B * vd, dv, True, **full), True),
        (gate, True),
    ]
    return projected_mixer(ctx, x, in_proj_width(g), float(g.value_heads) * dv, middle)


def pace_weights(model) -> dict:
    """Forward FLOPs per token of one layer of each kind of a hybrid model
    (``autopar.model.mamba.pace_weights``) and, with Gated DeltaNet layers,
    of one of those (the projections and the delta rule over a whole
    sequence): which stage paces the pipeline."""
    out = _layer_pace_weights(model)
    g = model.gdn
    if g is not None:
        h = float(model.hidden)
        rule = delta_rule_flops(1.0, g.value_heads, g.key_head_dim, g.value_head_dim,
                                min(g.chunk, model.seq_size))["fw"]
        out["gdn"] = 2 * h * in_proj_width(g) + 2 * g.value_heads * g.value_head_dim * h + rule
    return out
