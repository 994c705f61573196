"""``--format megatron``: a Megatron-LM launch script, ``torchrun ...
pretrain_gpt.py`` (a hybrid Mamba model: ``pretrain_hybrid.py``) with the
layout's and the model's arguments.

The settings are Megatron-Core's (``autopar.io.launch.mcore``), spelled as
NVIDIA/Megatron-LM@d98e8a6 megatron/training/arguments.py names them: most
are generated from ``TransformerConfig`` (attribute ``a_b`` -> ``--a-b``,
a boolean that defaults to true -> ``--no-a-b``; argument_utils.py
``ArgumentGroupFactory``); the exceptions are in ``ARG_NAMES``.  The number
of GPUs is the script's ``NUM_GPUS``; the data-parallel size is what
Megatron derives from it (world size / (TP x PP x CP)).

Reading accepts a script or a bare argument list: ``\\`` continuations,
``torchrun``/``python`` before the ``*.py`` entry point, ``--flag value`` and
``--flag=value``, comments; arguments autopar does not model are ignored; an
argument it reads with a value it cannot represent is one ``SpecError``
naming the file and the argument.  An absent argument means Megatron-LM's
default (argparse's), except the model's shape (left out).
"""
from __future__ import annotations

import re
import shlex

from autopar.io.errors import SpecError
from autopar.io.launch import mcore
from autopar.io.launch.base import Imported, LaunchFormat

NAME = "megatron"
# settings keys whose argument is not "--" + the attribute with dashes
ARG_NAMES = {
    "model.virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "model.num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "model.num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "model.fp8": "--fp8-format",
    "model.fp4": "--fp4-format",
    "model.gated_linear_unit": "--swiglu",
    "model.num_moe_experts": "--num-experts",
    "_num_procs": "NUM_GPUS",
    # with an emerging optimizer (Muon) --use-distributed-optimizer is the
    # layer-wise distributed optimizer (arguments.py validate_args)
    "optimizer.use_layer_wise_distributed_optimizer": "--use-distributed-optimizer",
}
# the entry points: a GPT model, and a hybrid (Mamba) one (pretrain_mamba.py
# is its deprecated wrapper, read as well)
ENTRY, HYBRID_ENTRY = "pretrain_gpt.py", "pretrain_hybrid.py"
# boolean settings whose argument turns a default-true attribute off
OFF_FLAGS = {"model.masked_softmax_fusion": "--no-masked-softmax-fusion",
             "model.add_bias_linear": "--disable-bias-linear"}
# settings not written as one argument of their own (handled in ``write``)
SPECIAL = ("mixed_precision.dtype", "ddp.grad_reduce_in_fp32", "model.bias_activation_fusion",
           "model.seq_length", "model.num_query_groups", "_num_procs",
           # no arguments of their own: --cpu-offloading-num-layers N > 0 turns
           # CPU offloading on (arguments.py validate_args; cpu_offloading,
           # cpu_offloading_activations and _weights are excluded from the
           # generated arguments, which leave them at TransformerConfig's
           # defaults: activations on, weights off)
           "model.cpu_offloading", "model.cpu_offloading_activations",
           "model.cpu_offloading_weights")


def arg_name(key: str) -> str:
    if key in ARG_NAMES:
        return ARG_NAMES[key]
    if key in OFF_FLAGS:
        return OFF_FLAGS[key]
    return "--" + key.split(".", 1)[1].replace("_", "-")


def refuse_model(model):
    return mcore.refuse_model(model, NAME)


def refuse_space(model, space):
    return mcore.refuse_space(space, NAME)


def refuse_datatype(datatype, space=None):
    if datatype in ("float8", "mxfp8"):
        return mcore.refusal("datatype", datatype, NAME, "Megatron-Core runs fp8 GEMMs inside "
                             "a bf16/fp16 model (use fp8_recipe with datatype bfloat16)")
    return None


def refuse_layout(model, execution):
    return mcore.refuse_layout(model, execution, NAME)


def write(model, execution) -> str:
    why = refuse_layout(model, execution)
    if why:
        raise SpecError("command line", "--format", why)
    s = mcore.settings(model, execution)
    args: list[str] = []
    hybrid = bool(getattr(model, "hybrid_pattern", ""))
    for key, v in s.items():
        if key in SPECIAL or v is None:
            continue
        if hybrid and key == "model.virtual_pipeline_model_parallel_size":
            continue        # derived from the pattern's pipes (arguments.py refuses it)
        if isinstance(v, bool):
            if key in OFF_FLAGS:
                if not v:
                    args.append(OFF_FLAGS[key])
            elif v:
                args.append(arg_name(key))
            continue
        if isinstance(v, list):
            args.append(f"{arg_name(key)} {' '.join(str(x) for x in v)}")
        else:
            args.append(f"{arg_name(key)} {shlex.quote(str(v))}")
    args.append(f"--seq-length {model.seq_size}")
    args.append(f"--max-position-embeddings {model.seq_size}")
    if "model.num_query_groups" in s:
        args.append(f"--group-query-attention --num-query-groups {s['model.num_query_groups']}")
    if not s["model.bias_activation_fusion"]:
        args.append("--no-bias-swiglu-fusion" if model.block == "llama"
                    else "--no-bias-gelu-fusion")
    dt = s["mixed_precision.dtype"]
    if dt == "bfloat16":
        args.append("--bf16")
        # bf16 reduces gradients in fp32 unless the main grads are bf16
        # (arguments.py validate_args)
        args.append("--accumulate-allreduce-grads-in-fp32" if s["ddp.grad_reduce_in_fp32"]
                    else "--main-grads-dtype bf16")
    else:
        if dt == "float16":
            args.append("--fp16")
        if s["ddp.grad_reduce_in_fp32"]:
            args.append("--accumulate-allreduce-grads-in-fp32")
    runnable = ["--mock-data", "--tokenizer-type NullTokenizer", "--train-iters 100",
                "--lr 1e-4"]
    n = execution["num_procs"]
    head = [
        "#!/bin/bash",
        f"# Megatron-LM launch written by autopar: model {model.name or '(unnamed)'} on "
        f"{n} GPUs (data-parallel size {execution['data_par']} = NUM_GPUS / "
        f"(TP x PP x CP)).",
        "# Network tiers are where the launcher places the ranks; they are not arguments.",
        "# Replace the last line's mock data, tokenizer and schedule with the run's own.",
    ]
    if not model.vocab_size:
        head.append("# The model file states no vocabulary: add --vocab-size for NullTokenizer.")
    # what validate_args asserts of the environment (arguments.py): before
    # Blackwell, TP or CP needs one CUDA connection unless Megatron-FSDP or the
    # EP overlap runs, and Megatron-FSDP needs it unset or > 1
    if s["ddp.use_megatron_fsdp"]:
        head.append("unset CUDA_DEVICE_MAX_CONNECTIONS   # Megatron-FSDP: unset or > 1")
    elif (s["model.tensor_model_parallel_size"] > 1 or s["model.context_parallel_size"] > 1) \
            and not s.get("model.overlap_moe_expert_parallel_comm"):
        head.append("export CUDA_DEVICE_MAX_CONNECTIONS=1   # TP/CP before Blackwell")
    if s.get("model.fine_grained_activation_offloading"):
        # validate_args asserts it with Transformer Engine >= 2.10 (TE's v1
        # offload path, which leaves the weights on the GPU)
        head.append("export NVTE_CPU_OFFLOAD_V1=1   # fine-grained activation offloading")
    head += [f"NUM_GPUS={n}", "GPUS_PER_NODE=${GPUS_PER_NODE:-8}",
             'torchrun --nproc-per-node "$GPUS_PER_NODE" '
             '--nnodes $((NUM_GPUS / GPUS_PER_NODE)) \\',
             f"    {HYBRID_ENTRY if hybrid else ENTRY} \\"]
    body = [f"    {a} \\" for a in args]
    return "\n".join(head + body + ["    " + " ".join(runnable)]) + "\n"


# ---------------------------------------------------------------------------
# reading

def _arg_keys() -> dict:
    """argument -> (settings key, how: value | on | off)."""
    keys = {}
    names = [
        "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
        "model.context_parallel_size", "model.expert_model_parallel_size",
        "model.expert_tensor_parallel_size", "model.virtual_pipeline_model_parallel_size",
        "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage",
        "model.pipeline_model_parallel_layout", "train.micro_batch_size",
        "train.global_batch_size", "model.recompute_granularity", "model.recompute_method",
        "model.recompute_num_layers", "model.recompute_modules",
        "ddp.data_parallel_sharding_strategy", "ddp.num_distributed_optimizer_instances",
        "ddp.outer_dp_sharding_strategy",
        "optimizer.optimizer_offload_fraction", "model.fp8", "model.fp8_recipe",
        "model.fp4", "model.fp4_recipe", "optimizer.optimizer",
        "model.num_layers_at_start_in_bf16", "model.num_layers_at_end_in_bf16",
        "model.transformer_impl", "model.attention_backend", "model.cp_comm_type",
        "model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend",
        "model.num_layers", "model.hidden_size", "model.ffn_hidden_size",
        "model.num_attention_heads", "model.kv_channels", "model.num_query_groups",
        "model.vocab_size", "model.normalization", "model.num_moe_experts",
        "model.moe_router_topk", "model.moe_ffn_hidden_size",
        "model.moe_shared_expert_intermediate_size", "model.moe_layer_freq",
        "model.moe_router_score_function", "model.moe_expert_capacity_factor",
        "model.kv_lora_rank", "model.q_lora_rank", "model.qk_head_dim",
        "model.qk_pos_emb_head_dim", "model.v_head_dim", "model.mtp_num_layers",
        "model.seq_length", "checkpoint.ckpt_format", "model.hybrid_layer_pattern",
        "model.mamba_num_heads", "model.mamba_head_dim", "model.mamba_state_dim",
        "model.mamba_num_groups", "optimizer.muon_tp_mode", "optimizer.muon_num_ns_steps",
        "model.cpu_offloading_num_layers", "model.moe_latent_size", "model.offload_modules",
        "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype",
        "model.experimental_attention_variant", "model.dsa_indexer_n_heads",
        "model.dsa_indexer_head_dim", "model.dsa_indexer_topk",
        "model.dsa_indexer_loss_coeff", "model.dsa_kernel_backend"]
    for k in names:
        keys[arg_name(k)] = (k, "value")
    for k in ("model.sequence_parallel", "model.tp_comm_overlap", "model.first_last_layers_bf16",
              "ddp.use_distributed_optimizer", "ddp.use_megatron_fsdp",
              "ddp.overlap_grad_reduce", "ddp.overlap_param_gather",
              "optimizer.optimizer_cpu_offload", "optimizer.use_precision_aware_optimizer",
              "model.gated_linear_unit",
              "model.overlap_moe_expert_parallel_comm", "model.multi_latent_attention",
              "model.account_for_embedding_in_pipeline_split",
              "model.account_for_loss_in_pipeline_split", "model.mtp_use_repeated_layer",
              "model.fine_grained_activation_offloading",
              "model.use_transformer_engine_op_fuser"):
        keys[arg_name(k)] = (k, "on")
    for k, a in OFF_FLAGS.items():
        keys[a] = (k, "off")
    keys["--no-bias-gelu-fusion"] = ("model.bias_activation_fusion", "off")
    keys["--no-bias-swiglu-fusion"] = ("model.bias_activation_fusion", "off")
    keys["--bf16"] = ("mixed_precision.dtype", "bfloat16")
    keys["--fp16"] = ("mixed_precision.dtype", "float16")
    keys["--accumulate-allreduce-grads-in-fp32"] = ("ddp.grad_reduce_in_fp32", "on")
    keys["--main-grads-dtype"] = ("_main_grads_dtype", "value")
    keys["--grad-reduce-in-bf16"] = ("_grad_reduce_in_bf16", "on")
    keys["--num-layers-per-virtual-pipeline-stage"] = ("_layers_per_virtual_stage", "value")
    keys["--recompute-activations"] = ("_recompute_activations", "on")
    keys["--disable-bias-linear"] = ("model.add_bias_linear", "off")
    keys["--group-query-attention"] = ("_group_query_attention", "on")
    keys["--squared-relu"] = ("_squared_relu", "on")
    keys["--hybrid-override-pattern"] = ("model.hybrid_override_pattern", "value")
    return keys


def _tokens(text: str, source: str) -> tuple[list[str], int | None]:
    """The arguments after the entry point (or all of them), and the number
    of GPUs where the script states it (NUM_GPUS=N, or torchrun's numeric
    --nnodes x --nproc-per-node)."""
    lines = []
    for no, line in enumerate(re.sub(r"\\\r?\n", " ", text).splitlines(), 1):
        try:
            lines.append(shlex.split(line, comments=True))
        except ValueError as err:
            raise SpecError(source, f"line {no}", f"cannot be split into arguments: "
                            f"{err}") from None
    gpus = None
    for t in (t for line in lines for t in line):
        m = re.fullmatch(r"NUM_GPUS=(\d+)", t)
        if m:
            gpus = int(m.group(1))
    # the command that runs the entry point (its own line once continuations
    # are joined); a bare argument list: every line
    command = next((line for line in lines if any(t.endswith(".py") for t in line)), None)
    if command is None:
        launcher, args = [], [t for line in lines for t in line]
    else:
        entry = next(i for i, t in enumerate(command) if t.endswith(".py"))
        launcher, args = command[:entry], command[entry + 1:]
    if gpus is None and launcher:
        opts = dict(_pairs(launcher))
        nodes = opts.get("--nnodes", "1")
        per = opts.get("--nproc-per-node", opts.get("--nproc_per_node"))
        if per is not None and per.isdigit() and nodes.isdigit():
            gpus = int(per) * int(nodes)
    return args, gpus


def _pairs(toks):
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("--") and "=" in t:
            k, v = t.split("=", 1)
            yield k, v
        elif t.startswith("--"):
            vals = []
            while i + 1 < len(toks) and not toks[i + 1].startswith("--"):
                i += 1
                vals.append(toks[i])
            yield t, " ".join(vals) if vals else None
        i += 1


def read(text: str, source: str = "megatron arguments") -> Imported:
    toks, gpus = _tokens(text, source)
    keys = _arg_keys()
    values: dict = {}
    spelled = {}
    for arg, val in _pairs(toks):
        if arg not in keys:
            continue
        key, how = keys[arg]
        spelled[key] = arg
        if how == "value":
            if val is None:
                raise SpecError(source, arg, "needs a value")
            if "$" in val:
                raise SpecError(source, arg, f"{val!r} is a shell variable autopar cannot "
                                "resolve; write the number")
            values[key] = val
        elif how in ("on", "off"):
            values[key] = how == "on"
        else:
            values[key] = how
    if gpus is not None:
        values["_num_procs"] = gpus
        spelled["_num_procs"] = "NUM_GPUS"
    r = mcore.Reader(values, source, lambda k: spelled.get(k, arg_name(k)))
    if not values.get("_group_query_attention"):
        # --num-query-groups counts only with --group-query-attention
        # (argument_utils.py core_transformer_config_from_args)
        values.pop("model.num_query_groups", None)
    if values.get("_recompute_activations") and "model.recompute_granularity" not in values:
        values["model.recompute_granularity"] = "selective"
    if "_layers_per_virtual_stage" in values:
        per = r.int("_layers_per_virtual_stage")
        layers, pp = r.int("model.num_layers"), r.int("model.pipeline_model_parallel_size", 1)
        if layers is None or layers % (pp * per):
            r.fail("_layers_per_virtual_stage", "needs --num-layers divisible by the "
                   "pipeline size times it")
        values["model.virtual_pipeline_model_parallel_size"] = layers // (pp * per)
    dt = values.setdefault("mixed_precision.dtype", "float32")
    if dt == "bfloat16":
        bf16_grads = values.get("_grad_reduce_in_bf16") or \
            r.choice("_main_grads_dtype", ("fp32", "bf16"), "fp32") == "bf16"
        values["ddp.grad_reduce_in_fp32"] = not bf16_grads
    else:
        values.setdefault("ddp.grad_reduce_in_fp32", False)
    ex, model = mcore.layout(r, framework_defaults=True)
    notes = () if gpus is not None else (
        "the number of GPUs is not stated (NUM_GPUS or torchrun's --nnodes x "
        "--nproc-per-node): num_procs and data_par are left out",)
    return Imported(execution=ex, model=model, framework="megatron-core", notes=notes)


FORMAT = LaunchFormat(
    name=NAME, suffix=".sh", framework="megatron-core",
    refuse_model=refuse_model, refuse_space=refuse_space, refuse_layout=refuse_layout,
    write=write, read=read, refuse_datatype=refuse_datatype, cut_space=mcore.cut_space,
    writes=mcore.writes,
    describe="Megatron-LM launch script: torchrun ... pretrain_gpt.py (pretrain_hybrid.py for "
             "a hybrid Mamba model) with the layout's and the model's arguments")
