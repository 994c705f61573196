"""Fine-tuning: frozen base weights, LoRA/QLoRA adapters, padded sequences.

Per row's ``adapter`` (``autopar.io.layouts``):

* ``lora`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
  Models", arXiv:2106.09685): every base weight is frozen: it has no weight
  gradient, no optimizer state and no master copy, and backward skips its
  weight-gradient GEMM (``requires_grad=False``: autograd computes only the
  input gradient, torch/csrc/autograd; PEFT's ``LoraModel`` freezes the base
  model, peft/tuners/lora/model.py ``_mark_only_adapters_as_trainable``),
  while the activation gradients still flow through every frozen layer.
  Each targeted linear layer ``y = x W`` (n x k on a processor) gains an
  adapter ``x A B`` with A of n x r and B of r x k (``adapter_rank`` r),
  trained with its gradients, optimizer state and master copy.  Forward
  counts ``2 m r (n + k)`` FLOPs for m tokens (``x A``, then ``(x A) B``);
  the input gradient ``dY B^T A^T`` as many; the weight gradients ``(x
  A)^T dY`` and ``x^T (dY B^T)`` as many again (``dY B^T`` is shared with
  the input gradient).  It keeps ``x A`` (m x r) for backward; ``x`` is the
  base layer's stored input.  Under tensor parallelism the adapter is split
  as the base (Megatron-Bridge / NeMo's ``LoRALinear`` on a column-parallel
  layer: A whole, B column-parallel; row-parallel: A row-parallel, B whole),
  so a processor holds ``r (n + k)`` of it with its local n, k; the small
  all-reduce of ``x A`` a row-parallel adapter needs is not counted.
  Targets: ``all`` q, k, v, o and the MLP's matrices (QLoRA's "all linear
  layers", Megatron-Bridge's default ``linear_qkv, linear_proj, linear_fc1,
  linear_fc2``); ``attention`` q, k, v, o; ``qv`` q and v (the LoRA paper's
  choice); ``qkv`` one adapter on the fused QKV projection, A of h x r and
  B of r x (q + 2 kv) (NeMo 1.x's default ``target_modules``
  ``attention_qkv``, nemo/collections/nlp/parts/peft_config.py
  ``get_target_modules``, its ``LoraKQVAdapter``).  Routed experts and multi-head latent attention take no
  adapters here (frozen, as every base weight).
* ``qlora`` (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of
  Quantized LLMs", arXiv:2305.14314, Sec. 3): as ``lora``, and the frozen
  matrices of the blocks are stored in 4-bit NormalFloat with double
  quantisation: 4 bits a weight plus 0.127 bits of block constants
  (``NF4_BYTES``); norms, embedding and output layer stay in the working
  datatype (bitsandbytes quantises only ``Linear`` layers; PEFT's QLoRA
  recipes keep ``lm_head`` unquantised).  Each GEMM dequantises its weight
  to the working datatype, in forward and again in backward (the input
  gradient): reading the 4-bit weight and writing the dequantised one is
  charged as memory traffic.
* ``sequence_fill`` < 100 (SFT on padded sequences): the model computes the
  padded ``seq_size`` tokens; only ``sequence_fill`` percent of them are
  real, which ``token_rate`` reports (on request: ``autopar.model.evaluate``'s
  ``ON_REQUEST``).
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES

# Bytes a weight of NF4 with double-quantised constants takes: 4 bits, plus
# fp8 constants for blocks of 64 weights (8 / 64 bits) and fp32 constants of
# those for blocks of 256 (32 / (64 * 256) bits): 0.127 bits (QLoRA, Sec. 3,
# "Double Quantization").
NF4_BYTES = (4.0 + 8.0 / 64 + 32.0 / (64 * 256)) / 8.0

_TARGETS = CHOICES["adapter_targets"]
_ALL, _ATTENTION, _QV, _QKV = (_TARGETS.index(t) for t in ("all", "attention", "qv", "qkv"))


def targeted(ctx, name: str):
    """Rows whose adapters target the matrix ``name`` (q, k, v, o, mlp, or
    qkv: the fused QKV projection's one adapter)."""
    t = ctx.adapter_targets
    if name == "qkv":
        return ctx.frozen & (t == _QKV)
    if name in ("q", "v"):
        return ctx.frozen & (t != _QKV)
    if name in ("k", "o"):
        return ctx.frozen & (t != _QV) & (t != _QKV)
    return ctx.frozen & (t == _ALL)


def frozen_layer(ctx, L: dict, keep, matrix: bool) -> None:
    """Freeze a base layer's weights on the rows where ``keep`` is 0 (in
    place, before its footprints are derived): no weight-gradient pass, no
    weight gradients, no optimizer state; a QLoRA row's block matrices in
    NF4 with their dequantisation traffic (``quantized_weights``)."""
    L["wgrad"] = L["wgrad"] * keep
    L["weight_grads"] = L["weight_grads"] * keep
    L["optim"] = L["optim"] * keep


def quantized_weights(ctx, L: dict) -> None:
    """QLoRA rows: a matrix's weights stored in NF4 (``weight_b``), each
    forward and input-gradient GEMM reading them and writing the
    dequantised copy."""
    q = ctx.qlora
    L["weight_b"] = np.where(q, L["weight"] * NF4_BYTES, L["weight_b"])
    extra = np.where(q, L["weight"] * (NF4_BYTES + ctx.elem_bytes), 0.0)
    L["mem_fw"] = L["mem_fw"] + extra
    L["mem_agrad"] = L["mem_agrad"] + extra


def real_tokens(cols: dict, seq_size) -> np.ndarray | float:
    """Real tokens of a sequence: ``sequence_fill`` percent of ``seq_size``."""
    fill = cols.get("sequence_fill") if hasattr(cols, "get") else None
    if fill is None:
        return float(seq_size)
    fill = np.asarray(fill)
    if fill.strides == (0,) and len(fill):       # one value (the default's view)
        return seq_size * float(fill[0]) / 100.0
    return seq_size * fill / 100.0
