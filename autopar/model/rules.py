"""Rules: why a layout cannot run, checked in Calculon's order.

Follows the checks of Calculon's ``llm.py``.  A reason starting "invalid:"
means the layout breaks a rule of its own (sizes that do not divide, an
option that needs another); "infeasible:" means it is well formed but the
system cannot run it (network tiers too small or not filled, interleaving
the blocks do not allow, offloading with too few blocks, memory capacity).
Each layout gets the first reason it meets, as a small integer code.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from autopar.io.layouts import (CHOICES, EXT_DEFAULTS, EXT_INT_FIELDS, FIELDS, SPLIT_FIELDS,
                                decoder_layer_counts, explicit_layout, offload_module_mask,
                                EXPERT_OFFLOAD_MODULES,
                                placement_problem)
from autopar.io.specs import FP8_MATRIX, ModelSpec, SystemSpec
from autopar.model.hardware import MAX_TIERS
from autopar.model.context import choose
from autopar.model.lookup import Ranges, by_value
from autopar.model.pipeline import distinct_splits, uneven_rows

# Why a layout cannot run.  "invalid": the layout breaks a rule of its own;
# "infeasible": well formed, but the system cannot run it.
REASONS: tuple[str, ...] = (
    "",
    "invalid: sizes must be positive",
    "invalid: tensor_par * pipeline_par * data_par != num_procs",
    "invalid: batch_size is not divisible by data_par",
    "invalid: local batch is not divisible by microbatch_size",
    "invalid: activation recompute is only for training",
    "invalid: pipeline_interleaving must be 1 when pipeline_par is 1",
    "invalid: optimizer_sharding needs data_par > 1",
    "invalid: tensor_par_overlap needs tensor_par > 1",
    "invalid: seq_par_ag_redo needs tensor_par_comm_type rs_ag",
    "invalid: seq_par_ag_redo is not used with full recompute",
    "invalid: data_par_overlap needs training and data_par > 1",
    "invalid: optimizer_offload is only for training",
    "invalid: network tier out of range",
    "invalid: datatype not supported by the system",
    "invalid: hidden, feedforward and attn_heads must be divisible by tensor_par",
    "invalid: microbatch_size * seq_size must be divisible by tensor_par",
    "infeasible: pipeline_interleaving exceeds the blocks per processor",
    "infeasible: pipeline_interleaving must divide the blocks per processor",
    "infeasible: offloading requires each processor to handle at least 3 blocks",
    "infeasible: mem tier1 capacity exceeded",
    "infeasible: mem tier2 capacity exceeded",
) + tuple(f"infeasible: network tier{t} isn't big enough" for t in range(MAX_TIERS)) \
  + tuple(f"infeasible: network tier{t} isn't fully used" for t in range(MAX_TIERS))

# Rules of autopar's extension fields (after Calculon's, so its codes stay).
REASONS = REASONS + (
    "invalid: seq_size must be divisible by 2 * context_par",
    "invalid: context_par_comm a2a needs attn_heads divisible by tensor_par * context_par",
    "invalid: weight_sharding needs optimizer_sharding without unsharded_grads",
    "invalid: sharding_group must divide data_par and needs optimizer_sharding",
    "invalid: recompute_layers needs activation_recompute full",
    "invalid: fp8_recipe needs datatype bfloat16 or float16 and the system's rate "
    "for the recipe",
    "invalid: tensor_par * pipeline_par * data_par * context_par != num_procs",
    "invalid: param_gather_overlap needs optimizer_sharding without weight_sharding",
    # mixture of experts and latent attention (issue 14)
    "invalid: expert_par and expert_tensor_par need a mixture-of-experts model",
    "invalid: expert_par must divide the number of experts",
    "invalid: expert_tensor_par must divide the expert feed-forward size",
    "invalid: expert_par * expert_tensor_par must divide tensor_par * data_par * context_par",
    "invalid: moe_dispatcher other than alltoall and moe_overlap need expert_par or "
    "expert_tensor_par > 1",
    "invalid: a mixture-of-experts model with tensor_par > 1 needs "
    "tensor_par_comm_type rs_ag (sequence parallelism)",
    "invalid: shared_feedforward must be divisible by tensor_par",
    "invalid: latent attention (mla) is modelled with tensor_par_overlap none",
)
# Uneven pipelines as Megatron-Core splits them (issue 24;
# ``autopar.model.pipeline.stage_split`` says which source states each).
REASONS = REASONS + (
    "invalid: first_stage_blocks and last_stage_blocks must be >= 0",
    "invalid: pipeline split fields need pipeline_par > 1",
    "invalid: first_stage_blocks and last_stage_blocks cannot be set with "
    "embedding_in_split or loss_in_split",
    "invalid: pipeline_layout balanced cannot be set with first_stage_blocks "
    "or last_stage_blocks",
    "infeasible: first_stage_blocks and last_stage_blocks must be divisible "
    "by pipeline_interleaving",
    "infeasible: the middle stages must share the blocks first_stage_blocks "
    "and last_stage_blocks leave evenly",
    "infeasible: the middle stages' blocks must be divisible by pipeline_interleaving",
    "infeasible: blocks with the embedding and loss counted must be divisible "
    "by pipeline_par",
    "infeasible: blocks per stage with the embedding and loss counted must be "
    "divisible by pipeline_interleaving",
    "infeasible: pipeline_layout balanced needs a block for every virtual stage",
    "invalid: mamba heads and groups must be divisible by tensor_par",
    "invalid: a hybrid model's Mamba / Gated DeltaNet layers are not modelled "
    "with context_par",
    "infeasible: a hybrid model's blocks must divide by pipeline_par x "
    "pipeline_interleaving to interleave (one '|' segment a virtual stage)",
)
# Counts beyond what the model has (issue 27): Megatron-Core's TransformerConfig
# (megatron/core/transformer/transformer_config.py, __post_init__) takes
# recompute_num_layers between 1 and num_layers // pipeline_model_parallel_size.
REASONS = REASONS + (
    "invalid: recompute_layers exceeds the blocks per pipeline stage "
    "(num_blocks // pipeline_par)",
)
# The recipe's BF16 first / last blocks (issue 28): Megatron-Core's
# TransformerConfig.__post_init__ takes num_layers_at_start_in_bf16 and
# num_layers_at_end_in_bf16 between 0 and num_layers // pipeline_model_parallel_size.
REASONS = REASONS + (
    "invalid: bf16_first_blocks and bf16_last_blocks must be 0..num_blocks // pipeline_par",
)
# Optimizers and fine-tuning (issue 28; autopar.model.finetune).
REASONS = REASONS + (
    "invalid: qlora dequantises to bfloat16 or float16 GEMMs: no fp8_recipe",
    "invalid: adapter_rank must be >= 1 and sequence_fill 1..100",
)
# Partial CPU activation offloading (issue 24, ``activation_offload_blocks``):
# Megatron-Core's TransformerConfig.__post_init__ (NVIDIA/Megatron-LM@2a75ac1
# megatron/core/transformer/transformer_config.py) takes cpu_offloading only
# without pipeline parallelism and without activation recompute, with
# cpu_offloading_num_layers below num_layers; Transformer Engine's
# get_cpu_offload_context (cpu_offload.py) refuses offloading every layer.
REASONS = REASONS + (
    "invalid: activation_offload_blocks needs training, pipeline_par 1, no activation "
    "recompute and no activations_offload",
    "invalid: activation_offload_blocks must be 0..num_blocks - 1",
)
# Fine-grained activation offloading (issue 24, ``activation_offload_modules``):
# Megatron-Core's TransformerConfig.__post_init__ (NVIDIA/Megatron-LM@2a75ac1)
# refuses it beside cpu_offloading; autopar counts it in training only, with
# no full recompute (a fully recomputed block saves only its input) and not
# beside the all-activations ``activations_offload``; the expert modules need
# routed experts.
REASONS = REASONS + (
    "invalid: activation_offload_modules needs training, no full activation recompute, "
    "no activations_offload and no activation_offload_blocks",
    "invalid: activation_offload_modules names an expert module (expert_fc1, moe_act, "
    "fused_group_mlp) for a model without routed experts",
)
# Gated DeltaNet layers (autopar.model.gated_delta).
REASONS = REASONS + (
    "invalid: gdn key and value heads must be divisible by tensor_par",
)
# Explicit pipeline layouts (issue 24 item 4, ``autopar.model.pipeline.layout_chunks``):
# Megatron-Core's pipeline_parallel_layer_layout.py / transformer_config.py checks.
REASONS = REASONS + (
    "invalid: an explicit pipeline_layout cannot be set with first_stage_blocks, "
    "last_stage_blocks, embedding_in_split or loss_in_split",
    "invalid: an explicit pipeline_layout's virtual stages must number "
    "pipeline_par x pipeline_interleaving",
    "invalid: an explicit pipeline_layout's decoder layers t must number the "
    "model's blocks (or half of a hybrid pattern's mixer + MLP pairs)",
    "invalid: an explicit pipeline_layout must hold the embedding first and the loss and "
    "the model's MTP layers last",
)
# DeepSeek Sparse Attention's all-gather context parallelism (megatron/core/
# transformer/experimental_attention_variant/dsa.py, DSAttention.forward).
REASONS = REASONS + (
    "invalid: context_par_comm allgather is modelled for DeepSeek Sparse Attention "
    "(mla.sparse_index) only",
)
# Megatron-FSDP's outer optimizer sharding (NVIDIA/Megatron-LM@2a75ac1
# megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:
# "Optimizer fully-sharded HFSDP is only supported with full-sharding on
# DP-Shard"; it needs num_distributed_optimizer_instances > 1).
REASONS = REASONS + (
    "invalid: optimizer_outer_sharding needs weight_sharding and 0 < sharding_group < data_par",
)
REASON_CODE = {r: i for i, r in enumerate(REASONS)}
_NET_BIG = REASON_CODE["infeasible: network tier0 isn't big enough"]
_NET_FILL = REASON_CODE["infeasible: network tier0 isn't fully used"]


# Rows checked at a time: slices whose columns stay in cache.  At 2^17 a
# slice's temporaries (about 40 int64 columns of 1 MiB) outgrew glibc's
# trim threshold in a process that had freed no larger array, so the heap
# was handed back after every slice and faulted in again by the next: 31k
# of the 68k page faults of a repeated evaluate_columns on 1M layouts (issue
# 13's benchmark, layouts loaded from a file); at 2^16, 2k.
CHUNK = 1 << 16


def check(model: ModelSpec, system: SystemSpec, cols: dict) -> tuple[np.ndarray, list[int]]:
    """The first rule each layout breaks (an index in ``REASONS``; 0: none), and
    the datatype codes the system supports.  Memory capacity is checked
    after the model has run (``autopar.model.evaluate``)."""
    n = len(cols["tensor_par"])
    if n <= CHUNK:
        return _check(model, system, cols)
    code = np.empty(n, dtype=np.int16)
    for i in range(0, n, CHUNK):
        sl = slice(i, min(i + CHUNK, n))
        code[sl], dts = _check(model, system, {f: v[sl] for f, v in cols.items()})
    return code, dts


def _check(model: ModelSpec, system: SystemSpec, cols: dict) -> tuple[np.ndarray, list[int]]:
    n = len(cols["tensor_par"])
    code = np.zeros(n, dtype=np.int16)

    def flag(mask, reason):
        mask = np.asarray(mask, dtype=bool)
        if mask.any():          # (most rules hold for every row)
            code[(code == 0) & mask] = REASON_CODE[reason]

    dts = [CHOICES["datatype"].index(d) for d in system.datatypes]
    if not n:
        return code, dts
    t, pp, dp = cols["tensor_par"], cols["pipeline_par"], cols["data_par"]
    tr = cols["training"]
    # The columns' ranges, found once, shared by the value tables and by the
    # rules: a rule that no value in range can break is not checked row by row.
    ranges = Ranges()
    sizes = (cols["num_procs"], t, pp, dp, cols["batch_size"], cols["microbatch_size"],
             cols["pipeline_interleaving"])
    if min(ranges(c)[0] for c in sizes) <= 0:
        flag(np.logical_or.reduce([c <= 0 for c in sizes]), "invalid: sizes must be positive")

    def at_least_1(c):
        return c if ranges(c)[0] >= 1 else np.maximum(c, 1)
    tp1, pp1, dp1 = at_least_1(t), at_least_1(pp), at_least_1(dp)
    mbs1 = at_least_1(cols["microbatch_size"])
    cp = cols["context_par"]
    cp1 = at_least_1(cp)
    extended = ranges(cp) != (1, 1)
    if extended:
        if ranges(cp)[0] <= 0:
            flag(cp <= 0, "invalid: sizes must be positive")
        flag((cp == 1) & (t * pp * dp != cols["num_procs"]),
             "invalid: tensor_par * pipeline_par * data_par != num_procs")
        flag(t * pp * dp * cp != cols["num_procs"],
             "invalid: tensor_par * pipeline_par * data_par * context_par != num_procs")
    else:
        flag(t * pp * dp != cols["num_procs"],
             "invalid: tensor_par * pipeline_par * data_par != num_procs")
    flag(cols["batch_size"] % dp1 != 0, "invalid: batch_size is not divisible by data_par")
    # (where data_par divides the batch -- the only rows this rule can flag --
    # micro-batches divide the local batch exactly where data_par *
    # microbatch_size divides the batch: one remainder instead of a division
    # and a remainder, while that product stays within int64)
    local = (cols["batch_size"] % (dp1 * mbs1) if ranges(dp1)[1] * ranges(mbs1)[1] < 1 << 62
             else (cols["batch_size"] // dp1) % mbs1)
    flag(local != 0, "invalid: local batch is not divisible by microbatch_size")
    rec = cols["activation_recompute"]
    flag((rec != CHOICES["activation_recompute"].index("none")) & ~tr,
         "invalid: activation recompute is only for training")
    if ranges(cols["pipeline_interleaving"]) != (1, 1):
        flag((pp == 1) & (cols["pipeline_interleaving"] != 1),
             "invalid: pipeline_interleaving must be 1 when pipeline_par is 1")
    flag(cols["optimizer_sharding"] & (dp * cp1 <= 1),
         "invalid: optimizer_sharding needs data_par > 1")
    flag((cols["tensor_par_overlap"] != 0) & (t <= 1),
         "invalid: tensor_par_overlap needs tensor_par > 1")
    rs = cols["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("rs_ag")
    redo = cols["seq_par_ag_redo"]
    flag(redo & ~rs, "invalid: seq_par_ag_redo needs tensor_par_comm_type rs_ag")
    flag(redo & (rec == CHOICES["activation_recompute"].index("full")),
         "invalid: seq_par_ag_redo is not used with full recompute")
    flag(cols["data_par_overlap"] & (~tr | (dp <= 1)),
         "invalid: data_par_overlap needs training and data_par > 1")
    flag(cols["optimizer_offload"] & ~tr, "invalid: optimizer_offload is only for training")
    nets = system.networks
    nn = len(nets)
    for f in ("tensor_par_net", "pipeline_par_net", "data_par_net") + (
            ("context_par_net",) if extended or cols["context_par_net"].any() else ()):
        flag(_tier_out_of_range(cols[f], nn, ranges), "invalid: network tier out of range")
    # Network tiers: each must hold the product of the parallelisms on it,
    # and a tier that must be filled must be filled exactly.
    pars = ((t, "tensor_par_net"), (pp, "pipeline_par_net"), (dp, "data_par_net"))
    if extended:
        pars += ((cp, "context_par_net"),)
    # (for the rows no earlier rule flagged every parallelism is >= 1 and
    # their product is num_procs: a tier's size neither misleads nor
    # overflows, and the tier is used where it is over 1)
    pars = [(np.asarray(par, dtype=np.int64), cols[net]) for par, net in pars]
    for tier in range(min(nn, MAX_TIERS)):
        size = _tier_size(pars, tier, ranges)
        if size is None:
            continue
        used = size > 1
        flag(used & (size > nets[tier].size), REASONS[_NET_BIG + tier])
        if nets[tier].must_be_filled:
            flag(used & by_value(lambda x, k=nets[tier].size: k % np.maximum(x, 1) != 0,
                                 size, ranges=ranges),
                 REASONS[_NET_FILL + tier])
    flag(~_member(cols["datatype"], dts), "invalid: datatype not supported by the system")
    nb = model.num_blocks
    blocks_per_stage = by_value(lambda p: -(-nb // p), pp1, ranges=ranges)
    interleaving = at_least_1(cols["pipeline_interleaving"])
    split = uneven_rows(cols)
    even = True if split is None else ~split
    flag(even & (interleaving > blocks_per_stage),
         "infeasible: pipeline_interleaving exceeds the blocks per processor")
    flag(even & by_value(lambda p, v: -(-nb // p) % v != 0, pp1, interleaving, ranges=ranges),
         "infeasible: pipeline_interleaving must divide the blocks per processor")
    fewest = blocks_per_stage
    if split is not None:
        # Megatron's uneven splits (``autopar.model.pipeline.stage_split``)
        # instead of Calculon's interleaving rules; offloading by the stage
        # with the fewest blocks.
        at = np.flatnonzero(split)
        splits, inv = distinct_splits({"pipeline_par": pp1, "pipeline_interleaving": interleaving,
                                       **{f: cols[f] for f in SPLIT_FIELDS}}, nb, at,
                                      reasons=True)
        for j, per in enumerate(splits):
            if isinstance(per, str):
                mask = np.zeros(n, dtype=bool)
                mask[at[inv == j]] = True
                flag(mask, per)
        least = np.array([0 if isinstance(per, str) else min(per) for per in splits])
        fewest = blocks_per_stage.copy()
        fewest[at] = least.take(inv)
    flag((cols["weight_offload"] | cols["activations_offload"] | cols["optimizer_offload"])
         & (fewest <= 2),
         "infeasible: offloading requires each processor to handle at least 3 blocks")
    p2p = cols["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("p2p_rs_ag")
    flag((rs | p2p) & by_value(lambda u, c, x: (u * (model.seq_size // c)) % x != 0,
                               cols["microbatch_size"], cp1, tp1, ranges=ranges),
         "invalid: microbatch_size * seq_size must be divisible by tensor_par")
    flag(by_value(lambda x: (model.hidden % x != 0) | (model.feedforward % x != 0)
                  | (model.attn_heads % x != 0), tp1, ranges=ranges),
         "invalid: hidden, feedforward and attn_heads must be divisible by tensor_par")
    # autopar's extension fields (checked only where some row sets them).
    if extended:
        flag((cp > 1) & by_value(lambda c: model.seq_size % (2 * c) != 0, cp1, ranges=ranges),
             "invalid: seq_size must be divisible by 2 * context_par")
        flag((cp > 1) & (cols["context_par_comm"] == 1)
             & by_value(lambda x, c: model.attn_heads % (x * c) != 0, tp1, cp1,
                       ranges=ranges),
             "invalid: context_par_comm a2a needs attn_heads divisible by tensor_par * context_par")
    ws = cols["weight_sharding"]
    if ws.any():
        flag(ws & (~cols["optimizer_sharding"] | cols["unsharded_grads"]),
             "invalid: weight_sharding needs optimizer_sharding without unsharded_grads")
    g = cols["sharding_group"]
    if g.any():
        flag((g < 0) | ((g > 0) & (~cols["optimizer_sharding"]
                                   | by_value(lambda d, x: d % np.maximum(x, 1) != 0, dp, g,
                                            ranges=ranges))),
             "invalid: sharding_group must divide data_par and needs optimizer_sharding")
    outer = cols["optimizer_outer_sharding"]
    if outer.any():
        flag(outer & (~ws | (g <= 0) | (g >= dp)),
             "invalid: optimizer_outer_sharding needs weight_sharding and 0 < sharding_group "
             "< data_par")
    pgo = cols["param_gather_overlap"]
    if pgo.any():
        flag(pgo & (~cols["optimizer_sharding"] | ws),
             "invalid: param_gather_overlap needs optimizer_sharding without weight_sharding")
    k = cols["recompute_layers"]
    if k.any():
        flag((k < 0) | ((k > 0) & (rec != CHOICES["activation_recompute"].index("full"))),
             "invalid: recompute_layers needs activation_recompute full")
        flag(k > nb // pp1, "invalid: recompute_layers exceeds the blocks per pipeline stage "
                            "(num_blocks // pipeline_par)")
    off = cols["activation_offload_blocks"]
    if off.any():
        none = CHOICES["activation_recompute"].index("none")
        flag((off > 0) & (~tr | (pp != 1) | (rec != none) | cols["activations_offload"]
                          | cols["recompute_moe_act"] | cols["recompute_mla_up_proj"]),
             "invalid: activation_offload_blocks needs training, pipeline_par 1, no "
             "activation recompute and no activations_offload")
        flag((off < 0) | (off >= nb),
             "invalid: activation_offload_blocks must be 0..num_blocks - 1")
    fine = cols.get("activation_offload_modules")
    if fine is not None and fine.any():
        full = CHOICES["activation_recompute"].index("full")
        flag((fine > 0) & (~tr | (rec == full) | cols["activations_offload"] | (off > 0)),
             "invalid: activation_offload_modules needs training, no full activation "
             "recompute, no activations_offload and no activation_offload_blocks")
        if model.moe is None:
            flag(np.logical_or.reduce([offload_module_mask(fine, m)
                                       for m in EXPERT_OFFLOAD_MODULES]),
                 "invalid: activation_offload_modules names an expert module (expert_fc1, "
                 "moe_act, fused_group_mlp) for a model without routed experts")
    recipe = cols["fp8_recipe"]
    for f in ("bf16_first_blocks", "bf16_last_blocks"):
        b = cols[f]
        if b.any():
            flag((b < 0) | ((recipe != 0) & (b > nb // pp1)),
                 "invalid: bf16_first_blocks and bf16_last_blocks must be "
                 "0..num_blocks // pipeline_par")
    if (recipe != 0).any():
        dts_ok = [CHOICES["datatype"].index(d) for d in ("bfloat16", "float16")]
        lacking = [i for i, r in enumerate(CHOICES["fp8_recipe"])
                   if i and FP8_MATRIX[r] not in system.matrix]
        flag((recipe != 0) & (~_member(cols["datatype"], dts_ok) | _member(recipe, lacking)),
             "invalid: fp8_recipe needs datatype bfloat16 or float16 and the system's rate "
             "for the recipe")
    adapter = cols["adapter"]
    if adapter.any():
        q = adapter == CHOICES["adapter"].index("qlora")
        dts_ok = [CHOICES["datatype"].index(d) for d in ("bfloat16", "float16")]
        flag(q & ((recipe != 0) | ~_member(cols["datatype"], dts_ok)),
             "invalid: qlora dequantises to bfloat16 or float16 GEMMs: no fp8_recipe")
        flag((adapter != 0) & (cols["adapter_rank"] < 1),
             "invalid: adapter_rank must be >= 1 and sequence_fill 1..100")
    fill = cols["sequence_fill"]
    if len(fill) and (fill.min() < 1 or fill.max() > 100):
        flag((fill < 1) | (fill > 100),
             "invalid: adapter_rank must be >= 1 and sequence_fill 1..100")
    _check_moe(model, system, cols, flag, tp1, dp1 * cp1, ranges)
    _check_explicit_layouts(model, cols, flag)
    if model.hybrid_pattern:
        _check_hybrid(model, cols, flag, tp1, cp, ranges)
    return code, dts


def _check_explicit_layouts(model: ModelSpec, cols: dict, flag) -> None:
    """The model's side of an explicit ``pipeline_layout`` (its split is
    ``autopar.model.pipeline.layout_chunks``'s): the embedding first, the
    loss and the model's ``mtp`` MTP layers last (Megatron's
    ``validate_layer_layout``; ``autopar.io.layouts.placement_problem``), and
    two blocks a decoder layer ``t`` only for a hybrid pattern of mixer +
    MLP pairs (``decoder_layer_blocks``)."""
    codes = cols["pipeline_layout"]
    if not len(codes) or int(codes.max()) < 2:
        return
    for c in np.unique(codes[codes >= 2]).tolist():
        stages = explicit_layout(int(c))
        rows = codes == c
        layers = sum(st.count("t") for st in stages)
        flag(rows & (placement_problem(stages, None, model.mtp) is not None),
             "invalid: an explicit pipeline_layout must hold the embedding first and the loss "
             "and the model's MTP layers last")
        flag(rows & (layers not in decoder_layer_counts(model)),
             "invalid: an explicit pipeline_layout's decoder layers t must number the "
             "model's blocks (or half of a hybrid pattern's mixer + MLP pairs)")


def _check_hybrid(model: ModelSpec, cols: dict, flag, tp1, cp, ranges: Ranges) -> None:
    """A hybrid model (``autopar.model.mamba``): Megatron's ``MambaMixer``
    splits heads and groups over tensor_par (it asserts both divide); the
    pattern is split over the pipeline stages and virtual stages as autopar's
    split fields say, written as '|' segments (``select_pipeline_segment``;
    an even split with virtual stages: blocks divisible by pp x vp); the
    Mamba layers' context parallelism is not modelled."""
    mb = model.mamba
    if mb is not None:
        flag(by_value(lambda x: (mb.heads % x != 0) | (mb.groups % x != 0), tp1, ranges=ranges),
             "invalid: mamba heads and groups must be divisible by tensor_par")
    g = model.gdn
    if g is not None:
        # (Megatron-Core _GDNBase.__init__ splits qk_dim, v_dim and the value
        # heads by tp_size: num_k_heads_local_tp, num_v_heads_local_tp)
        flag(by_value(lambda x: (g.key_heads % x != 0) | (g.value_heads % x != 0), tp1,
                      ranges=ranges),
             "invalid: gdn key and value heads must be divisible by tensor_par")
    flag(cp > 1, "invalid: a hybrid model's Mamba / Gated DeltaNet layers are not modelled "
         "with context_par")
    # Virtual stages and the embedding / loss / balanced splits: Megatron-Core
    # builds them from a pattern with '|' between the virtual stages
    # (hybrid_layer_allocation.py ``select_pipeline_segment``: virtual stage
    # ``vp_stage * pp + rank`` holds the segment of that index, any number of
    # layers; a pattern without '|' refuses virtual stages), which the
    # Megatron export writes (autopar.io.launch.mcore.hybrid_pattern) from
    # autopar's split (autopar.model.pipeline.chunk_split); an even split
    # with virtual stages needs segments of equal blocks.
    v, pp = cols["pipeline_interleaving"], cols["pipeline_par"]
    even = ~((cols["first_stage_blocks"] != 0) | (cols["last_stage_blocks"] != 0)
             | (cols["pipeline_layout"] >= 2))
    flag((v > 1) & even & (model.num_blocks % np.maximum(pp * v, 1) != 0),
         "infeasible: a hybrid model's blocks must divide by pipeline_par x "
         "pipeline_interleaving to interleave (one '|' segment a virtual stage)")


def _member(col: np.ndarray, values: list[int]) -> np.ndarray:
    """``np.isin(col, values)`` for a column of small codes: a comparison per
    value (isin sorts, ten times the time for a handful of values)."""
    if len(values) > 8:
        return np.isin(col, values)
    out = np.zeros(col.shape, dtype=bool)
    for v in values:
        out |= col == v
    return out


def _tier_size(pars, tier: int, ranges: Ranges):
    """Each row's size of network tier ``tier``: the product of the
    parallelisms on it (``pars``: (column, its tier column) pairs), or None
    where no row puts one on it."""
    size = None
    for par, net in pars:
        lo, hi = ranges(net)
        if not lo <= tier <= hi:            # no row on this tier
            continue
        factor = par if lo == hi else choose(net == tier, par, 1)
        size = factor if size is None else size * factor
    return size


def _tier_out_of_range(net: np.ndarray, tiers: int, ranges: Ranges):
    """The rows whose network tier is not one of the system's ``tiers``
    (False where the column's range holds none)."""
    lo, hi = ranges(net)
    return False if 0 <= lo and hi < tiers else (net < 0) | (net >= tiers)


def _check_moe(model: ModelSpec, system: SystemSpec, cols: dict, flag, tp1, dp1,
               ranges: Ranges) -> None:
    """The rules of expert parallelism and latent attention (none apply to a
    dense model at the defaults).  ``dp1``: data_par * context_par;
    ``ranges``: the columns' ranges (``_check``'s)."""
    ep, etp = cols["expert_par"], cols["expert_tensor_par"]
    if model.moe is None and model.mla is None and not (
            (ep != 1).any() or (etp != 1).any() or (cols["moe_dispatcher"] != 0).any()
            or cols["moe_overlap"].any() or (cols["expert_par_net"] != 0).any()
            or (cols["expert_tensor_par_net"] != 0).any()):
        return                      # a dense model at the defaults: nothing to check
    flag((ep <= 0) | (etp <= 0), "invalid: sizes must be positive")
    ep1, etp1 = np.maximum(ep, 1), np.maximum(etp, 1)
    expert = (ep > 1) | (etp > 1)
    moe = model.moe
    if moe is None:
        flag(expert, "invalid: expert_par and expert_tensor_par need a mixture-of-experts model")
    else:
        flag(moe.experts % ep1 != 0, "invalid: expert_par must divide the number of experts")
        flag(moe.expert_feedforward % etp1 != 0,
             "invalid: expert_tensor_par must divide the expert feed-forward size")
        flag((tp1 * dp1) % (ep1 * etp1) != 0,
             "invalid: expert_par * expert_tensor_par must divide tensor_par * data_par * "
             "context_par")
    other = cols["moe_dispatcher"] != CHOICES["moe_dispatcher"].index("alltoall")
    flag((other | cols["moe_overlap"]) & ~expert,
         "invalid: moe_dispatcher other than alltoall and moe_overlap need expert_par or "
         "expert_tensor_par > 1")
    if moe is not None:
        rs = cols["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("rs_ag")
        flag((tp1 > 1) & ~rs, "invalid: a mixture-of-experts model with tensor_par > 1 needs "
                              "tensor_par_comm_type rs_ag (sequence parallelism)")
        flag(moe.shared_feedforward % tp1 != 0,
             "invalid: shared_feedforward must be divisible by tensor_par")
    if model.mla is None or model.mla.sparse_index is None:
        flag((cols["context_par"] > 1)
             & (cols["context_par_comm"] == CHOICES["context_par_comm"].index("allgather")),
             "invalid: context_par_comm allgather is modelled for DeepSeek Sparse Attention "
             "(mla.sparse_index) only")
    if model.mla is not None:
        flag(cols["tensor_par_overlap"] != 0,
             "invalid: latent attention (mla) is modelled with tensor_par_overlap none")
    nets = system.networks
    nn = len(nets)
    for f in ("expert_par_net", "expert_tensor_par_net"):
        flag(_tier_out_of_range(cols[f], nn, ranges), "invalid: network tier out of range")
    # The expert groups are laid over tensor x data processors: each tier
    # must hold the expert parallelism assigned to it.
    pars = ((ep1, cols["expert_par_net"]), (etp1, cols["expert_tensor_par_net"]))
    for tier in range(min(nn, MAX_TIERS)):
        size = _tier_size(pars, tier, ranges)
        if size is not None:
            flag(size > nets[tier].size, REASONS[_NET_BIG + tier])


def normalize(cols: Mapping) -> dict:
    """A layout table with every field as a column of its length (extension
    fields filled with their defaults); ValueError if a field is missing."""
    missing = [f for f in FIELDS if f not in cols]
    if missing:
        raise ValueError(f"layout table lacks columns: {', '.join(missing)}")
    n = len(cols["tensor_par"])
    out = {}
    for f in FIELDS:
        a = np.asarray(cols[f])
        if a.shape != (n,):
            a = np.broadcast_to(a, (n,))
        out[f] = a
    for f, default in EXT_DEFAULTS.items():
        if f in cols:
            out[f] = np.broadcast_to(np.asarray(cols[f]), (n,))
        elif f in CHOICES:       # read-only views of one value: no copies
            out[f] = np.broadcast_to(np.int8(CHOICES[f].index(default)), (n,))
        elif f in EXT_INT_FIELDS:
            out[f] = np.broadcast_to(np.int64(default), (n,))
        else:
            out[f] = np.broadcast_to(np.bool_(default), (n,))
    return out
