"""torchtitan's TOML job config, out and in.

The file is the job config torchtitan 0.2.x reads with ``--job.config_file``
(``torchtitan/config/job_config.py`` of pytorch/torchtitan v0.2.2, the last
release that reads TOML; later releases build the same config tree in Python,
``torchtitan/config/configs.py``, and keep ``--section.key`` command-line
overrides of these names).  What each key stands for:

* ``[parallelism]``: ``data_parallel_replicate_degree`` x
  ``data_parallel_shard_degree`` is autopar's ``data_par``: FSDP2
  (``fully_shard``) over the shard degree shards weights, gradients and
  optimizer state (``weight_sharding`` + ``optimizer_sharding``); with a
  replicate degree too it is HSDP (``sharding_group`` = the shard degree);
  replicate alone is DDP (no sharding; torchtitan's DDP takes no other
  parallelism: ``models/llama3/infra/parallelize.py`` "DDP has not supported
  > 1D parallelism").  ``tensor_parallel_degree`` (always sequence-parallel:
  ``tensor_par_comm_type: rs_ag``, the gathered input kept by autograd:
  ``seq_par_ag_redo: false``), ``enable_async_tensor_parallel``
  (``tensor_par_overlap: ring``, needs ``[compile]``),
  ``pipeline_parallel_degree`` with ``pipeline_parallel_schedule`` (``1F1B``,
  or ``Interleaved1F1B`` for ``pipeline_interleaving`` > 1) and the split as
  ``module_fqns_per_model_part`` (every virtual stage's modules, so any
  even/balanced split with the embedding / loss counted is stated exactly;
  ``pipeline_parallel_first/last_stage_less_layers`` are the embedding / loss
  weights of torchtitan's own split, ``distributed/pipeline_parallel.py``
  ``generate_llm_fqn_per_model_part``), ``pipeline_parallel_microbatch_size``,
  ``context_parallel_degree`` (a ring of K/V exchanges: ``context_par_comm:
  p2p``; ``context_parallel_rotate_method`` allgather or alltoall are both
  that ring), ``expert_parallel_degree``, ``expert_tensor_parallel_degree``
  (1 or the TP degree), ``expert_parallel_comm_backend`` (``standard``:
  all-to-all; ``deepep``).
* ``[training]``: ``local_batch_size`` (per data-parallel rank: the
  micro-batch without PP, the rank's batch with PP), ``global_batch_size``
  (gradient accumulation makes up the rest), ``seq_len`` (the model's
  ``seq_size``), ``mixed_precision_param`` (``datatype``: bfloat16 or
  float32; gradients reduced in fp32, ``mixed_precision_reduce``:
  ``fp32_grads``), ``enable_cpu_offload`` (FSDP's CPU offload of parameters,
  gradients and optimizer state: ``weight_offload`` and
  ``optimizer_offload``).
* ``[activation_checkpoint] mode``: ``none`` / ``full``; ``selective``
  (per-op or every n-th layer) and ``memory_budget`` are none of autopar's
  recompute modes: read as unknown.
* ``[compile] enable``: fused RMSNorm (``fused_norm``).
* ``[model] converters`` with ``[quantize.linear.float8] recipe_name``
  (``fp8_recipe`` tensorwise / rowwise) or ``[quantize.linear.mx]``
  (``mxfp8``).

Not stated (``UNSTATED``): the network tiers (the device mesh's rank order
on the machine decides them) and ``fused_activation``.  Attention is
PyTorch's scaled-dot-product (flash) kernel: ``attention_impl: flash_v2``.
"""
from __future__ import annotations

import tomllib

from autopar.io.launch.base import Imported, LaunchFormat
from autopar.io.launch.expressible import (Keys, RECIPE_DEFAULTS, RECIPE_EXPRESSIBLE, divides,
                                           full, refuse_fields, refuse_values, states)

NAME = "torchtitan"
UNSTATED = ("tensor_par_net", "pipeline_par_net", "data_par_net", "context_par_net",
            "expert_par_net", "expert_tensor_par_net", "fused_activation", "sequence_fill",
            "attention_span")
SINGLE_STAGE = ("1F1B",)
MULTI_STAGE = ("Interleaved1F1B",)
# Field values torchtitan can state whatever the other fields are.
EXPRESSIBLE = {
    "attention_type": ("multihead",),
    "attention_impl": ("flash_v2",),
    "fp32_grads": (True,),
    "activation_recompute": ("full", "none"),
    "recompute_layers": (0,),
    "unsharded_grads": (False,),
    "activations_offload": (False,),
    "activation_offload_blocks": (0,),
    "activation_offload_modules": ("none",),
    "tensor_par_overlap": ("none", "ring"),
    "context_par_comm": ("p2p",),
    "moe_dispatcher": ("alltoall", "deepep"),
    "moe_overlap": (False,),
    "param_gather_overlap": (False,),
    "optimizer_outer_sharding": (False,),
    "first_stage_blocks": (0,),
    "last_stage_blocks": (0,),
    "training": (True,),
    "datatype": ("bfloat16", "float32"),
    "fp8_recipe": ("none", "tensorwise", "rowwise", "mxfp8"),
    # optimizer Adam, no adapters, no BF16 blocks (its converters quantize
    # every block's linear layers; a job config's filter_fqns is not read)
    **RECIPE_EXPRESSIBLE,
}
# the framework's reasons for issue 28's recipe fields (torchtitan v0.2.2,
# whose TOML autopar writes; HEAD b5bcd76 checked for what came later)
WHY = {"optimizer": "torchtitan 0.2.2's build_optimizers has Adam and AdamW "
                    "(torchtitan/components/optimizer.py); later releases add DistMuon, "
                    "configured in Python, not TOML",
       "optimizer_moment_bytes": "torchtitan's TOML has no setting for the dtype of the "
                                 "optimizer's moments: torch.optim's Adam/AdamW create "
                                 "them like the (fp32) sharded parameters they update "
                                 "(torch/optim/adam.py _init_group)",
       "adapter": "torchtitan 0.2.2 has no LoRA; later releases' LoRA converter "
                  "(torchtitan/components/lora.py) is configured in Python, not TOML",
       "activation_offload_modules": "torchtitan offloads no module's saved activations: "
                                     "its CPU offload (training.enable_cpu_offload, "
                                     "torchtitan/config/configs.py) is FSDP's of parameters, "
                                     "gradients and optimizer state, and its activation "
                                     "checkpointing recomputes rather than offloads",
       "activation_offload_blocks": "torchtitan offloads no activations: its CPU offload "
                                    "(training.enable_cpu_offload, torchtitan/config/"
                                    "configs.py) is FSDP's of parameters, gradients and "
                                    "optimizer state",
       "optimizer_outer_sharding": "torchtitan's HSDP (parallelism."
                                   "data_parallel_replicate_degree, torchtitan/distributed/"
                                   "parallel_dims.py dp_replicate x dp_shard) applies FSDP2's "
                                   "fully_shard over the 2-D mesh: parameters, gradients and "
                                   "the optimizer state that follows them are sharded over "
                                   "dp_shard and replicated over dp_replicate; it has no "
                                   "setting that shards the optimizer state across the "
                                   "replicas",
       "fp8_recipe": "autopar writes its quantize converters as float8 tensorwise / "
                     "rowwise and MX mxfp8 (quantize.linear.mx.recipe_name is a torchao "
                     "recipe name; an fp4 training recipe of the torchao 0.2.2 pins was "
                     "not checked)"}
FP8 = {"tensorwise": ("quantize.linear.float8", "tensorwise"),
       "rowwise": ("quantize.linear.float8", "rowwise"),
       "mxfp8": ("quantize.linear.mx", "mxfp8_cublas")}


def refuse_model(model) -> str | None:
    if getattr(model, "block", "gpt") != "llama":
        return (f"{NAME}: the model {model.name or ''} has block={model.block}; torchtitan's "
                "models are LLaMA-style (RMSNorm, SwiGLU): block llama")
    if getattr(model, "hybrid_pattern", ""):
        return (f"{NAME}: the model {model.name or ''} has hybrid_override_pattern; torchtitan's "
                "models are decoder blocks of attention and MLP / MoE only")
    mla = getattr(model, "mla", None)
    if mla is not None and mla.sparse_index is not None:
        # (pytorch/torchtitan's models/deepseek_v3 attends to every key: no
        # lightning indexer, no top-k selection)
        return (f"{NAME}: the model {model.name or ''} has mla.sparse_index (DeepSeek Sparse "
                "Attention); torchtitan's DeepSeek-V3 model has no indexer")
    return None


def refuse_space(model, space) -> str | None:
    return refuse_model(model) or refuse_values(NAME, space, {
        f: EXPRESSIBLE[f] for f in ("optimizer", "adapter", "attention_impl", "fp32_grads",
                                    "activation_recompute", "activations_offload",
                                    "activation_offload_blocks", "activation_offload_modules")}, WHY)


def split_counts(model, ex) -> list[int]:
    """Blocks of each virtual stage of ``ex``'s pipeline split (autopar's
    meaning of the split fields; first/last stage blocks are refused)."""
    stages = ex["pipeline_par"] * ex["pipeline_interleaving"]
    e, l = int(ex["embedding_in_split"]), int(ex["loss_in_split"])
    return stage_blocks(model.num_blocks, stages, e, l)


def stage_blocks(blocks: int, stages: int, e: int, l: int) -> list[int]:
    """torchtitan's split (``generate_llm_fqn_per_model_part``): the blocks
    plus the embedding / loss weights spread over the stages, ``q`` or ``q +
    1`` each with the earlier ones the more; the first and last stage carry
    the embedding and loss weights."""
    total = blocks + e + l
    q, r = divmod(total, stages)
    counts = [q + (i < r) for i in range(stages)]
    counts[0] -= e
    counts[-1] -= l
    return counts


def infer_split(counts: list[int]) -> dict:
    """The split fields whose torchtitan split gives ``counts`` (None: none
    does): the even split first, then the balanced one, each without, then
    with the embedding and the loss counted."""
    blocks, stages = sum(counts), len(counts)
    for layout in ("even", "balanced"):
        for e, l in ((0, 0), (1, 0), (0, 1), (1, 1)):
            if layout == "even" and not divides(blocks + e + l, stages):
                continue
            if stage_blocks(blocks, stages, e, l) == counts:
                return {"pipeline_layout": layout, "embedding_in_split": bool(e),
                        "loss_in_split": bool(l)}
    return None


def refuse_layout(model, execution) -> str | None:
    ex = full(execution)
    why = refuse_fields(NAME, ex, EXPRESSIBLE, WHY)
    if why:
        return why
    tp, pp, dp, cp = ex["tensor_par"], ex["pipeline_par"], ex["data_par"], ex["context_par"]
    if tp > 1 and ex["tensor_par_comm_type"] != "rs_ag":
        return (f"{NAME}: the layout has tensor_par_comm_type={ex['tensor_par_comm_type']}; "
                "torchtitan's tensor parallelism is sequence-parallel (rs_ag)")
    if tp > 1 and ex["seq_par_ag_redo"]:
        return (f"{NAME}: the layout has seq_par_ag_redo=true; autograd keeps the all-gathered "
                "input of torchtitan's sequence-parallel GEMMs (no all-gather redone)")
    if dp == 1 and (ex["optimizer_sharding"] or ex["weight_sharding"]):
        return f"{NAME}: the layout shards over data_par=1 (nothing to shard over)"
    if ex["data_par_overlap"] != (dp > 1):
        return (f"{NAME}: the layout has data_par_overlap={ex['data_par_overlap']} with "
                f"data_par={dp}; FSDP2 and DDP overlap the gradient reduction whenever there is "
                "data parallelism")
    if ex["tensor_par_overlap"] == "ring" and not ex["fused_norm"]:
        return (f"{NAME}: the layout has tensor_par_overlap=ring without fused_norm; async TP "
                "needs [compile] enable, which fuses the norms (fused_norm=true)")
    if ex["optimizer_sharding"] != ex["weight_sharding"] and dp > 1:
        return (f"{NAME}: the layout has optimizer_sharding={ex['optimizer_sharding']} with "
                f"weight_sharding={ex['weight_sharding']}; FSDP2 shards weights, gradients and "
                "optimizer state together (ZeRO-1/2 cannot be stated)")
    if dp > 1 and not ex["weight_sharding"] and tp * pp * cp > 1:
        return (f"{NAME}: the layout has data_par={dp} without weight_sharding beside other "
                "parallelism; torchtitan's DDP supports no other parallelism")
    if ex["weight_offload"] != ex["optimizer_offload"]:
        return (f"{NAME}: the layout has weight_offload={ex['weight_offload']} and "
                f"optimizer_offload={ex['optimizer_offload']}; enable_cpu_offload offloads both")
    if ex["weight_offload"] and not ex["weight_sharding"]:
        return f"{NAME}: the layout has weight_offload without weight_sharding; enable_cpu_offload is FSDP's"
    if ex["expert_tensor_par"] not in (1, tp):
        return (f"{NAME}: the layout has expert_tensor_par={ex['expert_tensor_par']}; "
                f"expert_tensor_parallel_degree is 1 or the TP degree ({tp})")
    if pp > 1:
        counts = split_counts(model, ex)
        if min(counts) < 1:
            return f"{NAME}: the layout's pipeline split leaves a virtual stage without blocks"
        back = infer_split(counts)
        mine = {k: ex[k] for k in ("pipeline_layout", "embedding_in_split", "loss_in_split")}
        if back != mine:
            return (f"{NAME}: the layout's split ({', '.join(f'{k}={v}' for k, v in mine.items())}) "
                    f"gives the modules per stage that "
                    + (", ".join(f"{k}={v}" for k, v in back.items()) if back else "nothing")
                    + " gives; torchtitan states the modules, so write that split")
    return None


# --------------------------------------------------------------------------
# Writing

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _toml(sections: dict, header: list[str]) -> str:
    lines = [f"# {h}" for h in header]
    for name, keys in sections.items():
        if not keys:
            continue
        lines += ["", f"[{name}]"]
        for k, v in keys.items():
            if isinstance(v, list) and v and isinstance(v[0], list):
                lines.append(f"{k} = [")
                lines += [f"    {_toml_value(x)}," for x in v]
                lines.append("]")
            else:
                lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _fqns(counts: list[int]) -> list[list[str]]:
    parts, n = [], 0
    for i, c in enumerate(counts):
        part = ["tok_embeddings"] if i == 0 else []
        part += [f"layers.{n + j}" for j in range(c)]
        n += c
        if i == len(counts) - 1:
            part += ["norm", "output"]
        parts.append(part)
    return parts


def write(model, execution) -> str:
    ex = full(execution)
    tp, pp, dp, cp = ex["tensor_par"], ex["pipeline_par"], ex["data_par"], ex["context_par"]
    if ex["weight_sharding"] and dp > 1:
        shard = ex["sharding_group"] or dp
        replicate = dp // shard
    else:
        shard, replicate = 1, dp
    mbs, batch = ex["microbatch_size"], ex["batch_size"]
    par = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
           "fsdp_reshard_after_forward": "default",
           "tensor_parallel_degree": tp,
           "enable_async_tensor_parallel": ex["tensor_par_overlap"] == "ring",
           "pipeline_parallel_degree": pp,
           "pipeline_parallel_schedule": "1F1B" if ex["pipeline_interleaving"] == 1
           else "Interleaved1F1B",
           "pipeline_parallel_microbatch_size": mbs if pp > 1 else 1}
    if pp > 1:
        par["module_fqns_per_model_part"] = _fqns(split_counts(model, ex))
    par.update({"context_parallel_degree": cp, "context_parallel_rotate_method": "allgather",
                "expert_parallel_degree": ex["expert_par"],
                "expert_tensor_parallel_degree": ex["expert_tensor_par"],
                "expert_parallel_comm_backend": "deepep" if ex["moe_dispatcher"] == "deepep"
                else "standard"})
    training = {"local_batch_size": batch // dp if pp > 1 else mbs,
                "global_batch_size": batch, "seq_len": model.seq_size,
                "dtype": "float32", "mixed_precision_param": ex["datatype"],
                "mixed_precision_reduce": "float32",
                "enable_cpu_offload": bool(ex["weight_offload"])}
    sections = {"training": training, "parallelism": par,
                "activation_checkpoint": {"mode": ex["activation_recompute"]},
                "compile": {"enable": bool(ex["fused_norm"]), "components": ["model", "loss"]}}
    if ex["fp8_recipe"] != "none":
        conv, recipe = FP8[ex["fp8_recipe"]]
        sections["model"] = {"converters": [conv]}
        sections[conv] = {"recipe_name": recipe}
    n = ex["num_procs"]
    header = [f"torchtitan job config written by autopar for {model.name or 'the model'} "
              f"on {n} GPUs (torchtitan 0.2.x):",
              f"  NGPU={n} CONFIG_FILE=<this file> ./run_train.sh   "
              "(or torchrun ... -m torchtitan.train --job.config_file <this file>)",
              "Add the [job], [model] name/flavor, [optimizer] and [checkpoint] sections of "
              "your run."]
    return _toml(sections, header)


# --------------------------------------------------------------------------
# Reading

def read(text: str, source: str, num_procs: int | None = None) -> Imported:
    """The layout a job config runs.  ``num_procs`` (the run's ``NGPU``, which
    the file does not hold) settles ``data_parallel_shard_degree = -1``, the
    ranks left over."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        k = Keys({}, source)
        k.fail("(file)", f"not valid TOML: {e}")
    k = Keys(data, source)
    notes: list[str] = []
    ex: dict = {**RECIPE_DEFAULTS,
                "training": True, "attention_type": "multihead", "attention_impl": "flash_v2",
                "fp32_grads": True, "unsharded_grads": False,
                "activations_offload": False, "activation_offload_blocks": 0,
                "activation_offload_modules": "none",
                "moe_overlap": False, "recompute_layers": 0,
                "param_gather_overlap": False, "optimizer_outer_sharding": False,
                "first_stage_blocks": 0, "last_stage_blocks": 0}
    P = "parallelism."
    tp = k.int(P + "tensor_parallel_degree", 1, minimum=1)
    pp = k.int(P + "pipeline_parallel_degree", 1, minimum=1)
    cp = k.int(P + "context_parallel_degree", 1, minimum=1)
    rep = k.int(P + "data_parallel_replicate_degree", 1, minimum=1)
    shard = k.int(P + "data_parallel_shard_degree", -1, allow=(-1,))
    if shard != -1 and shard < 1:
        k.fail(P + "data_parallel_shard_degree", f"must be -1 or >= 1, got {shard}")
    ex.update(tensor_par=tp, pipeline_par=pp, context_par=cp)
    if shard == -1 and num_procs is not None:
        if not divides(num_procs, rep * tp * pp * cp):
            k.fail(P + "data_parallel_shard_degree", f"-1: {num_procs} processors are not a "
                   f"multiple of the other degrees ({rep * tp * pp * cp})")
        shard = num_procs // (rep * tp * pp * cp)
    if shard == -1:
        notes.append("data_parallel_shard_degree = -1 (the ranks left over): num_procs and "
                     "data_par come from --num-procs")
        ex.update(weight_sharding=True, optimizer_sharding=True,
                  sharding_group=0 if rep == 1 else None)
    else:
        dp = rep * shard
        ex.update(data_par=dp, num_procs=dp * tp * pp * cp, weight_sharding=shard > 1,
                  optimizer_sharding=shard > 1,
                  sharding_group=shard if rep > 1 and shard > 1 else 0,
                  data_par_overlap=dp > 1)
        if rep > 1 and shard == 1 and tp * pp * cp > 1:
            k.fail(P + "data_parallel_replicate_degree", "DDP (replicate without shard) with "
                   "other parallelism: torchtitan refuses it (DDP is 1-D only)")
    reshard = k.choice(P + "fsdp_reshard_after_forward", ("default", "always", "never"),
                       "default")
    if reshard != "default":
        notes.append(f"fsdp_reshard_after_forward = {reshard!r} is a framework record "
                     f"(memory_overhead.fsdp_reshard), not a layout field: estimate with a "
                     f"framework file whose fsdp_reshard is {reshard!r}")
    if tp > 1:                 # with TP 1 these are idle: not stated
        ex.update(tensor_par_comm_type="rs_ag", seq_par_ag_redo=False)
    async_tp = k.bool(P + "enable_async_tensor_parallel", False)
    ex["tensor_par_overlap"] = "ring" if async_tp and tp > 1 else "none"
    # pipeline
    if pp > 1:
        sched = k.choice(P + "pipeline_parallel_schedule", SINGLE_STAGE + MULTI_STAGE, "1F1B")
        fqns = k.raw(P + "module_fqns_per_model_part")
        if fqns is not None:
            counts = _read_fqns(k, P + "module_fqns_per_model_part", fqns)
            if not divides(len(counts), pp):
                k.fail(P + "module_fqns_per_model_part", f"{len(counts)} stages are not a "
                       f"multiple of pipeline_parallel_degree {pp}")
            v = len(counts) // pp
            if (v == 1) != (sched in SINGLE_STAGE):
                k.fail(P + "pipeline_parallel_schedule", f"{sched!r} with {v} stages per rank")
            split = infer_split(counts)
            if split is None:
                k.fail(P + "module_fqns_per_model_part", f"blocks per stage {counts}: neither an "
                       "even nor a balanced split (autopar cannot state it)")
            ex.update(pipeline_interleaving=v, **split)
        else:
            e = k.choice(P + "pipeline_parallel_first_stage_less_layers", (0, 1), 1)
            l = k.choice(P + "pipeline_parallel_last_stage_less_layers", (0, 1), 1)
            ex.update(embedding_in_split=bool(e), loss_in_split=bool(l), pipeline_layout="even")
            notes.append("the split is torchtitan's own (generate_llm_fqn_per_model_part): even, "
                         "or balanced where the blocks do not divide (settled with the model)")
            if k.raw(P + "pipeline_parallel_layers_per_stage") is not None:
                k.int(P + "pipeline_parallel_layers_per_stage", minimum=1)
                ex["pipeline_interleaving"] = None
                notes.append("pipeline_parallel_layers_per_stage: the interleaving depends on "
                             "the model's layers; left unknown")
            else:
                ex["pipeline_interleaving"] = 1 if sched in SINGLE_STAGE else 2
        mbs = k.int(P + "pipeline_parallel_microbatch_size", 1, minimum=1)
    else:
        ex.update(pipeline_interleaving=1, pipeline_layout="even", embedding_in_split=False,
                  loss_in_split=False)
        mbs = None
    if k.raw(P + "pipeline_parallel_schedule_csv"):
        k.fail(P + "pipeline_parallel_schedule_csv", "a custom schedule: autopar models 1F1B "
               "and interleaved 1F1B")
    if cp > 1:
        k.choice(P + "context_parallel_rotate_method", ("allgather", "alltoall"), "allgather")
    ex["context_par_comm"] = "p2p"
    ep = k.int(P + "expert_parallel_degree", 1, minimum=1)
    etp = k.int(P + "expert_tensor_parallel_degree", 1, minimum=1)
    backend = k.choice(P + "expert_parallel_comm_backend", ("standard", "deepep"), "standard")
    ex.update(expert_par=ep, expert_tensor_par=etp,
              moe_dispatcher="deepep" if backend == "deepep" else "alltoall")
    # training
    T = "training."
    local = k.int(T + "local_batch_size", 8, minimum=1)
    glob = k.int(T + "global_batch_size", -1, allow=(-1,))
    if glob != -1 and glob < 1:
        k.fail(T + "global_batch_size", f"must be -1 or >= 1, got {glob}")
    seq = k.int(T + "seq_len", 2048, minimum=1)
    ex["microbatch_size"] = mbs if pp > 1 else local
    if pp > 1 and not divides(local, mbs):
        k.fail(P + "pipeline_parallel_microbatch_size", f"{mbs} does not divide "
               f"training.local_batch_size {local}")
    if glob > 0:
        ex["batch_size"] = glob
    elif "data_par" in ex:
        ex["batch_size"] = local * ex["data_par"]
    if k.choice(T + "dtype", ("float32", "bfloat16"), "float32") != "float32":
        k.fail(T + "dtype", "bfloat16 (training without fp32 master weights): autopar's "
               "layouts keep fp32 master weights (use mixed_precision_param)")
    ex["datatype"] = k.choice(T + "mixed_precision_param", ("bfloat16", "float32"), "bfloat16")
    k.choice(T + "mixed_precision_reduce", ("float32",), "float32")
    off = k.bool(T + "enable_cpu_offload", False)
    ex.update(weight_offload=off, optimizer_offload=off)
    # activation checkpointing
    mode = k.choice("activation_checkpoint.mode", ("none", "full", "selective", "memory_budget"),
                    "selective")
    if mode == "selective":
        opt = str(k.raw("activation_checkpoint.selective_ac_option", "2"))
        if opt == "1":
            mode = "full"
        else:
            mode = None
            notes.append(f"activation_checkpoint: selective ({opt!r}) is none of autopar's "
                         "recompute modes; activation_recompute left unknown")
    elif mode == "memory_budget":
        mode = None
        notes.append("activation_checkpoint: memory_budget; activation_recompute left unknown")
    ex["activation_recompute"] = mode
    ex["fused_norm"] = k.bool("compile.enable", False)
    # fp8
    convs = k.raw("model.converters", [])
    if isinstance(convs, str):
        convs = [c for c in convs.split(",") if c]
    if not isinstance(convs, list) or not all(isinstance(c, str) for c in convs):
        k.fail("model.converters", "expected a list of converter names")
    recipe = "none"
    for c in convs:
        if c in ("quantize.linear.float8", "float8"):
            r = k.choice("quantize.linear.float8.recipe_name", ("tensorwise", "rowwise"),
                         "tensorwise")
            recipe = r
        elif c in ("quantize.linear.mx", "mx"):
            k.choice("quantize.linear.mx.recipe_name", ("mxfp8_cublas", "mxfp8"), "mxfp8_cublas")
            recipe = "mxfp8"
        elif c.startswith("quantize.grouped_mm."):
            notes.append(f"model.converters: {c} (the experts' grouped GEMMs) is not modelled "
                         "apart from the linear layers' recipe")
        else:
            k.fail("model.converters", f"unknown converter {c!r} (autopar reads "
                   "quantize.linear.float8, quantize.linear.mx)")
    ex["fp8_recipe"] = recipe
    model = {"seq_size": seq}
    return Imported(execution=ex, model=model, framework="torchtitan", notes=tuple(notes))


def _read_fqns(k: Keys, key: str, parts) -> list[int]:
    """Blocks per stage of a ``module_fqns_per_model_part`` list, checked:
    the embedding first, consecutive layers, the norm and output last."""
    if not isinstance(parts, list) or not parts:
        k.fail(key, "expected a non-empty list of lists of module names")
    counts, nxt = [], 0
    for i, part in enumerate(parts):
        where = f"{key}[{i}]"
        if not isinstance(part, list) or not all(isinstance(m, str) for m in part):
            k.fail(where, "expected a list of module names")
        c = 0
        for m in part:
            if m == "tok_embeddings":
                if i != 0:
                    k.fail(where, "tok_embeddings outside the first stage")
            elif m in ("norm", "output"):
                if i != len(parts) - 1:
                    k.fail(where, f"{m} outside the last stage")
            elif m.startswith("layers.") and m[7:].isdigit():
                if int(m[7:]) != nxt:
                    k.fail(where, f"{m}: layers out of order (expected layers.{nxt})")
                nxt += 1
                c += 1
            else:
                k.fail(where, f"unknown module {m!r} (autopar reads tok_embeddings, "
                       "layers.N, norm, output)")
        counts.append(c)
    return counts


def settle(execution: dict, model) -> dict:
    """The read split with the model known: torchtitan's own split (no
    ``module_fqns_per_model_part``) is balanced where the blocks do not
    divide evenly over the stages."""
    ex = dict(execution)
    if ex.get("pipeline_par", 1) > 1 and ex.get("pipeline_layout") == "even" \
            and ex.get("pipeline_interleaving"):
        stages = ex["pipeline_par"] * ex["pipeline_interleaving"]
        e, l = int(ex.get("embedding_in_split", 0)), int(ex.get("loss_in_split", 0))
        if not divides(model.num_blocks + e + l, stages):
            ex["pipeline_layout"] = "balanced"
    return ex


FORMAT = LaunchFormat(
    writes=states(EXPRESSIBLE),
    name=NAME, suffix=".toml", framework="torchtitan", refuse_model=refuse_model,
    refuse_space=refuse_space, refuse_layout=refuse_layout, write=write, read=read,
    describe="torchtitan's TOML job config (torchtitan 0.2.x, --job.config_file)")

