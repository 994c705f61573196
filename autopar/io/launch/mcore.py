"""Megatron-Core's settings of a layout: what the ``megatron`` (command-line
arguments) and ``bridge`` (recipe overrides) formats both write and read.

A layout and its model become a dict of Megatron-Core config attributes, keyed
``section.attribute`` as Megatron-Bridge's ``ConfigContainer`` names them
(``model.*``: ``TransformerConfig`` / ``ModelParallelConfig``; ``ddp.*``:
``DistributedDataParallelConfig``; ``optimizer.*``: ``OptimizerConfig``;
``train.*``: ``TrainingConfig``).  ``megatron`` spells each as its
``pretrain_gpt.py`` argument, ``bridge`` as a ``key=value`` override; the
inverse (``layout``) turns such a dict back into execution and model fields.
The names are those of NVIDIA/Megatron-LM@d98e8a6
(megatron/core/transformer/transformer_config.py,
megatron/core/model_parallel_config.py,
megatron/core/distributed/distributed_data_parallel_config.py,
megatron/training/arguments.py) and NVIDIA-NeMo/Megatron-Bridge@067f987
(src/megatron/bridge/training/config.py ``ConfigContainer``); docs/launch.md
has the table.

Not a framework setting, so neither written nor read (read back: absent, the
framework spec's default or the partial-layout machinery fills them): the
network tiers (``*_net``: which network carries a group's traffic follows from
where the launcher places the ranks, not from an argument) and
``seq_par_ag_redo`` (Megatron-Core's column-parallel GEMMs keep the
sequence-parallel shard and all-gather it again in backward,
megatron/core/tensor_parallel/layers.py
``LinearWithGradAccumulationAndAsyncCommunication``; no argument chooses
otherwise).
"""
from __future__ import annotations

import re
from typing import Mapping

from autopar.io.errors import SpecError
from autopar.io.launch.base import SYSTEM_DERIVED
from autopar.io.layouts import (CHOICES, EXT_DEFAULTS, is_explicit_layout, layout_problem,
                                layout_stage_blocks, offload_modules_value, parse_layout)

# Execution fields that are not a framework setting (see the module docstring).
NOT_SETTINGS = ("tensor_par_net", "pipeline_par_net", "data_par_net", "context_par_net",
                "expert_par_net", "expert_tensor_par_net", "seq_par_ag_redo",
                # the data's (padded sequences), not the launch's
                "sequence_fill", "attention_span",
                # the adapters' rank and targets: pretrain_gpt.py has no adapters
                # (Megatron-Bridge writes them: bridge.py)
                "adapter_rank", "adapter_targets")

# Values no Megatron-Core setting expresses: field -> {value: why}.
UNEXPRESSED = {
    "weight_offload": {True: "Megatron-Core has no argument that keeps the weights in host "
                             "memory between uses (cpu_offloading_weights has no "
                             "pretrain_gpt.py argument; arguments.py excludes it)"},
    "activations_offload": {True: "Megatron-Core's cpu_offloading keeps the last layer's "
                                  "activations on the GPU (cpu_offloading_num_layers below "
                                  "num_layers: activation_offload_blocks) and fine-grained "
                                  "offloading (offload_modules) does not cover every stored "
                                  "activation"},
    "training": {False: "pretrain_gpt.py trains; an inference layout is not a training "
                        "launch"},
    "tensor_par_comm_type": {"p2p_rs_ag": "Megatron-Core's sequence parallelism uses NCCL "
                                          "reduce-scatter/all-gather collectives"},
    "tensor_par_overlap": {"pipe": "a pipelined TP overlap needs a per-GEMM userbuffers "
                                   "config (tp_comm_overlap_cfg) that autopar does not write"},
    "attention_impl": {"flash_v1": "Megatron-Core's flash backend is Transformer Engine's "
                                   "FlashAttention-2/3, not v1"},
    # issue 28's recipe fields (NVIDIA/Megatron-LM@d98e8a6): --optimizer
    # offers adam, sgd, muon, lion, soap, adaptive_muon (arguments.py), no
    # Adafactor; Transformer Engine's recipes have NVFP4BlockScaling but no
    # MXFP4 one (NVIDIA/TransformerEngine@d0067d0
    # transformer_engine/common/recipe/__init__.py), and --fp4-recipe offers
    # nvfp4; pretrain_gpt.py / pretrain_hybrid.py train every weight (LoRA is
    # Megatron-Bridge's PEFT: bridge.py)
    "optimizer": {"adafactor": "Megatron-LM's --optimizer offers adam, sgd, muon, lion, "
                               "soap, adaptive_muon (arguments.py): no Adafactor"},
    "fp8_recipe": {"mxfp4": "Transformer Engine has no MXFP4 recipe (common/recipe/__init__.py: "
                            "NVFP4BlockScaling only) and Megatron-Core's --fp4-recipe offers "
                            "nvfp4"},
    "adapter": {v: "pretrain_gpt.py trains every weight (no LoRA adapters; Megatron-Bridge's "
                   "PEFT has them: --format bridge)"
                for v in ("lora", "qlora")},
}


def refusal(field: str, value, fmt: str, why: str) -> str:
    return f"{fmt}: {field}={value} cannot be written: {why}"


def refuse_model(model, fmt: str, chunk_setting: bool = False) -> str | None:
    """Model shapes Megatron-Core cannot state (None: it can).  A hybrid
    Mamba model (``hybrid_override_pattern``) is Megatron-Core's
    ``HybridModel``: its Mamba mixer's convolution kernel and SSD chunk are
    ``MambaMixer``'s fixed arguments (megatron/core/ssm/mamba_mixer.py
    ``d_conv=4``, ``chunk_size=128``; no Megatron-LM argument sets them),
    so other values are refused; ``chunk_setting``: the format sets the
    chunk (Megatron-Bridge's ``HybridModelProvider.mamba_chunk_size``)."""
    if getattr(model, "gdn", None) is not None or getattr(model, "attention_output_gate", False):
        # (Megatron-Core@2a75ac1 builds 'G' layers from linear_num_key_heads,
        # linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
        # linear_conv_kernel_dim; autopar does not write them yet)
        field = "gdn" if getattr(model, "gdn", None) is not None else "attention_output_gate"
        return (f"{fmt}: the model {model.name or ''} has {field}: writing Megatron-Core's "
                "linear_* (Gated DeltaNet) and attention_output_gate settings is not supported")
    mb = getattr(model, "mamba", None)
    if getattr(model, "hybrid_pattern", "") and mb is not None:
        fixed_fields = [("conv_kernel", mb.conv_kernel, MAMBA_CONV_KERNEL)]
        if not chunk_setting:
            fixed_fields.append(("chunk", mb.chunk, MAMBA_CHUNK))
        for what, v, fixed in fixed_fields:
            if v != fixed:
                return (f"{fmt}: the model {model.name or ''} has mamba.{what}={v}: "
                        f"Megatron-Core's MambaMixer builds {fixed} (mamba_mixer.py; no "
                        "argument sets it)")
    return None


# The indexer loss coefficient written for a trained DSA indexer: Megatron-
# Bridge@067f987 models/glm_moe_dsa/glm5_bridge.py (dsa_indexer_loss_coeff).
DSA_LOSS_COEFF = 0.001

# MambaMixer's fixed convolution kernel and SSD chunk (mamba_mixer.py __init__)
MAMBA_CONV_KERNEL, MAMBA_CHUNK = 4, 128


def refuse_space(space, fmt: str, unexpressed: Mapping = UNEXPRESSED) -> str | None:
    """Why a layout this space may choose cannot be written (None: every field
    value it can choose is expressible)."""
    for f, bad in unexpressed.items():
        for v, why in bad.items():
            if space_allows(space, f, v):
                return refusal(f, _show(v), fmt, why) + f" (space {space.name} can choose it)"
    return None


def cut_space(space) -> dict:
    """What a space whose every optimizer is Muon implies under Megatron-Core
    (``_refuse_muon``): no Megatron-FSDP (unsharded gradients, no weight
    sharding), one layer-wise optimizer instance, no optimizer offload."""
    from autopar.io.launch.expressible import space_values
    if space_values(space, "optimizer") == ("muon",):
        return {"unsharded_grads": (True,), "weight_sharding": (False,),
                "sharding_group": (0,), "optimizer_offload": (False,),
                "optimizer_outer_sharding": (False,)}
    return {}


def space_allows(space, field: str, value) -> bool:
    from autopar.io.layouts import ALL_FIELDS
    if field in space.fixed:
        return space.fixed[field] == value
    allowed = space.allowed.get(field)
    if allowed is not None:
        if field in SYSTEM_DERIVED and allowed.values is None and allowed.low is None \
                and allowed.high is None:
            # derived from the system (its rates): cut to what the format
            # writes before the search (``autopar.io.export.format_space``)
            return False
        return bool(allowed.ok(value))
    # not listed: the field keeps its default (Calculon's for its 23 fields:
    # training true, offloads false)
    default = EXT_DEFAULTS.get(field, {"training": True}.get(field, False))
    return field in ALL_FIELDS and default == value


def writes(field: str, value, unexpressed: Mapping = UNEXPRESSED) -> bool:
    """Whether Megatron-Core's settings state ``value`` of ``field``."""
    return value not in unexpressed.get(field, {})


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _get(ex: Mapping, f: str):
    return ex.get(f, EXT_DEFAULTS.get(f))


def refuse_layout(model, ex: Mapping, fmt: str, unexpressed: Mapping = UNEXPRESSED,
                  te_only: bool = False) -> str | None:
    """Why this layout cannot be written (None: it can).  ``te_only``: the
    format builds Transformer Engine's layer spec only (Bridge)."""
    for f, bad in unexpressed.items():
        v = _get(ex, f)
        if v in bad and (not isinstance(v, bool) or type(v) is type(next(iter(bad)))):
            return refusal(f, _show(v), fmt, bad[v])
    why = _refuse_muon(ex, fmt) or _refuse_hybrid(model, ex, fmt)
    if _get(ex, "optimizer_moment_bytes") != 4 and _get(ex, "optimizer") != "adam":
        why = why or refusal("optimizer_moment_bytes", _get(ex, "optimizer_moment_bytes"), fmt,
                             "Megatron-Core's precision-aware optimizer (bf16 moments) runs "
                             "with Adam only (optimizer_config.py __post_init__)")
    if why:
        return why
    dt = ex.get("datatype")
    if dt in ("float8", "mxfp8"):
        return refusal("datatype", dt, fmt, "Megatron-Core runs fp8 GEMMs inside a bf16/fp16 "
                       "model (use fp8_recipe with datatype bfloat16)")
    fused_norm, attn = _get(ex, "fused_norm"), _get(ex, "attention_impl")
    if fused_norm and attn != "flash_v2":
        return refusal("attention_impl", attn, fmt, "with fused_norm (Transformer Engine's "
                       "layer spec) autopar writes the flash attention backend only")
    if not fused_norm and (attn == "flash_v2" or _get(ex, "fp8_recipe") != "none"):
        what = "fp8_recipe" if attn != "flash_v2" else "attention_impl"
        return refusal(what, _get(ex, what), fmt, "fused_norm false is Megatron-Core's local "
                       "layer spec, which has neither flash attention nor fp8")
    if not fused_norm and ex.get("tensor_par_overlap", "none") != "none":
        return refusal("tensor_par_overlap", ex["tensor_par_overlap"], fmt, "tp_comm_overlap "
                       "is Transformer Engine's userbuffers (megatron/training/initialize.py "
                       "_initialize_tp_communicators), not the local layer spec of fused_norm "
                       "false")
    if not fused_norm and te_only:
        return refusal("fused_norm", "false", fmt, "Megatron-Bridge's GPT providers build "
                       "Transformer Engine's layer spec (norm fused into the linear layer)")
    if ex.get("tensor_par_overlap", "none") != "none" and ex.get("tensor_par_comm_type") == "ar":
        return refusal("tensor_par_overlap", ex["tensor_par_overlap"], fmt,
                       "tp_comm_overlap needs sequence parallelism (tensor_par_comm_type rs_ag)")
    if _get(ex, "fp8_recipe") != "none" and dt not in ("bfloat16", "float16"):
        return refusal("fp8_recipe", _get(ex, "fp8_recipe"), fmt,
                       "Megatron-Core's fp8 runs inside a bf16/fp16 model")
    g = _get(ex, "sharding_group")
    if g and ex.get("data_par", 1) % g:
        return refusal("sharding_group", g, fmt, f"num_distributed_optimizer_instances must "
                       f"divide data_par ({ex.get('data_par')})")
    if g and not ex.get("optimizer_sharding"):
        return refusal("sharding_group", g, fmt, "without optimizer_sharding nothing is sharded")
    if _get(ex, "optimizer_outer_sharding") and not (
            _get(ex, "weight_sharding") and 0 < g < ex.get("data_par", 1)):
        return refusal("optimizer_outer_sharding", "true", fmt, "outer_dp_sharding_strategy "
                       "optim needs Megatron-FSDP's optim_grads_params (weight_sharding) and "
                       "more than one distributed-optimizer instance (0 < sharding_group < "
                       "data_par; megatron_fsdp/param_and_grad_buffer.py)")
    if _get(ex, "weight_sharding") and not ex.get("optimizer_sharding"):
        return refusal("weight_sharding", "true", fmt, "Megatron-FSDP shards the weights "
                       "together with the optimizer state (optimizer_sharding)")
    if _get(ex, "param_gather_overlap") and not (ex.get("optimizer_sharding")
                                                  and ex.get("data_par_overlap")):
        return refusal("param_gather_overlap", "true", fmt, "overlap_param_gather needs the "
                       "distributed optimizer or Megatron-FSDP (optimizer_sharding) and "
                       "overlap_grad_reduce (data_par_overlap) (arguments.py validate_args)")
    if _get(ex, "moe_overlap"):
        # transformer_config.py __post_init__ (overlap_moe_expert_parallel_comm)
        v = ex.get("pipeline_interleaving", 1)
        why = ("it needs expert parallelism (expert_par > 1)" if _get(ex, "expert_par") <= 1
               else "it needs the alltoall or flex (deepep) dispatcher"
               if _get(ex, "moe_dispatcher") == "allgather"
               else "it cannot be combined with full recompute"
               if ex.get("activation_recompute") == "full"
               else "it needs a bf16 or fp16 model" if dt not in ("bfloat16", "float16")
               else "with pipeline_par > 1 it needs virtual stages (pipeline_interleaving > 1)"
               if ex.get("pipeline_par", 1) > 1 and v == 1 else None)
        if why:
            return refusal("moe_overlap", "true", fmt, "Megatron-Core's EP all-to-all "
                           "overlap (overlap_moe_expert_parallel_comm): " + why)
    k = _get(ex, "activation_offload_blocks")
    if k:
        # transformer_config.py __post_init__ (NVIDIA/Megatron-LM@2a75ac1)
        why = ("there is no CPU offloading with pipeline parallelism"
               if ex.get("pipeline_par", 1) > 1 else
               "CPU offloading does not work with activation recompute"
               if ex.get("activation_recompute", "none") != "none"
               or _get(ex, "recompute_moe_act") or _get(ex, "recompute_mla_up_proj") else
               f"cpu_offloading_num_layers must be below num_layers ({model.num_blocks})"
               if k >= model.num_blocks else None)
        if why:
            return refusal("activation_offload_blocks", k, fmt, "Megatron-Core's cpu_offloading: "
                           + why)
    if _get(ex, "activation_offload_modules") not in (None, "none") \
            and not _get(ex, "fused_norm"):
        # megatron/training/arguments.py validate_args (NVIDIA/Megatron-LM@2a75ac1)
        return refusal("activation_offload_modules", _get(ex, "activation_offload_modules"),
                       fmt, "Megatron-Core's fine-grained activation offloading runs with "
                       "the transformer_engine implementation only (fused_norm true)")
    if _get(ex, "recompute_layers") and ex.get("activation_recompute") != "full":
        return refusal("recompute_layers", _get(ex, "recompute_layers"), fmt,
                       "recompute_num_layers with recompute_method block is full recompute only")
    return None


# Bytes of an Adam moment by its dtype as Megatron-LM's --exp-avg-dtype /
# --exp-avg-sq-dtype spell it (arguments.py: fp32, fp16, bf16, fp8) and as
# Megatron-Bridge's OptimizerConfig overrides do (torch dtype names); the
# first of each width is what autopar writes.
MOMENT_DTYPE = {4: "fp32", 2: "bf16"}
MOMENT_BYTES_OF = {"fp32": 4, "float32": 4, "torch.float32": 4,
                   "bf16": 2, "bfloat16": 2, "torch.bfloat16": 2,
                   "fp16": 2, "float16": 2, "torch.float16": 2}


def _read_moments(r, ex: dict, put) -> None:
    """optimizer_moment_bytes from the precision-aware optimizer's moment
    dtypes (fp32 unless use_precision_aware_optimizer sets them)."""
    keys = ("optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype")
    aware = r.bool("optimizer.use_precision_aware_optimizer", False)
    widths = []
    for k in keys:
        name = r.v.get(k)
        if name is None:
            widths.append(4)
            continue
        name = str(name)
        if name not in MOMENT_BYTES_OF:
            r.fail(k, f"autopar counts fp32, bf16 or fp16 moments; got {name!r}")
        widths.append(MOMENT_BYTES_OF[name])
    if widths[0] != widths[1]:
        r.fail(keys[1], f"exp_avg and exp_avg_sq of different widths ({widths[0]} and "
               f"{widths[1]} bytes): autopar counts one width for both moments")
    if widths[0] != 4 and not aware:
        r.fail("optimizer.use_precision_aware_optimizer", "moments narrower than fp32 need "
               "the precision-aware optimizer (optimizer_config.py asserts it)")
    if aware or any(k in r.v for k in keys):
        put("optimizer_moment_bytes", widths[0])


def _refuse_muon(ex: Mapping, fmt: str) -> str | None:
    """What Megatron-Core's Muon (an "emerging optimizer") does not run with."""
    if _get(ex, "optimizer") != "muon":
        return None
    if ex.get("optimizer_sharding") and (_get(ex, "weight_sharding")
                                         or not _get(ex, "unsharded_grads")):
        return refusal("optimizer", "muon", fmt, "Megatron-Core's emerging optimizers do not "
                       "run with Megatron-FSDP (ZeRO-2/3 sharding; arguments.py validate_args)")
    if _get(ex, "sharding_group"):
        return refusal("optimizer", "muon", fmt, "autopar writes Muon's layer-wise distributed "
                       "optimizer over the whole data-parallel group (sharding_group 0)")
    if ex.get("optimizer_offload"):
        return refusal("optimizer", "muon", fmt, "the layer-wise optimizer skips Megatron's "
                       "wrapping, which optimizer_cpu_offload needs (megatron/core/optimizer/"
                       "__init__.py)")
    return None


def _refuse_hybrid(model, ex: Mapping, fmt: str) -> str | None:
    """A hybrid model's split: every virtual stage a segment of the pattern."""
    if not getattr(model, "hybrid_pattern", ""):
        return None
    counts = layout_blocks(model, ex)
    if ex.get("pipeline_par", 1) * ex.get("pipeline_interleaving", 1) > 1 and \
            (counts is None or min(counts) < 1):
        return refusal("pipeline_par", ex.get("pipeline_par"), fmt, "a hybrid model's "
                       "--hybrid-layer-pattern needs a layer in every virtual pipeline stage")
    return None


# ---------------------------------------------------------------------------
# layout -> settings

def virtual_stage_blocks(num_blocks: int, p: int, v: int, first: int = 0, last: int = 0,
                         embedding: bool = False, loss: bool = False,
                         balanced: bool = False) -> list[int] | None:
    """The blocks of each of the ``p * v`` virtual stages in Megatron-Core's
    order (virtual stage ``k`` on stage ``k % p``), as it builds them for a
    split (megatron/core/transformer/transformer_block.py
    ``get_num_layers_to_build``; a ``balanced`` layout as
    ``_balanced_layout`` writes it), or None where the split cannot be
    built.  Even: every stage's share over its ``v`` chunks, the first
    chunk of the first stage one block fewer where the embedding counts,
    the last chunk of the last stage where the loss counts; ``first`` /
    ``last``: those stages' blocks over their chunks, the middle stages
    sharing the rest."""
    e, l_ = int(embedding), int(loss)
    k = p * v
    if balanced:
        q, r = divmod(num_blocks + e + l_, k)
        counts = [q + (i < r) for i in range(k)]
    elif first or last:
        rest, middle = num_blocks - first - last, p - bool(first) - bool(last)
        if (first % v or last % v or rest < 0 or bool(rest) != bool(middle)
                or (middle and (rest % middle or (rest // middle) % v))):
            return None
        per = [rest // middle if middle else 0] * p
        if first:
            per[0] = first
        if last:
            per[-1] = last
        counts = [per[i % p] // v for i in range(k)]
    else:
        layers = num_blocks + e + l_
        if layers % k:
            return None
        counts = [layers // k] * k
    counts[0] -= e
    counts[-1] -= l_
    return counts if min(counts) >= 0 and sum(counts) == num_blocks else None


def layout_blocks(model, ex: Mapping) -> list[int] | None:
    """``virtual_stage_blocks`` of a layout's split fields (an explicit
    layout's: ``autopar.io.layouts.layout_stage_blocks``)."""
    if is_explicit_layout(_get(ex, "pipeline_layout")):
        return layout_stage_blocks(parse_layout(_get(ex, "pipeline_layout")), model.num_blocks)
    return virtual_stage_blocks(
        model.num_blocks, ex.get("pipeline_par", 1), ex.get("pipeline_interleaving", 1),
        _get(ex, "first_stage_blocks"), _get(ex, "last_stage_blocks"),
        bool(_get(ex, "embedding_in_split")), bool(_get(ex, "loss_in_split")),
        _get(ex, "pipeline_layout") == "balanced")


def _balanced_layout(model, ex: Mapping) -> str:
    """The ``pipeline_model_parallel_layout`` of autopar's balanced split
    (autopar.model.pipeline.stage_split): ``p * v`` virtual stages in order,
    ``q`` or ``q + 1`` counted layers each (the earlier ones the more), the
    embedding ``E`` first and the loss ``L`` last (counted where
    embedding_in_split / loss_in_split), MTP modules ``m`` before the loss."""
    counts = layout_blocks(model, ex)
    k = len(counts)
    return "|".join(("E" if i == 0 else "") + "t" * n
                    + (("m" * model.mtp + "L") if i == k - 1 else "")
                    for i, n in enumerate(counts))


def hybrid_pattern(model, ex: Mapping) -> str:
    """The model's ``hybrid_override_pattern`` with ``|`` between the virtual
    pipeline stages (Megatron-Core's ``--hybrid-layer-pattern``: the pipes are
    the stage boundaries, megatron/core/models/hybrid/hybrid_layer_allocation.py;
    arguments.py derives the virtual stages from their number), each holding
    the blocks autopar's split gives it (``layout_blocks``)."""
    counts = layout_blocks(model, ex)
    out, at = [], 0
    for n in counts:
        out.append(model.hybrid_pattern[at:at + n])
        at += n
    return "|".join(out)


def mtp_pattern_suffix(model) -> str:
    """A hybrid model's MTP modules in Megatron-Core's unified pattern: ``/``
    and the module's layers once per depth
    (megatron/core/models/hybrid/hybrid_layer_allocation.py
    ``parse_hybrid_pattern``: the depths are the parts after the main
    pattern, all alike; Megatron-Bridge's HybridModelProvider.finalize writes
    ``mtp_hybrid_override_pattern`` so, ``mtp_num_layers`` copies)."""
    if not (getattr(model, "mtp_pattern", "") and model.mtp):
        return ""
    return "/" + "/".join([model.mtp_pattern] * model.mtp)


def settings(model, ex: Mapping) -> dict:
    """The Megatron-Core settings (``section.attribute`` -> value) of a layout
    that ``refuse_layout`` accepts, with the model's shape."""
    s: dict = {}
    s.update(model_settings(model, ex))
    tp, pp, cp = ex["tensor_par"], ex["pipeline_par"], _get(ex, "context_par")
    s["model.tensor_model_parallel_size"] = tp
    s["model.pipeline_model_parallel_size"] = pp
    s["model.context_parallel_size"] = cp
    if model.moe is not None or _get(ex, "expert_par") > 1 or _get(ex, "expert_tensor_par") > 1:
        s["model.expert_model_parallel_size"] = _get(ex, "expert_par")
        s["model.expert_tensor_parallel_size"] = _get(ex, "expert_tensor_par")
    v = ex.get("pipeline_interleaving", 1)
    if getattr(model, "hybrid_pattern", ""):
        # HybridModel: the pattern's pipes are the split (arguments.py refuses
        # the layout string, first/last stage sizes and the embedding/loss
        # accounting next to pipes)
        s["model.hybrid_layer_pattern"] = hybrid_pattern(model, ex) + mtp_pattern_suffix(model)
        s["model.virtual_pipeline_model_parallel_size"] = v if v > 1 else None
    elif is_explicit_layout(_get(ex, "pipeline_layout")):
        # Megatron-Core's own layout string, as the user wrote it (the
        # virtual size is the layout's: transformer_config.py __post_init__)
        s["model.pipeline_model_parallel_layout"] = _get(ex, "pipeline_layout")
    elif _get(ex, "pipeline_layout") == "balanced":
        s["model.pipeline_model_parallel_layout"] = _balanced_layout(model, ex)
    else:
        s["model.virtual_pipeline_model_parallel_size"] = v if v > 1 else None
        if _get(ex, "first_stage_blocks"):
            s["model.num_layers_in_first_pipeline_stage"] = _get(ex, "first_stage_blocks")
        if _get(ex, "last_stage_blocks"):
            s["model.num_layers_in_last_pipeline_stage"] = _get(ex, "last_stage_blocks")
        s["model.account_for_embedding_in_pipeline_split"] = bool(_get(ex, "embedding_in_split"))
        s["model.account_for_loss_in_pipeline_split"] = bool(_get(ex, "loss_in_split"))
    s["train.micro_batch_size"] = ex["microbatch_size"]
    s["train.global_batch_size"] = ex["batch_size"]
    # TransformerConfig refuses sequence parallelism without tensor parallelism
    # (model_parallel_config.py __post_init__); with one TP rank there is no
    # TP traffic to split, so rs_ag and ar are the same run
    s["model.sequence_parallel"] = ex["tensor_par_comm_type"] == "rs_ag" and tp > 1
    s["model.tp_comm_overlap"] = ex["tensor_par_overlap"] == "ring"
    rec = ex["activation_recompute"]
    # Megatron-Core's output-discarding modules beside the selective choice
    discard = [m for m, f in (("moe_act", "recompute_moe_act"),
                              ("mla_up_proj", "recompute_mla_up_proj")) if _get(ex, f)]
    if rec == "full":
        k = _get(ex, "recompute_layers")
        s["model.recompute_granularity"] = "full"
        s["model.recompute_method"] = "block" if k else "uniform"
        s["model.recompute_num_layers"] = k if k else 1
    elif rec in ("attn_only", "mlp_only") or discard:
        s["model.recompute_granularity"] = "selective"
        s["model.recompute_modules"] = ([] if rec == "none" else
                                        ["core_attn" if rec == "attn_only" else "mlp"]) + discard
    else:
        s["model.recompute_granularity"] = None
    # data-parallel sharding: none, ZeRO-1 (the distributed optimizer),
    # ZeRO-2 / ZeRO-3 (Megatron-FSDP's optim_grads / optim_grads_params)
    shard, whole_grads = bool(ex["optimizer_sharding"]), bool(_get(ex, "unsharded_grads"))
    ws = bool(_get(ex, "weight_sharding"))
    fsdp = shard and (ws or not whole_grads)
    muon = _get(ex, "optimizer") == "muon"
    # Muon's sharded state is Megatron-Core's layer-wise distributed optimizer
    # (whole matrices per data-parallel rank): OptimizerConfig's
    # use_layer_wise_distributed_optimizer, which Megatron-LM sets from
    # --use-distributed-optimizer with an emerging optimizer (arguments.py
    # validate_args, "emerging optimizer check")
    s["ddp.use_distributed_optimizer"] = shard and not fsdp and not muon
    if muon:
        s["optimizer.use_layer_wise_distributed_optimizer"] = shard and not fsdp
    s["ddp.use_megatron_fsdp"] = fsdp
    if fsdp:
        s["ddp.data_parallel_sharding_strategy"] = "optim_grads_params" if ws else "optim_grads"
        # Megatron-FSDP saves only this checkpoint format (arguments.py
        # validate_args; Megatron-Bridge config.py likewise)
        s["checkpoint.ckpt_format"] = "fsdp_dtensor"
    g = _get(ex, "sharding_group")
    s["ddp.num_distributed_optimizer_instances"] = ex["data_par"] // g if g else 1
    if _get(ex, "optimizer_outer_sharding"):
        # Megatron-FSDP's HFSDP: the optimizer state sharded across the
        # instances too (--outer-dp-sharding-strategy, arguments.py)
        s["ddp.outer_dp_sharding_strategy"] = "optim"
    s["ddp.overlap_grad_reduce"] = bool(ex["data_par_overlap"])
    s["ddp.overlap_param_gather"] = bool(_get(ex, "param_gather_overlap"))
    s["ddp.grad_reduce_in_fp32"] = bool(_get(ex, "fp32_grads"))
    # Partial CPU activation offloading: TransformerConfig.cpu_offloading with
    # cpu_offloading_num_layers (model_parallel_config.py; Megatron-LM's
    # --cpu-offloading-num-layers N sets cpu_offloading itself, arguments.py
    # validate_args), activations only, as the Bridge recipes set it
    off = _get(ex, "activation_offload_blocks")
    s["model.cpu_offloading"] = bool(off)
    if off:
        s["model.cpu_offloading_num_layers"] = int(off)
        s["model.cpu_offloading_activations"] = True
        s["model.cpu_offloading_weights"] = False
    # Fine-grained activation offloading: TransformerConfig's
    # fine_grained_activation_offloading with offload_modules (Megatron-LM's
    # --fine-grained-activation-offloading --offload-modules a b ...)
    mods = _get(ex, "activation_offload_modules")
    s["model.fine_grained_activation_offloading"] = mods not in (None, "none")
    if mods not in (None, "none"):
        s["model.offload_modules"] = mods.split("+")
        if "fused_group_mlp" in mods.split("+"):
            # the whole fused grouped MLP is the Transformer Engine op
            # fuser's (transformer_config.py __post_init__ raises without it;
            # Megatron-LM's --use-transformer-engine-op-fuser)
            s["model.use_transformer_engine_op_fuser"] = True
    s["optimizer.optimizer_cpu_offload"] = bool(ex["optimizer_offload"])
    if ex["optimizer_offload"]:
        s["optimizer.optimizer_offload_fraction"] = 1.0
        # the hybrid device optimizer runs on the precision-aware path
        # (arguments.py validate_args asserts it)
        s["optimizer.use_precision_aware_optimizer"] = True
    s["mixed_precision.dtype"] = ex["datatype"]
    fp8 = _get(ex, "fp8_recipe")
    if fp8 == "nvfp4":
        # NVFP4: TransformerConfig.fp4 / fp4_recipe (--fp4-format e2m1 --fp4-recipe nvfp4)
        s["model.fp8"], s["model.fp8_recipe"] = None, None
        s["model.fp4"], s["model.fp4_recipe"] = "e2m1", "nvfp4"
    else:
        s["model.fp8"] = None if fp8 == "none" else ("hybrid" if fp8 == "tensorwise" else "e4m3")
        s["model.fp8_recipe"] = {"none": None, "tensorwise": "tensorwise",
                                 "rowwise": "blockwise", "mxfp8": "mxfp8"}[fp8]
    if _get(ex, "optimizer") != "adam":
        s["optimizer.optimizer"] = _get(ex, "optimizer")      # OptimizerConfig.optimizer
    moments = _get(ex, "optimizer_moment_bytes")
    if moments != 4:
        # bf16 moments: OptimizerConfig.use_precision_aware_optimizer with
        # exp_avg_dtype / exp_avg_sq_dtype (Transformer Engine's FusedAdam
        # stores them so); Megatron-LM's --exp-avg-dtype spelling
        s["optimizer.use_precision_aware_optimizer"] = True
        s["optimizer.exp_avg_dtype"] = s["optimizer.exp_avg_sq_dtype"] = MOMENT_DTYPE[moments]
    if muon:
        # Newton-Schulz of a tensor-parallel matrix spread over its TP ranks
        # (OptimizerConfig.muon_tp_mode "distributed", emerging_optimizers.py
        # newton_schulz_tp): each computes its share, as autopar counts it
        # (autopar.model.optimizers); Megatron's default "duplicated" runs the
        # whole matrix on every TP rank.  Five iterations (--muon-num-ns-steps
        # default 5, autopar's NS_STEPS).
        s["optimizer.muon_tp_mode"] = "distributed"
    first, last = _get(ex, "bf16_first_blocks"), _get(ex, "bf16_last_blocks")
    if fp8 != "none" and (first or last):
        # TransformerConfig.first_last_layers_bf16 with the counts
        # (arguments.py --first-last-layers-bf16, --num-layers-at-start-in-bf16,
        # --num-layers-at-end-in-bf16)
        s["model.first_last_layers_bf16"] = True
        s["model.num_layers_at_start_in_bf16"] = int(first)
        s["model.num_layers_at_end_in_bf16"] = int(last)
    s["model.bias_activation_fusion"] = bool(ex["fused_activation"])
    s["model.transformer_impl"] = "transformer_engine" if _get(ex, "fused_norm") else "local"
    attn = _get(ex, "attention_impl")
    if attn == "flash_v2":
        s["model.attention_backend"] = "flash"
    else:
        s["model.masked_softmax_fusion"] = attn == "fused_softmax"
    if cp > 1:
        s["model.cp_comm_type"] = _get(ex, "context_par_comm")
    if model.moe is not None:
        d = _get(ex, "moe_dispatcher")
        s["model.moe_token_dispatcher_type"] = "flex" if d == "deepep" else d
        if d == "deepep":
            s["model.moe_flex_dispatcher_backend"] = "deepep"
        s["model.overlap_moe_expert_parallel_comm"] = bool(_get(ex, "moe_overlap"))
    s["_num_procs"] = ex["num_procs"]
    return s


def model_settings(model, ex: Mapping) -> dict:
    """The model's shape as Megatron-Core's config attributes."""
    s = {"model.num_layers": model.num_blocks, "model.hidden_size": model.hidden,
         "model.ffn_hidden_size": model.feedforward,
         "model.num_attention_heads": model.attn_heads, "model.kv_channels": model.attn_size,
         "model.seq_length": model.seq_size}
    groups = model.kv_heads
    if groups is None and ex.get("attention_type") == "multiquery":
        groups = 1
    if groups is not None:
        s["model.num_query_groups"] = groups
    if model.vocab_size:
        s["model.vocab_size"] = model.vocab_size
    llama = model.block == "llama"
    s["model.gated_linear_unit"] = llama
    s["model.normalization"] = "RMSNorm" if llama else "LayerNorm"
    s["model.position_embedding_type"] = "rope" if llama else "learned_absolute"
    if getattr(model, "hybrid_pattern", "") and not llama:
        # a hybrid model's attention layers take no position embedding
        # (Nemotron-H; Megatron-Bridge's HybridModelProvider default "none");
        # autopar counts none for either block
        s["model.position_embedding_type"] = "none"
    s["model.add_bias_linear"] = not llama
    if model.moe is not None:
        m = model.moe
        s["model.num_moe_experts"] = m.experts
        s["model.moe_router_topk"] = m.top_k
        s["model.moe_ffn_hidden_size"] = m.expert_feedforward
        if m.shared_experts:
            s["model.moe_shared_expert_intermediate_size"] = m.shared_feedforward
        if m.first_dense:
            s["model.moe_layer_freq"] = (f"([0]*{m.first_dense}+[1]*"
                                         f"{model.num_blocks - m.first_dense})")
        s["model.moe_router_score_function"] = m.router
        if m.capacity_factor is not None:
            s["model.moe_expert_capacity_factor"] = m.capacity_factor
        if m.latent_size:
            s["model.moe_latent_size"] = m.latent_size
    if model.mla is not None:
        a = model.mla
        s["model.multi_latent_attention"] = True
        s["model.kv_lora_rank"] = a.kv_lora_rank
        s["model.q_lora_rank"] = a.q_lora_rank or None
        s["model.qk_head_dim"] = a.qk_nope_head_dim
        s["model.qk_pos_emb_head_dim"] = a.qk_rope_head_dim
        s["model.v_head_dim"] = a.v_head_dim
        if a.sparse_index is not None:
            # DeepSeek Sparse Attention (TransformerConfig's dsa_* fields,
            # Megatron-LM arguments generated from them): the fused kernels
            # autopar counts (dsa_kernel_backend; "none" would run the
            # unfused path that materialises every score), the indexer's
            # sparse KL loss at Megatron-Bridge's GLM-5 coefficient (0.001,
            # glm5_bridge.py) where the indexer is trained, else none.
            d = a.sparse_index
            s["model.experimental_attention_variant"] = "dsa"
            s["model.dsa_indexer_n_heads"] = d.n_heads
            s["model.dsa_indexer_head_dim"] = d.head_dim
            s["model.dsa_indexer_topk"] = d.topk
            s["model.dsa_indexer_loss_coeff"] = DSA_LOSS_COEFF if d.loss else 0.0
            s["model.dsa_indexer_use_sparse_loss"] = True
            s["model.dsa_kernel_backend"] = "cudnn"
    if model.mtp:
        s["model.mtp_num_layers"] = model.mtp
        if getattr(model, "mtp_repeated", False):
            s["model.mtp_use_repeated_layer"] = True
    mb = getattr(model, "mamba", None)
    if getattr(model, "hybrid_pattern", "") and mb is not None:
        # TransformerConfig.mamba_num_heads / mamba_head_dim / mamba_state_dim /
        # mamba_num_groups (transformer_config.py)
        s["model.mamba_num_heads"] = mb.heads
        s["model.mamba_head_dim"] = mb.head_dim
        s["model.mamba_state_dim"] = mb.state
        s["model.mamba_num_groups"] = mb.groups
    return s


# ---------------------------------------------------------------------------
# settings -> layout

class Reader:
    """Typed access to settings read from a file, errors naming the file and
    the argument as the file spells it (``spell(key)``)."""

    def __init__(self, values: Mapping, source: str, spell):
        self.v, self.source, self.spell = values, source, spell   # the caller's dict

    def has(self, key):
        return key in self.v

    def fail(self, key, msg):
        raise SpecError(self.source, self.spell(key), msg)

    def int(self, key, default=None, minimum=1):
        if key not in self.v:
            return default
        raw = self.v[key]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        try:
            n = int(str(raw))
        except ValueError:
            self.fail(key, f"expected an integer, got {raw!r}")
        if n < minimum:
            self.fail(key, f"must be >= {minimum}, got {n}")
        return n

    def float(self, key, default=None):
        if key not in self.v:
            return default
        try:
            return float(str(self.v[key]))
        except ValueError:
            self.fail(key, f"expected a number, got {self.v[key]!r}")

    def bool(self, key, default=None):
        if key not in self.v:
            return default
        raw = self.v[key]
        if isinstance(raw, bool):
            return raw
        t = str(raw).lower()
        if t in ("true", "1", "yes"):
            return True
        if t in ("false", "0", "no"):
            return False
        self.fail(key, f"expected true or false, got {raw!r}")

    def choice(self, key, options, default=None):
        if key not in self.v:
            return default
        raw = self.v[key]
        if raw is None or str(raw).lower() in ("none", "null"):
            return None
        if str(raw) not in options:
            self.fail(key, f"expected one of {', '.join(options)}, got {raw!r}")
        return str(raw)

    def list(self, key):
        if key not in self.v:
            return None
        raw = self.v[key]
        if raw is None:
            return None
        if isinstance(raw, (list, tuple)):
            return [str(x) for x in raw]
        return [x for x in re.split(r"[\s,\[\]'\"]+", str(raw)) if x]


def _read_layout(r: Reader, key: str, pp: int, num_blocks: int | None) -> dict:
    """A ``pipeline_model_parallel_layout`` -> autopar's balanced split fields
    where it is one, else the layout itself (an explicit ``pipeline_layout``);
    a one-line error naming the key where Megatron-Core refuses it
    (``autopar.io.layouts.parse_layout`` / ``layout_problem``)."""
    raw = str(r.v[key])
    try:
        stages = list(parse_layout(raw))
    except ValueError as e:
        r.fail(key, str(e))
    k = len(stages)
    counted = sum(st.count("t") for st in stages)
    why = layout_problem(stages, pp, k // pp if pp else 0,
                         num_blocks if num_blocks is not None and counted != num_blocks / 2
                         else None)
    if why:
        r.fail(key, why)
    blocks = [s.count("t") for s in stages]
    for e in (False, True):
        for l_ in (False, True):
            q, rem = divmod(sum(blocks) + e + l_, k)
            want = [q + (i < rem) for i in range(k)]
            want[0] -= e
            want[-1] -= l_
            if q >= 1 and want == blocks:
                return {"pipeline_layout": "balanced", "pipeline_interleaving": k // pp,
                        "embedding_in_split": e, "loss_in_split": l_}
    return {"pipeline_layout": raw, "pipeline_interleaving": k // pp,
            "embedding_in_split": False, "loss_in_split": False}


def layout(r: Reader, framework_defaults: bool) -> tuple[dict, dict]:
    """Execution and model fields from Megatron-Core settings.  With
    ``framework_defaults`` (Megatron-LM's command line) an absent argument
    means its argparse default; otherwise (a recipe override list) an absent
    key is left out."""
    d = framework_defaults
    ex: dict = {}
    model = _read_model(r)

    def put(f, v):
        if v is not None:
            ex[f] = v
    tp = r.int("model.tensor_model_parallel_size", 1 if d else None)
    pp = r.int("model.pipeline_model_parallel_size", 1 if d else None)
    cp = r.int("model.context_parallel_size", 1 if d else None)
    put("tensor_par", tp)
    put("pipeline_par", pp)
    put("context_par", cp)
    put("expert_par", r.int("model.expert_model_parallel_size", 1 if d else None))
    etp = r.int("model.expert_tensor_parallel_size", None)
    put("expert_tensor_par", etp if etp is not None else (tp if d and model.get("moe") else
                                                          (1 if d else None)))
    n = r.int("_num_procs", None)
    if n is not None:
        ex["num_procs"] = n
        if None not in (tp, pp, cp):
            if n % (tp * pp * cp):
                r.fail("_num_procs", f"{n} GPUs do not divide by tensor x pipeline x context "
                       f"parallel sizes ({tp * pp * cp})")
            ex["data_par"] = n // (tp * pp * cp)
    segments = _pattern_segments(r)
    if segments is not None and len(segments) > 1:
        # pipes: the split (a pattern without pipes on several stages is
        # Megatron-Core's even or first/last split, read below:
        # hybrid_layer_allocation.py select_pipeline_segment)
        ex.update(_read_segments(r, segments, pp or 1, model.get("mtp") or 0))
    elif r.has("model.pipeline_model_parallel_layout") and \
            r.v["model.pipeline_model_parallel_layout"] not in (None, "None", "null"):
        ex.update(_read_layout(r, "model.pipeline_model_parallel_layout", pp or 1,
                               model.get("num_blocks")))
    else:
        if r.has("model.virtual_pipeline_model_parallel_size") or d:
            # absent or null: no virtual stages
            ex["pipeline_interleaving"] = r.int("model.virtual_pipeline_model_parallel_size",
                                                None) or 1
        put("first_stage_blocks", r.int("model.num_layers_in_first_pipeline_stage",
                                        0 if d else None))
        put("last_stage_blocks", r.int("model.num_layers_in_last_pipeline_stage",
                                       0 if d else None))
        put("embedding_in_split", r.bool("model.account_for_embedding_in_pipeline_split",
                                         False if d else None))
        put("loss_in_split", r.bool("model.account_for_loss_in_pipeline_split",
                                    False if d else None))
        if d or r.has("model.virtual_pipeline_model_parallel_size"):
            ex["pipeline_layout"] = "even"
    put("microbatch_size", r.int("train.micro_batch_size", 1 if d else None))
    put("batch_size", r.int("train.global_batch_size", None))
    if "batch_size" not in ex and d and "data_par" in ex:
        ex["batch_size"] = ex["microbatch_size"] * ex["data_par"]
    sp = r.bool("model.sequence_parallel", False if d else None)
    if sp is not None:
        ex["tensor_par_comm_type"] = "rs_ag" if sp else "ar"
    ov = r.bool("model.tp_comm_overlap", False if d else None)
    if ov is not None:
        ex["tensor_par_overlap"] = "ring" if ov else "none"
    _read_recompute(r, ex, d)
    _read_sharding(r, ex, d)
    put("data_par_overlap", r.bool("ddp.overlap_grad_reduce", False if d else None))
    put("param_gather_overlap", r.bool("ddp.overlap_param_gather", False if d else None))
    put("fp32_grads", r.bool("ddp.grad_reduce_in_fp32", None))
    _read_cpu_offload(r, ex, d)
    _read_fine_offload(r, ex, d)
    put("optimizer_offload", r.bool("optimizer.optimizer_cpu_offload", False if d else None))
    if ex.get("optimizer_offload") and \
            r.float("optimizer.optimizer_offload_fraction", 1.0) != 1.0:
        r.fail("optimizer.optimizer_offload_fraction", "autopar offloads all of the optimizer "
               "(1.0) or none of it")
    put("datatype", r.choice("mixed_precision.dtype", CHOICES["datatype"], None))
    fmt8 = r.choice("model.fp8", ("e4m3", "hybrid"), None)
    recipe = r.choice("model.fp8_recipe", ("tensorwise", "delayed", "mxfp8", "blockwise"),
                      "delayed" if fmt8 else None)
    if fmt8 is not None or r.has("model.fp8"):
        ex["fp8_recipe"] = "none" if fmt8 is None else \
            {"tensorwise": "tensorwise", "delayed": "tensorwise", "blockwise": "rowwise",
             "mxfp8": "mxfp8"}[recipe]
    if r.choice("model.fp4", ("e2m1",), None) is not None:
        r.choice("model.fp4_recipe", ("nvfp4",), "nvfp4")
        ex["fp8_recipe"] = "nvfp4"
    opt = r.choice("optimizer.optimizer", ("adam", "sgd", "muon", "dist_muon"),
                   "adam" if d else None)
    if opt == "dist_muon":
        # deprecated spelling of muon with the layer-wise distributed optimizer
        opt = "muon"
        ex.update(optimizer_sharding=True, unsharded_grads=True, weight_sharding=False)
    put("optimizer", opt)
    _read_moments(r, ex, put)
    if opt == "muon":
        r.choice("optimizer.muon_tp_mode", ("blockwise", "duplicated", "distributed"), None)
        if r.int("optimizer.muon_num_ns_steps", 5) != 5:
            r.fail("optimizer.muon_num_ns_steps", "autopar counts Muon's five Newton-Schulz "
                   "iterations, got " + str(r.v["optimizer.muon_num_ns_steps"]))
    if r.bool("model.first_last_layers_bf16", False):
        # Megatron's defaults for the counts are 1 each (arguments.py)
        ex["bf16_first_blocks"] = r.int("model.num_layers_at_start_in_bf16", 1, minimum=0)
        ex["bf16_last_blocks"] = r.int("model.num_layers_at_end_in_bf16", 1, minimum=0)
    elif d:
        ex["bf16_first_blocks"] = ex["bf16_last_blocks"] = 0
    put("fused_activation", r.bool("model.bias_activation_fusion", True if d else None))
    impl = r.choice("model.transformer_impl", ("transformer_engine", "local"),
                    "transformer_engine" if d else None)
    if impl is not None:
        ex["fused_norm"] = impl == "transformer_engine"
    backend = r.choice("model.attention_backend", ("flash", "fused", "unfused", "local", "auto"),
                       None)
    if impl == "local" or backend == "local":
        fused = r.bool("model.masked_softmax_fusion", True if d else None)
        if fused is not None:
            ex["attention_impl"] = "fused_softmax" if fused else "unfused"
    elif backend in ("flash", "fused", "auto") or (backend is None and d):
        ex["attention_impl"] = "flash_v2"
    elif backend == "unfused":
        r.fail("model.attention_backend", "Transformer Engine's unfused backend is not one "
               "autopar models (flash, or the local layer spec)")
    cpc = r.list("model.cp_comm_type")
    if cpc:
        if len(set(cpc)) != 1 or cpc[0] not in CHOICES["context_par_comm"]:
            r.fail("model.cp_comm_type", f"autopar models one of "
                   f"{', '.join(CHOICES['context_par_comm'])} for every layer, got {cpc}")
        ex["context_par_comm"] = cpc[0]
    elif d:
        ex["context_par_comm"] = "p2p"
    disp = r.choice("model.moe_token_dispatcher_type", ("allgather", "alltoall", "flex"),
                    None)
    if disp is not None:
        if disp == "flex":
            r.choice("model.moe_flex_dispatcher_backend", ("deepep", "hybridep"), "deepep")
        ex["moe_dispatcher"] = "deepep" if disp == "flex" else disp
    elif d and model.get("moe"):
        ex["moe_dispatcher"] = "allgather"     # TransformerConfig's default
    put("moe_overlap", r.bool("model.overlap_moe_expert_parallel_comm", False if d else None))
    groups = model.get("kv_heads")
    if groups == 1:             # one key/value head: Calculon's multi-query attention
        ex["attention_type"] = "multiquery"
        del model["kv_heads"]
    elif groups is not None or d:
        ex["attention_type"] = "multihead"
    # what neither format can say otherwise (UNEXPRESSED)
    ex.update(training=True, weight_offload=False, activations_offload=False)
    return ex, model


def _read_recompute(r: Reader, ex: dict, d: bool) -> None:
    gran = r.choice("model.recompute_granularity", ("full", "selective"), None)
    if gran is None:
        if d or r.has("model.recompute_granularity"):
            ex["activation_recompute"] = "none"
            ex["recompute_layers"] = 0
            ex["recompute_moe_act"] = ex["recompute_mla_up_proj"] = False
        return
    if gran == "selective":
        mods = r.list("model.recompute_modules")
        mods = ["core_attn"] if mods is None else mods
        # output-discarding modules: autopar.io.layouts recompute_moe_act /
        # recompute_mla_up_proj
        ex["recompute_moe_act"] = "moe_act" in mods
        ex["recompute_mla_up_proj"] = "mla_up_proj" in mods
        rest = [m for m in mods if m not in ("moe_act", "mla_up_proj")]
        if rest == ["core_attn"]:
            ex["activation_recompute"] = "attn_only"
        elif rest == ["mlp"]:
            ex["activation_recompute"] = "mlp_only"
        elif rest == []:
            ex["activation_recompute"] = "none"
        else:
            r.fail("model.recompute_modules", f"autopar models core_attn or mlp alone (with "
                   f"moe_act, mla_up_proj), got {' '.join(mods)}")
        ex["recompute_layers"] = 0
        return
    ex["recompute_moe_act"] = ex["recompute_mla_up_proj"] = False
    method = r.choice("model.recompute_method", ("uniform", "block"), None)
    k = r.int("model.recompute_num_layers", None)
    if method is None:
        r.fail("model.recompute_method", "full recompute needs uniform or block")
    if method == "uniform":
        if k not in (None, 1):
            r.fail("model.recompute_num_layers", f"autopar models uniform recompute of "
                   f"every layer (1), got {k}")
        ex.update(activation_recompute="full", recompute_layers=0)
    else:
        if k is None:
            r.fail("model.recompute_num_layers", "block recompute needs a number of layers")
        ex.update(activation_recompute="full", recompute_layers=k)


def _read_cpu_offload(r: Reader, ex: dict, d: bool) -> None:
    """``activation_offload_blocks`` from Megatron-Core's CPU offloading:
    ``cpu_offloading`` on with ``cpu_offloading_num_layers`` N offloading
    activations -> N (Megatron-LM's command line has no --cpu-offloading: a
    number of layers above 0 turns it on, arguments.py validate_args);
    offloading weights alone does nothing in Transformer Engine 2.x
    (cpu_offload.py: deprecated, no effect) -> 0."""
    on = r.bool("model.cpu_offloading", True if d else None)
    k = r.int("model.cpu_offloading_num_layers", 0 if d else None, minimum=0)
    if on is None:
        return
    acts = r.bool("model.cpu_offloading_activations", True)
    ex["activation_offload_blocks"] = (k or 0) if on and acts else 0


def _read_fine_offload(r: Reader, ex: dict, d: bool) -> None:
    """``activation_offload_modules`` from Megatron-Core's
    ``fine_grained_activation_offloading`` and ``offload_modules``: off ->
    "none"; on -> the modules (TransformerConfig ``__post_init__`` asserts
    some are named; a module autopar does not count, or attn_proj without
    core_attn, names ``offload_modules``)."""
    on = r.bool("model.fine_grained_activation_offloading", False if d else None)
    if on is None:
        return
    if not on:
        ex["activation_offload_modules"] = "none"
        return
    mods = r.list("model.offload_modules") or []
    value = offload_modules_value(mods)
    if isinstance(value, tuple):
        r.fail("model.offload_modules", value[1])
    if value == "none":
        r.fail("model.offload_modules", "fine-grained activation offloading needs modules to "
               "offload (TransformerConfig asserts offload_modules is not empty)")
    if "fused_group_mlp" in value.split("+") and \
            r.bool("model.use_transformer_engine_op_fuser", False if d else None) is False:
        r.fail("model.offload_modules", "fused_group_mlp needs use_transformer_engine_op_fuser "
               "(TransformerConfig.__post_init__ raises without it)")
    ex["activation_offload_modules"] = value


def _read_sharding(r: Reader, ex: dict, d: bool) -> None:
    distopt = r.bool("ddp.use_distributed_optimizer", False if d else None)
    if distopt is None:
        distopt = r.bool("optimizer.use_distributed_optimizer", None)
    if r.bool("optimizer.use_layer_wise_distributed_optimizer", False):
        distopt = True          # Muon's layer-wise sharding of the optimizer state
    fsdp = r.bool("ddp.use_megatron_fsdp", False if d else None)
    if fsdp:
        strat = r.choice("ddp.data_parallel_sharding_strategy",
                         ("no_shard", "optim", "optim_grads", "optim_grads_params"),
                         "optim_grads_params")
        if strat in ("no_shard", "optim"):
            ex.update(optimizer_sharding=strat == "optim", unsharded_grads=strat == "optim",
                      weight_sharding=False)
        else:
            ex.update(optimizer_sharding=True, unsharded_grads=False,
                      weight_sharding=strat == "optim_grads_params")
    elif distopt is not None:
        ex.update(optimizer_sharding=distopt, unsharded_grads=distopt, weight_sharding=False)
    inst = r.int("ddp.num_distributed_optimizer_instances", 1 if d else None)
    if inst is not None:
        if inst == 1:
            ex["sharding_group"] = 0
        elif "data_par" in ex:
            if ex["data_par"] % inst:
                r.fail("ddp.num_distributed_optimizer_instances",
                       f"must divide the data-parallel size {ex['data_par']}, got {inst}")
            ex["sharding_group"] = ex["data_par"] // inst
        else:
            r.fail("ddp.num_distributed_optimizer_instances",
                   "needs the number of GPUs to know the data-parallel size")
    outer = r.choice("ddp.outer_dp_sharding_strategy", ("no_shard", "optim"),
                     "no_shard" if d else None)
    if outer == "optim":
        # Megatron-FSDP (param_and_grad_buffer.py) runs it only on full
        # sharding within an instance, with more than one instance.
        if not (ex.get("weight_sharding") and 0 < ex.get("sharding_group", 0)):
            r.fail("ddp.outer_dp_sharding_strategy",
                   "optim needs use_megatron_fsdp with data_parallel_sharding_strategy "
                   "optim_grads_params and num_distributed_optimizer_instances > 1")
        ex["optimizer_outer_sharding"] = True
    elif outer == "no_shard":
        ex["optimizer_outer_sharding"] = False


def _read_model(r: Reader) -> dict:
    m: dict = {}
    for key, f in (("model.num_layers", "num_blocks"), ("model.hidden_size", "hidden"),
                   ("model.ffn_hidden_size", "feedforward"),
                   ("model.num_attention_heads", "attn_heads"),
                   ("model.kv_channels", "attn_size"), ("model.seq_length", "seq_size"),
                   ("model.num_query_groups", "kv_heads"), ("model.vocab_size", "vocab_size"),
                   ("model.mtp_num_layers", "mtp")):
        v = r.int(key, None, minimum=0 if f in ("vocab_size", "mtp") else 1)
        if v is not None:
            m[f] = v
    segments = _pattern_segments(r)
    if segments is not None:
        pattern = "".join(segments)
        m["hybrid_override_pattern"] = pattern
        m["num_blocks"] = len(pattern)
        depths = _mtp_parts(r)
        if depths:
            m["mtp_hybrid_override_pattern"] = depths[0]
            m.setdefault("mtp", len(depths))
        if r.bool("model.mtp_use_repeated_layer", False):
            m["mtp_use_repeated_layer"] = True
        if "M" in pattern:
            head_dim = r.int("model.mamba_head_dim", 64)
            heads = r.int("model.mamba_num_heads", None)
            if heads is None:
                # MambaMixer: d_inner = expand (2) x hidden, heads = d_inner / head_dim
                if "hidden" not in m:
                    r.fail("model.mamba_num_heads", "needs the hidden size to derive it")
                heads = 2 * m["hidden"] // head_dim
            m["mamba"] = {"heads": heads, "head_dim": head_dim,
                          "state": r.int("model.mamba_state_dim", 128),
                          "groups": r.int("model.mamba_num_groups", 8),
                          "conv_kernel": MAMBA_CONV_KERNEL,
                          "chunk": r.int("model.mamba_chunk_size", MAMBA_CHUNK)}
    if "attn_size" not in m and "hidden" in m and m.get("attn_heads"):
        m["attn_size"] = m["hidden"] // m["attn_heads"]
    glu = r.bool("model.gated_linear_unit", None)
    norm = r.choice("model.normalization", ("LayerNorm", "RMSNorm"), None)
    if norm == "RMSNorm" and not glu and r.has("_squared_relu") and m.get("hybrid_override_pattern"):
        # Nemotron-H (Megatron-LM's Nemotron 3 examples: --normalization RMSNorm
        # --squared-relu, no --swiglu): a squared-ReLU MLP, not gated, which
        # autopar models as the gpt block (as the Hugging Face nemotron_h
        # import does; models/README.md)
        norm = "LayerNorm"
    if glu is not None or norm is not None:
        llama = bool(glu) and norm == "RMSNorm"
        if bool(glu) != (norm == "RMSNorm"):
            r.fail("model.gated_linear_unit" if glu else "model.normalization",
                   "autopar models gpt (LayerNorm, GeLU MLP) or llama (RMSNorm, SwiGLU) blocks")
        m["block"] = "llama" if llama else "gpt"
    experts = r.int("model.num_moe_experts", None)
    if experts is not None:
        moe = {"experts": experts, "top_k": r.int("model.moe_router_topk", 2),
               "expert_feedforward": r.int("model.moe_ffn_hidden_size", None)
               or m.get("feedforward")}
        shared = r.int("model.moe_shared_expert_intermediate_size", None)
        if shared:
            moe["shared_experts"] = 1
            moe["shared_feedforward"] = shared
        if r.has("model.moe_layer_freq"):
            moe["first_dense"] = _first_dense(r, "model.moe_layer_freq")
        router = r.choice("model.moe_router_score_function", ("softmax", "sigmoid"), None)
        if router:
            moe["router"] = router
        cap = r.float("model.moe_expert_capacity_factor", None)
        if cap is not None:
            moe["capacity_factor"] = cap
        latent = r.int("model.moe_latent_size", None)
        if latent:
            moe["latent_size"] = latent
        m["moe"] = moe
    if r.bool("model.multi_latent_attention", False):
        m["mla"] = {"kv_lora_rank": r.int("model.kv_lora_rank", 512),
                    "q_lora_rank": r.int("model.q_lora_rank", 0, minimum=0) or 0,
                    "qk_nope_head_dim": r.int("model.qk_head_dim", 128),
                    "qk_rope_head_dim": r.int("model.qk_pos_emb_head_dim", 64, minimum=0),
                    "v_head_dim": r.int("model.v_head_dim", 128)}
        if r.v.get("model.experimental_attention_variant") == "dsa":
            coeff = r.float("model.dsa_indexer_loss_coeff", 0.0)
            idx = {}
            for f in ("n_heads", "head_dim", "topk"):
                key = f"model.dsa_indexer_{f}"
                idx[f] = r.int(key, None)
                if idx[f] is None:
                    r.fail(key, "missing: experimental_attention_variant dsa needs it")
            m["mla"]["sparse_index"] = dict(idx, loss=bool(coeff and coeff > 0))
    return m


def _pattern_key(r: Reader) -> str | None:
    """The settings key of a hybrid model's layer pattern
    (``model.hybrid_layer_pattern``, or the deprecated
    ``hybrid_override_pattern``), None where there is none."""
    return next((k for k in ("model.hybrid_layer_pattern", "model.hybrid_override_pattern")
                 if r.v.get(k) not in (None, "None", "null")), None)


def _mtp_parts(r: Reader) -> list[str]:
    """A hybrid pattern's MTP depths (the parts after ``/``, each the MTP
    module's layers; hybrid_layer_allocation.py ``parse_hybrid_pattern``
    requires them alike), [] where there are none."""
    key = _pattern_key(r)
    if key is None:
        return []
    parts = [x for x in str(r.v[key]).replace(" ", "").split("/")[1:] if x]
    if len(set(parts)) > 1:
        r.fail(key, f"MTP patterns after '/' must all be alike (Megatron-Core's "
                    f"parse_hybrid_pattern), got {parts}")
    return parts


def _pattern_segments(r: Reader) -> list[str] | None:
    """A hybrid model's layer pattern split at its pipes, or None."""
    key = _pattern_key(r)
    if key is None:
        return None
    from autopar.io.specs import HYBRID_SYMBOLS
    # (after '/': the MTP module's layers, read below)
    text = str(r.v[key]).replace(" ", "").split("/")[0]
    # (Gated DeltaNet 'G' layers are modelled, but their linear_* settings
    # are not read from a launch file: refused with the rest)
    read_symbols = [c for c in HYBRID_SYMBOLS if c != "G"]
    bad = sorted(set(text) - set(read_symbols) - {"|"})
    if bad:
        r.fail(key, f"autopar reads the layer symbols {''.join(read_symbols)} "
               f"(and | between stages), got {''.join(bad)!r}")
    return text.split("|")


def _read_segments(r: Reader, segments: list[str], pp: int, mtp: int = 0) -> dict:
    """A hybrid pattern's pipeline segments -> autopar's split fields: the
    first of even, even with the embedding / loss counted, first / last
    stage sizes, balanced, whose virtual stages hold these blocks; else an
    explicit layout of as many ``t`` a virtual stage as its segment has
    layers (the embedding first, the model's ``mtp`` MTP layers and the loss
    last: ``hybrid_layer_allocation.py`` builds the embedding on the first
    and the MTP and output layer on the last virtual stage)."""
    key = _pattern_key(r)
    counts = [len(x) for x in segments]
    if len(counts) % pp:
        r.fail(key, f"has {len(counts)} pipeline segments, not a multiple of the pipeline "
               f"size {pp}")
    v, n = len(counts) // pp, sum(counts)
    p_first = sum(counts[0::pp]) if pp > 1 else 0
    p_last = sum(counts[pp - 1::pp]) if pp > 1 else 0
    tries = [dict(embedding=e, loss=l_) for e in (False, True) for l_ in (False, True)]
    tries += [dict(first=f, last=l_) for f in (p_first, 0) for l_ in (p_last, 0) if f or l_]
    tries += [dict(balanced=True, embedding=e, loss=l_) for e in (False, True)
              for l_ in (False, True)]
    for t in tries:
        if virtual_stage_blocks(n, pp, v, **t) == counts:
            out = {"pipeline_interleaving": v,
                   "pipeline_layout": "balanced" if t.get("balanced") else "even",
                   "first_stage_blocks": t.get("first", 0),
                   "last_stage_blocks": t.get("last", 0),
                   "embedding_in_split": t.get("embedding", False),
                   "loss_in_split": t.get("loss", False)}
            return out
    text = "|".join((f"t*{c}" if c > 1 else "t" * c) for c in counts)
    return {"pipeline_interleaving": v, "pipeline_layout": "E" + text + "m" * mtp + "L",
            "first_stage_blocks": 0, "last_stage_blocks": 0,
            "embedding_in_split": False, "loss_in_split": False}


def _first_dense(r: Reader, key: str) -> int:
    """``moe_layer_freq`` as autopar has it: dense blocks first, MoE after."""
    text = str(r.v[key]).replace(" ", "")
    if text == "1":
        return 0
    m = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", text)
    if m:
        return int(m.group(1))
    r.fail(key, f"autopar models the first blocks dense and the rest MoE "
           f"(([0]*N+[1]*M)), got {text!r}")
