"""Megatron-Bridge's performance recipes as layouts autopar must predict to fit.

Every function of Megatron-Bridge's ``src/megatron/bridge/perf_recipes/<family>/
<gpu>/*.py`` (NVIDIA-NeMo/Megatron-Bridge@067f987) is a layout NVIDIA ran as a
benchmark, so each one fits on its GPUs.  ``benchmarks/write_recipe_table.py``
reads them into ``autopar/data/recipes/bridge_dense.csv`` (one row per recipe;
the dense and hybrid families here, the MoE ones in
``autopar.studies.recipes_moe``); ``recipe_case(row)`` turns a row into a
``published_base.PublishedCase`` (no measured figures: ``measured`` = {},
feasibility only) under ``frameworks/megatron-bridge.json``, or a ``Skip``
naming what autopar cannot express; ``predict`` evaluates them (``autopar
validate recipes``).

What a row sets, and how it maps (what it leaves empty: the framework file's
defaults, Bridge's recipe defaults):

* ``precision``: ``bf16`` -> no fp8 recipe; ``fp8_cs`` / ``fp8_ds`` ->
  ``tensorwise``; ``fp8_mx`` -> ``mxfp8``; ``nvfp4`` -> ``nvfp4`` (Bridge
  ``training/mixed_precision.py``; the performance recipes' ``_perf_precision``
  turns the first/last BF16 layers off).
* ``recompute_granularity`` ``full`` -> ``full`` (``recompute_num_layers``
  with ``block``: ``recompute_layers``, that many of each model chunk:
  ``stage_recompute_layers``; ``uniform`` recomputes every block);
  ``selective`` with Megatron-Core's modules ``core_attn`` -> ``attn_only``,
  ``mlp`` -> ``mlp_only``; other modules (``layernorm``, ``moe_act``,
  ``mla_up_proj``, ...) and combinations: Skip.
* ``offload``: ``cpu_activations:layers=N`` (Megatron-Core's
  ``cpu_offloading`` of the first N layers' activations) ->
  ``activation_offload_blocks`` N (``cpu_offload_layers``); other
  offloading: Skip (the rows that offload modules, fine-grained, are MoE
  rows: ``recipes_moe.fine_offload_modules``).
* ``model.gradient_accumulation_fusion`` False: no TE dummy weight
  gradients (``recipe_table.without_wgrad_fusion``).
* ``extra``: ``ddp.use_megatron_fsdp`` with ``optim_grads_params`` ->
  ``weight_sharding``; ``ddp.num_distributed_optimizer_instances`` ->
  ``sharding_group`` (with ``outer_dp_sharding_strategy`` optim,
  ``optimizer_outer_sharding``); ``grad_reduce_in_fp32`` -> ``fp32_grads``;
  ``ddp.overlap_*`` -> the overlaps; ``comm_overlap.tp_comm_overlap`` ->
  ``tensor_par_overlap: ring`` (with sequence parallelism);
  ``account_for_embedding/loss_in_pipeline_split`` -> ``embedding_in_split``
  / ``loss_in_split``; a ``pipeline_model_parallel_layout``: the split
  autopar builds with the same blocks per stage, else the layout itself as
  an explicit ``pipeline_layout`` (``recipes_moe.pipeline_layout_fields``,
  shared with the MoE table); ``peft=lora`` with
  ``peft.target_modules=linear_qkv`` -> ``adapter: lora``, ``qkv`` (not set:
  Bridge's default, every linear layer: ``all``), rank ``peft.dim``
  (the 70B recipes: 16; Bridge ``peft/lora.py`` ``LoRA.dim`` default 32).
* The vocabulary: the model's own where its provider presets one (the
  Llama recipes' Hugging Face config: 128256, used unpadded: Bridge
  ``training/setup.py _validate_and_set_vocab_size`` overrides the recipe's
  ``should_pad_vocab``), else the tokenizer's (``tokenizer.vocab_size``; the
  Nemotron-H recipes' NullTokenizer 32000) padded to a multiple of 128 x
  tensor_par (``padded_vocab``).
* ``mixed_precision.fp8_param_gather`` / ``fp4_param_gather``: the fp8 /
  fp4 weights kept as the only copy of the block's linear weights
  (frameworks/megatron-bridge.json ``fp8_primary_weights``, as Bridge's fp8
  and fp4 precision recipes set it); a recipe that turns it off gets the
  count with the working-precision copy (``primary_weights_off``).
* ``cuda_graph``: the memory a captured graph keeps beyond eager execution
  (``recipe_table.cuda_graph_mode`` -> frameworks/megatron-bridge.json's
  ``memory_overhead.cuda_graphs`` for the row); its time is not modelled
  (docs/validation.md, "CUDA graphs and TE userbuffers: memory, counted").
  ``comm_overlap.tp_comm_overlap`` also holds TE's userbuffers
  (``memory_overhead.te_userbuffers``; the overlap config's output
  projections, ``recipe_table.userbuffers_rs``).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd

from autopar.io.errors import SpecError
from autopar.io.specs import FP8_MATRIX, load_execution
from autopar.studies import published_base as P
from autopar.studies import recipes_moe
from autopar.studies.recipe_table import (CSV, CSVS, FP8, FRAMEWORK, SELECTIVE,  # noqa: F401
                                          SYSTEMS, extra, flag, int_cell, megatron_fsdp,
                                          moment_bytes, outer_optimizer_sharding, read,
                                          with_cuda_graphs,
                                          with_userbuffers_rs, without_wgrad_fusion)

# The dense and hybrid models of autopar's models/ the recipes name.
DENSE_MODELS = ("llama3-8B", "llama3-70B", "llama3-405B", "nemotron-h-8B", "nemotron-h-47B",
                "nemotron-h-56B")
# Megatron's make_vocab_size_divisible_by (Bridge's GPT / hybrid providers: 128).
VOCAB_DIVISOR = 128
# Bridge's LoRA default rank (src/megatron/bridge/peft/lora.py LoRA.dim).
LORA_DIM = 32
# LoRA target modules -> autopar's adapter_targets; "" (not set): Bridge's
# default, every linear layer of the block (LoRA.target_modules: linear_qkv,
# linear_proj, linear_fc1, linear_fc2).
LORA_TARGETS = {"": "all", "linear_qkv": "qkv",
                "linear_qkv;linear_proj;linear_fc1;linear_fc2": "all"}


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of 128 x tensor_par
    (NVIDIA/Megatron-LM megatron/training/tokenizer/tokenizer.py
    ``_vocab_size_with_padding``; Bridge's providers the same,
    src/megatron/bridge/models/gpt_provider.py ``calculate_padded_vocab_size``
    under ``should_pad_vocab``)."""
    m = VOCAB_DIVISOR * tp
    return int(math.ceil(vocab / m) * m)


def stage_recompute_layers(n: int, blocks: int, pp: int, vp: int) -> int:
    """autopar's ``recompute_layers`` (blocks of a pipeline stage recomputed)
    for Megatron-Core's ``recompute_method: block`` with
    ``recompute_num_layers`` = ``n``: Megatron recomputes the first ``n``
    layers of each model chunk (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/recompute.py ``checkpointed_forward``: the ``block`` loop
    runs over ``self.num_layers_per_pipeline_rank``, which
    transformer_block.py sets to ``len(self.layers)``, the layers of the one
    chunk it builds), so with ``vp`` chunks a stage recomputes ``n * vp``
    blocks; ``n`` at or above a chunk's blocks: every block (0)."""
    if n <= 0:
        return 0
    per_chunk = blocks // max(pp * vp, 1)
    if n >= per_chunk:
        return 0
    return n * vp


def primary_weights_off(row, fp8: str) -> bool:
    """Whether the recipe turns off keeping its fp8 / fp4 weights as the only
    copy (``mixed_precision.fp8_param_gather`` / ``fp4_param_gather`` False
    under that recipe), where frameworks/megatron-bridge.json has it on."""
    x = extra(row)
    key = "mixed_precision.fp4_param_gather" if fp8 == "nvfp4" else \
        "mixed_precision.fp8_param_gather"
    return fp8 != "none" and x.get(key) == "False"


def cpu_offload_layers(cell) -> "int | str":
    """The recipe's ``offload`` cell as autopar's ``activation_offload_blocks``:
    ``cpu_activations:layers=N`` (Megatron-Core's ``cpu_offloading`` with
    ``cpu_offloading_num_layers`` N, ``cpu_offloading_weights`` False, as
    the Llama recipes set it) -> N; empty -> 0; anything else (weights,
    fine-grained offloading of modules): the reason autopar cannot express
    it."""
    cell = str(cell).strip()
    if not cell or cell == "nan":
        return 0
    kind, _, rest = cell.partition(":")
    if kind == "cpu_activations" and rest.startswith("layers="):
        n = int_cell(rest[len("layers="):], 0)
        if n > 0:
            return n
    return f"offloading {cell}: autopar offloads the activations of whole blocks " \
           "(activation_offload_blocks) or all of them"


def is_moe(row) -> bool:
    return bool(str(row["ep"]).strip()) or str(row["model"]) not in DENSE_MODELS


def label(row) -> str:
    return str(row["recipe"])


def recipe_case(row) -> "P.PublishedCase | P.Skip":
    """One recipe row as a case to predict (feasibility only) or a Skip."""
    lab = label(row)
    if is_moe(row):
        return recipes_moe.recipe_case(row)
    sys_name = SYSTEMS.get(str(row["gpu"]))
    if sys_name is None:
        return P.Skip(f"no system file for {row['gpu']}", lab)
    x = extra(row)
    precision = str(row["precision"])
    if precision not in FP8:
        return P.Skip(f"precision {precision!r} not mapped", lab)
    # Recompute.
    gran, mods = str(row["recompute_granularity"]), str(row["recompute_modules"])
    recompute, layers = "none", 0
    if gran == "full":
        recompute = "full"
        if str(row["recompute_method"]) == "block":
            layers = int_cell(row["recompute_num_layers"], 0)
    elif gran == "selective":
        key = tuple(m for m in mods.split(";") if m) or ("core_attn",)
        if key not in SELECTIVE:
            return P.Skip(f"selective recompute of {'+'.join(key)}: autopar recomputes the "
                          "attention core or the MLP", lab)
        recompute = SELECTIVE[key]
    offload_blocks = cpu_offload_layers(row["offload"])
    if isinstance(offload_blocks, str):
        return P.Skip(offload_blocks, lab)
    layout = x.get("model.pipeline_model_parallel_layout", "")
    layout = None if layout in ("", "None") else layout
    n, tp, pp, cp = (int_cell(row["n_gpus"]), int_cell(row["tp"], 1), int_cell(row["pp"], 1),
                     int_cell(row["cp"], 1))
    vp = int_cell(row["vp"], 1)
    if vp > 1 and pp == 1:
        vp = 1
    if layout and pp > 1 and not row["vp"]:
        # the layout sets the virtual stages (as in recipes_moe.recipe_case)
        vp = max(len(recipes_moe.parse_layout(layout)) // pp, 1)
    if n % (tp * pp * cp):
        return P.Skip(f"{n} GPUs not divisible by tp*pp*cp = {tp * pp * cp}", lab)
    dp = n // (tp * pp * cp)
    mbs, gbs, seq = int_cell(row["mbs"], 1), int_cell(row["gbs"]), int_cell(row["seq"])
    if gbs % (dp * mbs):
        # Megatron refuses it (global batch = micro-batch x data_par x micro-batches).
        return P.Skip(f"global batch {gbs} not divisible by micro-batch {mbs} x data_par {dp} "
                      f"on {n} GPUs: the recipe cannot run as written", lab)
    m = P.model(str(row["model"]), seq_size=seq)
    if x.get("model_vocab") == "tokenizer":
        # No vocabulary preset by the model: the tokenizer's, padded.
        vocab = int_cell(x.get("tokenizer.vocab_size"), m.vocab_size)
        m = dataclasses.replace(m, vocab_size=padded_vocab(vocab, tp))
    sy = without_wgrad_fusion(P.system(sys_name, FRAMEWORK), x)
    if primary_weights_off(row, FP8[precision]):
        sy = dataclasses.replace(sy, memory_overhead=dataclasses.replace(
            sy.memory_overhead, fp8_primary_weights=False))
    sy = with_userbuffers_rs(with_cuda_graphs(sy, row["cuda_graph"]), x)
    fsdp = megatron_fsdp(x)
    if isinstance(fsdp, str):
        return P.Skip(fsdp, lab)
    grads32 = not (x.get("ddp.grad_reduce_in_fp32") == "False"
                   or x.get("mixed_precision.grad_reduce_in_fp32") == "False")
    sp = flag(row["sp"])
    ex = P.megatron_execution(
        sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp, recompute=recompute,
        sp=sp, tp_overlap=flag(x.get("comm_overlap.tp_comm_overlap")) and sp,
        dist_opt=x.get("ddp.use_distributed_optimizer", "True") == "True" or fsdp,
        dp_overlap=x.get("ddp.overlap_grad_reduce", "True") == "True",
        fp8=FP8[precision], fsdp=fsdp, fp32_grads=grads32)
    if x.get("ddp.overlap_param_gather") == "False":
        ex["param_gather_overlap"] = False
    # the precision-aware optimizer's bf16 moments
    moments = moment_bytes(x)
    if isinstance(moments, str):
        return P.Skip(moments, lab)
    if moments != 4:
        ex["optimizer_moment_bytes"] = moments
    P.te_gathers_again(ex)
    ex["recompute_layers"] = (stage_recompute_layers(layers, m.num_blocks, pp, vp)
                              if recompute == "full" else 0)
    if offload_blocks:
        ex["activation_offload_blocks"] = offload_blocks
    inst = int_cell(x.get("ddp.num_distributed_optimizer_instances"), 1)
    if inst > 1:
        ex["sharding_group"] = dp * cp // inst
        ex["optimizer_outer_sharding"] = bool(fsdp) and outer_optimizer_sharding(x)
    ex["embedding_in_split"] = flag(x.get("model.account_for_embedding_in_pipeline_split")) \
        and pp > 1
    ex["loss_in_split"] = flag(x.get("model.account_for_loss_in_pipeline_split")) and pp > 1
    if layout:
        # Megatron-Core's pipeline_model_parallel_layout: the split autopar
        # builds for it, or the layout itself (one mapper for both tables)
        split = recipes_moe.pipeline_layout_fields(layout, m.num_blocks, pp, vp)
        if isinstance(split, str):
            return P.Skip(split, lab)
        ex.update({"embedding_in_split": False, "loss_in_split": False, **split})
    if x.get("peft") in ("LoRA", "lora"):
        targets = x.get("peft.target_modules", "")
        if targets not in LORA_TARGETS:
            return P.Skip(f"LoRA on {targets}", lab)
        ex.update(adapter="lora", adapter_targets=LORA_TARGETS[targets],
                  adapter_rank=int_cell(x.get("peft.dim"), LORA_DIM))
    return P.PublishedCase(m, sy, ex, {}, lab)


def mfu(stats: dict, system_, fp8_recipe: str) -> float:
    """Model FLOPs utilisation against the peak of the datatype the recipe's
    GEMMs run in (bf16, fp8, mxfp8 or nvfp4; the system's ``matrix``): the
    model's ``total_efficiency`` (useful FLOPs without recompute, over the
    BF16 peak and the step time; hybrid blocks counted as they are) scaled
    to that peak.  Above 1 cannot be; below 0.15 or above 0.75 is
    implausible for a benchmark recipe (docs/validation.md)."""
    bf16 = system_.matrix["bfloat16"].tflops
    dt = FP8_MATRIX.get(fp8_recipe, "bfloat16")       # the rate the model runs them at
    peak = system_.matrix[dt].tflops if dt in system_.matrix else bf16
    return float(stats["total_efficiency"]) * bf16 / peak


def predict(family: str | None = None, partial: bool = False,
            paths=CSVS) -> pd.DataFrame:
    """One row per recipe: status (predicted | skipped), reason, fits,
    predicted peak GiB per GPU and the system's capacity, tokens/s/GPU and
    MFU; with ``partial``: whether some completion of the fields the recipe
    leaves to the framework's defaults (``UNSTATED``) fits."""
    from autopar.model import evaluate_one
    from autopar.model.evaluate import reason_text

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    frames = [read(p).assign(_file=Path(p).name) for p in paths]
    whole = pd.concat(frames, ignore_index=True)
    frame = whole
    if family:
        frame = whole[whole["family"] == family]
        if not len(frame):
            raise SpecError("command line", "--family",
                            f"no recipes of family {family!r} (one of: "
                            f"{', '.join(sorted(whole['family'].unique()))})")
    recs = []
    for _, row in frame.iterrows():
        c = recipe_case(row)
        base = {"recipe": row["recipe"], "family": row["family"], "model": row["model"],
                "gpu": row["gpu"], "precision": row["precision"]}
        if isinstance(c, P.Skip):
            recs.append({**base, "status": "skipped", "reason": c.reason})
            continue
        ex = load_execution(c.execution, system=c.system, model=c.model,
                              source=f"{row['_file']}: {c.label}")
        s = evaluate_one(c.model, c.system, ex)
        fits = bool(s["feasible"])
        tok = s["sample_rate"] * c.model.seq_size / ex["num_procs"] if fits else np.nan
        rec = {**base, "status": "predicted", "fits": fits,
               "reason": "" if fits else str(reason_text({k: np.array([v]) for k, v in s.items()},
                                                         c.system)[0]),
               "peak_gib": s["proc_mem_tier1_cap_req"] / P.GIB,
               "capacity_gib": c.system.mem1.GiB,
               "tokens_per_s_per_gpu": tok,
               "mfu": mfu(s, c.system, c.execution.get("fp8_recipe", "none")) if fits else np.nan}
        if partial:
            if str(row["recompute_granularity"]):      # the recipe states it
                rec.update(fits_any=fits, completion="(recipe states every searched field)")
            else:
                rec.update(_completions(c))
        recs.append(rec)
    cols = ["recipe", "family", "model", "gpu", "precision", "status", "reason", "fits",
            "peak_gib", "capacity_gib", "tokens_per_s_per_gpu", "mfu"]
    if partial:
        cols += ["fits_any", "completion"]
    return pd.DataFrame(recs).reindex(columns=cols)


# Fields a recipe may leave to Bridge's defaults, searched by ``--partial``
# where it does (recompute: the base recipes set None, no recompute).
UNSTATED = {"activation_recompute": ("none", "attn_only", "mlp_only", "full")}


def _completions(case) -> dict:
    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS
    from autopar.search.partial import complete

    ex = case.execution
    stated = {f: ex.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS
              if f not in UNSTATED and (f in ex or f in EXT_DEFAULTS)}
    res = complete(case.model, case.system, stated, tuple(UNSTATED), UNSTATED,
                   source=f"recipe {case.label}", options_source="autopar.studies.recipes")
    chosen = ", ".join(f"{f}={v}" for f, v in res.best.chosen.items()) if res.best else res.reason
    return {"fits_any": res.fits, "completion": chosen or ""}


def summary_line(rows: pd.DataFrame) -> str:
    pred = rows[rows.status == "predicted"]
    fits = int(pred.fits.astype(bool).sum()) if len(pred) else 0
    return (f"{fits} of {len(rows)} recipes predicted to fit ({len(pred)} predicted, "
            f"{len(rows) - len(pred)} skipped)")

