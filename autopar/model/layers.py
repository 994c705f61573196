"""Layers: FLOPs, bytes moved, footprints and processing times.

Follows Calculon's ``layers.py``.  A layer is a dict of per-row columns:
its FLOPs and memory traffic per pass (forward ``fw``, activation gradient
``agrad``, weight gradient ``wgrad``, optimizer step ``optim``), its
footprints, and after ``finish`` its times per pass: ``flops_time_<pass>``,
``mem_time_<pass>`` and ``time_<pass>`` (the two combined by the processing
mode).  Communication layers (``autopar.model.communication``) also carry,
for the base and the edge blocks of a pipeline chunk, ``comm_bytes_``,
``comm_time_`` and ``exposed_`` (time not hidden behind compute) per pass,
and ``tp_bw_req_`` (bandwidth needed to hide tile-overlapped communication).

Constructors take sizes in elements of the working datatype; the keywords
of ``layer`` say how the layer behaves under recompute and what it keeps.
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES
from autopar.model.context import LayoutContext
from autopar.model.finetune import frozen_layer, quantized_weights
from autopar.model.hardware import efficiency_at
from autopar.model.optimizers import layer_state

# The passes of a layer, in order.
STAGES = ("fw", "agrad", "wgrad", "optim")


def layer(ctx: LayoutContext, *, fw=0.0, agrad=0.0, wgrad=0.0, inputs=0.0, outputs=0.0,
          act=0.0, act_grads=0.0, weight=0.0, weight_grads=0.0, optim=0.0,
           recompute=False, recomm=False, reused=False, stored=True,
           out_stored=True, matrix=False, expert=False, adapter=False, factored=0.0):
    """A plain layer (Calculon's base Layer semantics); sizes in elements.

    ``fw``/``agrad``/``wgrad`` are the FLOPs of the forward pass and of the
    activation- and weight-gradient passes; ``act`` the activations kept for
    backward, ``act_grads`` the gradients of its output; ``recompute`` (the
    layer runs again in backward), ``recomm`` (its communication runs again),
    ``reused`` (its working space is another layer's), ``stored``/``out_stored``
    (its input/output stays in memory between passes), ``expert`` (its
    weights are routed experts': their gradients and optimizer state are
    sharded over the expert-data-parallel group).  Footprints in bytes:
    ``weight_b``, ``act_b``, ``out_b``, ``agrad_b``, ``wgrad_sh`` (weight
    gradients after sharding), ``wgrad_full`` (fp32, unsharded) and
    ``optimizer`` (master weights and moments, after sharding).
    ``adapter``: a LoRA adapter (trained where the base is frozen;
    ``autopar.model.finetune``); ``factored``: the rows + columns of its
    weight matrices (Adafactor's state; ``autopar.model.optimizers``).
    """
    z = ctx.zeros
    L = dict(fw=fw + z, agrad=agrad + z, wgrad=wgrad + z, inputs=inputs + z,
             outputs=outputs + z, act=act + z, act_grads=act_grads + z,
             weight=weight + z, weight_grads=weight_grads + z, optim=optim + z,
             recompute=np.broadcast_to(recompute, z.shape),
             recomm=np.broadcast_to(recomm, z.shape),
             reused=np.broadcast_to(reused, z.shape),
             stored=np.broadcast_to(stored, z.shape),
             out_stored=np.broadcast_to(out_stored, z.shape), matrix=matrix)
    b = ctx.elem_bytes
    optim_shards = ctx.expert_optim_shards if expert else ctx.optim_shards
    grad_shards = ctx.expert_grad_shards if expert else ctx.grad_shards
    L["expert"] = expert
    keep = None
    if ctx.frozen is not None and not adapter:
        # Fine-tuning with adapters: the base weights are frozen (an
        # adapter is a layer of only the rows that have it).
        keep = ctx.trainable
        frozen_layer(ctx, L, keep, matrix)
    state, per_param = L["optim"], 11
    if ctx.optimizer is not None:
        state, per_param = layer_state(ctx, L["optim"], matrix, factored)
    L["optim_flops"] = L["weight_grads"] / optim_shards * per_param
    L["mem_fw"] = (L["inputs"] + L["outputs"] + L["weight"]) * b
    L["mem_agrad"] = (L["weight"] + L["act"] + L["act_grads"]) * b
    L["mem_wgrad"] = np.where(L["weight"] == 0, 0.0,
                              (L["weight_grads"] + L["act"] + L["act_grads"]) * b)
    if ctx.grad_accum_bytes and not (matrix and ctx.grad_accum_in_gemm):
        # The framework adds each fresh weight gradient into its fp32
        # buffer outside the GEMM, once per micro-batch (TimeOverhead);
        # with grad_accum_in_gemm the linear layers' GEMMs accumulate in
        # place and only the other weighted layers (norms) take the hook.
        L["mem_wgrad"] = L["mem_wgrad"] + np.where(
            L["weight"] == 0, 0.0, L["weight_grads"] * ctx.grad_accum_bytes)
    master = np.where(b < 4, L["weight"] * ctx.master_bytes, 0.0)
    if keep is not None:
        master = master * keep
        L["mem_wgrad"] = L["mem_wgrad"] * keep
    # (the moments' elements at ctx.moment_bytes: 4, fp32, unless the
    # execution's optimizer_moment_bytes says bf16)
    L["optimizer"] = (master + state * ctx.moment_bytes) / optim_shards
    L["mem_optim"] = L["optimizer"]
    L["weight_b"] = L["weight"] * b
    L["act_b"] = L["act"] * b
    L["out_b"] = L["outputs"] * b
    L["wgrad_sh"] = L["weight_grads"] * b / grad_shards
    L["wgrad_full"] = L["weight_grads"] * 4
    L["agrad_b"] = L["act_grads"] * b
    L["kind"] = "plain"
    if ctx.qlora is not None and matrix and not adapter:
        quantized_weights(ctx, L)
    return L


def no_tp_comm(ctx: LayoutContext, L: dict) -> None:
    """Mark layer ``L`` as one without tensor-parallel communication: its
    collective sizes, times, exposed times and bandwidth needs are zero."""
    z = ctx.zeros
    for s in ("fw", "agrad", "wgrad"):
        for e in ("base", "edge"):
            L[f"comm_bytes_{s}_{e}"] = z
            L[f"comm_time_{s}_{e}"] = z
            L[f"exposed_{s}_{e}"] = z
    L["tp_bw_req_fw"] = L["tp_bw_req_agrad"] = z


def pieces_time(eng, flops, groups=None, parts=(1.0,)):
    """Seconds for ``flops`` run as ``groups`` equal GEMMs (a grouped GEMM's
    groups, a TP GEMM's per-rank chunks; None: one) of each of ``parts``
    (shares of the work: separate projections), each at the efficiency of
    its own size."""
    g = 1.0 if groups is None else groups
    return sum(g * eng.time(flops * p / g) for p in parts)


def finish(ctx: LayoutContext, L: dict) -> dict:
    """Compute times of a layer once its flops/mem columns are final."""
    flops = {"fw": L["fw"], "agrad": L["agrad"], "wgrad": L["wgrad"],
             "optim": L["optim_flops"]}
    if "time_scale" in L:       # a kernel that executes other work than it counts
        flops = dict(flops, agrad=flops["agrad"] + L["agrad_extra"])
    fp8 = ctx.fp8 if L.get("fp8") else None
    # A GEMM run as equal pieces: a grouped GEMM's groups, or the per-rank
    # chunks of a tile-overlapped TP GEMM (communication.tp_overlapped_linear).
    groups = L.get("groups", L.get("chunks"))
    # A fused projection the framework runs as separate GEMMs
    # (TimeOverhead.separate_projections; ``projections``): each its share.
    parts = L.get("parts", (1.0,)) if ctx.separate_projections else (1.0,)
    # A published fp8 linear speed-up (fp8_gemm): bf16 time / speed-up.
    speedup = L.get("fp8_speedup")
    for s in STAGES:
        eng = ctx.matrix if (L["matrix"] and s != "optim") else ctx.vector
        if (groups is not None or len(parts) > 1) and eng is ctx.matrix:
            # A grouped GEMM runs each group at the efficiency of its own
            # size; so does each chunk, and each separate projection.
            L["flops_time_" + s] = pieces_time(eng, flops[s], groups, parts)
            if fp8 is not None and s != "optim":
                L["flops_time_" + s] = np.where(
                    fp8, pieces_time(ctx.matrix_fp8, flops[s], groups, parts),
                    L["flops_time_" + s])
        else:
            L["flops_time_" + s] = eng.time(flops[s])
            if fp8 is not None and s != "optim":
                L["flops_time_" + s] = np.where(fp8, ctx.matrix_fp8.time(flops[s]),
                                                L["flops_time_" + s])
        L["mem_time_" + s] = ctx.mem1.time(L["mem_" + s])
        if speedup is not None and s != "optim":
            high = pieces_time(eng, flops[s], groups, parts)
            tab = speedup > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                L["flops_time_" + s] = np.where(tab, high / speedup, L["flops_time_" + s])
                L["mem_time_" + s] = np.where(tab, L["mem_time_" + s] / speedup,
                                              L["mem_time_" + s])
    if "time_scale" in L:
        for s in ("fw", "agrad"):
            L["flops_time_" + s] = L["flops_time_" + s] * L.get("time_scale_" + s, L["time_scale"])
    if L["kind"] == "plain":
        for s in STAGES:
            L["time_" + s] = ctx.processing_time(L["flops_time_" + s], L["mem_time_" + s])
        no_tp_comm(ctx, L)
    else:                       # a communication layer finishes itself
        L["finish"](ctx, L)
    return L


def linear(ctx, m, n, k, **kw):
    return layer(ctx, fw=2 * m * n * k, agrad=2 * m * n * k, wgrad=2 * m * n * k,
                 inputs=m * n, outputs=m * k, weight=n * k, weight_grads=n * k,
                  act=m * n, act_grads=m * k, optim=2 * n * k, matrix=True,
                  factored=n + k, **kw)


# FP8 recipes: bytes moved per element to quantize a tensor (read it in the
# working precision, write 1-byte values; the amax reduction reads it again
# for current scaling, folded in here), for one orientation; ``rowwise`` and
# ``mxfp8`` quantize both orientations the GEMMs of backward need.
_FP8_CAST_COPIES = {"tensorwise": 1.0, "rowwise": 2.0, "mxfp8": 2.0}

# FP4 recipes (issue 28), bytes per element of their quantized tensors:
# 4-bit E2M1 values and one 1-byte scale per block.  NVFP4 ("Pretraining
# Large Language Models with NVFP4", NVIDIA 2025, sections 2 and 4.3;
# Transformer Engine's ``NVFP4BlockScaling``): activations and gradients in
# 1x16 blocks with E4M3 scales, weights in 16x16 blocks (one scale per 256
# elements), each tensor with one fp32 scale as well.  MXFP4 (OCP
# Microscaling Formats spec v1.0): 1x32 blocks with E8M0 scales, no
# per-tensor scale.
NVFP4_BYTES = 0.5 + 1 / 16
NVFP4_WEIGHT_BYTES = 0.5 + 1 / 256
MXFP4_BYTES = 0.5 + 1 / 32


def _recipe_bytes():
    """Per recipe (indexed by its code): the bytes one element of an input or
    output gradient moves to be quantized, as ``(reads of the working
    precision, bytes written)``; the same for one element of a weight; the
    bytes of the quantized weight copies kept; the bytes of the saved input.

    * fp8: ``_FP8_CAST_COPIES`` quantizations, each a read and a 1-byte write.
    * ``nvfp4``, an input or output gradient: an amax pass for the per-tensor
      scale (one read), a row-wise quantization for the forward / data-grad
      GEMM, a column-wise one after a 16x16 random Hadamard transform for the
      weight-gradient GEMM (paper section 4.2; TE applies it inside the cast
      kernel: 16 multiply-adds an element on the tensor cores, far below the
      kernel's memory time, so only its bytes are counted); gradients are
      stochastically rounded (section 4.4), in the same kernels (no bytes).
      A weight: the amax read and one 2D-block quantization writing both
      orientations (16x16 blocks are the same blocks either way, section
      4.3); both orientations are kept across micro-batches (TE's weight
      workspace, as for fp8).  The saved input of the weight-gradient GEMM
      is its column-wise fp4 cast.
    * ``mxfp4``: as ``mxfp8`` (two orientations, no amax), with fp4 values.
    """
    n = len(CHOICES["fp8_recipe"])
    act_reads, act_write = np.zeros(n), np.zeros(n)
    w_reads, w_write = np.zeros(n), np.zeros(n)
    copy_b, saved_b = np.zeros(n), np.zeros(n)
    for name, c in _FP8_CAST_COPIES.items():
        i = CHOICES["fp8_recipe"].index(name)
        act_reads[i] = w_reads[i] = c
        act_write[i] = w_write[i] = c * 1.0
        copy_b[i], saved_b[i] = c * 1.0, 1.0
    i = CHOICES["fp8_recipe"].index("nvfp4")
    act_reads[i], act_write[i] = 3.0, 2 * NVFP4_BYTES
    w_reads[i], w_write[i] = 2.0, 2 * NVFP4_WEIGHT_BYTES
    copy_b[i], saved_b[i] = 2 * NVFP4_WEIGHT_BYTES, NVFP4_BYTES
    i = CHOICES["fp8_recipe"].index("mxfp4")
    act_reads[i] = w_reads[i] = 2.0
    act_write[i] = w_write[i] = copy_b[i] = 2 * MXFP4_BYTES
    saved_b[i] = MXFP4_BYTES
    return act_reads, act_write, w_reads, w_write, copy_b, saved_b


_RECIPE_BYTES = _recipe_bytes()


def _gathered_bytes():
    """Per recipe code: the bytes one weight element moves in Megatron-Core's
    parameter all-gather where the quantized weight is the only copy
    (``fp8_param_gather`` / ``fp4_param_gather``;
    MemoryOverhead.fp8_primary_weights), counted from the data-parallel
    buffer the gather reads (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/distributed/param_and_grad_buffer.py:
    ``group_params_for_buffers`` stores a quantized parameter in a uint8
    buffer of one element a parameter; ``_ParamAndGradBuffer.__init__``
    sizes an NVFP4 buffer by its packed row-wise bytes,
    ``nvfp4_packed_numel``; with MXFP8 parameters and the distributed
    optimizer it makes ``param_data`` a bf16 view of the gradient buffer,
    ``shared_buffer``, into which the bf16 values are gathered and
    re-quantized after, ``_post_param_sync``):

    * ``tensorwise``, ``rowwise``: the 1-byte values (the per-tensor or
      per-block scales are not in the buffer: each rank recomputes them from
      its fp32 master shard, ``quantize_param_shard``);
    * ``mxfp8``: 2 bytes (the bf16 view), the same as a bf16 parameter;
    * ``nvfp4``: the packed 4-bit row-wise values, half a byte;
    * ``mxfp4``: no Megatron-Core path; its values as nvfp4's.
    The cached copies beside them (Transformer Engine's transposes) are
    never gathered."""
    out = np.zeros(len(CHOICES["fp8_recipe"]))
    for name, g in (("tensorwise", 1.0), ("rowwise", 1.0), ("mxfp8", 2.0),
                    ("nvfp4", 0.5), ("mxfp4", 0.5)):
        out[CHOICES["fp8_recipe"].index(name)] = g
    return out


_GATHERED_BYTES = _gathered_bytes()


def fp8_gemm(ctx, L: dict) -> dict:
    """Mark a linear layer's GEMMs as low-precision where the row's recipe
    (fp8 or fp4) says so: they run at the recipe's matrix rate; the casts of
    its input and weight (forward) and of its output gradient (backward) move
    memory (``_recipe_bytes``); the quantized copies of the weight stay in
    memory beside the high-precision one.  Only the linear layers of a block
    are marked: the attention core's batched matmuls, norms, the embedding and
    the output layer stay in the working precision, as the fp8 recipes and
    NVIDIA's NVFP4 recipe keep them (paper section 4.1)."""
    if ctx.fp8 is None:
        return L
    L["fp8"] = True
    b = ctx.elem_bytes
    r = ctx.fp8_recipe
    act_reads, act_write, w_reads, w_write, copy_b, saved_b = (t[r] for t in _RECIPE_BYTES)
    per_act = act_reads * b + act_write          # bytes per element cast
    per_w = w_reads * b + w_write
    if ctx.fp8_speedup:
        # A recipe with a published speed-up (TimeOverhead.fp8_linear_speedup):
        # the layer's time is its bf16 time over the speed-up at its shape,
        # which includes the casts (layers.finish).
        s = fp8_table_speedup(ctx, L)
        L["fp8_speedup"] = s
        per_act = np.where(s > 0, 0.0, per_act)
        per_w = np.where(s > 0, 0.0, per_w)
    L["mem_fw"] = L["mem_fw"] + per_act * L["inputs"] + per_w * L["weight"]
    L["mem_agrad"] = L["mem_agrad"] + per_act * L["act_grads"]
    if ctx.fp8_weight_copy:
        if ctx.fp8_primary_weights:
            # The quantized weight is the layer's only copy (Megatron-Core's
            # fp8_param_gather / fp4_param_gather;
            # MemoryOverhead.fp8_primary_weights): the working-precision
            # bytes are not held (memory.footprints); ``weight_b`` keeps
            # them, as the gradient sync's size (communication), and the
            # parameter all-gather moves the quantized bytes instead
            # (``_gathered_bytes``; ``unsent_b``: the bytes it does not move).
            L["unkept_b"] = np.where(ctx.fp8, L["weight"] * b, 0.0)
            L["unsent_b"] = np.where(ctx.fp8, L["weight"] * (b - _GATHERED_BYTES[r]), 0.0)
        # The quantized copies are no parameters: Megatron-Core's data-
        # parallel buffers hold one gradient and one parameter element a
        # parameter (param_and_grad_buffer.py), so neither the gradient
        # reduce-scatter / all-reduce nor the parameter all-gather moves them
        # (``copy_b``, subtracted in communication.data_parallel_sync).
        L["copy_b"] = L["weight"] * copy_b
        L["weight_b"] = L["weight_b"] + L["copy_b"]
    # The input kept for the weight gradient is its quantized cast, in the one
    # orientation the weight-gradient GEMM reads (Transformer Engine drops
    # the row-wise data of a saved quantized input: update_usage(rowwise=False)).
    L["act_b"] = np.where(ctx.fp8, L["act"] * saved_b, L["act_b"])
    return L


def original_input(ctx, L: dict) -> dict:
    """The attention's output projection (an ``fp8_gemm`` layer) under
    ``memory_overhead.proj_saves_original``: on the rows with an fp8 / fp4
    recipe it saves its input in the working precision, not its quantized
    cast.  Megatron-Core sets ``save_original_input`` on ``linear_proj`` for
    every fp8 recipe but delayed scaling and for fp4
    (NVIDIA/Megatron-LM@2a75ac1 megatron/core/transformer/attention.py
    ``Attention.__init__``, and multi_latent_attention.py
    ``MultiLatentAttention.__init__`` the same: "the output of the fused core_attn is saved by
    itself, and linear_proj also saves the quantized tensor of this
    output"), and Transformer Engine's ``Linear`` then keeps ``inp`` itself
    (NVIDIA/TransformerEngine@d0067d0 transformer_engine/pytorch/module/
    linear.py: ``if save_original_input: inputmat = inp``).  That input is
    the attention core's output, which the core saves for its own backward
    and autopar counts once, through the projection (``flash_attention``
    counts q, k, v): the block then keeps it in the working precision
    (``act`` x the element bytes), as without the recipe, where the
    quantized cast (``fp8_gemm``: 1 byte, fp4 ``NVFP4_BYTES``) under-counted
    the core's saved output.  Rows without a recipe are unchanged."""
    if ctx.fp8 is None or not getattr(ctx, "proj_saves_original", False):
        return L
    L["act_b"] = np.where(ctx.fp8, L["act"] * ctx.elem_bytes, L["act_b"])
    return L


def projections(L: dict, widths) -> dict:
    """Mark a linear layer as the fusion of projections of these output
    widths (q, k, v; a gated MLP's gate and up): a framework that runs them
    as separate layers (TimeOverhead.separate_projections) times each GEMM
    at its own size (``finish``, ``pieces_time``) and has its published fp8
    speed-up read at each one's shape (``fp8_table_speedup``).  (``L``
    changed in place and returned.)"""
    total = float(sum(widths))
    if len(widths) > 1:
        L["parts"] = tuple(w / total for w in widths)
    return L


def fp8_table_speedup(ctx, L: dict) -> np.ndarray:
    """Per row, the published speed-up of an fp8 linear layer over bf16 at
    the grid shape nearest (log scale, clamped) to this layer's forward GEMM
    -- M tokens, K input and N output features, read back from its input,
    output and weight sizes (M^2 = inputs x outputs / weight) -- or 0 where
    the row's recipe has no table (TimeOverhead.fp8_linear_speedup).  M is
    the whole GEMM's where it runs as per-rank chunks: the casts the figure
    includes are of the whole tensors, and the chunks' own GEMM efficiency
    is in the bf16 time it divides (``finish``, ``pieces_time``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.sqrt(L["inputs"] * L["outputs"] / L["weight"])
        k, n = L["inputs"] / m, L["outputs"] / m
    # A fused projection the framework runs as separate linear layers
    # (TimeOverhead.separate_projections): each part's share of N and work.
    parts = L.get("parts", (1.0,)) if ctx.separate_projections else (1.0,)
    out = ctx.zeros.copy()
    ok = ctx.fp8 & (L["weight"] > 0)
    for code, (lm, lk, ln, table) in ctx.fp8_speedup.items():
        rows = ok & (ctx.fp8_recipe == code)
        if not rows.any():
            continue

        def nearest(axis, x):
            return np.abs(np.log2(np.maximum(x[rows], 1.0))[:, None] - axis[None, :]).argmin(1)
        im, ik = nearest(lm, m), nearest(lk, k)
        slow = sum(np.broadcast_to(share, m.shape)[rows] / table[im, ik, nearest(ln, n * share)]
                   for share in parts)
        out[rows] = 1.0 / slow
    return out


def grouped_linear(ctx, groups, m, n, k, **kw):
    """``groups`` experts' linear layers (n x k each) over ``m`` tokens in all,
    run as one grouped GEMM: FLOPs as one linear layer of the ``m`` tokens,
    time at the efficiency of one expert's GEMM (``m / groups`` tokens)."""
    L = layer(ctx, fw=2 * m * n * k, agrad=2 * m * n * k, wgrad=2 * m * n * k,
              inputs=m * n, outputs=m * k, weight=groups * n * k,
              weight_grads=groups * n * k, act=m * n, act_grads=m * k,
              optim=2 * groups * n * k, matrix=True, expert=True,
              factored=groups * (n + k), **kw)
    L["groups"] = groups + ctx.zeros
    return L


def batched_matmul(ctx, batch, m, n, k, **kw):
    return layer(ctx, fw=batch * 2 * m * n * k, agrad=batch * 4 * m * n * k,
                 inputs=batch * (m * n + n * k), outputs=batch * m * k,
                  act=batch * (m * n + n * k), act_grads=batch * m * k,
                  matrix=True, **kw)


def layer_norm(ctx, size, hidden, fused_norm, **kw):
    """LayerNorm as Calculon counts it (one pass; a fused kernel changes nothing)."""
    return layer(ctx, fw=9 * size, agrad=14 * size, wgrad=7 * size,
                 inputs=size, outputs=size, act=size, act_grads=size,
                  weight=2 * hidden, weight_grads=2 * hidden, optim=4 * hidden, **kw)


# PyTorch's reference RMSNorm upcasts to fp32 and runs as separate kernels:
# about this many extra bytes per element move through memory, and autograd
# keeps an fp32 copy of the input and the normalized fp32 output.  (Measured
# with PyTorch, benchmarks/memory_torch.py: Hugging Face's LlamaRMSNorm keeps
# 4 bytes per element beyond the fused kernel, in fp32 and bf16 alike; the
# LLaMA sweeps' calibration rests on 8: docs/validation.md, "Memory measured
# with PyTorch on CPU".)
_RMS_UNFUSED_TRAFFIC = {"fw": 48.0, "agrad": 80.0}
_RMS_UNFUSED_STORED = 8.0


def rms_norm(ctx, size, hidden, fused_norm, **kw):
    """RMSNorm: a fused kernel is one pass; unfused adds fp32 intermediates."""
    L = layer(ctx, fw=4 * size, agrad=8 * size, wgrad=2 * size,
              inputs=size, outputs=size, act=size, act_grads=size,
               weight=hidden, weight_grads=hidden, optim=2 * hidden, **kw)
    extra = np.where(fused_norm, 0.0, 1.0) * size
    L["mem_fw"] = L["mem_fw"] + extra * _RMS_UNFUSED_TRAFFIC["fw"]
    L["mem_agrad"] = L["mem_agrad"] + extra * _RMS_UNFUSED_TRAFFIC["agrad"]
    # Stored beside the input that the Fork before it keeps.
    L["keep_b"] = extra * _RMS_UNFUSED_STORED
    return L


def rotary(ctx, size, **kw):
    """Rotary position embedding applied to queries and keys (elementwise)."""
    return layer(ctx, fw=3 * size, agrad=3 * size, inputs=size, outputs=size,
                 act=0.0, act_grads=size, **kw)


def swiglu(ctx, size, fused, **kw):
    """SiLU(gate) * up over ``size`` outputs; keeps gate and up for backward
    (and SiLU(gate) too when not fused)."""
    keep = np.where(fused, 2.0, 3.0) * size
    L = layer(ctx, fw=6 * size, agrad=10 * size, inputs=2 * size, outputs=size,
              act=keep, act_grads=size, **kw)
    L["mem_agrad"] = L["mem_fw"]
    return L


# Executed work of a causal FlashAttention kernel relative to the counted
# (dense) attention flops (exactly a half unless time_overhead.attention_tile
# names the kernel's tile), and its speed relative to the matrix engine's
# curve (both passes, unless time_overhead.attention_backward_speed names the
# backward's); FlashAttention-2 partitions work better than v1.
_FLASH_CAUSAL = 0.5
_FLASH_SPEED = {"flash_v1": 0.6, "flash_v2": 0.75}


def flash_attention(ctx, mbs, heads_t, s, d, kv, impl, sk=None, dv=None, kv_v=None,
                    causal=True, **kw):
    """FlashAttention: QK^T, softmax and PV in one kernel; the s x s scores
    never reach memory and are recomputed in the backward pass.  With
    context parallelism ``s`` is the local queries and ``sk`` the keys they
    attend to (the whole sequence); K/V held locally are the local ones.
    ``dv`` / ``kv_v``: value head size and width when they differ from the
    keys' (multi-head latent attention).  The kernel saves its output for
    backward; that is the tensor the output projection that follows saves
    as its input (Megatron-Core's MLA passes the attention's output to
    ``linear_proj`` as a view: megatron/core/transformer/
    multi_latent_attention.py ``forward``), counted there, as for the
    other attention."""
    sk = s if sk is None else sk
    q = mbs * s * heads_t * d
    k = mbs * s * kv
    if dv is None:
        fw = 4 * mbs * heads_t * s * sk * d
        L = layer(ctx, fw=fw, agrad=2 * fw, inputs=q + 2 * k, outputs=q,
                  act=q + 2 * k, act_grads=q, matrix=True, **kw)
    else:
        v = mbs * s * kv_v
        o = mbs * s * heads_t * dv
        fw = 2 * mbs * heads_t * s * sk * (d + dv)
        L = layer(ctx, fw=fw, agrad=2 * fw, inputs=q + k + v, outputs=o,
                  act=q + k + v, act_grads=o, matrix=True, **kw)
    L["keep_b"] = mbs * heads_t * s * 4 + ctx.zeros          # log-sum-exp, fp32
    if ctx.cp_a2a_output_copy:
        # ``memory_overhead.cp_a2a_output_copy``: all-to-all context
        # parallelism keeps the output in the head-split layout too
        # (TransformerEngine AttnFuncWithCPAndQKVOA2A saves ``out_part``).
        L["keep_b"] = L["keep_b"] + np.where(_cp_a2a(ctx), L["outputs"] * ctx.elem_bytes, 0.0)
    L["mem_agrad"] = 2 * L["mem_fw"]
    speed = np.where(impl == CHOICES["attention_impl"].index("flash_v1"),
                     _FLASH_SPEED["flash_v1"], _FLASH_SPEED["flash_v2"])
    if ctx.attention_speed:
        # The framework's kernel as stated (time_overhead.attention_speed).
        speed = np.full_like(speed, ctx.attention_speed, dtype=float)
    if not causal:
        # ``sk`` already counts the keys each query attends to (a sparse
        # kernel's chosen keys: autopar.model.sparse_attention): the kernel
        # executes what is counted.
        causal = 1.0
    elif ctx.attention_tile:
        # A tile on the diagonal is computed whole (time_overhead.attention_tile).
        tiles = np.ceil(sk / ctx.attention_tile)
        causal = _FLASH_CAUSAL * (1.0 + 1.0 / tiles)
    else:
        causal = _FLASH_CAUSAL
    # Scale the executed flops into the time the kernel takes.
    L["time_scale"] = causal / speed
    if ctx.attention_backward_speed:
        # The kernel's backward at its own rate (time_overhead.attention_backward_speed).
        L["time_scale_agrad"] = causal / ctx.attention_backward_speed + ctx.zeros
    L["agrad_extra"] = fw                                      # recomputed forward
    if ctx.attention_rates and not ctx.attention_speed:
        # The system's measured kernel rates by the size of a call (system
        # file ``attention``), for the fused kernel: the framework's stated
        # kernel (time_overhead.attention_speed) wins.  One call: the ring
        # (p2p) calls the kernel once per step on a causal-equivalent block
        # of the local queries (s^2 / 2 of the executed s x sk / 2); the
        # all-to-all path (a2a) once, causal, on the whole sequence with
        # heads / cp: the whole executed work (context_parallel_elementwise).
        call = np.where(_cp_a2a(ctx), fw * causal, fw * causal * s / sk)
        measured_attention(ctx, L, call, fw * causal,
                           d, impl != CHOICES["attention_impl"].index("flash_v1"))
    return L


def _cp_a2a(ctx):
    """Rows whose context parallelism re-splits Q, K, V by heads
    (``context_par_comm: a2a``, TE ``AttnFuncWithCPAndQKVOA2A``)."""
    return (ctx.cp > 1) & (ctx._ext("context_par_comm", 0)
                           == CHOICES["context_par_comm"].index("a2a"))


def _cp_ring(ctx):
    """Rows whose context parallelism passes K/V round a ring
    (``context_par_comm: p2p``, TE ``AttnFuncWithCPAndKVP2P``)."""
    return (ctx.cp > 1) & (ctx._ext("context_par_comm", 0)
                           == CHOICES["context_par_comm"].index("p2p"))


def context_parallel_elementwise(ctx, mbs, heads_t, s, d, kv, dv=None, kv_v=None, **kw):
    """The elementwise passes Transformer Engine's context-parallel attention
    runs beside the kernel, per block and micro-batch, as one memory-bound
    layer (sizes: ``s`` local queries, ``heads_t`` query heads and ``kv`` /
    ``kv_v`` K / V widths per rank; ``dv`` the value head size).  Zero on
    rows without context parallelism.  Counted from
    NVIDIA/TransformerEngine ``attention/dot_product_attention/
    context_parallel.py`` (v2.11; ``pytorch/attention.py`` at bee4649, 2.2,
    alike), causal, bf16/fp16, sbhd/bshd, for the rank of the ring that does
    the most (rank cp - 1: every ring step of its forward and backward
    covers all its queries; the next layer's ring waits for it):

    * ring (p2p), ``AttnFuncWithCPAndKVP2P.forward``: K and V concatenated
      into the first send buffer (read + write K, V); the first step's
      log-sum-exp cloned, each later step's merged into it
      (``flash_attn_fwd_softmax_lse_correction``: two fp32 reads, one
      write); after the loop the output assembled from the cp steps' partial
      outputs (``flash_attn_fwd_out_correction_init``: read O_0, write O;
      ``flash_attn_fwd_out_correction`` per later step: read O and O_i,
      write O; each reads the two lse).  ``backward``: K, V copied into the
      ring buffer; dQ copied at step 0 and added at every later step
      (``dq.add_``: read, read, write); dK/dV of the first local chunk
      copied at step 0 and added at steps 1..cp-2, the whole dK/dV added at
      the last (diagonal) step.
    * all-to-all (a2a), ``AttnFuncWithCPAndQKVOA2A``:
      ``flash_attn_a2a_communicate`` makes three contiguous copies of each
      tensor it re-splits (``movedim(...).contiguous()`` before the
      exchange, and after it ``reorder_seq_chunks_for_a2a_*``'s
      ``contiguous`` and ``index_select``), read + write each: Q, K, V and
      O in the forward, dO, dQ, dK, dV in the backward.

    The kernel's own work is the flash layer's; the K/V / all-to-all
    transfers are ``communication.context_exchange``'s."""
    b = ctx.elem_bytes
    cp = ctx.cp
    dv = d if dv is None else dv
    kv_v = kv if kv_v is None else kv_v
    t = mbs * s
    Q, O = t * heads_t * d * b, t * heads_t * dv * b
    KV = t * (kv + kv_v) * b
    lse = t * heads_t * 4.0                                   # fp32 per query and head
    steps = np.maximum(cp - 1, 0)
    ring_fw = 2 * KV + 2 * lse + 2 * O + 2 * lse + steps * (3 * O + 2 * lse + 3 * lse)
    ring_bw = (2 * KV + 2 * Q + steps * 3 * Q
               + KV + np.maximum(cp - 2, 0) * 1.5 * KV + 3 * KV)
    a2a_fw = a2a_bw = 6 * (Q + KV + O)
    if ctx.cp_ring_impl != "te":
        ring_fw, ring_bw = torch_ring_elementwise(cp, Q, O, t * heads_t * d * b, lse, b)
    ring, a2a = _cp_ring(ctx), _cp_a2a(ctx)
    mem_fw = np.where(ring, ring_fw, np.where(a2a, a2a_fw, 0.0))
    mem_bw = np.where(ring, ring_bw, np.where(a2a, a2a_bw, 0.0))
    # Memory traffic only: the merges' arithmetic (a multiply-add per
    # element against 6 bytes moved) is not counted, so the block's FLOPs
    # stay the layers' matrix and elementwise counts.
    L = layer(ctx, **kw)
    L["mem_fw"] = mem_fw + ctx.zeros
    L["mem_agrad"] = mem_bw + ctx.zeros
    return L


def torch_ring_elementwise(cp, Q, O, kv_head_bytes, lse, b):
    """Bytes PyTorch's ring attention moves beside its SDPA calls, per block
    and micro-batch, forward and backward (``TimeOverhead.cp_ring_impl``
    ``torch_*``): ``Q`` / ``O`` the local queries' / output's bytes,
    ``kv_head_bytes`` one of K, V at the query heads' width (torchtitan's
    Llama repeats the K/V heads before SDPA: ``repeat_kv`` in
    torchtitan/models/llama/model.py at 9dec370), ``lse`` the fp32
    log-sum-exp bytes, ``b`` bytes an element.  Counted from
    ``torch/distributed/tensor/experimental/_attention.py`` of late 2024
    (``_templated_ring_attention``, ``_SDPAMerger``,
    ``_templated_ring_attention_backward``; ``convert_to_f32`` and
    ``enable_load_balance`` on, the defaults), for the rank that does the
    most, rank cp - 1 (every step after the first is ``i <= rank``: all its
    queries against the first half of the received K/V, merged whole):

    * forward: ``key.contiguous()`` / ``value.contiguous()`` (the SDPA
      inputs are ``transpose(1, 2)`` views: a copy, read + write K, V);
      ``torch.cat([key.flatten(), value.flatten()])`` before every send
      (cp - 1 of them, read + write K, V); each step's output cast to fp32
      (``out.to(torch.float32)``: read O, write 2 O); every later step's
      merge as eager elementwise kernels on the fp32 out and lse:
      ``block_lse - lse``, ``sigmoid``, ``out - block_out``, the product,
      ``out - ...`` (3 + 2 + 3 + 2 + 3 lse, 3 + 2 + 3 fp32 O, the
      product's broadcast lse read once), ``lse - block_lse``,
      ``logsigmoid``, ``lse - ...`` (3 + 2 + 3 lse); the result cast back
      (read fp32 O, write O).
    * backward: fp32 ``zeros_like`` of dQ, dK, dV (write); K, V made
      contiguous again and concatenated before each of the cp - 1 sends;
      step 0's ``grad_key += grad_key_`` (and V: read fp32 + bf16, write
      fp32); each later step's ``_partial_update(..., add=True)`` on the
      first half (the add on half, then ``torch.cat`` of the chunks: read +
      write the whole fp32 dK, dV); every step's ``torch.cat`` of the fp32
      dK, dV to send; every step's ``grad_query += grad_query_`` (read fp32
      + bf16, write fp32); the final casts of dQ and the received dK/dV to
      bf16.

    The transfers are ``communication.context_exchange``'s."""
    f = 4.0 / b                                               # fp32 over the working bytes
    KV = 2 * kv_head_bytes
    steps = np.maximum(cp - 1, 0)
    merge = 8 * f * O + 14 * lse                              # one later step's merge
    fw = 2 * KV + steps * 2 * KV + (O + f * O) + steps * (O + f * O + merge) + (f * O + O)
    bw = (f * Q + f * KV                                      # zeros_like
          + 2 * KV + steps * 2 * KV                           # contiguous, cats to send
          + (2 * f * KV + KV)                                 # step 0's dK/dV add
          + steps * (0.5 * (2 * f * KV + KV) + 2 * f * KV)    # half add, then cat
          + cp * 2 * f * KV                                   # dK/dV cat to send
          + cp * (2 * f * Q + Q)                              # dQ add
          + (f * Q + Q) + (f * KV + KV))                      # casts back to bf16
    return fw, bw


# FlashAttention's count of the backward's work, in forwards (the input
# gradients' 4 matmuls and the recomputed scores: flash-attention's
# benchmarks/benchmark_flash_attention.py ``flops()``; SimuMax's
# simu_tools/efficency_test/test_fa_efficiency.py counts the same,
# ``bwd_flops = 5 * base_flops`` over a ``2 * base_flops`` forward), which
# the system's measured backward rates are rates of.
_FLASH_BACKWARD_WORK = 2.5


def measured_attention(ctx, L, call, executed, d, rows):
    """Time the flash layer ``L`` at the system's measured kernel rates
    (``SystemSpec.attention``) on ``rows``: forward ``executed`` FLOPs at the
    forward rate and 2.5 x them at the backward rate, each a fraction of the
    datatype's matrix peak, read at the GFLOP of one kernel ``call`` (the
    executed forward work of one call: under context parallelism each ring
    step's call is a causal-equivalent block of the local queries, TE
    ``AttnFuncWithCPAndKVP2P``; under all-to-all one causal call over the
    whole sequence with heads / cp, ``AttnFuncWithCPAndQKVOA2A``) for head
    size ``d``.  Rows of a datatype or
    head size the record does not list keep their time."""
    scale = {s: L.get("time_scale_" + s, L["time_scale"]) + ctx.zeros for s in ("fw", "agrad")}
    work = {"fw": executed + ctx.zeros,
            "agrad": _FLASH_BACKWARD_WORK * executed + ctx.zeros}
    counted = {"fw": L["fw"] + ctx.zeros, "agrad": L["agrad"] + L["agrad_extra"] + ctx.zeros}
    call = call + ctx.zeros
    dtype = ctx.matrix.datatype + np.zeros(ctx.n, dtype=int)
    peak = ctx.matrix.peak + ctx.zeros
    for dt, by_dim in ctx.attention_rates.items():
        curves = by_dim.get(int(d))
        on = rows & (dtype == dt) & (counted["fw"] > 0)
        if curves is None or not on.any():
            continue
        for s, p in (("fw", "fwd"), ("agrad", "bwd")):
            rate = efficiency_at(*curves[p], call[on])
            # time_scale multiplies the matrix curve's time of the counted work.
            curve_time = ctx.matrix.time(counted[s])[on]
            scale[s][on] = work[s][on] / (peak[on] * rate) / curve_time
    L["time_scale"] = scale["fw"]
    L["time_scale_fw"] = scale["fw"]
    L["time_scale_agrad"] = scale["agrad"]


def dropout(ctx, size, **kw):
    L = layer(ctx, fw=size, agrad=size, inputs=size, outputs=size, act=size,
              act_grads=size, **kw)
    # The mask is one byte per element and is the only stored activation.
    L["act_b"] = L["act"]
    L["agrad_b"] = L["act_grads"]
    L["mem_fw"] = (L["inputs"] + L["outputs"]) * ctx.elem_bytes + L["act"]
    L["mem_agrad"] = L["mem_fw"]
    return L


def gelu(ctx, size, fused, **kw):
    keep = np.where(fused, 0.0, 1.0) * size
    L = layer(ctx, fw=8 * size, agrad=13 * size, inputs=size, outputs=size,
              act=keep, act_grads=keep, **kw)
    L["mem_agrad"] = L["mem_fw"]
    return L


def softmax(ctx, size, impl, llama, **kw):
    """Softmax over the attention scores.  PyTorch's LLaMA code computes it in
    fp32 with a separate scale/mask pass; a fused scale-mask-softmax kernel
    (and Calculon's count) keeps one score tensor in the working precision."""
    L = layer(ctx, fw=5 * size, agrad=8 * size, inputs=size, outputs=size,
              act=size, act_grads=size, **kw)
    if llama:
        torch = impl == CHOICES["attention_impl"].index("unfused")
        extra = np.where(torch, size * (4 - ctx.elem_bytes + 4), 0.0)   # fp32 probs + masked scores
        L["act_b"] = L["act_b"] + extra
        L["mem_fw"] = L["mem_fw"] + 2 * extra
    L["mem_agrad"] = L["mem_fw"]
    return L


def residual(ctx, a, b_, **kw):
    size = np.maximum(a, b_)
    return layer(ctx, fw=size, agrad=a + b_, inputs=a + b_, outputs=size,
                 act=a + b_, act_grads=size, **kw)


def fork(ctx, size, users, **kw):
    L = layer(ctx, inputs=size, agrad=users * size, act=size, **kw)
    L["mem_fw"] = ctx.zeros
    L["mem_agrad"] = L["act"] * ctx.elem_bytes * (users + 1)
    return L


def offload_group(layers, module: str):
    """``layers`` (one layer dict, or (layer, present) pairs) tagged as
    Megatron-Core's fine-grained offload group ``module``
    (``autopar.io.layouts.OFFLOAD_MODULES``): what autograd saves inside the
    group is what its layers store (``accumulate``: ``act_offload``).  A
    layer inside two groups (an expert GEMM is in ``expert_fc1`` and in the
    whole ``fused_group_mlp``; Megatron-Core never offloads both) carries
    both names: it offloads where a row offloads either."""
    for L in ([layers] if isinstance(layers, dict) else [L for L, _ in layers]):
        L["offload_module"] = L.get("offload_module", ()) + (module,)
    return layers
