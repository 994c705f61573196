"""The shared vocabulary of the Megatron-Bridge performance-recipe tables
(``autopar/data/recipes/*.csv``, written by ``benchmarks/write_recipe_table*.py``
from NVIDIA-NeMo/Megatron-Bridge@067f987 ``src/megatron/bridge/perf_recipes``):
where they are, their columns, how a GPU folder, a precision and a selective
recompute module map to autopar, and how a row's cells read.  The dense rows
are ``autopar.studies.recipes``'s, the MoE rows ``autopar.studies.recipes_moe``'s.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from autopar.io.errors import SpecError

RECIPES = Path(__file__).resolve().parent.parent / "data" / "recipes"
CSV = RECIPES / "bridge_dense.csv"
# Every recipe table: the dense and hybrid recipes (``autopar.studies.recipes``)
# and the MoE ones (``autopar.studies.recipes_moe``).
CSVS = (CSV, RECIPES / "bridge_moe.csv")
FRAMEWORK = "megatron-bridge"
# The columns both recipe tables share (empty: not set by the recipe).
COLUMNS = ("recipe", "family", "model", "gpu", "precision", "n_gpus", "tp", "pp", "cp", "vp",
           "ep", "etp", "mbs", "gbs", "seq", "sp", "recompute_granularity", "recompute_modules",
           "recompute_num_layers", "recompute_method", "offload", "cuda_graph", "dispatcher",
           "extra", "source")
# Megatron-Bridge GPU folder -> autopar system file.
SYSTEMS = {"h100": "h100_80g_nvl8", "b200": "b200_nvl8", "b300": "b300_nvl8",
           "gb200": "gb200_nvl72", "gb300": "gb300_nvl72"}
# The recipes' precision (perf_recipes/_common.py ``_perf_precision``) ->
# autopar's fp8_recipe (per-tensor delayed scaling is autopar's tensorwise
# too; ``fp8_sc``, blockwise 1x128, its rowwise).
FP8 = {"bf16": "none", "fp8_cs": "tensorwise", "fp8_ds": "tensorwise", "fp8_mx": "mxfp8",
       "fp8_sc": "rowwise", "nvfp4": "nvfp4"}
# Megatron-Core's selective recompute modules autopar expresses.
SELECTIVE = {("core_attn",): "attn_only", ("mlp",): "mlp_only"}


def read(path: Path | str = CSV) -> pd.DataFrame:
    """A recipe table, every column as text (empty: not set by the recipe);
    ``SpecError`` naming the file where it is missing or not a CSV with the
    shared columns."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except FileNotFoundError:
        raise SpecError(str(path), "(file)", "no such file (benchmarks/write_recipe_table*.py "
                        "write them)") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise SpecError(str(path), "(file)", f"not a readable CSV: {e}") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise SpecError(str(path), missing[0], "missing column")
    return frame


def extra(row) -> dict:
    """The row's ``extra`` column as {key: text}."""
    out = {}
    for part in str(row["extra"]).split(";"):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
    return out


def moment_bytes(x: dict) -> int | str:
    """The recipe's ``optimizer_moment_bytes`` from its precision-aware
    optimizer settings (``opt.*`` in the MoE table, ``optimizer.*`` in the
    dense one, whose MoE rows recipes_moe reads too): 2 where
    ``use_precision_aware_optimizer`` keeps both Adam moments in bf16/fp16
    (``exp_avg_dtype``, ``exp_avg_sq_dtype``), 4 otherwise; a reason (str) where autopar cannot count them."""
    from autopar.io.launch.mcore import MOMENT_BYTES_OF
    section = "opt" if "opt.use_precision_aware_optimizer" in x else "optimizer"
    if str(x.get(f"{section}.use_precision_aware_optimizer", "false")).lower() != "true":
        return 4
    widths = {MOMENT_BYTES_OF.get(x.get(f"{section}.{k}", "float32"))
              for k in ("exp_avg_dtype", "exp_avg_sq_dtype")}
    if len(widths) != 1 or None in widths:
        return (f"Adam moments {x.get(f'{section}.exp_avg_dtype')} / "
                f"{x.get(f'{section}.exp_avg_sq_dtype')}: autopar counts one width of "
                f"fp32, bf16 or fp16 for both")
    return widths.pop()


def int_cell(v, default=None):
    """A cell as an int (``default`` where it is empty, None or nan)."""
    v = str(v).strip()
    if v in ("", "None", "nan"):
        return default
    return int(float(v))


def flag(v) -> bool:
    """A cell or ``extra`` value as a bool: ``True`` / ``true`` (the dense
    table writes Python's spelling, the MoE table JSON's)."""
    return str(v).strip().lower() == "true"


def megatron_fsdp(x: dict) -> "bool | str":
    """Whether a recipe runs Megatron-FSDP's ``optim_grads_params`` (weights,
    gradients and optimizer state sharded: ``weight_sharding``; with
    expert parallelism the experts' over the expert-data-parallel group,
    ``autopar.model.context.expert_weight_shards``), or the reason autopar
    does not express what it runs: another sharding strategy, or an outer
    strategy other than Megatron-FSDP's two (``no_shard``: HSDP;
    ``optim``: ``outer_optimizer_sharding``)."""
    if not flag(x.get("ddp.use_megatron_fsdp")):
        return False
    strategy = x.get("ddp.data_parallel_sharding_strategy", "optim_grads_params")
    if strategy != "optim_grads_params":
        return f"Megatron FSDP sharding {strategy} is not modelled"
    outer = x.get("ddp.outer_dp_sharding_strategy", "no_shard")
    if outer not in ("no_shard", "optim"):
        return f"Megatron FSDP outer_dp_sharding_strategy {outer} is not modelled"
    return True


def outer_optimizer_sharding(x: dict) -> bool:
    """Whether a Megatron-FSDP recipe shards the optimizer state across its
    distributed-optimizer instances too (``num_distributed_optimizer_instances``
    > 1 with ``outer_dp_sharding_strategy`` optim, "HFSDP"): the execution's
    ``optimizer_outer_sharding`` (autopar.model.context ``shard_counts``)."""
    inst = int_cell(x.get("ddp.num_distributed_optimizer_instances"), 1)
    return inst > 1 and x.get("ddp.outer_dp_sharding_strategy", "no_shard") == "optim"


# Megatron-Core CUDA-graph scopes whose capture holds one of a block's two
# parts (the attention / Mamba mixer or the MLP) while the other runs eagerly
# (memory_overhead.cuda_graphs "scoped").  The MoE router and its
# preprocessing alone are not such a part (their largest op, the router's
# input gradient, is not counted).
SCOPED_PARTS = ("attn", "mlp", "mamba")


def cuda_graph_mode(cell) -> str:
    """The row's ``cuda_graph`` cell (``impl:scope``; empty: no CUDA graphs)
    as ``memory_overhead.cuda_graphs``: "full_iteration" where the scope (or
    the impl, as the MoE table writes it) is the whole step (Megatron-Core's
    full_cuda_graph.py); "layers" for Megatron-Core's ``local`` impl without a
    scope (cuda_graphs.py CudaGraphManager: every TransformerLayer a graph in
    one global mempool, a graph's output buffer reused as the next graph's
    input, no copy); "te_layers" for ``transformer_engine`` without a scope
    (TE's make_graphed_callables over whole layers, chained by a copy);
    "scoped" for ``transformer_engine`` scopes that capture the attention,
    the MLP or the Mamba mixer of a layer; "none" for no graphs, a router-only
    scope, or a scope the table could not resolve (a list built at run time,
    written as its expression)."""
    cell = str(cell).strip()
    if not cell or cell == "nan":
        return "none"
    impl, _, scope = cell.partition(":")
    if "full_iteration" in (impl, *scope.split(";")):
        return "full_iteration"
    if "[" in scope:                   # unresolved expression
        return "none"
    scopes = [s for s in scope.split(";") if s]
    if not scopes:
        return "layers" if impl == "local" else "te_layers"
    if impl == "transformer_engine" and any(s in SCOPED_PARTS for s in scopes):
        return "scoped"
    return "none"


def with_cuda_graphs(system_, cell):
    """``system_`` with its memory_overhead's ``cuda_graphs`` set from the row's
    ``cuda_graph`` cell (``cuda_graph_mode``); unchanged where the framework
    states no memory_overhead or the row has no graphs."""
    import dataclasses
    mode = cuda_graph_mode(cell)
    if system_.memory_overhead is None or mode == "none":
        return system_
    return dataclasses.replace(system_, memory_overhead=dataclasses.replace(
        system_.memory_overhead, cuda_graphs=mode))


# Megatron-Bridge's per-GEMM overlap configs (src/megatron/bridge/training/
# comm_overlap.py) for the output projections' reduce-scatter ->
# memory_overhead.te_userbuffers_rs.
USERBUFFERS_RS = {"PipelineOverlapCfg": "pipeline_fp8", "RingExchangeOverlapCfg": "ring_exchange"}


def userbuffers_rs(x: dict) -> str:
    """How the recipe's TP-overlap config (``comm_overlap.tp_comm_overlap_cfg``,
    its ``proj_fprop`` / ``fc2_fprop`` entries as the table writes them) runs
    the output projections' reduce-scatter: "pipeline" (not set: TE's
    default), "pipeline_fp8" (Bridge's PipelineOverlapCfg: its fp8_buf default
    ``(False,)`` is a tuple, which TE's initialize_ub reads as true) or
    "ring_exchange" (RingExchangeOverlapCfg); where the two entries differ,
    the one that holds more ("ring_exchange" over the others)."""
    got = {USERBUFFERS_RS.get(x.get(f"comm_overlap.tp_comm_overlap_cfg.{k}", ""), "pipeline")
           for k in ("proj_fprop", "fc2_fprop")}
    for mode in ("ring_exchange", "pipeline", "pipeline_fp8"):
        if mode in got:
            return mode
    return "pipeline"


def with_userbuffers_rs(system_, x: dict):
    """``system_`` with ``memory_overhead.te_userbuffers_rs`` from the row's
    overlap config (``userbuffers_rs``); unchanged where it is TE's default."""
    import dataclasses
    mode = userbuffers_rs(x)
    if system_.memory_overhead is None or mode == "pipeline":
        return system_
    return dataclasses.replace(system_, memory_overhead=dataclasses.replace(
        system_.memory_overhead, te_userbuffers_rs=mode))


def without_wgrad_fusion(system_, x: dict):
    """The system under a recipe that turns Megatron-Core's
    ``gradient_accumulation_fusion`` off (``model.gradient_accumulation_fusion``
    in the dense table, ``gradient_accumulation_fusion`` in the MoE one;
    the Llama 3 70B Megatron-FSDP recipes set it False): Transformer Engine
    then returns each weight gradient as its own tensor and keeps no cached
    dummy one (TransformerEngine transformer_engine/pytorch/module/linear.py
    and layernorm_linear.py call ``get_dummy_wgrad`` only under
    ``fuse_wgrad_accumulation``, which Megatron-Core sets from
    ``config.gradient_accumulation_fusion``: NVIDIA/Megatron-LM@2a75ac1
    megatron/core/extensions/transformer_engine.py; the output layer's,
    megatron/core/tensor_parallel/layers.py, only under
    ``ctx.gradient_accumulation_fusion``), and the gradient GEMM does not
    write into the gradient buffer: ``memory_overhead.dummy_wgrad`` and
    ``wgrad_accumulation_fusion`` off.  The system unchanged where the
    recipe leaves it on (Megatron-Core's default) or has no such records."""
    import dataclasses
    v = x.get("model.gradient_accumulation_fusion", x.get("gradient_accumulation_fusion"))
    over = system_.memory_overhead
    if v is None or flag(v) or over is None:
        return system_
    return dataclasses.replace(system_, memory_overhead=dataclasses.replace(
        over, dummy_wgrad=False, wgrad_accumulation_fusion=False))

