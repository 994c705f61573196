"""Megatron-Bridge's MoE performance recipes as autopar layouts: do they fit?

``autopar/data/recipes/bridge_moe.csv`` (written by
benchmarks/write_recipe_table_moe.py from ``NVIDIA-NeMo/Megatron-Bridge@067f987``
``src/megatron/bridge/perf_recipes/<family>/<gpu>/*.py``) holds one row per
recipe function: a layout NVIDIA ran as a benchmark, so it fits its GPUs.
``recipe_case(row)`` turns a row into a ``published_base.PublishedCase``
(``measured`` empty: feasibility only) under frameworks/megatron-bridge.json,
or a ``published_base.Skip`` that says what autopar cannot express.

What a recipe sets and autopar counts:

* tensor / pipeline / virtual / context / expert / expert-tensor parallel
  sizes, micro and global batch, sequence, sequence parallelism, the
  precision (``fp8_cs`` -> ``tensorwise``, ``fp8_mx`` -> ``mxfp8``, ``fp8_sc``
  (blockwise 1x128) -> ``rowwise``, ``nvfp4``; BF16 first/last blocks where
  the recipe keeps them), gradients reduced in the working precision
  (``ddp.grad_reduce_in_fp32``), the overlapped gradient reduce,
  the distributed optimizer, Adam or Muon (``dist_muon``: layer-wise
  sharded over the data-parallel ranks), ``moe_a2a_overlap``
  (``comm_overlap.overlap_moe_expert_parallel_comm``) as ``moe_overlap``, the
  flex dispatcher (DeepEP / HybridEP) as ``deepep``, the model's MTP layers
  (``mtp_num_layers``), the pipeline layout (``pipeline_layout_fields``),
  experts padded to capacity (``moe_expert_capacity_factor`` with
  ``moe_pad_expert_input_to_capacity``) as ``moe.capacity_factor``.
* recompute: ``full`` (uniform: every block), selective ``core_attn`` ->
  ``attn_only``, ``mlp`` -> ``mlp_only``, ``moe_act`` and ``mla_up_proj``
  -> ``recompute_moe_act`` / ``recompute_mla_up_proj``; Megatron-Core's other
  selective modules (``layernorm``, ``moe``, ``shared_experts``) are not
  autopar choices and are dropped: their activations are counted as saved
  (more memory than the run needs).
* ``overlap.tp_comm_overlap`` -> ``tensor_par_overlap: ring`` (with
  sequence parallelism), which holds TE's userbuffers
  (``memory_overhead.te_userbuffers``); ``cuda_graph`` -> the memory a
  captured graph keeps (``recipe_table.cuda_graph_mode``,
  ``memory_overhead.cuda_graphs``; docs/validation.md, "CUDA graphs and TE
  userbuffers: memory, counted").
* fine-grained activation offloading (``offload`` ``fine_grained:<modules>``
  / ``activations:<modules>``) -> ``activation_offload_modules``
  (``fine_offload_modules``; a module autopar does not count: Skip);
  ``gradient_accumulation_fusion`` false -> no TE dummy weight gradients
  (``recipe_table.without_wgrad_fusion``).
* Not counted (the layout is predicted without them; the docs say which
  rows they touch): CUDA graphs' time, paged stashing / expert capacity padding
  for CUDA graphs, fp8 primary weights / fp8 parameter gather.

Megatron-FSDP (``ddp.use_megatron_fsdp`` with ``optim_grads_params``) is
``weight_sharding``: the dense weights sharded over the data-parallel
ranks, the experts' over the expert-data-parallel ones (``megatron_fsdp``;
docs/validation.md, "Megatron-FSDP with expert parallelism, counted").

Skipped: models whose blocks autopar cannot express (``NOT_EXPRESSED``: the
reason names what it lacks), models without a file in ``models/``, Megatron
FSDP strategies other than ``optim_grads_params`` (``megatron_fsdp``; hybrid
sharding with outer strategy optim is ``optimizer_outer_sharding``), and
layouts whose pipeline split autopar cannot build.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from autopar.io.layouts import (OFFLOAD_MODULES_NOT_COUNTED, offload_modules_value,
                                 parse_layout)
from autopar.model.pipeline import stage_split
from autopar.studies import published_base as P
from autopar.studies.published_moe import expert_fields
from autopar.studies.recipe_table import (COLUMNS, FP8, RECIPES, SELECTIVE,  # noqa: F401
                                          SYSTEMS, extra, flag, int_cell, megatron_fsdp,
                                          moment_bytes, outer_optimizer_sharding, read,
                                          with_cuda_graphs,
                                          without_wgrad_fusion)

CSV = RECIPES / "bridge_moe.csv"
FRAMEWORK = "megatron-bridge"
# The shared vocabulary of both recipe tables (autopar.studies.recipe_table): GPU
# folders -> system files, precision -> fp8_recipe, the columns, Megatron-Core's
# selective recompute modules autopar has a choice for.
RECIPE_SYSTEMS, RECIPE_FP8, RECOMPUTE_CHOICE = SYSTEMS, FP8, SELECTIVE

# The recipe tables' models whose blocks autopar cannot express (no models/ file
# is written for them), each with what autopar lacks: the Skip reason.  Sources:
# Megatron-Bridge@067f987's model bridges, which build the Megatron-Core model
# from each released Hugging Face config (docs/validation.md, "Megatron-Bridge
# performance recipes: model files (Nemotron 3, ...)").
NOT_EXPRESSED = {
    # models/deepseek/deepseek_v4_bridge.py: HyperConnectionModule, CompressedSparseAttention
    "deepseek-v4":
        "DeepSeek-V4 (Flash / Pro) uses hyper-connections (4 residual streams mixed per layer), "
        "compressed sparse attention (compressor and indexer, compress ratios 4 and 128, "
        "sliding-window layers) and hash-routed MoE layers; autopar has none of the three",
}


# Recipe tables' model names whose models/ file is named otherwise.
MODEL_FILES = {"glm5": "glm-5"}

# Recipes of an expressed model that use what autopar lacks (recipe-name
# prefix -> the Skip reason).
NOT_EXPRESSED_RECIPES = {
    # Megatron-Bridge@067f987 models/glm_moe_dsa/glm5_bridge.py reads GLM-5.2's
    # index_topk_freq / index_skip_topk_offset (dsa_indexer_topk_freq,
    # dsa_indexer_skip_topk_offset: Megatron-Core dsa.py is_dsa_skip_topk_layer)
    "glm52_":
        "GLM-5.2 shares DeepSeek Sparse Attention's top-k (IndexShare: the indexer runs on "
        "one layer in four and the next three reuse its keys); autopar's mla.sparse_index "
        "runs the indexer on every layer",
}


def read_recipes(path: Path | str = CSV) -> pd.DataFrame:
    """The MoE recipe table (``autopar.studies.recipe_table.read``)."""
    return read(path)


def cases(path: Path | str = CSV) -> list[tuple[str, "P.PublishedCase | P.Skip"]]:
    """Every recipe of the table as (recipe, case or skip), each execution
    checked as a user's file is."""
    from autopar.io.specs import load_execution

    out = []
    for i, row in read_recipes(path).iterrows():
        c = recipe_case(row)
        if isinstance(c, P.PublishedCase):
            ex = load_execution(c.execution, system=c.system, model=c.model,
                                source=f"{Path(path).name} row {i}")
            c = P.PublishedCase(c.model, c.system, ex, c.measured, c.label)
        out.append((row["recipe"], c))
    return out


def recipe_stage_blocks(stages: list[str], pp: int) -> list[int]:
    """Decoder blocks of each of the ``pp`` stages (virtual stage k on stage
    k % pp, Megatron's interleaved order)."""
    per = [0] * pp
    for k, st in enumerate(stages):
        per[k % pp] += st.count("t")
    return per


def pipeline_layout_fields(layout: str | None, num_blocks: int, pp: int, vp: int,
                           first: int | None = None, last: int | None = None,
                           emb: bool = False, loss: bool = False) -> dict | str:
    """autopar's split fields (``autopar.io.layouts.SPLIT_FIELDS``) that build
    the recipe's blocks per stage, or the reason none does.  A layout string
    is matched by its blocks per stage (autopar.model.pipeline.stage_split):
    even, balanced, with or without the embedding / loss counted; a layout
    none of those builds is kept as it is, an explicit ``pipeline_layout``
    (``autopar.model.pipeline.layout_chunks``), as is one that counts half
    the blocks (a hybrid pattern's mixer + MLP pairs, two blocks a decoder
    layer ``t``: ``autopar.io.layouts.decoder_layer_counts``)."""
    if pp <= 1:
        return {}
    if layout is None:
        if first or last:
            return {"first_stage_blocks": first or 0, "last_stage_blocks": last or 0}
        if emb or loss:
            return {"embedding_in_split": emb, "loss_in_split": loss}
        return {}
    stages = parse_layout(layout)
    if len(stages) != pp * vp:
        # (Megatron-Core@2a75ac1 transformer_config.py __post_init__ asserts
        # the virtual size the layout implies is the one set)
        return (f"pipeline layout of {len(stages)} virtual stages beside pipeline {pp} x "
                f"virtual {vp}: Megatron-Core refuses the two together")
    want = recipe_stage_blocks(stages, pp)
    if 2 * sum(want) == num_blocks:
        # two blocks a decoder layer: only the explicit layout says which
        return {"pipeline_layout": layout}
    if sum(want) != num_blocks:
        return f"pipeline layout of {sum(want)} blocks for a model of {num_blocks}"
    ceil = -(-num_blocks // pp)
    if want[:-1] == [ceil] * (pp - 1) and num_blocks % pp:
        # Calculon's split (autopar's default): ceil(blocks / pp) a stage,
        # the last stage lacking the rest
        return {}
    for balanced in (False, True):
        for e in (False, True):
            for lo in (False, True):
                got = stage_split(num_blocks, pp, vp, 0, 0, e, lo, balanced)
                if got == want:
                    f = {"embedding_in_split": e, "loss_in_split": lo}
                    if balanced:
                        f["pipeline_layout"] = "balanced"
                    return f
    for a in range(1, num_blocks):
        for b in range(1, num_blocks - a + 1):
            if stage_split(num_blocks, pp, vp, a, b, False, False, False) == want:
                return {"first_stage_blocks": a, "last_stage_blocks": b}
    # Megatron-Core's own layout (the typed layer checks it: load_execution)
    return {"pipeline_layout": layout}


def fine_offload_modules(cell) -> str:
    """The recipe's ``offload`` cell as ``activation_offload_modules``:
    ``fine_grained:<module>;<module>`` (Megatron-Core's
    ``fine_grained_activation_offloading`` with those ``offload_modules``, as
    the DeepSeek-V3 GB300 recipes set ``core_attn`` and ``attn_proj``; the
    dense table writes ``activations:<module>``) -> the
    field's value; empty -> "none"; anything else: the reason, starting
    "offloading".  A module autopar does not count
    (``OFFLOAD_MODULES_NOT_COUNTED``: ``attn_norm``, ``qkv_linear``,
    ``mlp_norm``) is left out: its activations are counted on the GPU, so
    the predicted peak errs high, never low.  (The Nemotron 3 Ultra recipes'
    ``fused_group_mlp`` is counted.)"""
    cell = str(cell).strip()
    if not cell or cell == "nan":
        return "none"
    kind, _, rest = cell.partition(":")
    # (the MoE table writes "fine_grained:", the dense one "activations:")
    if kind not in ("fine_grained", "activations"):
        return f"offloading {cell}: not fine-grained offloading of modules"
    value = offload_modules_value([m for m in rest.split(";")
                                   if m and m not in OFFLOAD_MODULES_NOT_COUNTED])
    if isinstance(value, tuple):
        return f"offloading {cell}: {value[1]}"
    return value


def recipe_case(row) -> "P.PublishedCase | P.Skip":
    label = str(row["recipe"])
    name = str(row["model"])
    if name in NOT_EXPRESSED:
        return P.Skip(NOT_EXPRESSED[name], label)
    for prefix, reason in NOT_EXPRESSED_RECIPES.items():
        if label.startswith(prefix):
            return P.Skip(reason, label)
    name = MODEL_FILES.get(name, name)
    if not (P.MODELS / f"{name}.json").is_file():
        return P.Skip(f"no model file for {name}", label)
    gpu = str(row["gpu"])
    sys_name = RECIPE_SYSTEMS.get(gpu)
    if sys_name is None:
        return P.Skip(f"no system file for {gpu}", label)
    x = extra(row)
    fsdp = megatron_fsdp(x)
    if isinstance(fsdp, str):
        return P.Skip(fsdp, label)
    precision = str(row["precision"])
    fp8 = RECIPE_FP8.get(precision)
    if fp8 is None:
        return P.Skip(f"precision {precision} is no autopar recipe", label)
    sy = with_cuda_graphs(without_wgrad_fusion(P.system(sys_name, FRAMEWORK), x),
                          row["cuda_graph"])
    seq = int_cell(row["seq"], 4096)
    changes = {"seq_size": seq}
    base = P.model(name)
    if "mtp_num_layers" in x and base.mtp is not None:
        changes["mtp"] = int_cell(x["mtp_num_layers"], 0)
    cap = x.get("model.moe_expert_capacity_factor", x.get("moe_expert_capacity_factor"))
    pad = x.get("model.moe_pad_expert_input_to_capacity",
                x.get("moe_pad_expert_input_to_capacity"))
    if cap not in (None, "", "None") and flag(pad) and base.moe is not None:
        # Megatron-Core@2a75ac1 token_dispatcher.py (MoEAlltoAllTokenDispatcher and the
        # flex dispatcher's _HybridEPManager): moe_pad_expert_input_to_capacity
        # (drop_and_pad) pads every expert's tokens to moe_utils.get_capacity,
        # tokens x top-k / experts x moe_expert_capacity_factor: autopar's
        # moe.capacity_factor (the Super H100 recipe: 1.10).  Without the padding
        # the factor only drops tokens above it, which balanced routing does not reach.
        try:
            factor = float(cap)
        except ValueError:
            return P.Skip(f"moe_expert_capacity_factor {cap!r} is no number", label)
        changes["moe"] = dataclasses.replace(base.moe, capacity_factor=factor)
    if "vocab_size" in x:
        # the recipe's own vocabulary (gpt-oss 20B's perf recipes: 128256)
        changes["vocab_size"] = int_cell(x["vocab_size"])
    m = P.model(name, **changes)
    n = int_cell(row["n_gpus"])
    tp, pp, cp = int_cell(row["tp"], 1), int_cell(row["pp"], 1), int_cell(row["cp"], 1)
    vp = int_cell(row["vp"], 1)
    layout = x.get("pipeline_model_parallel_layout")
    if layout and pp > 1 and not row["vp"] and len(parse_layout(layout)) % pp == 0:
        # A layout sets the virtual stages where the recipe does not
        # (Megatron-Core@2a75ac1 transformer_config.py ``__post_init__``:
        # virtual_pipeline_model_parallel_size from the layout; a different
        # one set beside it fails its assertion)
        vp = len(parse_layout(layout)) // pp
    modules = fine_offload_modules(row["offload"])
    if isinstance(modules, str) and modules.startswith("offloading"):
        return P.Skip(modules, label)
    ep, etp = int_cell(row["ep"], 1), int_cell(row["etp"], 1)
    mbs, gbs = int_cell(row["mbs"], 1), int_cell(row["gbs"])
    if n is None or gbs is None or n % (tp * pp * cp):
        return P.Skip(f"{n} GPUs are no multiple of tp x pp x cp = {tp * pp * cp}", label)
    dp = n // (tp * pp * cp)
    if (tp * dp * cp) % (ep * etp):
        # (NVIDIA/Megatron-LM@2a75ac1 megatron/core/parallel_state.py
        # initialize_model_parallel: the world must divide by
        # expert_tensor x expert x pipeline)
        return P.Skip(f"expert parallel {ep} x expert tensor {etp} x pipeline {pp} does not "
                      f"divide the {n} GPUs of the recipe's name: Megatron-Core cannot build "
                      f"it on them (parallel_state.initialize_model_parallel)", label)
    sp = flag(row["sp"]) if row["sp"] else tp > 1
    # recompute
    gran = str(row["recompute_granularity"] or "")
    mods = str(row["recompute_modules"] or "")
    recompute, discard = "none", {}
    if gran == "full":
        if str(row["recompute_method"]) == "block" and int_cell(row["recompute_num_layers"]):
            return P.Skip("full recompute of some blocks (block method) not mapped", label)
        recompute = "full"
    elif gran == "selective":
        mod_list = ["core_attn"] if mods == "" else ([] if mods == "none" else mods.split(";"))
        kept = tuple(sorted(mm for mm in mod_list if mm in ("core_attn", "mlp")))
        if kept:
            recompute = RECOMPUTE_CHOICE.get(kept)
            if recompute is None:
                return P.Skip(f"selective recompute of {' and '.join(kept)} together", label)
        discard = {f"recompute_{mm}": True for mm in ("moe_act", "mla_up_proj") if mm in mod_list}
    ddp_fp32 = x.get("ddp.grad_reduce_in_fp32")
    fp32_grads = flag(ddp_fp32) if ddp_fp32 is not None else None
    dist_opt = not (x.get("ddp.use_distributed_optimizer") == "false")
    dp_overlap = x.get("ddp.overlap_grad_reduce") != "false"
    cp_comm = x.get("cp_comm_type", "p2p")      # Megatron-Core's default: p2p
    if cp > 1 and cp_comm not in ("p2p", "a2a", "allgather"):
        return P.Skip(f"context parallel communication {cp_comm} is not modelled", label)
    ex = P.megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp,
                              cp_comm=cp_comm if cp > 1 else "p2p",
                              recompute=recompute, sp=sp, dist_opt=dist_opt,
                              tp_overlap=flag(x.get("overlap.tp_comm_overlap")) and sp,
                              dp_overlap=dp_overlap, fp8=fp8, fp32_grads=fp32_grads,
                              fsdp=fsdp)
    P.te_gathers_again(ex)
    ex.update(discard)
    disp = str(row["dispatcher"] or "alltoall")
    dispatcher = "deepep" if disp.startswith("flex") else disp
    ex.update(expert_fields(sy, tp=tp, ep=ep, etp=etp, dispatcher=dispatcher))
    ex["moe_overlap"] = flag(x.get("overlap.overlap_moe_expert_parallel_comm")) and ep * etp > 1
    opt = x.get("opt.optimizer", "adam")
    if opt.endswith("muon"):
        ex["optimizer"] = "muon"
    # the precision-aware optimizer's bf16 moments (the DeepSeek-V3 recipes)
    moments = moment_bytes(x)
    if isinstance(moments, str):
        return P.Skip(moments, label)
    if moments != 4:
        ex["optimizer_moment_bytes"] = moments
    if opt.startswith("dist_") and dp * cp > 1:
        # "dist_muon" is Muon under Megatron-Core's layer-wise distributed
        # optimizer (NVIDIA/Megatron-LM@2a75ac1, Bridge's pin,
        # megatron/core/optimizer/__init__.py: "dist_*" -> the bare name with
        # use_layer_wise_distributed_optimizer; layer_wise_optimizer.py
        # LayerWiseDistributedOptimizer: each data-parallel rank keeps the
        # state of its share of the layers) whatever ddp.use_distributed_optimizer
        # says: the state sharded over the data-parallel ranks, the
        # gradients whole.
        ex.update(optimizer_sharding=True, unsharded_grads=True)
    inst = int_cell(x.get("ddp.num_distributed_optimizer_instances"), 1)
    if fsdp and inst > 1:
        # Megatron-FSDP's hybrid sharding: each of the instances shards
        # over its own data_par x context_par / instances ranks
        ex["sharding_group"] = dp // inst
        ex["optimizer_outer_sharding"] = outer_optimizer_sharding(x)
    if fp8 != "none" and flag(x.get("mp.first_last_layers_bf16")):
        ex["bf16_first_blocks"] = int_cell(x.get("mp.num_layers_at_start_in_bf16"), 0)
        ex["bf16_last_blocks"] = int_cell(x.get("mp.num_layers_at_end_in_bf16"), 0)
    split = pipeline_layout_fields(
        layout, m.num_blocks, pp, vp,
        int_cell(x.get("num_layers_in_first_pipeline_stage")),
        int_cell(x.get("num_layers_in_last_pipeline_stage")),
        flag(x.get("account_for_embedding_in_pipeline_split")),
        flag(x.get("account_for_loss_in_pipeline_split")))
    if isinstance(split, str):
        return P.Skip(split, label)
    ex.update(split)
    if modules != "none":
        ex["activation_offload_modules"] = modules
    return P.PublishedCase(m, sy, ex, {}, label)
