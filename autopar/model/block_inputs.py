"""What a transformer block's layers are built from: ``BlockInputs``, and
the activation sizes of one micro-batch, ``ActivationSizes`` (which the
batch level reads too: checkpoints, pipeline transfers, the output head).

One record per block evaluation, built once by ``block_inputs`` from the
layout columns and passed explicitly to the halves of the block
(``autopar.model.block``'s attention and MLP, ``autopar.model.moe``'s latent
attention and routed experts): the activation sizes of one micro-batch, the
recompute and communication masks of each row, and the layer options they
imply.  The model's own sizes (hidden, heads, ...) stay on ``ctx.model``.

Notation (elements of one micro-batch on one processor): ``B`` tokens,
``A`` = B x hidden, ``A_split`` the same split over tensor_par (sequence
parallelism), ``A_tp`` whichever of the two the layout keeps; ``sq`` the
queries (tokens) of the local share of the sequence under context
parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopar.io.layouts import CHOICES
from autopar.model.context import LayoutContext
from autopar.model.layers import layer_norm, rms_norm


@dataclass(frozen=True)
class ActivationSizes:
    """Activation sizes (elements) of one micro-batch on one processor, and
    the rows that recompute whole blocks."""
    B: np.ndarray               # tokens
    A: np.ndarray               # B x hidden
    A_split: np.ndarray         # A split over tensor_par (sequence parallelism)
    recompute_full: np.ndarray


def activation_sizes(ctx: LayoutContext, cols: dict) -> ActivationSizes:
    """The ``ActivationSizes`` of the rows of ``cols``."""
    B = cols["microbatch_size"].astype(float) * ctx.model.seq_size / ctx.cp
    A = B * ctx.model.hidden
    # (B and tensor_par are whole numbers below 2^53 for a layout that passes
    # the rules, so the floor of their rounded quotient is the exact floor
    # that np.floor_divide gives through fmod, at a tenth of its time)
    A_split = np.floor(B / ctx.tp) * ctx.model.hidden
    recompute_full = cols["activation_recompute"] == CHOICES["activation_recompute"].index("full")
    return ActivationSizes(B=B, A=A, A_split=A_split, recompute_full=recompute_full)


@dataclass(frozen=True)
class BlockInputs:
    """The per-row inputs of one block's layers (arrays over the rows, or
    scalars where every row has the same)."""
    llama: bool                 # RMSNorm, rotary, grouped-query, SwiGLU, no dropout
    norm: Callable              # rms_norm or layer_norm
    # sizes of one micro-batch
    mbs: np.ndarray             # micro-batch (sequences)
    sq: np.ndarray              # local queries of a sequence (seq_size / context_par)
    B: np.ndarray               # tokens
    A: np.ndarray               # B x hidden
    A_tp: np.ndarray            # A, or A split over tensor_par with rs_ag
    # recompute (which layers run again in backward)
    recompute_full: np.ndarray
    recompute_attn: np.ndarray  # full or attn_only
    recompute_mlp: np.ndarray   # full or mlp_only
    mlp_only: np.ndarray        # Megatron's selective MLP recompute
    # Megatron's output-discarding recompute of the experts' activation and
    # of MLA's up projections (autopar.io.layouts: recompute_moe_act,
    # recompute_mla_up_proj)
    recompute_moe_act: np.ndarray | bool
    recompute_up_proj: np.ndarray | bool
    regather_attn: np.ndarray   # the attention's input all-gather runs again
    regather_mlp: np.ndarray    # the MLP's input all-gather runs again
    # what the column-parallel GEMMs keep (see block_inputs)
    keep_shard_attn: np.ndarray | bool
    keep_shard_mlp: np.ndarray | bool
    keep_qkv_input: np.ndarray
    # tensor-parallel communication and attention variants
    tp_separate: np.ndarray     # TP collectives as layers of their own
    tp_overlapped: np.ndarray   # TP collectives overlapped with their GEMMs
    multiquery: np.ndarray
    kv_width: np.ndarray        # K (and V) width per processor
    impl: np.ndarray            # attention_impl codes
    span: np.ndarray | float    # keys a query attends to (seq_size; packed: attention_span)
    flash: np.ndarray           # a FlashAttention kernel
    core: np.ndarray            # the unfused attention core (no FlashAttention)
    fused_norm: np.ndarray
    fused: np.ndarray           # fused_activation
    # layer options: recomputed under full recompute; under full or
    # attention-only; a layer whose input is the preceding Fork's
    full: dict
    attn: dict
    shared_input: dict


def _flag(cols: dict, field: str) -> np.ndarray | bool:
    """A flag column, or False where the columns lack it (its default)."""
    c = cols.get(field)
    return False if c is None else c.astype(bool, copy=False)


def block_inputs(ctx: LayoutContext, cols: dict) -> BlockInputs:
    """The ``BlockInputs`` of the rows of ``cols``."""
    m = ctx.model
    llama = m.block == "llama"
    s, d = float(m.seq_size), float(m.attn_size)
    KV = float(m.kv_heads or m.attn_heads)
    # Context parallelism: sq of the sequence's queries (and tokens) are local;
    # attention runs them against all s keys.  (The rules make seq_size a
    # multiple of context_par, so B = mbs * sq exactly.)
    sq = s / ctx.cp
    acts = activation_sizes(ctx, cols)
    rec = cols["activation_recompute"]
    recompute_full = acts.recompute_full
    recompute_attn = recompute_full | (rec == CHOICES["activation_recompute"].index("attn_only"))
    # Megatron's selective MLP recompute: the MLP's first GEMM and activation
    # run again in backward from the MLP's input; the activation's output is
    # not kept.
    mlp_only = rec == CHOICES["activation_recompute"].index("mlp_only")
    ag_redo = cols["seq_par_ag_redo"]
    regather_attn = recompute_attn | ag_redo
    regather_mlp = recompute_full | ag_redo
    # What the column-parallel GEMMs keep.  Calculon: the all-gather's shard
    # (sequence parallelism) and the gathered input unless it is gathered
    # again; under attention recompute not the QKV input, even without an
    # all-gather to redo.  ``memory_overhead.autograd_inputs``: as autograd
    # keeps them: Megatron's column-parallel GEMM keeps the shard when it
    # gathers it again in backward, else the gathered input, never both
    # (megatron/core/tensor_parallel/layers.py,
    # LinearWithGradAccumulationAndAsyncCommunication); selective recompute
    # checkpoints only the attention core (megatron/core/transformer/
    # attention.py, _checkpointed_attention_forward), so without sequence
    # parallelism the QKV GEMMs keep their input.  Measured with PyTorch:
    # benchmarks/memory_torch.py, docs/validation.md.
    keep_shard_attn, keep_shard_mlp = True, True
    keep_qkv_input = ~regather_attn
    if ctx.autograd_inputs:
        keep_shard_attn, keep_shard_mlp = regather_attn, regather_mlp
        keep_qkv_input = keep_qkv_input | (~ctx.tp_rs_ag & ~recompute_full)
    tp_separate = cols["tensor_par_overlap"] == 0
    multiquery = cols["attention_type"] == CHOICES["attention_type"].index("multiquery")
    impl = cols["attention_impl"]
    flash = impl >= CHOICES["attention_impl"].index("flash_v1")
    # Packed documents (``attention_span``): FlashAttention's variable-length
    # (THD) kernel attends within each document only.
    span_col = cols.get("attention_span", 0)
    span = np.where(span_col > 0, np.minimum(span_col, s), s) if np.any(span_col) else s
    return BlockInputs(
        llama=llama, norm=rms_norm if llama else layer_norm,
        mbs=cols["microbatch_size"].astype(float), sq=sq, B=acts.B, A=acts.A,
        A_tp=np.where(ctx.tp_rs_ag, acts.A_split, acts.A),
        recompute_full=recompute_full, recompute_attn=recompute_attn,
        recompute_mlp=recompute_full | mlp_only, mlp_only=mlp_only,
        recompute_moe_act=_flag(cols, "recompute_moe_act"),
        recompute_up_proj=_flag(cols, "recompute_mla_up_proj"),
        regather_attn=regather_attn, regather_mlp=regather_mlp,
        keep_shard_attn=keep_shard_attn, keep_shard_mlp=keep_shard_mlp,
        keep_qkv_input=keep_qkv_input,
        tp_separate=tp_separate, tp_overlapped=~tp_separate, multiquery=multiquery,
        kv_width=np.where(multiquery, d, KV * d / ctx.tp), impl=impl, span=span, flash=flash,
        core=~flash,
        fused_norm=cols["fused_norm"], fused=cols["fused_activation"],
        full={"recompute": recompute_full}, attn={"recompute": recompute_attn},
        shared_input={"stored": False, "reused": True})
