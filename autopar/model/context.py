"""What every layer of a block needs to know about its layout, as columns.

``LayoutContext`` gathers, once per chunk of layouts, the quantities the
layer formulas share: bytes per element of the datatype, the tensor-parallel
size and how its communication is done, the divisors that optimizer
sharding applies to footprints, the compute engines and memory tiers, and
the processing mode (Calculon's ``roofline`` takes the slower of compute and
memory; ``no_overlap`` adds them).
"""
from __future__ import annotations

from functools import cached_property

import numpy as np

from autopar.io.layouts import BYTES_PER_ELEMENT, CHOICES, EXT_DEFAULTS
from autopar.io.specs import FP8_MATRIX, MemoryOverhead, ModelSpec, SystemSpec, TimeOverhead
from autopar.model.hardware import ComputeEngine, MemoryTier, NetworkTier, efficiency_curve


def is_choice(column: np.ndarray, field: str, value: str) -> np.ndarray:
    """Rows whose string-coded ``field`` is ``value``."""
    return column == CHOICES[field].index(value)


def _col(cols: dict, field: str):
    """An extension column, or its default (as a code) when the table lacks it."""
    if field in cols:
        return cols[field]
    default = EXT_DEFAULTS[field]
    return CHOICES[field].index(default) if field in CHOICES else default


def shard_counts(cols: dict):
    """How many ways data-parallel sharding divides (optimizer state, weight
    gradients, weights), per row.

    Calculon's optimizer_sharding divides the optimizer state and the weight
    gradients over data_par (ZeRO-2); ``unsharded_grads`` keeps the gradients
    whole (ZeRO-1); ``weight_sharding`` divides the weights too (ZeRO-3 /
    FSDP).  With context parallelism the data-parallel group is data_par x
    context_par (Megatron reduces gradients over both); ``sharding_group`` > 0
    shards over that many data-parallel ranks only (hybrid sharding).

    ``optimizer_outer_sharding`` (with hybrid sharding) divides the optimizer
    state, fp32 master weights included, over the whole data_par x
    context_par group while the weights and gradients stay divided over the
    instance's ``sharding_group`` x context_par ranks: Megatron-FSDP's
    ``outer_dp_sharding_strategy="optim"`` (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py,
    ``ParamAndGradBuffer`` docstring of the HFSDP helper buffers: the
    persistent parameters and gradients live in ``hfsdp_helper_wbuf`` /
    ``hfsdp_helper_gbuf`` in the inner-DP layout, the optimizer states are
    "fully sharded" over the DP group)."""
    group = cols["data_par"]
    sg, cp = np.asarray(_col(cols, "sharding_group")), np.asarray(_col(cols, "context_par"))
    if sg.any():
        group = choose(sg > 0, sg, group)
    if (cp != 1).any():
        group = group * cp
    shards = choose(cols["optimizer_sharding"], group, 1)
    optim = shards.astype(float)
    outer = np.asarray(_col(cols, "optimizer_outer_sharding"))
    if outer.any():
        optim = choose(outer & (sg > 0), cols["data_par"] * cp, shards).astype(float)
    ug = _col(cols, "unsharded_grads")
    grad = choose(ug, 1, shards).astype(float) if np.any(ug) or outer.any() else optim
    ws = np.asarray(_col(cols, "weight_sharding"))
    weight = choose(ws, shards, 1).astype(float) if ws.any() else np.ones_like(optim)
    return optim, grad, weight


def expert_data_parallel(cols: dict):
    """The expert-data-parallel group's size per row: Megatron lays expert_par
    x expert_tensor_par over tensor_par x data_par x context_par, so the
    experts' gradients (and optimizer state, and Megatron-FSDP's shards of
    their weights) spread over the rest, at least one rank."""
    dp = np.asarray(cols["data_par"], dtype=float)
    cp = np.asarray(_col(cols, "context_par"), dtype=float)
    tp = np.asarray(cols["tensor_par"], dtype=float)
    ep = np.asarray(_col(cols, "expert_par"), dtype=float)
    etp = np.asarray(_col(cols, "expert_tensor_par"), dtype=float)
    return np.maximum(dp * tp * cp / (ep * etp), 1.0)


def expert_weight_shards(cols: dict, weight_shards):
    """How many ways ``weight_sharding`` divides the routed experts' weights,
    per row (1 where it does not shard them): Megatron-FSDP shards each FSDP
    unit's expert parameters apart from its dense ones, over the
    expert-data-parallel group, tensor_par x data_par x context_par /
    (expert_par x expert_tensor_par) ranks (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py
    ``_get_parameter_groups``: a parameter group is expert or not by
    ``".experts." in name``; ``ParamAndGradBuffer._init_each_parameter_group_buffers``:
    its weight and gradient buffers on ``dist_index.get_fsdp_group(
    is_expert_parallel=group.is_expert_param)``, which
    mcore_fsdp_adapter.py ``_init_dist_index`` sets to
    ``parallel_state.get_expert_data_parallel_group()``).  With hybrid
    sharding (``sharding_group`` > 0: ``num_distributed_optimizer_instances``
    instances) the expert group is the one within an instance
    (``partial_expert_data_parallel=True``): the expert-data-parallel ranks
    over the instances.  ``weight_shards``: the dense weights' divisor
    (``shard_counts``)."""
    edp = expert_data_parallel(cols)
    dp = np.asarray(cols["data_par"], dtype=float)
    cp = np.asarray(_col(cols, "context_par"), dtype=float)
    # (instances = dp x cp / weight_shards where the weights are sharded)
    inner = np.maximum(np.floor(edp * weight_shards / (dp * cp)), 1.0)
    return np.where(weight_shards > 1, inner, 1.0)


def expert_shard_counts(cols: dict, weight_shards):
    """How many ways data-parallel sharding divides the routed experts'
    (optimizer state, weight gradients), per row: the expert-data-parallel
    group (``optimizer_sharding``; gradients whole with ``unsharded_grads``).
    With ``optimizer_outer_sharding`` (Megatron-FSDP's outer strategy
    ``optim``) the optimizer state keeps that whole group (the expert device
    mesh is ``outer_fsdp_dp`` x the instance's expert group,
    mcore_fsdp_adapter.py ``_init_dist_index``) while the gradients stay on
    the instance's expert group (``expert_weight_shards``):
    param_and_grad_buffer.py keeps them in ``hfsdp_helper_gbuf``, on
    ``get_fsdp_group(is_expert_parallel=True)``, the partial expert group
    of ``get_expert_data_parallel_group(partial_expert_data_parallel=True)``.
    Hybrid sharding without it (``outer_dp_sharding_strategy="no_shard"``:
    ``weight_sharding`` with ``sharding_group`` > 0 alone) divides both the
    optimizer state and the gradients by the instance's expert group only:
    with no HFSDP helper buffers the main weight and gradient buffers, and
    the optimizer state over the main weights, sit on
    ``get_fsdp_group(is_expert_parallel=True)`` ("DP-Shard only, since we're
    not sharding on DP-Outer", ``ParamAndGradBuffer``'s buffer set-up), which
    ``_init_dist_index`` makes the partial expert-data-parallel group whenever
    ``num_distributed_optimizer_instances`` > 1.  ``weight_shards``: the
    dense weights' divisor (``shard_counts``)."""
    edp = expert_data_parallel(cols)
    optim = np.where(cols["optimizer_sharding"], edp, 1.0)
    grad = np.where(_col(cols, "unsharded_grads"), 1.0, optim)
    hybrid = np.asarray(_col(cols, "weight_sharding")) \
        & (np.asarray(_col(cols, "sharding_group")) > 0)
    if np.any(hybrid):
        inner = expert_weight_shards(cols, weight_shards)
        outer = np.asarray(_col(cols, "optimizer_outer_sharding"))
        optim = np.where(hybrid & ~outer & np.asarray(cols["optimizer_sharding"]), inner, optim)
        grad = np.where(hybrid, inner, grad)
    return optim, grad


def grad_scale(cols):
    """Weight-gradient bytes relative to the working datatype: 4 / its bytes
    where ``fp32_grads`` (Megatron's fp32 main_grad), else 1; None where no
    row asks for fp32 gradients."""
    if "fp32_grads" not in cols or not cols["fp32_grads"].any():
        return None
    b = np.array([BYTES_PER_ELEMENT[d] for d in CHOICES["datatype"]], dtype=float)
    dt = cols["datatype"]
    if dt.strides == (0,):          # one datatype: a table of the two values
        return np.array([1.0, 4.0 / b[dt[0]]]).take(cols["fp32_grads"].view(np.uint8))
    return np.where(cols["fp32_grads"], 4.0 / b[dt], 1.0)


def pick(mask, a, b):
    """``np.where(mask, a, b)`` for float columns; ``a`` or ``b`` itself
    (a value broadcast to the rows) where ``mask`` is a view of one value (a
    default column, an option no row sets)."""
    if isinstance(mask, np.ndarray) and mask.strides == (0,) and mask.size:
        chosen = a if mask[0] else b
        return chosen if np.shape(chosen) == mask.shape else np.broadcast_to(
            np.asarray(chosen, dtype=float), mask.shape)
    return np.where(mask, a, b)


def masked(x, mask):
    """``np.where(mask, x, 0)`` for integers or finite floats (sizes; not
    times, which may be inf), as ``x * mask``: x * 1 is x and x * 0 is zero,
    exactly, at a fifth of np.where's time on a mask that changes from row to
    row."""
    return x * mask


def choose(mask, a, b):
    """``np.where(mask, a, b)`` for integers (columns or numbers), as
    ``b + (a - b) * mask``: exact, and a fraction of np.where's time on a
    mask that changes from row to row."""
    return b + (a - b) * mask


class LayoutContext:
    """Per-row quantities shared by all layers of a block."""

    def __init__(self, model: ModelSpec, system: SystemSpec, cols: dict, datatypes,
                 shards=None):
        self.model = model
        self.n = len(cols["tensor_par"])
        self.training = cols["training"]
        self.all_training = bool(np.all(self.training))
        self.elem_bytes = np.array([BYTES_PER_ELEMENT[d] for d in CHOICES["datatype"]],
                                   dtype=float)[cols["datatype"]]
        self.matrix = ComputeEngine(system.matrix, cols["datatype"], datatypes)
        self.vector = ComputeEngine(system.vector, cols["datatype"], datatypes)
        self.mem1 = MemoryTier(system.mem1)
        self.mem2 = MemoryTier(system.mem2)
        self.roofline = system.processing_mode == "roofline"
        # The framework's records (their defaults: Calculon's count).
        t = system.time_overhead or TimeOverhead()
        mo = system.memory_overhead or MemoryOverhead()
        # Host time exposed per MoE block and micro-batch (autopar.model.moe).
        self.moe_host_s = t.moe_block_s
        # ... and host time per op issued after the block's token-count sync
        # (overhead.moe_sync_ops; moe.host_sync).
        self.moe_host_op_s = t.moe_host_op_s
        # The framework's fused-attention speed, where stated (layers.flash_attention).
        self.attention_speed = t.attention_speed
        # ... its backward's speed and its causal tile, where stated.
        self.attention_backward_speed = t.attention_backward_speed
        self.attention_tile = t.attention_tile
        # Whose context-parallel ring runs the ``p2p`` rows (TimeOverhead.
        # cp_ring_impl: "te", or PyTorch's "torch_allgather" / "torch_alltoall";
        # communication.context_exchange, layers.context_parallel_elementwise).
        self.cp_ring_impl = t.cp_ring_impl
        # The system's measured attention kernel rates, where it lists them:
        # {datatype code: {head size: {pass: (thresholds in FLOP, rates)}}}
        # (SystemSpec.attention; layers.flash_attention).
        self.attention_rates = {
            CHOICES["datatype"].index(dt): {
                d: {p: (th * 1e9, eff) for p, (th, eff) in
                    ((p, efficiency_curve(tab)) for p, tab in passes.items())}
                for d, passes in by_dim.items()}
            for dt, by_dim in (system.attention or {}).items()
            if CHOICES["datatype"].index(dt) in datatypes}
        # Weight-gradient accumulation outside the GEMM, bytes per weight and
        # micro-batch (layers.layer: the weight-gradient pass's memory time),
        # not on the linear layers where their GEMMs accumulate in place.
        self.grad_accum_bytes = t.grad_accum_bytes
        self.grad_accum_in_gemm = bool(t.grad_accum_in_gemm)
        # Overlapped TP GEMMs run as tensor_par per-rank chunks
        # (communication.tp_overlapped_linear; TimeOverhead.tp_overlap_chunks).
        self.tp_overlap_chunks = bool(t.tp_overlap_chunks)
        # The framework's LoRA adapter's element-wise bytes (adapters.adapter_layers).
        self.adapter_bytes = t.adapter_bytes
        # Bytes of the optimizer's master copy per weight (narrow datatypes).
        self.master_bytes = mo.master_weight_bytes
        # Bytes of an optimizer-state element (the moments): 4 (fp32,
        # Calculon's) or 2 (bf16, the precision-aware optimizer).
        moments = np.asarray(_col(cols, "optimizer_moment_bytes"))
        self.moment_bytes = 4.0 if not (moments != 4).any() else \
            np.broadcast_to(moments, (self.n,)).astype(float)
        # GEMM and router inputs counted as autograd keeps them (block, moe).
        self.autograd_inputs = bool(mo.autograd_inputs)
        self.moe_probs_in_activation = bool(mo.moe_probs_in_activation)
        # The framework memory terms a block sums only where asked for
        # (block.framework_terms).
        self.dummy_wgrad = bool(mo.dummy_wgrad)
        self.backward_by_op = mo.backward_transient == "op"
        # CUDA graphs and what their memory pool keeps apart (block.framework_terms).
        self.cuda_graphs = mo.cuda_graphs
        self.cp_a2a_output_copy = bool(mo.cp_a2a_output_copy)
        # What a block keeps under selective recompute (block.op_policy_saves).
        self.selective_saves = mo.selective_saves
        # Whether the fp8 / fp4 recipes keep a quantized copy of each weight.
        self.fp8_weight_copy = mo.fp8_weight_copy
        # ... and whether that copy is the only one (layers.fp8_gemm).
        self.fp8_primary_weights = bool(mo.fp8_primary_weights)
        # ... and whether the output projection saves its unquantized input
        # (layers.original_input).
        self.proj_saves_original = bool(mo.proj_saves_original)
        # Bytes a LoRA adapter keeps per input element beyond the base
        # layer's saved input (adapters.adapter_layers).
        self.adapter_saved_bytes = mo.adapter_saved_bytes
        self.tp = cols["tensor_par"].astype(float)
        # Optimizer sharding divides the optimizer state (and, unless the
        # gradients are kept whole, the weight gradients) over data_par
        # (``shards``: ``shard_counts(cols)`` when the caller has them).
        self.optim_shards, self.grad_shards, self.weight_shards = (
            shard_counts(cols) if shards is None else shards)
        # Context parallelism: each processor holds 1/context_par of the sequence.
        self.cp = np.broadcast_to(_col(cols, "context_par"), (self.n,)).astype(float)
        # FP8 / FP4 recipes: the block's GEMMs run at the recipe's matrix rate
        # (``FP8_MATRIX``: float8, mxfp8, nvfp4 or mxfp4).
        recipe = np.broadcast_to(_col(cols, "fp8_recipe"), (self.n,))
        self.fp8 = None
        if (recipe != 0).any():
            self.fp8 = recipe != 0
            self.fp8_recipe = recipe
            dts = CHOICES["datatype"]
            have = [dts.index(d) for d in dict.fromkeys(FP8_MATRIX.values())
                    if d in system.matrix]
            fallback = have[0] if have else dts.index(next(iter(system.matrix)))
            rate = np.array([fallback] + [dts.index(FP8_MATRIX[r])
                                          for r in CHOICES["fp8_recipe"][1:]], dtype=np.int8)
            code = rate[recipe]
            # The codes present, from the recipes present (a comparison each).
            present = {int(rate[i]) for i in range(len(rate)) if (recipe == i).any()}
            used = sorted(present & set(have))
            if len(used) < len(present):
                code = np.where(np.isin(code, used), code, fallback).astype(np.int8)
                used = sorted(set(used) | {fallback})
            self.matrix_fp8 = ComputeEngine(system.matrix, code, used)
        # Bytes an element of a TP all-gather moves: the working precision,
        # or float8's 1 byte where the framework gathers the tensorwise cast
        # (TimeOverhead.tp_gather_fp8; communication.finish_tp_collective /
        # finish_tp_overlapped).
        self.tp_gather_bytes = self.elem_bytes
        if self.fp8 is not None and t.tp_gather_fp8:
            tensorwise = recipe == CHOICES["fp8_recipe"].index("tensorwise")
            self.tp_gather_bytes = np.where(tensorwise, 1.0, self.elem_bytes)
        # Published speed-ups of the framework's fp8 linear layer over bf16,
        # per recipe code (TimeOverhead.fp8_linear_speedup; layers.fp8_gemm).
        self.fp8_speedup = {}
        # ... read at each separate projection's shape (layers.fp8_table_speedup).
        self.separate_projections = bool(t.separate_projections)
        if self.fp8 is not None:
            for r, ms, ks, ns, v in t.fp8_linear_speedup:
                self.fp8_speedup[CHOICES["fp8_recipe"].index(r)] = (
                    np.log2(ms), np.log2(ks), np.log2(ns),
                    np.asarray(v, dtype=float).reshape(len(ms), len(ks), len(ns)))
        # Optimizers and fine-tuning (autopar.model.optimizers, .finetune):
        # None where every row is Calculon's (Adam, every weight trained).
        opt = np.asarray(_col(cols, "optimizer"))
        self.optimizer = np.broadcast_to(opt, (self.n,)) if opt.any() else None
        adapter = np.asarray(_col(cols, "adapter"))
        self.frozen = self.qlora = None
        if adapter.any():
            adapter = np.broadcast_to(adapter, (self.n,))
            self.frozen = adapter != 0
            self.trainable = (~self.frozen).astype(float)
            q = is_choice(adapter, "adapter", "qlora")
            self.qlora = q if q.any() else None
            self.adapter_rank = np.broadcast_to(_col(cols, "adapter_rank"),
                                                (self.n,)).astype(float)
            self.adapter_targets = np.broadcast_to(_col(cols, "adapter_targets"), (self.n,))
        self.tp_net = NetworkTier(system.networks, cols["tensor_par_net"])
        self.cp_net = NetworkTier(system.networks,
                                  np.broadcast_to(_col(cols, "context_par_net"), (self.n,)))
        comm = cols["tensor_par_comm_type"]
        # Sequence parallelism: reduce-scatter + all-gather instead of all-reduce.
        self.tp_rs_ag = is_choice(comm, "tensor_par_comm_type", "rs_ag")
        # The same split only at the edges of a block (point-to-point variant).
        self.tp_p2p = is_choice(comm, "tensor_par_comm_type", "p2p_rs_ag")
        self.tp_pipe_overlap = is_choice(cols["tensor_par_overlap"], "tensor_par_overlap",
                                         "pipe")
        self._cols = cols
        self._networks = system.networks
        self.zeros = np.zeros(self.n)

    # Mixture of experts (computed on first use: dense layouts never ask).
    # Expert weights are spread over expert_par x expert_tensor_par
    # processors; their gradients are synchronised, and their optimizer state
    # sharded, over the expert-data-parallel group (tensor_par * data_par *
    # context_par / (EP * ETP), as Megatron lays EP over TP x DP x CP).
    # Under weight_sharding their weights are sharded over that group too
    # (Megatron-FSDP: ``expert_weight_shards``).
    def _ext(self, field, default):
        return np.broadcast_to(self._cols.get(field, default), (self.n,))

    @cached_property
    def ep(self):
        return self._ext("expert_par", 1).astype(float)

    @cached_property
    def etp(self):
        return self._ext("expert_tensor_par", 1).astype(float)

    @cached_property
    def edp(self):
        return np.broadcast_to(expert_data_parallel(self._cols), (self.n,))

    @cached_property
    def expert_weight_shards(self):
        """``expert_weight_shards`` of the rows (1 where nothing is weight-sharded)."""
        if not np.any(self.weight_shards > 1):
            return np.ones(self.n)
        return np.broadcast_to(expert_weight_shards(self._cols, self.weight_shards), (self.n,))

    @cached_property
    def _expert_shards(self):
        optim, grad = expert_shard_counts(self._cols, self.weight_shards)
        return np.broadcast_to(optim, (self.n,)), np.broadcast_to(grad, (self.n,))

    @cached_property
    def expert_optim_shards(self):
        """``expert_shard_counts``' optimizer-state divisor of the rows."""
        return self._expert_shards[0]

    @cached_property
    def expert_grad_shards(self):
        """``expert_shard_counts``' gradient divisor of the rows."""
        return self._expert_shards[1]

    @cached_property
    def ep_net(self):
        return NetworkTier(self._networks, self._ext("expert_par_net", 0))

    @cached_property
    def etp_net(self):
        return NetworkTier(self._networks, self._ext("expert_tensor_par_net", 0))

    @cached_property
    def moe_allgather(self):
        return is_choice(self._ext("moe_dispatcher", 0), "moe_dispatcher", "allgather")

    @cached_property
    def moe_deepep(self):
        return is_choice(self._ext("moe_dispatcher", 0), "moe_dispatcher", "deepep")

    @cached_property
    def ep_local(self):
        """Ranks of an EP group that share the first tier: a group on a tier
        above the first spans several first-tier domains (nodes)."""
        size0 = self._networks[0].size
        return np.where(self.ep_net.tier > 0, np.minimum(size0, self.ep), self.ep)

    @cached_property
    def net0(self):
        return NetworkTier(self._networks, np.zeros(self.n, dtype=np.int64))

    @cached_property
    def moe_overlap(self):
        return self._ext("moe_overlap", False)

    def if_training(self, x, other=0.0):
        """``np.where(training, x, other)``: ``x`` itself (a float column)
        when every row trains."""
        if self.all_training and isinstance(x, np.ndarray) and x.dtype == np.float64 \
                and x.shape == (self.n,):
            return x
        return np.where(self.training, x, other)

    def processing_time(self, flops_time, mem_time):
        """Time of work that computes ``flops_time`` and moves ``mem_time``."""
        if self.roofline:
            return np.maximum(flops_time, mem_time)
        return flops_time + mem_time
