"""The table of layouts: Calculon's 23 execution fields as columns.

A layout table is a ``dict[str, numpy.ndarray]`` with one equal-length column
per execution field.  Integer fields are int64, flags are bool, and the
string-valued fields are stored as small integer codes (int8) whose meaning is
the position of the string in ``CHOICES[field]``.  This is the form the model,
the enumerator and the searchers exchange; ``to_columns`` / ``to_records``
convert from and to the JSON form (one dict per execution) that users write.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from autopar.io.errors import SpecError

# Order of Calculon's execution JSON.
FIELDS: tuple[str, ...] = (
    "num_procs", "tensor_par", "pipeline_par", "data_par",
    "tensor_par_net", "pipeline_par_net", "data_par_net",
    "batch_size", "microbatch_size", "datatype",
    "fused_activation", "attention_type", "activation_recompute",
    "pipeline_interleaving", "optimizer_sharding", "tensor_par_comm_type",
    "tensor_par_overlap", "seq_par_ag_redo", "data_par_overlap",
    "weight_offload", "activations_offload", "optimizer_offload", "training",
)

INT_FIELDS = frozenset({
    "num_procs", "tensor_par", "pipeline_par", "data_par",
    "tensor_par_net", "pipeline_par_net", "data_par_net",
    "batch_size", "microbatch_size", "pipeline_interleaving",
})

BOOL_FIELDS = frozenset({
    "fused_activation", "optimizer_sharding", "seq_par_ag_redo",
    "data_par_overlap", "weight_offload", "activations_offload",
    "optimizer_offload", "training",
})

# String fields: the code of a value is its index here.
CHOICES: dict[str, tuple[str, ...]] = {
    "datatype": ("float8", "float16", "bfloat16", "float32", "mxfp8", "nvfp4", "mxfp4"),
    "attention_type": ("multihead", "multiquery"),
    "activation_recompute": ("full", "attn_only", "none", "mlp_only"),
    "tensor_par_comm_type": ("ar", "p2p_rs_ag", "rs_ag"),
    "tensor_par_overlap": ("none", "ring", "pipe"),
}

BYTES_PER_ELEMENT = {"float8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "mxfp8": 1,
                     "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}
# Datatypes that are only a matrix rate: the GEMMs of an fp4 recipe
# (``fp8_recipe: nvfp4 | mxfp4``) run there, no layout runs in them as its
# working datatype (no framework trains with fp4 activations between layers).
# Their bytes: 4-bit values plus one 1-byte scale per 16 (NVFP4's E4M3) or per
# 32 (MXFP4's E8M0) elements.
GEMM_ONLY_DATATYPES = frozenset({"nvfp4", "mxfp4"})

# Extension fields: optional in files, absent from Calculon's format; the
# defaults keep Calculon's meaning.  ``attention_impl`` is the attention
# kernel (Calculon's separate matmul/softmax/dropout layers, a fused
# scale-mask-softmax, or FlashAttention v1/v2); ``fused_norm`` a fused
# LayerNorm/RMSNorm kernel; ``unsharded_grads`` keeps whole weight gradients
# while the optimizer state is sharded (Megatron's distributed optimizer)
# instead of sharding both (Calculon's optimizer_sharding).
EXT_DEFAULTS: dict[str, object] = {"attention_impl": "unfused", "fused_norm": False,
                                   "unsharded_grads": False}
CHOICES["attention_impl"] = ("unfused", "fused_softmax", "flash_v1", "flash_v2")
BOOL_FIELDS = BOOL_FIELDS | {"fused_norm", "unsharded_grads"}

# Dimensions of today's training (issue 13), all opt-in:
# * ``context_par`` (CP): the sequence of every micro-batch is split over this
#   many processors; attention exchanges K/V between them, either around a ring
#   of point-to-point transfers overlapped with the attention compute
#   (``context_par_comm: p2p``, Megatron's default) or with all-to-alls that
#   trade the sequence split for a head split around attention (``a2a``,
#   DeepSpeed-Ulysses style); ``context_par_net`` is its network tier.
#   num_procs = tensor_par * pipeline_par * data_par * context_par.
# * Data-parallel sharding stages: Calculon's ``optimizer_sharding`` shards the
#   optimizer state and the weight gradients (ZeRO-2); with ``unsharded_grads``
#   only the optimizer state (ZeRO-1, Megatron's distributed optimizer);
#   ``weight_sharding`` also shards the weights, all-gathered block by block in
#   forward and backward with the next block's gather prefetched behind the
#   current block's compute (ZeRO-3 / FSDP); ``sharding_group`` > 0 shards over
#   groups of that many data-parallel ranks and replicates across the groups
#   (hybrid sharding, HSDP); 0 shards over all of data_par.
# * ``activation_recompute`` gains ``mlp_only`` (Megatron's selective MLP
#   recompute) beside ``attn_only`` (attention core, Megatron's selective);
#   ``recompute_layers`` > 0 with ``full`` recomputes only that many blocks of
#   each stage (Megatron's recompute_num_layers), 0: all of them.
# * ``fp8_recipe``: GEMMs of the block's linear layers run at the system's
#   float8 rate (``tensorwise``: per-tensor scales, TE delayed/current scaling
#   or torchao tensorwise; ``rowwise``: per-row / 1x128 block scales) or its
#   mxfp8 rate (``mxfp8``: 1x32 block scales, Blackwell); ``datatype`` stays
#   the high precision (bfloat16) of everything else: weights, activations
#   between layers, the attention core, norms, the output layer; the fp32
#   master weights and optimizer state are as for that datatype.  The casts to
#   fp8 (and their amax reductions) are charged as memory traffic.  The fp4
#   recipes (issue 28) are values of the same field, as Transformer Engine
#   takes them (``NVFP4BlockScaling`` is a recipe passed where the fp8 ones
#   are, ``te.autocast(recipe=...)``): ``nvfp4`` (NVIDIA's NVFP4 pretraining
#   recipe: 1x16 blocks with E4M3 scales and a per-tensor fp32 scale, 16x16
#   blocks for weights, random Hadamard transforms on the weight-gradient
#   inputs, stochastic rounding of gradients) at the system's ``nvfp4`` rate,
#   ``mxfp4`` (OCP MX: 1x32 blocks with E8M0 scales) at its ``mxfp4`` rate;
#   the layers the recipes keep in high precision are the fp8 recipes'
#   (autopar/model/layers.py ``fp8_gemm``).
# * ``fp32_grads``: weight gradients are accumulated and reduced in fp32
#   (Megatron's main_grad buffers) rather than in the working datatype.
# * ``param_gather_overlap``: with sharded optimizer state (and whole
#   weights), the all-gather of the updated weights leaves the gradient sync
#   and runs block by block during the next step's first forward pass, each
#   block's gather hidden behind the forward of the one before (Megatron's
#   overlap_param_gather).
# * ``optimizer_outer_sharding``: with hybrid sharding (``weight_sharding``
#   and 0 < ``sharding_group`` < data_par) the optimizer state and fp32 master
#   weights are sharded over the whole data-parallel group too, while weights
#   and gradients stay sharded within an instance (Megatron-FSDP's
#   ``outer_dp_sharding_strategy: optim``, "HFSDP"; autopar.model.context
#   ``shard_counts``).  False: replicated across the instances (HSDP).
EXT_DEFAULTS.update({"context_par": 1, "context_par_net": 0, "context_par_comm": "p2p",
                     "weight_sharding": False, "sharding_group": 0,
                     "recompute_layers": 0, "fp8_recipe": "none", "fp32_grads": False,
                     "param_gather_overlap": False, "optimizer_outer_sharding": False})
CHOICES["context_par_comm"] = ("p2p", "a2a", "allgather")
CHOICES["fp8_recipe"] = ("none", "tensorwise", "rowwise", "mxfp8", "nvfp4", "mxfp4")
BOOL_FIELDS = BOOL_FIELDS | {"weight_sharding", "fp32_grads", "param_gather_overlap",
                             "optimizer_outer_sharding"}
EXT_INT_FIELDS = frozenset({"context_par", "context_par_net", "sharding_group",
                            "recompute_layers"})
# Mixture-of-experts execution (issue 14; only meaningful for a model with
# ``moe``): ``expert_par`` (EP) spreads the routed experts over that many
# processors, ``expert_tensor_par`` (ETP) splits each expert's feed-forward
# over that many; both are laid over the tensor x data x context processors
# of a stage (as Megatron does), so the expert-data-parallel group that syncs
# expert gradients (and shards their optimizer state) is
# tensor_par * data_par * context_par / (EP * ETP).  ``expert_par_net`` /
# ``expert_tensor_par_net`` are their network tiers; ``moe_dispatcher`` moves
# tokens to their experts by all-to-all, by all-gather (and back by
# all-to-all / reduce-scatter), or ``deepep``: an all-to-all that sends a
# token once to each remote node holding any of its experts and forwards it
# inside the node (DeepEP / HybridEP, Megatron's flex dispatcher);
# ``moe_overlap`` hides the dispatch and combine
# behind the experts' compute.  The defaults (1, 1, tier 0, all-to-all, no
# overlap) leave a dense model exactly as Calculon has it.
EXT_DEFAULTS.update({"expert_par": 1, "expert_tensor_par": 1, "expert_par_net": 0,
                     "expert_tensor_par_net": 0, "moe_dispatcher": "alltoall",
                     "moe_overlap": False})
CHOICES["moe_dispatcher"] = ("alltoall", "allgather", "deepep")
BOOL_FIELDS = BOOL_FIELDS | {"moe_overlap"}
EXT_INT_FIELDS = EXT_INT_FIELDS | {"expert_par", "expert_tensor_par", "expert_par_net",
                                   "expert_tensor_par_net"}
# Uneven pipelines (issue 24), as Megatron-Core splits the blocks
# (megatron/core/transformer/transformer_block.py ``get_num_layers_to_build``,
# transformer_config.py's checks): ``first_stage_blocks`` /
# ``last_stage_blocks`` > 0 give the first / last stage that many blocks and
# spread the rest evenly over the stages between
# (``num_layers_in_first_pipeline_stage`` / ``..._last_...``; 0: not set);
# ``embedding_in_split`` / ``loss_in_split`` count the embedding / the output
# layer with its loss as one block of the split, so the first / last stage
# builds one block fewer (``account_for_embedding_in_pipeline_split`` /
# ``account_for_loss_in_pipeline_split``); ``pipeline_layout: balanced``
# spreads the blocks (with the embedding and loss where they count) over the
# ``pipeline_par * pipeline_interleaving`` virtual stages as evenly as they
# go, the earlier virtual stages one block more where they do not divide: a
# ``pipeline_model_parallel_layout`` (pipeline_parallel_layer_layout.py) of
# that form, so that virtual stages need not divide the blocks.  ``even``
# (the default) is Calculon's split and its rules.
EXT_DEFAULTS.update({"first_stage_blocks": 0, "last_stage_blocks": 0,
                     "embedding_in_split": False, "loss_in_split": False,
                     "pipeline_layout": "even"})
CHOICES["pipeline_layout"] = ("even", "balanced")
BOOL_FIELDS = BOOL_FIELDS | {"embedding_in_split", "loss_in_split"}
EXT_INT_FIELDS = EXT_INT_FIELDS | {"first_stage_blocks", "last_stage_blocks"}
# Optimizers and fine-tuning (issue 28), recipe (execution) fields because
# the same model trains with different optimizers and is pre-trained or
# fine-tuned on the same layouts (``autopar.model.optimizers``,
# ``autopar.model.finetune``):
# * ``optimizer``: ``adam`` (Calculon's: two fp32 moments, an fp32 master
#   copy under a narrow datatype, 11 FLOPs a parameter), ``sgd`` (with
#   momentum: one moment), ``adafactor`` (factored second moment: rows +
#   columns of each matrix, a full one for vectors; no first moment, the
#   paper's default) or ``muon`` (one momentum buffer for the matrices of
#   the blocks, orthogonalised by five Newton-Schulz iterations; AdamW for
#   the vectors, the embedding and the output layer, as Muon recipes do).
# * ``adapter``: ``lora`` freezes every base weight (no weight gradients,
#   optimizer state or master copy; backward still computes the activation
#   gradients through them but not their weight-gradient GEMMs) and trains
#   low-rank adapters of rank ``adapter_rank`` on the ``adapter_targets``
#   (``all``: q, k, v, o and the MLP's matrices; ``attention``: q, k, v, o;
#   ``qv``: q and v, as the LoRA paper; ``qkv``: one adapter on the fused
#   QKV projection, NeMo's default ``attention_qkv``); ``qlora`` also stores the frozen
#   block matrices in 4-bit NF4 with double-quantised block scales,
#   dequantised for each GEMM.  ``none`` (the default): full training
#   (pre-training or full-weight SFT).
# * ``sequence_fill``: the percentage of the ``seq_size`` tokens of a
#   sequence that are real tokens (SFT with padded sequences: the mean
#   sample length over the padded length); the model computes the padded
#   sequences; ``token_rate`` (on request) counts the real tokens.  100 (the default):
#   packed or pre-training sequences.
EXT_DEFAULTS.update({"optimizer": "adam", "adapter": "none", "adapter_rank": 16,
                     "adapter_targets": "all", "sequence_fill": 100})
CHOICES["optimizer"] = ("adam", "sgd", "muon", "adafactor")
CHOICES["adapter"] = ("none", "lora", "qlora")
CHOICES["adapter_targets"] = ("all", "attention", "qv", "qkv")
EXT_INT_FIELDS = EXT_INT_FIELDS | {"adapter_rank", "sequence_fill"}
# * ``attention_span``: packed sequences whose attention stays inside each
#   packed document (SFT on packed samples: NeMo's GPTSFTPackedDataset passes
#   ``cu_seqlens`` and ``qkv_format='thd'`` to Transformer Engine's fused
#   attention, megatron_gpt_model.py ``get_forward_output_and_loss_func``):
#   the keys a query attends to, length-weighted over the documents
#   (``sum l_i^2 / sum l_i`` for documents of l_i tokens).  It shortens the
#   FlashAttention core only (an unfused attention computes the masked
#   ``seq_size`` x ``seq_size`` scores in full).  0 (the default): one
#   document fills the sequence, Calculon's meaning.
EXT_DEFAULTS.update({"attention_span": 0})
EXT_INT_FIELDS = EXT_INT_FIELDS | {"attention_span"}
# * ``optimizer_moment_bytes``: bytes of each element of the optimizer's
#   moments (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's and Muon's
#   momentum, Adafactor's factored second moment): 4 (fp32, the default and
#   Calculon's count) or 2 (bf16, Megatron-Core's precision-aware optimizer
#   with ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, whose moments
#   Transformer Engine's FusedAdam stores in that dtype:
#   megatron/core/optimizer/optimizer_config.py ``exp_avg_dtype`` /
#   ``exp_avg_sq_dtype``).  The master copy is ``master_weight_bytes``'s.
EXT_DEFAULTS.update({"optimizer_moment_bytes": 4})
EXT_INT_FIELDS = EXT_INT_FIELDS | {"optimizer_moment_bytes"}
MOMENT_BYTES = (4, 2)
# The fp8 / fp4 recipe's blocks kept in BF16 (issue 28, NVFP4 follow-up):
# ``bf16_first_blocks`` / ``bf16_last_blocks`` blocks at the start / end of
# the model run without the ``fp8_recipe`` (their GEMMs at the working
# precision's rate, no casts or quantized weight copies), as Megatron-Core's
# ``--first-last-layers-bf16`` with ``--num-layers-at-start-in-bf16`` /
# ``--num-layers-at-end-in-bf16`` (megatron/core/fp8_utils.py
# ``is_first_last_bf16_layer``, fp4_utils.py ``get_fp4_context``: a global
# layer index below the start count or at or above num_layers - end count
# gets no quantization context).  Each at most num_blocks // pipeline_par
# (transformer_config.py ``__post_init__``).  Without a recipe they change
# nothing; 0 (the default): every block quantized, today's meaning.
EXT_DEFAULTS.update({"bf16_first_blocks": 0, "bf16_last_blocks": 0})
EXT_INT_FIELDS = EXT_INT_FIELDS | {"bf16_first_blocks", "bf16_last_blocks"}
# Megatron-Core's output-discarding selective recompute of MoE / MLA models
# (``recompute_modules`` "moe_act" and "mla_up_proj", NVIDIA/Megatron-LM@2a75ac1
# megatron/core/transformer/transformer_config.py), beside any
# ``activation_recompute``:
# * ``recompute_moe_act``: the routed experts' activation runs under
#   ``CheckpointWithoutOutput`` and its output, the second grouped GEMM's
#   input, is freed once that GEMM has run and recomputed in backward
#   (megatron/core/transformer/moe/experts.py ``TEGroupedMLP.forward``; with
#   fp8 / fp4 the GEMM is told to save its original input,
#   ``set_save_original_input``, which is the freed tensor): nothing of the
#   activation's output kept, its forward run again.
# * ``recompute_mla_up_proj``: multi-head latent attention's query and
#   key/value up projections and the rotary embedding run under
#   ``CheckpointWithoutOutput`` (multi_latent_attention.py
#   ``qkv_up_proj_and_rope_apply``); the query, key and value they make,
#   the attention core's inputs, are freed after the core and recomputed
#   in backward: the core's inputs not kept, the up projections and the
#   rotary embedding run again.
# False (the default): everything kept, Calculon's meaning; they change
# nothing for a model without experts / without MLA.
EXT_DEFAULTS.update({"recompute_moe_act": False, "recompute_mla_up_proj": False})
BOOL_FIELDS = BOOL_FIELDS | {"recompute_moe_act", "recompute_mla_up_proj"}
# Partial CPU activation offloading (issue 24): ``activation_offload_blocks``
# > 0 offloads the saved activations of that many blocks of the stage to the
# second memory tier (host memory) in forward and brings them back in
# backward, as Megatron-Core's ``cpu_offloading`` with
# ``cpu_offloading_num_layers`` N runs Transformer Engine's CPU offload
# (NVIDIA/Megatron-LM@2a75ac1 transformer_block.py ``get_cpu_offload_context``;
# TransformerEngine transformer_engine/pytorch/cpu_offload.py
# ``DefaultOffloadSynchronizer``): the first N blocks offload, each kept on
# the GPU until the forward of the block L - N later (L the stage's blocks),
# so L - N blocks' saved activations are on the GPU at once
# (``autopar.model.memory.partial_offload``).  Megatron-Core takes it only
# without pipeline parallelism and without activation recompute, for fewer
# blocks than the model has (transformer_config.py ``__post_init__``); the
# model's rules say the same.  0 (the default): nothing offloaded beyond
# ``activations_offload``, Calculon's meaning.
EXT_DEFAULTS.update({"activation_offload_blocks": 0})
EXT_INT_FIELDS = EXT_INT_FIELDS | {"activation_offload_blocks"}
# Explicit pipeline layouts (issue 24 item 4): ``pipeline_layout`` may also be
# Megatron-Core's ``pipeline_model_parallel_layout`` string
# (NVIDIA/Megatron-LM@2a75ac1 megatron/core/transformer/
# pipeline_parallel_layer_layout.py ``PipelineParallelLayerLayout``): ``E``
# the embedding, ``t`` a decoder layer, ``m`` an MTP layer, ``L`` the loss,
# ``|`` between virtual stages (virtual stage ``k`` on pipeline rank
# ``k % pipeline_par``), ``(...)*n`` and ``x*n`` repetition, commas purely
# cosmetic.  Each distinct string is parsed once here (``parse_layout``) and
# becomes a code of ``CHOICES["pipeline_layout"]`` after "even" and
# "balanced" (``layout_code``), so a table column stays small integer codes
# and the model groups rows by it as by any categorical field; the model
# reads a code's virtual stages back with ``explicit_layout``.
LAYOUT_SYMBOLS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
_EXPLICIT: dict[str, tuple[str, ...]] = {}
# (int8 codes: at most this many choices of pipeline_layout in one process)
_MAX_LAYOUT_CODES = 127


def parse_layout(text: str) -> tuple[str, ...]:
    """A ``pipeline_model_parallel_layout`` string -> its virtual stages, each
    the string of its layers (``E``, ``t``, ``m``, ``L``), as Megatron-Core's
    ``PipelineParallelLayerLayout.parse_str_to_list`` reads it: commas
    removed, every ``(...)*n`` and then every ``x*n`` written out, split at
    ``|``; any other character is Megatron's "Invalid layer character".
    Raises ValueError with Megatron's reason."""
    import re

    s = str(text).replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    stages = tuple(s.split("|"))
    for st in stages:
        for ch in st:
            if ch not in LAYOUT_SYMBOLS:
                raise ValueError(f"invalid layer character {ch!r} in virtual stage {st!r} "
                                 f"(Megatron-Core knows {', '.join(LAYOUT_SYMBOLS)}; "
                                 f"'|' between stages, (...)*n and x*n repeat)")
    return stages


def layout_problem(stages, pp: int, vp: int, num_layers: int | None = None,
                   mtp: int | None = None) -> str | None:
    """Why Megatron-Core (or autopar's placement of the head) refuses the
    parsed layout ``stages`` on ``pp`` pipeline ranks of ``vp`` virtual
    stages for a model of ``num_layers`` decoder layers and ``mtp`` MTP
    layers (None: not checked), or None.  Megatron's checks
    (pipeline_parallel_layer_layout.py ``__init__`` and
    ``validate_layer_layout``, transformer_config.py ``__post_init__``): the
    stages a multiple of pp, the virtual size they imply the one set, the
    embedding first and the loss last, once each, as many ``t`` as layers
    and ``m`` as MTP layers, the MTP layers after every decoder layer, all
    in one virtual stage, the last one of its rank.  autopar's own: the
    embedding in the first virtual stage and the loss and any MTP layers in
    the last (autopar counts the head and the MTP modules on the first /
    last pipeline stage; a standalone MTP stage is not modelled)."""
    k = len(stages)
    if pp < 1 or k % pp:
        return (f"has {k} virtual stages, not divisible by pipeline_par {pp} (Megatron: "
                f"pipeline_model_parallel_layout must be divisible by "
                f"pipeline_model_parallel_size)")
    if k // pp != vp:
        return (f"has {k} virtual stages: {k // pp} a pipeline rank, but pipeline_interleaving "
                f"is {vp} (Megatron: virtual_pipeline_model_parallel_size conflicts with "
                f"pipeline_model_parallel_layout)")
    return placement_problem(stages, num_layers, mtp)


def placement_problem(stages, num_layers: int | None = None,
                      mtp: int | None = None) -> str | None:
    """``layout_problem``'s checks that do not need the pipeline sizes."""
    k = len(stages)
    flat = "".join(stages)
    if not flat or flat[0] != "E":
        return "must start with the embedding E (Megatron: the first layer must be embedding)"
    if flat[-1] != "L":
        return "must end with the loss L (Megatron: the last layer must be loss)"
    if flat.count("E") != 1 or flat.count("L") != 1:
        return "must hold the embedding E and the loss L exactly once each"
    if num_layers is not None and flat.count("t") != num_layers:
        return (f"holds {flat.count('t')} decoder layers t, the model has {num_layers} "
                f"(Megatron: number of decoder layers must match num_layers)")
    if mtp is not None and flat.count("m") != mtp:
        return (f"holds {flat.count('m')} MTP layers m, the model has {mtp} "
                f"(Megatron: number of mtp layers in layout must match mtp_num_layers)")
    if "m" in flat:
        if "t" in flat[flat.index("m"):]:
            return "puts a decoder layer t after an MTP layer m (Megatron: decoder layers " \
                   "must be placed before MTP layers)"
        holding = [i for i, st in enumerate(stages) if "m" in st]
        if len(holding) > 1:
            return "spreads the MTP layers m over virtual stages (Megatron: all of the MTP " \
                   "layers must be in the same one virtual pipeline stage)"
        if holding[0] != k - 1:
            return "puts the MTP layers m in a virtual stage before the last (Megatron takes " \
                   "them only in a rank's last virtual stage; on a rank before the last, a " \
                   "standalone MTP stage, which autopar does not model: it counts the MTP " \
                   "modules on the last stage)"
    if "E" not in stages[0]:
        return "puts the embedding E after an empty first virtual stage: autopar counts " \
               "the embedding on the first pipeline stage"
    if "L" not in stages[-1]:
        return "puts the loss L before an empty last virtual stage: autopar counts the " \
               "output layer and loss on the last pipeline stage"
    return None


def layout_stage_blocks(stages, num_blocks: int) -> list[int] | None:
    """The blocks of each virtual stage of an explicit layout's ``stages``:
    its decoder layers ``t`` (Megatron's ``get_num_layers_to_build``), each
    ``num_blocks / t`` blocks, which must be 1 or 2 (2: a hybrid pattern of
    mixer + MLP pairs, ``decoder_layer_counts``); None where they are not."""
    t = [st.count("t") for st in stages]
    layers = sum(t)
    if not layers or num_blocks % layers or num_blocks // layers > 2:
        return None
    return [n * (num_blocks // layers) for n in t]


def decoder_layer_counts(model) -> tuple[int, ...]:
    """The numbers of decoder layers ``t`` an explicit layout of ``model``
    may hold: its blocks, one a ``t``; and for a hybrid pattern of mixer +
    MLP pairs (each even position a Mamba / Gated DeltaNet / attention
    mixer, each odd one an MLP or MoE), half of them: Megatron builds such a
    model as a GPT model whose ``TransformerLayer`` is a mixer and its MLP
    (Megatron-Bridge's Qwen3-Next, whose layout counts 48 layers for the
    pattern's 96 blocks)."""
    n, pat = model.num_blocks, getattr(model, "hybrid_pattern", "")
    if pat and len(pat) % 2 == 0 and set(pat[0::2]) <= set("MG*") \
            and set(pat[1::2]) <= set("-E"):
        return (n, n // 2)
    return (n,)


def layout_code(value: str) -> int:
    """The code of a ``pipeline_layout`` value: "even" 0, "balanced" 1, an
    explicit layout string the next free code (parsed and registered the
    first time it is seen; ValueError with Megatron's reason where it does
    not parse)."""
    choices = CHOICES["pipeline_layout"]
    if value in choices:
        return choices.index(value)
    stages = parse_layout(value)
    if len(choices) >= _MAX_LAYOUT_CODES:
        raise ValueError(f"more than {_MAX_LAYOUT_CODES - 2} distinct explicit pipeline "
                         f"layouts in one run")
    _EXPLICIT[value] = stages
    CHOICES["pipeline_layout"] = choices + (value,)
    return len(choices)


def registered_layouts() -> tuple[str, ...]:
    """The explicit layouts registered in this process, in code order (code
    2 first): what a worker process needs to read this process's codes."""
    return CHOICES["pipeline_layout"][2:]


def restore_layouts(layouts) -> None:
    """Register another process's ``registered_layouts`` here, in order, so
    that a code means the same layout in both (a search's worker processes,
    spawned or on Ray, start with none).  RuntimeError where this process
    has registered others first (its codes would disagree)."""
    layouts, have = tuple(layouts), registered_layouts()
    n = min(len(layouts), len(have))
    if layouts[:n] != have[:n]:
        raise RuntimeError("explicit pipeline layouts were registered in another order in this "
                           "process: their codes disagree")
    for text in layouts[n:]:
        layout_code(text)


def explicit_layout(code: int) -> tuple[str, ...] | None:
    """The virtual stages of ``pipeline_layout`` code ``code`` (each the
    string of its layers), or None for "even" and "balanced"."""
    if code < 2:
        return None
    return _EXPLICIT[CHOICES["pipeline_layout"][code]]


def is_explicit_layout(value) -> bool:
    """Whether a ``pipeline_layout`` value (name or code) is an explicit
    layout string rather than "even" / "balanced"."""
    if isinstance(value, str):
        return value not in ("even", "balanced")
    return int(value) >= 2


# Fine-grained activation offloading (issue 24): ``activation_offload_modules``
# names the modules of every block whose saved tensors go to the second
# memory tier (host memory) in forward and come back in backward, as
# Megatron-Core's ``fine_grained_activation_offloading`` with
# ``offload_modules`` (NVIDIA/Megatron-LM@2a75ac1
# megatron/core/pipeline_parallel/fine_grained_activation_offload.py,
# docs/user-guide/features/fine_grained_activation_offloading.md): a set of
# ``OFFLOAD_MODULES``, written in a file as a list or joined by "+" in
# Megatron's forward order ("core_attn+attn_proj"); ``attn_proj`` only with
# ``core_attn`` (transformer_config.py ``__post_init__``).  The model counts
# the saved tensors of the module's layers (``autopar.model.block``), less two
# blocks' worth kept on tier 1 (``autopar.model.memory.fine_offload``).
# "none" (the default): nothing offloaded, Calculon's meaning.
# ``fused_group_mlp``: the routed experts' whole fused grouped MLP (fc1, the
# probability-scaled activation, fc2: megatron/core/transformer/moe/experts.py
# ``TEGroupedMLP._fused_forward``, the offload context around the Transformer
# Engine op-fuser call), never beside ``expert_fc1`` or ``moe_act``
# (transformer_config.py ``__post_init__`` raises).
OFFLOAD_MODULES = ("core_attn", "attn_proj", "expert_fc1", "moe_act", "fused_group_mlp")
# Megatron-Core's other offload modules, which autopar does not count.
OFFLOAD_MODULES_NOT_COUNTED = ("attn_norm", "qkv_linear", "mlp_norm")
# The modules of the routed experts (a model without them cannot offload them).
EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")


def _offload_module_sets() -> tuple[str, ...]:
    """Every value of ``activation_offload_modules``: "none", then each
    allowed set of ``OFFLOAD_MODULES`` joined by "+" in their order."""
    out = ["none"]
    n = len(OFFLOAD_MODULES)
    for bits in range(1, 2 ** n):
        names = [OFFLOAD_MODULES[i] for i in range(n) if bits >> i & 1]
        if "attn_proj" in names and "core_attn" not in names:
            continue
        if "fused_group_mlp" in names and {"expert_fc1", "moe_act"} & set(names):
            continue
        out.append("+".join(names))
    return tuple(out)


def offload_modules_value(v) -> "str | tuple[str, str]":
    """A file's ``activation_offload_modules`` (a list of module names, one
    name, or names joined by "+"; empty or "none": none) as its canonical
    value, or ("error", message)."""
    if v is None or (isinstance(v, str) and v.strip() in ("", "none")):
        return "none"
    if isinstance(v, str):
        names = [p.strip() for p in v.replace(",", "+").split("+") if p.strip()]
    elif isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v):
        names = [p.strip() for p in v]
    else:
        return ("error", f"expected a list of module names, got {type(v).__name__}")
    for name in names:
        if name in OFFLOAD_MODULES_NOT_COUNTED:
            return ("error", f"{name!r} is a Megatron-Core offload module autopar does not "
                             f"count (it counts: {', '.join(OFFLOAD_MODULES)})")
        if name not in OFFLOAD_MODULES:
            return ("error", f"unknown module {name!r} (one of: {', '.join(OFFLOAD_MODULES)})")
    if "attn_proj" in names and "core_attn" not in names:
        return ("error", "attn_proj needs core_attn (Megatron-Core refuses attn_proj alone: "
                         "its input is the core attention's output, which core_attn's "
                         "backward needs)")
    if "fused_group_mlp" in names and {"expert_fc1", "moe_act"} & set(names):
        return ("error", "fused_group_mlp offloads the whole fused grouped MLP and cannot be "
                         "named beside expert_fc1 or moe_act (Megatron-Core refuses it)")
    chosen = [m for m in OFFLOAD_MODULES if m in names]
    return "+".join(chosen) if chosen else "none"


def offload_module_mask(codes, module: str) -> np.ndarray:
    """Rows of an ``activation_offload_modules`` code column that offload
    ``module``."""
    table = np.array([module in v.split("+") for v in CHOICES["activation_offload_modules"]])
    return table[np.asarray(codes, dtype=np.int64)]


CHOICES["activation_offload_modules"] = _offload_module_sets()
EXT_DEFAULTS.update({"activation_offload_modules": "none"})
# The fields of the pipeline split (all at their defaults: Calculon's).
SPLIT_FIELDS = ("first_stage_blocks", "last_stage_blocks", "embedding_in_split",
                "loss_in_split", "pipeline_layout")
ALL_FIELDS: tuple[str, ...] = FIELDS + tuple(EXT_DEFAULTS)


def code(field: str, value: str) -> int:
    """The integer code of a string ``value`` of ``field`` (an explicit
    pipeline layout registered on first sight: ``layout_code``)."""
    if field == "pipeline_layout":
        return layout_code(value)
    return CHOICES[field].index(value)


def to_columns(records: Iterable[Mapping]) -> dict[str, np.ndarray]:
    """Execution dicts (already validated) -> a layout table."""
    records = list(records)
    cols: dict[str, np.ndarray] = {}
    for f in ALL_FIELDS:
        vals = [r.get(f, EXT_DEFAULTS.get(f)) if f in EXT_DEFAULTS else r[f] for r in records]
        if f in CHOICES:
            cols[f] = np.array([code(f, v) for v in vals], dtype=np.int8)
        elif f in BOOL_FIELDS:
            cols[f] = np.array(vals, dtype=bool)
        else:
            cols[f] = np.array(vals, dtype=np.int64)
    return cols


def to_records(cols: Mapping[str, np.ndarray]) -> list[dict]:
    """A layout table -> execution dicts in Calculon's JSON form."""
    n = len(next(iter(cols.values())))
    out = []
    for i in range(n):
        out.append(record(cols, i))
    return out


def record(cols: Mapping[str, np.ndarray], i: int) -> dict:
    """Row ``i`` of a layout table as one Calculon execution dict.

    Extension fields appear only where they differ from their defaults, so a
    plain layout is exactly Calculon's 23 fields.
    """
    rec = {}
    for f in ALL_FIELDS:
        if f not in cols:
            continue
        v = cols[f][i]
        if f in CHOICES:
            rec[f] = CHOICES[f][int(v)]
        elif f in BOOL_FIELDS:
            rec[f] = bool(v)
        else:
            rec[f] = int(v)
        if f in EXT_DEFAULTS and rec[f] == EXT_DEFAULTS[f]:
            del rec[f]
    return rec


def execution_from_row(row) -> dict:
    """A table row or mapping (names or codes) -> an execution dict: Calculon's
    23 fields, plus the extension fields that differ from their defaults."""
    out = {}
    for f in ALL_FIELDS:
        v = row.get(f) if hasattr(row, "get") else row[f]
        if f in EXT_DEFAULTS and (v is None or (isinstance(v, float) and v != v)):
            continue
        v = v.item() if hasattr(v, "item") else v
        if f in CHOICES:
            v = CHOICES[f][v] if isinstance(v, int) and not isinstance(v, bool) else str(v)
        elif f in BOOL_FIELDS:
            v = bool(v)
        else:
            v = int(v)
        if f in EXT_DEFAULTS and v == EXT_DEFAULTS[f]:
            continue
        out[f] = v
    return out


def _string_codes(series, choices) -> np.ndarray:
    """Codes (int8) of a column of strings (-1 for unknown values), vectorised.

    A column of one repeated string (an extension field left at its default,
    or a field the table fixes) costs one comparison of its bytes instead of
    a lookup per row, and comes back as a read-only view of its one code (as
    ``autopar.model.rules.normalize`` gives a field the table lacks); any
    other column is looked up by Arrow's hash (``pyarrow.compute.index_in``).
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    try:
        arr = pa.array(series.array if hasattr(series, "array") else series, from_pandas=True)
        one = _repeated_string(arr)
        if one is not None:
            code = choices.index(one) if one in choices else -1
            return np.broadcast_to(np.int8(code), (len(arr),))
        codes = pc.index_in(arr, value_set=pa.array(list(choices)))
        return np.asarray(codes.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int8)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        import pandas as pd
        return np.asarray(pd.Categorical(series, categories=list(choices)).codes, dtype=np.int8)


def _repeated_string(arr):
    """The one string every row of the Arrow string array (or chunked array)
    ``arr`` holds, or None (nulls, several values, another type, no rows):
    equal lengths (from the offsets) and every row's bytes equal to the
    first row's."""
    import pyarrow as pa
    chunks = [c for c in (arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]) if len(c)]
    value = None
    for c in chunks:
        if c.null_count or not (pa.types.is_string(c.type) or pa.types.is_large_string(c.type)):
            return None
        n = len(c)
        wide = np.int64 if pa.types.is_large_string(c.type) else np.int32
        off = np.frombuffer(c.buffers()[1], dtype=wide)[c.offset:c.offset + n + 1]
        width = int(off[1] - off[0])
        if int(off[-1] - off[0]) != width * n or not (np.diff(off) == width).all():
            return None
        if width:
            data = np.frombuffer(c.buffers()[2], dtype=np.uint8)[off[0]:off[-1]]
            if not (data[width:] == data[:-width]).all():
                return None
        first = c[0].as_py()
        if value is not None and first != value:
            return None
        value = first
    return value


def from_frame(frame, source: str = "executions") -> dict[str, np.ndarray]:
    """A pandas DataFrame with the execution fields as columns -> a layout table.

    String fields may hold the names (``"full"``) or the integer codes.  A
    missing column or an unknown value raises ``SpecError`` naming the column.
    """

    missing = [f for f in FIELDS if f not in frame.columns]
    if missing:
        raise SpecError(source, missing[0], "missing column")
    cols: dict[str, np.ndarray] = {}
    for f in ALL_FIELDS:
        if f not in frame.columns:
            continue
        s = frame[f]
        if f in CHOICES:
            if s.dtype.kind in "iu":
                v = s.to_numpy()
                if len(v) and (v.min() < 0 or v.max() >= len(CHOICES[f])):
                    raise SpecError(source, f, f"code out of range 0..{len(CHOICES[f]) - 1}")
                cols[f] = v.astype(np.int8)
            else:
                if f == "pipeline_layout":
                    _register_layouts(s, source)
                codes = _string_codes(s, CHOICES[f])
                if (codes < 0).any():
                    bad = s.iloc[int(np.flatnonzero(codes < 0)[0])]
                    raise SpecError(source, f, f"unknown value {bad!r} "
                                               f"(one of: {', '.join(CHOICES[f])})")
                cols[f] = codes
        elif f in BOOL_FIELDS:
            if s.dtype.kind != "b":
                raise SpecError(source, f, f"expected booleans, got {s.dtype}")
            cols[f] = s.to_numpy()
        else:
            if s.dtype.kind not in "iu":
                raise SpecError(source, f, f"expected integers, got {s.dtype}")
            cols[f] = s.to_numpy().astype(np.int64)
    return cols


def _register_layouts(series, source: str) -> None:
    """Register the explicit layout strings of a ``pipeline_layout`` column
    (``layout_code``), each distinct value once; SpecError naming the column
    for one that does not parse."""
    for v in set(series.dropna().unique().tolist()) if hasattr(series, "dropna") else set(series):
        if isinstance(v, str) and v not in CHOICES["pipeline_layout"]:
            try:
                layout_code(v)
            except ValueError as e:
                raise SpecError(source, "pipeline_layout", f"{v!r}: {e}") from None
