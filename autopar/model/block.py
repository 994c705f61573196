"""The transformer block: a sequence of layers, summed per block.

Follows Calculon's ``llm.py`` (its attention and MLP block builders and the
per-block statistics).  ``block`` lays out the layers of one block for every
row at once: layers that exist only for some rows (separate vs overlapped TP
communication, multi-query, FlashAttention) carry a presence mask, and the
sequence is a superset whose order agrees with every variant, so running
sums over it equal the sums over each row's own layers.  ``accumulate``
sums the layers into the per-block quantities (``SUMS``) with Calculon's
recompute rules.  ``BlockCache`` computes them once per distinct block (a
block depends on a handful of columns) and gathers them back per row.
``head_time`` and ``head_memory`` are the embedding and the output layer
with its loss, for models that give a vocabulary.

Notation (elements of one micro-batch on one processor): ``B`` tokens,
``A`` = B x hidden, ``A_split`` the same split over tensor_par (sequence
parallelism), ``A_tp`` whichever of the two the layout keeps; ``h, f, s, H,
d, KV``: hidden, feed-forward, sequence, heads, head size, K/V heads.
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES
from autopar.io.specs import MemoryOverhead, SystemSpec
from autopar.model.communication import context_exchange, tp_collective, tp_overlapped_linear
from autopar.model.context import LayoutContext, grad_scale, masked, shard_counts
from autopar.model.lookup import distinct, pack
from autopar.model.moe import mla_attention, routed_experts
from autopar.model.layers import (batched_matmul, dropout, finish, flash_attention, fork,
                                  fp8_gemm, gelu, layer, layer_norm, linear, residual, rms_norm,
                                  rotary, softmax, swiglu)


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
    multi-head latent attention.
    """
    m = ctx.model
    llama = m.block == "llama"
    h, f, s, H, d = (float(m.hidden), float(m.feedforward), float(m.seq_size),
                     float(m.attn_heads), float(m.attn_size))
    KV = float(m.kv_heads or m.attn_heads)
    tp = ctx.tp
    mbs = cols["microbatch_size"].astype(float)
    # Context parallelism: sq of the sequence's queries (and tokens) are local;
    # attention runs them against all s keys.
    sq = s / ctx.cp
    B = mbs * sq
    A = B * h
    A_split = np.floor_divide(B, tp) * h
    A_tp = np.where(ctx.tp_rs_ag, A_split, A)
    rec = cols["activation_recompute"]
    recompute_full = rec == CHOICES["activation_recompute"].index("full")
    recompute_attn = recompute_full | (rec == CHOICES["activation_recompute"].index("attn_only"))
    # Megatron's selective MLP recompute: the MLP's first GEMM and activation
    # run again in backward from the MLP's input; the activation's output is
    # not kept.
    mlp_only = rec == CHOICES["activation_recompute"].index("mlp_only")
    recompute_mlp = recompute_full | mlp_only
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
    tp_separate = cols["tensor_par_overlap"] == 0     # TP comm as separate layers
    tp_overlapped = ~tp_separate
    multiquery = cols["attention_type"] == CHOICES["attention_type"].index("multiquery")
    kv_width = np.where(multiquery, d, KV * d / tp)   # K (and V) width per processor
    impl = cols["attention_impl"]
    flash = impl >= CHOICES["attention_impl"].index("flash_v1")
    core = ~flash
    fused_norm = cols["fused_norm"]
    fused = cols["fused_activation"]
    heads_tp = H / tp
    scores = heads_tp * sq * s * mbs
    norm = rms_norm if llama else layer_norm

    def g(L):           # a GEMM of the block: fp8 where the recipe says so
        return fp8_gemm(ctx, L)
    ff_in = 2 * f if llama else f           # SwiGLU: gate and up projections

    full = {"recompute": recompute_full}        # recomputed under full recompute
    attn = {"recompute": recompute_attn}        # ... under full or attention-only
    shared_input = {"stored": False, "reused": True}   # its input is the Fork's
    # (layer, rows that have it)
    if m.mla is not None:
        seq, core_layers, q_width, kv_width = mla_attention(
            ctx, cols, A=A, A_tp=A_tp, B=B, mbs=mbs, sq=sq, norm=norm, full=full, attn=attn,
            shared_input=shared_input, regather_attn=regather_attn,
            recompute_attn=recompute_attn, flash=flash, core=core, impl=impl,
            fused_norm=fused_norm, g=g)
    else:
        seq, core_layers = _attention(**locals())
        q_width = H * d / tp
    moe = kind == "moe"
    if moe:
        f = float(m.moe.shared_feedforward)
        ff_in = 2 * f if llama else f
    seq += [
        (residual(ctx, A_tp, A_tp, **full, **shared_input), True),
        # MLP block
        (fork(ctx, A_tp, 2, **full, stored=True), True),
        (norm(ctx, A_tp, h, fused_norm, **full, **shared_input), True),
    ]
    if f > 0:
        seq += [
            (tp_collective(ctx, A, False, recomm=regather_mlp, stored=keep_shard_mlp),
             tp_separate),
            (g(linear(ctx, B, h, ff_in / tp, recompute=recompute_mlp,
                      stored=~regather_mlp)), tp_separate),
            (g(tp_overlapped_linear(ctx, B, h, ff_in, False, recompute_mlp, regather_mlp)),
             tp_overlapped),
            ((swiglu if llama else gelu)(ctx, f * B / tp, fused, recompute=recompute_mlp,
                                         stored=~mlp_only), True),
            (g(linear(ctx, B, f / tp, h, **full, stored=~mlp_only)), tp_separate),
            (tp_collective(ctx, A, True, recomm=recompute_full, stored=False), tp_separate),
            (g(tp_overlapped_linear(ctx, B, f, h, True, recompute_full, recompute_full)),
             tp_overlapped),
        ]
    if moe:
        seq += routed_experts(ctx, cols, llama, full, g)
    if not llama:
        seq.append((dropout(ctx, A_tp, **full), True))
    seq.append((residual(ctx, A_tp, A_tp, **full, **shared_input), True))
    acc = accumulate(ctx, cols, seq, recompute_full)
    # The attention core's own times, which the K/V exchange can hide behind.
    attn_fw, attn_bw = ctx.zeros.copy(), ctx.zeros.copy()
    for L, present in core_layers:
        if "time_fw" not in L:          # no row has it
            continue
        attn_fw += np.where(present, L["time_fw"], 0.0)
        attn_bw += np.where(present, L["time_agrad"] + L["time_wgrad"], 0.0)
    acc.update(context_exchange(ctx, cols, mbs, sq, q_width, kv_width, attn_fw, attn_bw,
                                recompute_attn))
    return acc


def _attention(ctx, A, A_tp, B, mbs, h, s, sq, H, d, KV, tp, llama, norm, full, attn,
               shared_input, regather_attn, recompute_full, recompute_attn, tp_separate,
               tp_overlapped, multiquery, kv_width, impl, flash, core, fused_norm,
               scores, heads_tp, g, keep_shard_attn, keep_qkv_input, **_):
    """The attention half of the block, up to (not including) its residual,
    and the layers of its core (which a K/V exchange can hide behind)."""
    seq = [
        # attention block
        (fork(ctx, A_tp, 2, **full, stored=True), True),
        (norm(ctx, A_tp, h, fused_norm, **full, **shared_input), True),
        (tp_collective(ctx, A, False, recomm=regather_attn, stored=keep_shard_attn),
         tp_separate),
        (fork(ctx, A, 3, recompute=regather_attn, stored=keep_qkv_input), tp_separate),
        (g(linear(ctx, B, h, H * d / tp, **full, **shared_input)), tp_separate),
        (g(tp_overlapped_linear(ctx, B, h, (H + 2 * KV) * d, False, recompute_full,
                                regather_attn)), tp_overlapped & ~multiquery),
        (g(tp_overlapped_linear(ctx, B, h, H * d, False, recompute_full, regather_attn)),
         tp_overlapped & multiquery),
        (fork(ctx, A, 2, recompute=regather_attn, stored=~regather_attn),
         tp_overlapped & multiquery),
        (g(linear(ctx, B, h, kv_width, **full, **shared_input)), tp_separate | multiquery),
        (g(linear(ctx, B, h, kv_width, **full, **shared_input)), tp_separate | multiquery),
    ]
    if llama:
        seq.append((rotary(ctx, B * (H * d / tp + kv_width), **attn), True))
    core_layers = [
        (batched_matmul(ctx, mbs * heads_tp, sq, d, s, **attn, out_stored=~recompute_attn), core),
        (softmax(ctx, scores, impl, llama, **attn, out_stored=~recompute_attn), core),
    ]
    if not llama:
        core_layers.append((dropout(ctx, scores, **attn, stored=~recompute_attn), core))
    core_layers += [
        (batched_matmul(ctx, mbs * heads_tp, sq, s, d, **full), core),
        (flash_attention(ctx, mbs, heads_tp, sq, d, kv_width, impl, sk=s, **full), flash),
    ]
    seq += core_layers
    seq += [
        (g(linear(ctx, B, H * d / tp, h, **full)), tp_separate),
        (tp_collective(ctx, A, True, recomm=recompute_full, stored=False), tp_separate),
        (g(tp_overlapped_linear(ctx, B, H * d, h, True, recompute_full, recompute_full)),
         tp_overlapped),
    ]
    if not llama:
        seq.append((dropout(ctx, A_tp, **full), True))
    return seq, core_layers


def activation_sizes(ctx: LayoutContext, cols: dict) -> dict:
    """Activation sizes (elements) of one micro-batch and the recompute flag."""
    B = cols["microbatch_size"].astype(float) * ctx.model.seq_size / ctx.cp
    A = B * ctx.model.hidden
    # (B and tensor_par are whole numbers below 2^53 for a layout that passes
    # the rules, so the floor of their rounded quotient is the exact floor
    # that np.floor_divide gives through fmod, at a tenth of its time)
    A_split = np.floor(B / ctx.tp) * ctx.model.hidden
    recompute_full = cols["activation_recompute"] == CHOICES["activation_recompute"].index("full")
    return dict(B=B, A=A, A_split=A_split, recompute_full=recompute_full)


# Columns the per-block statistics depend on.
_BLOCK_FIELDS = ("attention_impl", "fused_norm",
                 "datatype", "tensor_par", "microbatch_size", "activation_recompute",
                 "tensor_par_comm_type", "tensor_par_overlap", "seq_par_ag_redo",
                 "fused_activation", "attention_type", "training", "tensor_par_net",
                 "optimizer_sharding", "data_par", "context_par", "context_par_net",
                 "context_par_comm", "fp8_recipe", "sharding_group", "unsharded_grads",
                 "weight_sharding", "fp32_grads",
                 "expert_par", "expert_tensor_par", "expert_par_net",
                 "expert_tensor_par_net", "moe_dispatcher", "moe_overlap")
# Block sums of the optimizer step (they depend on the sharding, cached apart).
# Per-block sums the memory footprints need (``memory.footprints``, with
# the shard divisions of ``BlockCache.rows``): evaluate_columns gathers
# them for every row, the others only for the rows that fit in memory.
FOOTPRINT_SUMS = ("weight_space", "act_working", "act_storage", "act_storage_all",
                  "wgrad_space", "wgrad_space_full", "act_grad_space", "optimizer_space",
                  "x_wgrad_space", "x_optimizer_space")
OPTIM_SUMS = ("optim_flops", "optim_flops_time", "optim_mem", "optim_mem_time",
              "optim_time")
# The other sums the batch level (``evaluate.batch_time``) computes with;
# the rest are only reported, gathered from the block table straight into
# the result.
BATCH_SUMS = ("fw_time", "fw_mem_time", "re_time", "re_flops_time", "re_mem_time",
              "agrad_time", "agrad_flops_time", "agrad_mem_time",
              "wgrad_time", "wgrad_flops_time", "wgrad_mem_time",
              "base_fw_tp_time", "edge_fw_tp_time", "base_fw_tp_exp", "edge_fw_tp_exp",
              "base_agrad_tp_time", "edge_agrad_tp_time", "base_agrad_tp_exp",
              "edge_agrad_tp_exp", "base_recomm_time", "edge_recomm_time",
              "base_recomm_exp", "edge_recomm_exp",
              "cp_fw_link", "cp_bw_link", "cp_fw_exp", "cp_bw_exp", "cp_re_exp",
              "ep_link", "ep_exposed", "useful_fw", "useful_bw", "x_weight_space")


_FEW = 64


def _ones_to_none(a):
    return None if np.all(a == 1) else a


def _where_on(mask, col):
    """``np.where(mask, col, 0)``; a view of a column of zeros where ``col``
    is one (a default network tier, say)."""
    if col.strides == (0,) and len(col) and col[0] == 0:
        return col
    return masked(col, mask)


class BlockCache:
    """Per-block sums for every row, computed once per distinct block.

    The block depends on a handful of columns; most layouts of a search share
    their block with many others, so it is evaluated on the distinct keys and
    gathered back.  Optimizer sharding only divides footprints (exactly) and
    changes the optimizer step, which is evaluated on its own smaller key.
    """

    def __init__(self, model, system, cols: dict, datatypes, kind: str = "dense"):
        n = len(cols["tensor_par"])
        head = kind == "dense" and model.vocab_size > 0
        self._split = self._ext = None
        if n <= _FEW:        # a handful of layouts: no deduplication to win
            ctx = LayoutContext(model, system, cols, datatypes)
            sums = block(ctx, cols, kind)
            self._head = (head_microbatch_time(ctx, activation_sizes(ctx, cols)["B"])
                          if head else None)
            self._n1 = [name for name in sums if name not in OPTIM_SUMS]
            self._t1 = np.stack([np.broadcast_to(sums[name], (n,)) for name in self._n1])
            self._t2 = np.stack([np.broadcast_to(sums[name], (n,)) for name in OPTIM_SUMS])
            self.inv1 = self.inv2 = np.arange(n)
            self.shard = self.grad_shard = np.ones(n)     # already divided
            self.weight_shard = _ones_to_none(shard_counts(cols)[2])
            self.grad_scale = grad_scale(cols)
            self.x_shard = self.x_grad_shard = self.shard
            self.shard_counts = None
            return
        t = cols["tensor_par"]
        tpnet = _where_on(t > 1, cols["tensor_par_net"])
        moe_key = []
        if kind == "moe":
            ep, etp = cols["expert_par"], cols["expert_tensor_par"]
            moe_key = [ep, etp, np.where(ep > 1, cols["expert_par_net"], 0),
                       np.where(etp > 1, cols["expert_tensor_par_net"], 0),
                       cols["moe_dispatcher"], cols["moe_overlap"]]
        cp = cols["context_par"]
        # (the distinct blocks come out in the order of their keys, the first
        # column the slowest: the columns that decide which layers a block
        # runs come first, so that each layer's rows are runs of the table
        # and its masked sums cost what unmasked ones do)
        key1 = [cols["training"], cols["activation_recompute"], cols["fp8_recipe"], cp,
                _where_on(cp > 1, cols["context_par_comm"]),
                _where_on(cp > 1, cols["context_par_net"]), t, cols["tensor_par_overlap"],
                cols["tensor_par_comm_type"], cols["seq_par_ag_redo"],
                cols["fused_activation"], cols["fused_norm"], cols["attention_impl"],
                cols["attention_type"], tpnet, cols["datatype"],
                cols["microbatch_size"]] + moe_key
        idx1, inv1 = distinct(*pack(key1))
        sub = {f: cols[f][idx1] for f in _BLOCK_FIELDS}
        sub["tensor_par_net"] = tpnet[idx1]
        sub["context_par_net"] = np.where(sub["context_par"] > 1, sub["context_par_net"], 0)
        sub["optimizer_sharding"] = np.zeros(len(idx1), dtype=bool)
        sub["data_par"] = np.ones(len(idx1), dtype=np.int64)
        sub["unsharded_grads"] = np.zeros(len(idx1), dtype=bool)
        sub["sharding_group"] = np.zeros(len(idx1), dtype=np.int64)
        sub["weight_sharding"] = np.zeros(len(idx1), dtype=bool)
        self.shard_counts = shard_counts(cols)
        shard, grad_shard, weight_shard = self.shard_counts
        key2 = [cols["datatype"], t, cols["attention_type"], cols["tensor_par_overlap"] != 0,
                cols["training"], shard.astype(np.int64)]
        # (the divisors stay the float columns of shard_counts: dividing by
        # them gives what dividing by the same integers gives)
        x_shard, x_grad_shard = shard, grad_shard
        if kind == "moe":
            edp = np.maximum(cols["data_par"] * t * cols["context_par"]
                             // (cols["expert_par"] * cols["expert_tensor_par"]), 1)
            x_shard = np.where(cols["optimizer_sharding"], edp, 1)
            x_grad_shard = np.where(cols["unsharded_grads"], 1, x_shard)
            key2 += [x_shard] + moe_key
        idx2, inv2 = distinct(*pack(key2))
        # Both tables' blocks in one evaluation (the block is row by row):
        # the first len(idx1) rows give the sums, the others the optimizer step.
        k1, k = len(idx1), len(idx1) + len(idx2)
        both = {f: np.concatenate([sub[f], cols[f][idx2]]) for f in _BLOCK_FIELDS}
        ctx = LayoutContext(model, system, both, datatypes)
        sums = {name: np.broadcast_to(v, (k,)) for name, v in block(ctx, both, kind).items()}
        self._head = (head_microbatch_time(ctx, activation_sizes(ctx, both)["B"])[:k1][inv1]
                      if head else None)
        # Sums stacked as (sum, distinct block) tables, gathered per chunk.
        self._n1 = [name for name in sums if name not in OPTIM_SUMS]
        self._t1 = np.stack([sums[name][:k1] for name in self._n1])
        self._t2 = np.stack([sums[name][k1:] for name in OPTIM_SUMS])
        self.inv1, self.inv2 = inv1, inv2
        self.shard = shard
        self.grad_shard = grad_shard
        self.weight_shard = _ones_to_none(weight_shard)
        self.grad_scale = grad_scale(cols)
        self.x_shard = x_shard
        self.x_grad_shard = x_grad_shard

    def shards(self, sl: slice):
        """``shard_counts`` of the rows ``sl`` (None: compute them)."""
        return None if self.shard_counts is None else tuple(c[sl] for c in self.shard_counts)

    def head(self, sl: slice):
        """``head_microbatch_time`` of the rows ``sl`` (None: no vocabulary)."""
        return None if self._head is None else self._head[sl]

    def rows(self, at, part: str | None = None) -> dict:
        """Per-block sums for the rows ``at`` (a slice, or positions), one
        gather per key table: every sum, or ``part="footprints"``: only the
        ``FOOTPRINT_SUMS`` (what the memory footprints need), or
        ``part="rest"``: the others (with the optimizer step's), or
        ``part="batch"``: of those, the ones the batch level computes with."""
        # np.take keeps each sum a contiguous row (``t[:, idx]`` would give
        # a column-major result, every sum strided across the others).
        if part is None:
            names, table = self._n1, self._t1
        else:
            names, table = self._parts()[part]
        sums = dict(zip(names, np.take(table, self.inv1[at], axis=1)))
        if part == "footprints":
            return self._sharded(sums, at)
        sums.update(zip(OPTIM_SUMS, np.take(self._t2, self.inv2[at], axis=1)))
        return sums if part in ("rest", "batch") else self._sharded(sums, at)

    def _parts(self) -> dict:
        """The names and table of the footprint sums, of the others, and of
        those the batch level computes with (``BATCH_SUMS``)."""
        if self._split is None:
            foot = [self._n1.index(name) for name in FOOTPRINT_SUMS]
            rest = [i for i in range(len(self._n1)) if i not in foot]
            batch = [i for i in rest if self._n1[i] in BATCH_SUMS]
            self._split = {
                "footprints": (list(FOOTPRINT_SUMS), self._t1[foot]),
                "rest": ([self._n1[i] for i in rest], self._t1[rest]),
                "batch": ([self._n1[i] for i in batch], self._t1[batch])}
        return self._split

    def sum_tables(self) -> dict:
        """Each sum's row of distinct-block values followed by a NaN, with
        the distinct-block index it takes (``inv1`` or ``inv2``): a statistic
        that is a block sum is gathered from it straight into the result."""
        if self._ext is None:
            ext = {}
            for names, table, inv in ((self._n1, self._t1, self.inv1),
                                      (OPTIM_SUMS, self._t2, self.inv2)):
                t = np.empty((table.shape[0], table.shape[1] + 1))
                t[:, :-1] = table
                t[:, -1] = np.nan
                ext.update({name: (t[i], inv) for i, name in enumerate(names)})
            self._ext = ext
        return self._ext

    def _sharded(self, sums: dict, at) -> dict:
        """The footprint sums divided by the rows' shards (in place)."""
        # Expert footprints shard over expert-data-parallel, the rest over data_par.
        xw, xo = sums["x_wgrad_space"], sums["x_optimizer_space"]
        sums["x_wgrad_space"] = xw / self.x_grad_shard[at]
        sums["x_optimizer_space"] = xo / self.x_shard[at]
        sums["wgrad_space"] = (sums["wgrad_space"] - xw) / self.grad_shard[at] \
            + sums["x_wgrad_space"]
        sums["optimizer_space"] = (sums["optimizer_space"] - xo) / self.shard[at] \
            + sums["x_optimizer_space"]
        if self.grad_scale is not None:
            sums["wgrad_space"] = sums["wgrad_space"] * self.grad_scale[at]
        # ZeRO-3 / FSDP keeps 1/shards of the weights; a whole block is
        # gathered when it runs (``weight_space_full``).
        sums["weight_space_full"] = sums["weight_space"]
        if self.weight_shard is not None:
            sums["weight_space"] = sums["weight_space"] / self.weight_shard[at]
        return sums


SUMS = (
    "fw_flops", "fw_flops_time", "fw_mem", "fw_mem_time", "fw_time",
    "base_fw_tp_size", "edge_fw_tp_size", "base_fw_tp_time", "edge_fw_tp_time",
    "base_fw_tp_exp", "edge_fw_tp_exp",
    "re_flops", "re_flops_time", "re_mem", "re_mem_time", "re_time",
    "base_recomm_size", "edge_recomm_size", "base_recomm_time", "edge_recomm_time",
    "base_recomm_exp", "edge_recomm_exp",
    "agrad_flops", "agrad_flops_time", "agrad_mem", "agrad_mem_time", "agrad_time",
    "base_agrad_tp_size", "edge_agrad_tp_size", "base_agrad_tp_time",
    "edge_agrad_tp_time", "base_agrad_tp_exp", "edge_agrad_tp_exp",
    "wgrad_flops", "wgrad_flops_time", "wgrad_mem", "wgrad_mem_time", "wgrad_time",
    "optim_flops", "optim_flops_time", "optim_mem", "optim_mem_time", "optim_time",
    "weight_space", "act_working", "act_storage", "wgrad_space",
    "wgrad_space_full", "act_grad_space", "optimizer_space", "useful_fw",
    "useful_bw",
    # the routed experts' share of the footprints (sharded over expert-data-
    # parallel) and the dispatch/combine transfers (link and exposed time)
    "x_weight_space", "x_wgrad_space", "x_optimizer_space", "ep_link", "ep_exposed",
)


def _rows_of(mask):
    """True if ``mask`` holds for every row, False for none, else the mask."""
    mask = np.asarray(mask)
    if mask.all():
        return True
    return mask if mask.any() else False


def accumulate(ctx: LayoutContext, cols: dict, seq, recompute_full) -> dict:
    """Per-block sums over the layer sequence, for one micro-batch."""
    z = ctx.zeros
    acc = {k: z.copy() for k in SUMS}
    acc["tp_bw_req"] = z.copy()
    tr = ctx.training
    for L, present in seq:
        p = np.broadcast_to(present, z.shape)
        if not p.any():
            continue
        finish(ctx, L)
        pt = p & tr

        # Each mask classified once per layer: every row, none, or some.
        on, on_t = _rows_of(p), _rows_of(pt)

        def add(key, val, which=on):
            if which is True:
                acc[key] += val
            elif which is not False:
                acc[key] += np.where(which, val, 0.0)

        add("fw_flops", L["fw"])
        add("fw_flops_time", L["flops_time_fw"])
        add("fw_mem", L["mem_fw"])
        add("fw_mem_time", L["mem_time_fw"])
        add("fw_time", L["time_fw"])
        add("useful_fw", L["fw"])
        for e in ("base", "edge"):
            add(f"{e}_fw_tp_size", L[f"comm_bytes_fw_{e}"])
            add(f"{e}_fw_tp_time", L[f"comm_time_fw_{e}"])
            add(f"{e}_fw_tp_exp", L[f"exposed_fw_{e}"])
        acc["tp_bw_req"] = np.maximum(acc["tp_bw_req"], np.where(p, L["tp_bw_req_fw"], 0.0))
        # Calculon adds the running forward totals (not the layer's own) to the
        # recompute sums; its recompute time is the layer's own.
        r = _rows_of(pt & L["recompute"])
        add("re_flops", acc["fw_flops"], r)
        add("re_flops_time", acc["fw_flops_time"], r)
        add("re_mem", acc["fw_mem"], r)
        add("re_mem_time", acc["fw_mem_time"], r)
        add("re_time", L["time_fw"], r)
        rc = _rows_of(pt & L["recomm"])
        for e in ("base", "edge"):
            add(f"{e}_recomm_size", L[f"comm_bytes_wgrad_{e}"], rc)
            add(f"{e}_recomm_time", L[f"comm_time_wgrad_{e}"], rc)
            add(f"{e}_recomm_exp", L[f"exposed_wgrad_{e}"], rc)
            add(f"{e}_agrad_tp_size", L[f"comm_bytes_agrad_{e}"], on_t)
            add(f"{e}_agrad_tp_time", L[f"comm_time_agrad_{e}"], on_t)
            add(f"{e}_agrad_tp_exp", L[f"exposed_agrad_{e}"], on_t)
        add("agrad_flops", L["agrad"], on_t)
        add("agrad_flops_time", L["flops_time_agrad"], on_t)
        add("agrad_mem", L["mem_agrad"], on_t)
        add("agrad_mem_time", L["mem_time_agrad"], on_t)
        add("agrad_time", L["time_agrad"], on_t)
        add("wgrad_flops", L["wgrad"], on_t)
        add("wgrad_flops_time", L["flops_time_wgrad"], on_t)
        add("wgrad_mem", L["mem_wgrad"], on_t)
        add("wgrad_mem_time", L["mem_time_wgrad"], on_t)
        add("wgrad_time", L["time_wgrad"], on_t)
        add("optim_flops", L["optim_flops"], on_t)
        add("optim_flops_time", L["flops_time_optim"], on_t)
        add("optim_mem", L["mem_optim"], on_t)
        add("optim_mem_time", L["mem_time_optim"], on_t)
        add("optim_time", L["time_optim"], on_t)
        add("useful_bw", L["agrad"] + L["wgrad"], on_t)
        acc["tp_bw_req"] = np.maximum(acc["tp_bw_req"], np.where(pt, L["tp_bw_req_agrad"], 0.0))
        add("weight_space", L["weight_b"])
        add("act_working", L["act_b"], _rows_of(p & ~L["reused"]))
        add("act_storage", L["act_b"])
        add("act_storage", -L["out_b"], _rows_of(pt & ~L["out_stored"]))
        add("act_storage", -L["act_b"], _rows_of(pt & ~L["stored"]))
        if "keep_b" in L:       # intermediates a kernel keeps beyond Calculon's count
            add("act_storage", L["keep_b"])
            add("act_working", L["keep_b"])
        add("wgrad_space", L["wgrad_sh"], on_t)
        add("wgrad_space_full", L["wgrad_full"], on_t)
        add("act_grad_space", L["agrad_b"], on_t)
        add("optimizer_space", L["optimizer"], on_t)
        if L["expert"]:
            add("x_weight_space", L["weight_b"])
            add("x_wgrad_space", L["wgrad_sh"], on_t)
            add("x_optimizer_space", L["optimizer"], on_t)
        if "ep_link_total" in L:
            add("ep_link", np.where(tr, L["ep_link_total"], L["ep_link_total"] / 2))
            add("ep_exposed", np.where(tr, L["ep_exposed_total"], L["time_fw"]))
    # What a block keeps when it does not recompute (for recompute_layers).
    acc["act_storage_all"] = acc["act_storage"]
    acc["act_storage"] = np.where(recompute_full, 0.0, acc["act_storage"])
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
    per_mb = out["time_fw"] + loss["time_fw"] + np.where(
        training, out["time_agrad"] + out["time_wgrad"] + loss["time_agrad"], 0.0)
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


def head_memory(ctx: LayoutContext, cols: dict, acts: dict, stages, system: SystemSpec):
    """Memory of the embedding and the output layer with its loss.

    Only for models that give ``vocab_size`` (Calculon models none).  The
    first stage holds the embedding, the last the output matrix and one
    micro-batch's logits (with the fp32 copies the system's
    ``memory_overhead`` says the loss keeps); with one stage, both.
    """
    V = float(ctx.model.vocab_size)
    if V <= 0:
        return {"first": 0.0, "last": 0.0,
                "logits": {"total": 0.0, "fp32_copies": 0.0, "fp32_copy": 0.0}}
    tp, b = ctx.tp, ctx.elem_bytes
    B = acts["B"]
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
    optim_b = np.where(b < 4, 8.0 + ctx.master_bytes, 8.0)     # moments + master copy
    per_param = b + ctx.if_training(grads + optim_b / ctx.optim_shards)
    matrix = params * per_param
    over = system.memory_overhead or MemoryOverhead()
    whole = B * V / (1.0 if over.logits_gathered else tp)
    copy = ctx.if_training(whole * 4.0)
    copies = over.logits_fp32_copies * copy
    last = matrix * (1.0 + (stages == 1))        # both matrices on a single stage
    if mtp:
        last = last + 2.0 * ctx.model.hidden * ctx.model.hidden * mtp * per_param
    return {"first": matrix, "last": last,
            "logits": {"total": whole * b + copies, "fp32_copies": copies,
                       "fp32_copy": copy}}
