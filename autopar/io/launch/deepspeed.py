"""A DeepSpeed ``ds_config`` JSON with the launcher's parallel sizes, out and in.

The ``ds_config`` keys are DeepSpeed's own (deepspeedai/DeepSpeed
``deepspeed/runtime/constants.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/config.py``):

* ``train_batch_size`` (``batch_size``), ``train_micro_batch_size_per_gpu``
  (``microbatch_size``), ``gradient_accumulation_steps`` (their quotient over
  the data-parallel ranks; DeepSpeed checks the product);
* ``zero_optimization.stage``: 0 no sharding; 1 ``optimizer_sharding`` with
  ``unsharded_grads`` (ZeRO-1); 2 ``optimizer_sharding`` (ZeRO-2); 3 also
  ``weight_sharding`` (ZeRO-3) (``frameworks/deepspeed-zero1/2/3.json``);
  ``overlap_comm`` (``data_par_overlap``; DeepSpeed's default: on for stage 3
  only), ``contiguous_gradients``, ``offload_optimizer.device: cpu``
  (``optimizer_offload``, stage >= 1) and ``offload_param.device: cpu``
  (``weight_offload``, stage 3);
* ``bf16.enabled`` / ``fp16.enabled`` (``datatype``; neither: float32);
  ``data_types.grad_accum_dtype: fp32`` (``fp32_grads``).

A config read back names the framework spec ``deepspeed-zero<stage>``
(``Imported.framework``) where the layout is within that spec's options
(tensor and sequence parallel size 1: the specs cover ZeRO's data
parallelism); with TP or Ulysses from the training script, none.

DeepSpeed's config holds no tensor or pipeline size: those are the training
script's (Megatron-DeepSpeed's ``megatron/arguments.py``).  They travel in a
top-level ``"autopar_launcher"`` object, which DeepSpeed's config reader
ignores, named as Megatron-DeepSpeed's arguments are (their ``args.`` names):
``world_size`` (the launcher's processes: ``deepspeed --num_nodes x
--num_gpus``), ``tensor_model_parallel_size``,
``pipeline_model_parallel_size`` (DeepSpeed's pipeline engine: ZeRO stage
<= 1, ``runtime/pipe/engine.py``), ``ds_sequence_parallel_size``
(DeepSpeed-Ulysses: ``context_par`` with ``context_par_comm: a2a``),
``sequence_parallel`` (Megatron's sequence parallelism: ``rs_ag`` with the
all-gather redone in backward), ``recompute_granularity`` (``full`` /
``selective``: ``attn_only`` / null), ``recompute_method`` and
``recompute_num_layers`` (``block``: ``recompute_layers``),
``use_flash_attn_v1`` / ``use_flash_attn_v2`` / ``masked_softmax_fusion``
(``attention_impl``), ``moe_expert_parallel_size`` (``expert_par``) and
``seq_length`` (the model's ``seq_size``).  Values ``"auto"`` (Hugging Face
Trainer's integration) are read as unknown.

Not stated (``UNSTATED``): the network tiers, ``fused_activation`` and
``fused_norm`` (the model code's kernels).
"""
from __future__ import annotations

import json

from autopar.io.launch.base import Imported, LaunchFormat
from autopar.io.launch.expressible import (Keys, RECIPE_DEFAULTS, RECIPE_EXPRESSIBLE, divides,
                                           full, json_object, refuse_fields, refuse_values,
                                           states)

NAME = "deepspeed"
LAUNCHER = "autopar_launcher"
UNSTATED = ("tensor_par_net", "pipeline_par_net", "data_par_net", "context_par_net",
            "expert_par_net", "expert_tensor_par_net", "fused_activation", "fused_norm",
            "sequence_fill", "attention_span")
EXPRESSIBLE = {
    "attention_type": ("multihead",),
    "datatype": ("bfloat16", "float16", "float32"),
    "activation_recompute": ("full", "attn_only", "none"),
    "pipeline_interleaving": (1,),
    "pipeline_layout": ("even",),
    "embedding_in_split": (False,),
    "loss_in_split": (False,),
    "first_stage_blocks": (0,),
    "last_stage_blocks": (0,),
    # (before sharding_group: the more telling reason for a hybrid layout)
    "optimizer_outer_sharding": (False,),
    "sharding_group": (0,),
    "tensor_par_overlap": ("none",),
    "activations_offload": (False,),
    "activation_offload_blocks": (0,),
    "activation_offload_modules": ("none",),
    "fp8_recipe": ("none",),
    "expert_tensor_par": (1,),
    "moe_dispatcher": ("alltoall",),
    "moe_overlap": (False,),
    "param_gather_overlap": (False,),
    "training": (True,),
    **RECIPE_EXPRESSIBLE,
    # Muon: DeepSpeed's own (runtime/config.py MUON_OPTIMIZER; engine.py builds
    # MuonWithAuxAdam); Adafactor: torch.optim.Adafactor, which engine.py takes
    # by name from torch.optim (torch >= 2.5)
    "optimizer": ("adam", "muon", "adafactor"),
}
# the framework's reasons for issue 28's recipe fields (DeepSpeed@edaa722)
WHY = {"optimizer_outer_sharding": "ZeRO's hybrid forms differ: ZeRO++ hpZ "
                                   "(zero_hpz_partition_size) keeps a secondary copy of the "
                                   "weights within a node while ZeRO-3 shards everything over "
                                   "the whole data-parallel group, and MiCS (mics_shard_size) "
                                   "shards weights, gradients and optimizer state within a "
                                   "group and replicates all three across groups "
                                   "(deepspeed/runtime/zero/config.py, mics.py); neither "
                                   "shards only the optimizer state across the groups",
       "optimizer": "SGD would be torch.optim.SGD under ZeRO's untested-optimizer "
                    "switch, which autopar does not write",
       "optimizer_moment_bytes": "ds_config has no setting for the dtype of Adam's "
                                 "moments: ZeRO steps the fp32 master partition, whose "
                                 "optimizer creates its moments like those fp32 "
                                 "parameters",
       "adapter": "DeepSpeed's LoRA (deepspeed/linear/config.py LoRAConfig, "
                  "OptimizedLinear) is set up in the training script, not in ds_config",
       "activation_offload_modules": "ds_config has no per-module activation offloading: "
                                     "activation_checkpointing.cpu_checkpointing moves every "
                                     "layer's checkpoint under recompute (deepspeed/runtime/"
                                     "activation_checkpointing/config.py), not the saved "
                                     "inputs of chosen modules",
       "activation_offload_blocks": "ds_config offloads activations only as "
                                    "activation_checkpointing.cpu_checkpointing, every "
                                    "layer's checkpoint under recompute (deepspeed/runtime/"
                                    "activation_checkpointing/config.py), not some layers' "
                                    "saved activations",
       "fp8_recipe": "ds_config has no fp8/fp4 recipe (Transformer Engine's are the "
                     "model code's)"}
# ds_config optimizer.type of autopar's optimizers (Adam: the config's own
# default, not written)
OPTIMIZER_TYPES = {"muon": "Muon", "adafactor": "Adafactor"}
FLASH = {"flash_v1": "use_flash_attn_v1", "flash_v2": "use_flash_attn_v2"}


def refuse_model(model) -> str | None:
    # the model is the training script's: any, but a hybrid Mamba model
    # (Megatron-DeepSpeed's GPT script builds attention blocks only)
    if getattr(model, "hybrid_pattern", ""):
        return (f"{NAME}: the model {model.name or ''} has hybrid_override_pattern (Mamba "
                "layers), which Megatron-DeepSpeed's GPT model does not build")
    return None


def refuse_space(model, space) -> str | None:
    return refuse_values(NAME, space, {f: EXPRESSIBLE[f] for f in (
        "optimizer", "adapter", "activation_recompute", "pipeline_layout",
        "activations_offload", "activation_offload_blocks", "activation_offload_modules",
        "fp8_recipe", "sharding_group",
        "tensor_par_overlap")}, WHY)


def cut_space(space) -> dict:
    """What a space's optimizer implies here (``refuse_layout``): Muon runs
    inside ZeRO (stage >= 1) without offloading; Adafactor without ZeRO."""
    from autopar.io.launch.expressible import space_values
    opts = space_values(space, "optimizer")
    if opts == ("muon",):
        return {"optimizer_sharding": (True,), "optimizer_offload": (False,),
                "weight_offload": (False,)}
    if opts == ("adafactor",):
        return {"optimizer_sharding": (False,)}
    return {}


def _stage(ex) -> int:
    if not ex["optimizer_sharding"]:
        return 0
    if ex["weight_sharding"]:
        return 3
    return 1 if ex["unsharded_grads"] else 2


def refuse_layout(model, execution) -> str | None:
    ex = full(execution)
    why = refuse_fields(NAME, ex, EXPRESSIBLE, WHY)
    if why:
        return why
    stage = _stage(ex)
    if ex["pipeline_par"] > 1 and stage >= 2:
        return (f"{NAME}: the layout has pipeline_par={ex['pipeline_par']} with ZeRO stage "
                f"{stage}; DeepSpeed's pipeline engine takes ZeRO stage 0 or 1")
    if ex["context_par"] > 1 and ex["context_par_comm"] != "a2a":
        return (f"{NAME}: the layout has context_par={ex['context_par']} with "
                f"context_par_comm={ex['context_par_comm']}; DeepSpeed's sequence parallelism "
                "is Ulysses (a2a)")
    comm = ex["tensor_par_comm_type"]
    if ex["tensor_par"] > 1:
        if comm == "p2p_rs_ag":
            return f"{NAME}: the layout has tensor_par_comm_type=p2p_rs_ag; Megatron states ar or rs_ag"
        redo = comm == "rs_ag" and ex["activation_recompute"] != "full"
        if ex["seq_par_ag_redo"] != redo:
            return (f"{NAME}: the layout has seq_par_ag_redo={ex['seq_par_ag_redo']}; Megatron's "
                    f"sequence parallelism {'redoes' if redo else 'has no'} all-gather in backward "
                    f"here (seq_par_ag_redo={redo})")
    if ex["weight_offload"] and stage != 3:
        return f"{NAME}: the layout has weight_offload without ZeRO-3; offload_param is stage 3's"
    if ex["optimizer_offload"] and stage == 0:
        return f"{NAME}: the layout has optimizer_offload without ZeRO; offload_optimizer needs stage >= 1"
    if ex["data_par_overlap"] and ex["data_par"] == 1:
        return f"{NAME}: the layout has data_par_overlap with data_par=1"
    if ex["data_par_overlap"] and stage == 0 and ex["data_par"] > 1:
        return (f"{NAME}: the layout has data_par_overlap without ZeRO; DeepSpeed reduces the "
                "gradients after backward at stage 0 (overlap_comm is ZeRO's)")
    if ex["recompute_layers"] and ex["activation_recompute"] != "full":
        return f"{NAME}: the layout has recompute_layers without full recompute"
    if ex["optimizer"] == "muon" and stage == 0:
        # the Newton-Schulz step runs in ZeRO's gradient code
        # (runtime/zero/stage_1_and_2.py, stage3.py: muon_update); at stage 0
        # MuonWithAuxAdam.step applies the un-orthogonalised update
        return (f"{NAME}: the layout has optimizer=muon without ZeRO; DeepSpeed runs Muon's "
                "Newton-Schulz step inside ZeRO stages 1-3 (docs/_pages/config-json.md)")
    if ex["optimizer"] == "muon" and (ex["optimizer_offload"] or ex["weight_offload"]):
        return (f"{NAME}: the layout has optimizer=muon with offloading; autopar writes "
                "DeepSpeed's Muon on the GPU only")
    if ex["optimizer"] == "adafactor" and stage >= 1:
        # ZeRO's optimizer sees flat 1-D partitions (stage_1_and_2.py
        # single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat):
        # torch's Adafactor factors only tensors of 2+ dimensions
        return (f"{NAME}: the layout has optimizer=adafactor with ZeRO stage {stage}; ZeRO "
                "hands the optimizer flat 1-D partitions, which Adafactor does not factor")
    return None


def write(model, execution) -> str:
    ex = full(execution)
    stage = _stage(ex)
    dp, mbs, batch = ex["data_par"], ex["microbatch_size"], ex["batch_size"]
    zero = {"stage": stage, "overlap_comm": bool(ex["data_par_overlap"]),
            "contiguous_gradients": True}
    if stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu" if ex["optimizer_offload"] else "none"}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu" if ex["weight_offload"] else "none"}
    cfg = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": mbs,
           "gradient_accumulation_steps": batch // (dp * mbs),
           "bf16": {"enabled": ex["datatype"] == "bfloat16"},
           "fp16": {"enabled": ex["datatype"] == "float16"},
           "zero_optimization": zero}
    if ex["fp32_grads"]:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if ex["optimizer"] == "muon":
        # the Newton-Schulz iteration autopar counts (zeropower_via_newtonschulz5;
        # DeepSpeed's default ns_method is its Gram variant: original_muon.py)
        cfg["optimizer"] = {"type": "Muon", "params": {"ns_method": "standard"}}
    elif ex["optimizer"] in OPTIMIZER_TYPES:
        cfg["optimizer"] = {"type": OPTIMIZER_TYPES[ex["optimizer"]]}
    rec = ex["activation_recompute"]
    impl = ex["attention_impl"]
    cfg[LAUNCHER] = {
        "world_size": ex["num_procs"],
        "tensor_model_parallel_size": ex["tensor_par"],
        "pipeline_model_parallel_size": ex["pipeline_par"],
        "ds_sequence_parallel_size": ex["context_par"],
        "sequence_parallel": ex["tensor_par"] > 1 and ex["tensor_par_comm_type"] == "rs_ag",
        "recompute_granularity": {"full": "full", "attn_only": "selective"}.get(rec),
        "recompute_method": "block" if ex["recompute_layers"] else None,
        "recompute_num_layers": ex["recompute_layers"] or None,
        "use_flash_attn_v1": impl == "flash_v1",
        "use_flash_attn_v2": impl == "flash_v2",
        "masked_softmax_fusion": impl == "fused_softmax",
        "moe_expert_parallel_size": ex["expert_par"],
        "seq_length": model.seq_size,
    }
    return json.dumps(cfg, indent=2) + "\n"


def read(text: str, source: str) -> Imported:
    data, k = json_object(text, source, "a ds_config")
    notes: list[str] = []
    ex: dict = {**RECIPE_DEFAULTS,
                "training": True, "attention_type": "multihead", "pipeline_layout": "even",
                "embedding_in_split": False, "loss_in_split": False, "first_stage_blocks": 0,
                "last_stage_blocks": 0, "sharding_group": 0, "tensor_par_overlap": "none",
                "activations_offload": False, "activation_offload_blocks": 0,
                "activation_offload_modules": "none",
                "fp8_recipe": "none", "expert_tensor_par": 1,
                "moe_dispatcher": "alltoall", "moe_overlap": False,
                "param_gather_overlap": False, "optimizer_outer_sharding": False,
                "pipeline_interleaving": 1}
    L = LAUNCHER + "."
    launcher = k.table(LAUNCHER)
    if not launcher:
        notes.append(f"no {LAUNCHER!r} object: tensor, pipeline and sequence parallel sizes "
                     "taken as 1; num_procs from --num-procs")
    tp = _int(k, L + "tensor_model_parallel_size", 1)
    pp = _int(k, L + "pipeline_model_parallel_size", 1)
    cp = _int(k, L + "ds_sequence_parallel_size", 1)
    ep = _int(k, L + "moe_expert_parallel_size", 1)
    ex.update(tensor_par=tp, pipeline_par=pp, context_par=cp, expert_par=ep,
              context_par_comm="a2a" if cp > 1 else "p2p")
    world = _int(k, L + "world_size", None)
    if world is not None:
        if not divides(world, tp * pp * cp):
            k.fail(L + "world_size", f"{world} is not a multiple of tensor x pipeline x "
                   f"sequence parallel sizes ({tp * pp * cp})")
        ex.update(num_procs=world, data_par=world // (tp * pp * cp))
    # batch
    batch = _int(k, "train_batch_size", None)
    mbs = _int(k, "train_micro_batch_size_per_gpu", None)
    gas = _int(k, "gradient_accumulation_steps", None)
    dp = ex.get("data_par")
    if mbs is None and None not in (batch, gas, dp) and divides(batch, gas * dp):
        mbs = batch // (gas * dp)
    if batch is None and None not in (mbs, gas, dp):
        batch = mbs * gas * dp
    if None not in (batch, mbs, gas, dp) and batch != mbs * gas * dp:
        k.fail("train_batch_size", f"{batch} != train_micro_batch_size_per_gpu {mbs} x "
               f"gradient_accumulation_steps {gas} x data-parallel ranks {dp} (DeepSpeed "
               "refuses it)")
    if batch is not None:
        ex["batch_size"] = batch
    ex["microbatch_size"] = mbs
    # precision
    bf16 = _enabled(k, "bf16") or _enabled(k, "bfloat16")
    fp16 = _enabled(k, "fp16")
    if bf16 and fp16:
        k.fail("fp16.enabled", "fp16 and bf16 both enabled (DeepSpeed refuses it)")
    ex["datatype"] = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    acc = k.choice("data_types.grad_accum_dtype", ("fp32", "fp16", "bf16", None), None)
    ex["fp32_grads"] = acc == "fp32"
    # ZeRO
    Z = "zero_optimization."
    stage = k.choice(Z + "stage", (0, 1, 2, 3), 0) if k.table("zero_optimization") else 0
    ex.update(optimizer_sharding=stage >= 1, unsharded_grads=stage == 1,
              weight_sharding=stage == 3)
    overlap = k.raw(Z + "overlap_comm")
    if overlap is None or overlap == "auto":
        overlap = stage == 3
    elif not isinstance(overlap, bool):
        k.fail(Z + "overlap_comm", f"expected true or false, got {overlap!r}")
    ex["data_par_overlap"] = bool(overlap) and ex.get("data_par", 2) > 1
    opt_dev = k.choice(Z + "offload_optimizer.device", ("cpu", "none", "nvme"), "none")
    par_dev = k.choice(Z + "offload_param.device", ("cpu", "none", "nvme"), "none")
    for key, dev in ((Z + "offload_optimizer.device", opt_dev),
                     (Z + "offload_param.device", par_dev)):
        if dev == "nvme":
            k.fail(key, "nvme: autopar's second memory tier is host memory (cpu)")
    if par_dev == "cpu" and stage != 3:
        k.fail(Z + "offload_param.device", "cpu offload of parameters needs ZeRO stage 3")
    ex.update(optimizer_offload=opt_dev == "cpu" and stage >= 1, weight_offload=par_dev == "cpu")
    if k.raw(Z + "mics_shard_size", -1) not in (-1, None):
        k.fail(Z + "mics_shard_size", "MiCS sharding (removed from DeepSpeed) is not read")
    if k.raw(Z + "zero_hpz_partition_size", 1) not in (1, None):
        notes.append("zero_hpz_partition_size (ZeRO++ secondary weight partition) is not "
                     "modelled: read as plain ZeRO-3")
    if stage >= 2 and pp > 1:
        k.fail(Z + "stage", f"{stage} with pipeline_model_parallel_size {pp}: DeepSpeed's "
               "pipeline engine takes ZeRO stage 0 or 1")
    # the training script's arguments
    seq_par = _bool(k, L + "sequence_parallel", False)
    gran = k.choice(L + "recompute_granularity", ("full", "selective", None), None)
    rec = {"full": "full", "selective": "attn_only", None: "none"}[gran]
    ex["activation_recompute"] = rec
    method = k.choice(L + "recompute_method", ("block", "uniform", None), None)
    layers = _int(k, L + "recompute_num_layers", None)
    if method == "uniform" and rec == "full" and layers not in (None, 1):
        k.fail(L + "recompute_method", "uniform with recompute_num_layers > 1 (chunks of "
               "layers checkpointed together) is not one of autopar's recompute layouts")
    ex["recompute_layers"] = layers if method == "block" and rec == "full" and layers else 0
    if tp > 1:
        ex["tensor_par_comm_type"] = "rs_ag" if seq_par else "ar"
        ex["seq_par_ag_redo"] = seq_par and rec != "full"
    v1 = _bool(k, L + "use_flash_attn_v1", False)
    v2 = _bool(k, L + "use_flash_attn_v2", False)
    fused = _bool(k, L + "masked_softmax_fusion", True)
    if v1 and v2:
        k.fail(L + "use_flash_attn_v2", "set together with use_flash_attn_v1")
    ex["attention_impl"] = "flash_v2" if v2 else "flash_v1" if v1 else \
        "fused_softmax" if fused else "unfused"
    ex["optimizer"] = _optimizer(k, notes)
    model = {}
    seq = _int(k, L + "seq_length", None)
    if seq is not None:
        model["seq_size"] = seq
    framework = f"deepspeed-zero{stage}" if stage >= 1 else None
    if stage == 0:
        notes.append("ZeRO stage 0: no framework spec ships for plain data parallelism")
    elif tp > 1 or cp > 1:
        # frameworks/deepspeed-zero*.json cover ZeRO's data parallelism (their
        # options: tensor_par 1, context_par 1); TP and Ulysses are the script's
        framework = None
        notes.append(f"tensor / sequence parallelism from the training script: the "
                     f"deepspeed-zero{stage} spec covers ZeRO data parallelism only (its "
                     "options); no framework spec applied")
    return Imported(execution=ex, model=model, framework=framework, notes=tuple(notes))


def _optimizer(k: Keys, notes: list) -> str:
    """``optimizer.type`` -> autopar's optimizer (absent: Adam, the model
    code's or the config's default)."""
    t = k.raw("optimizer.type")
    if t is None or t == "auto":
        return "adam"
    name = str(t).lower()
    if name in ("adam", "adamw", "fusedadam", "cpuadam"):
        return "adam"
    if name == "muon":
        if k.raw("optimizer.params.ns_method", "gram") == "gram":
            notes.append("Muon's Gram Newton-Schulz (ns_method gram, DeepSpeed's default) is "
                         "counted as the standard iteration")
        return "muon"
    if name == "adafactor":
        return "adafactor"
    k.fail("optimizer.type", f"autopar models Adam/AdamW, Muon and Adafactor, got {t!r}")


def _int(k: Keys, key: str, default):
    """An integer, ``default`` where absent, None (unknown) for ``"auto"``."""
    v = k.raw(key)
    if v is None:
        return default
    if v == "auto":
        return None
    return k.int(key, minimum=1)


def _bool(k: Keys, key: str, default):
    return default if k.raw(key) is None else k.bool(key)


def _enabled(k: Keys, section: str) -> bool:
    if not k.has(section):
        return False
    v = k.raw(section + ".enabled", False)
    if v == "auto":
        return False
    return k.bool(section + ".enabled")


FORMAT = LaunchFormat(
    writes=states(EXPRESSIBLE), cut_space=cut_space,
    name=NAME, suffix=".json", framework="deepspeed-zero1", refuse_model=refuse_model,
    refuse_space=refuse_space, refuse_layout=refuse_layout, write=write, read=read,
    describe="a DeepSpeed ds_config JSON with the launcher's parallel sizes "
             f"(top-level {LAUNCHER!r}: Megatron-DeepSpeed's argument names)")
