"""Published training measurements: one registry of tables, one report.

The registry and what row functions share are ``published_base``; the
dense tables are registered here, the mixture-of-experts rows' functions are
``published_moe``, llm-foundry's and NeMo-Launcher's tables
``published_foundry``.

Each published table (measured training throughput with the layouts that
produced it; the package's own ``autopar/data/published/``, written from the
published figures with their sources) is registered here as a
``Table``: its CSV file, which rows it keeps, and a row function that turns
one CSV row into what autopar needs to predict it -- a model spec, a system
spec, an execution dict and the measured figures -- or says why the row is
skipped (``Skip``: a dimension autopar does not model yet, a figure the table
does not give).  Skipped rows are listed with their reason, never dropped.

Settings a table does not state take the documented defaults of that
framework's recipes (``docs/validation.md`` says which, per table).  What the
framework holds and does beyond the model (memory and time records) comes
from the named framework file of ``frameworks/`` each row function asks for
(``system(name, framework)``); the system files hold the hardware.

``report(table)`` predicts every row and summarises per table: published
layouts predicted feasible, median and worst |error| of tokens/s/GPU, where
the published layout ranks among autopar's own best layouts for the same
case (model, system, GPUs, global batch), and the peak-memory error where
the table measured it.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import pandas as pd

from autopar.io.errors import SpecError
from autopar.io.specs import ModelSpec, SystemSpec
from autopar.studies.published_base import (  # noqa: F401  (the registry, read here too)
    FRAMEWORKS, GIB, MCORE_RECOMPUTE, MODELS, NEMO1, NEMO2_2504, PACKAGED, PublishedCase,
    SIMUMAX_FRAMEWORK, SYSTEMS, Skip, TABLES, Table, cases, flops_per_token, gpt_model, te_gathers_again,
    int_or_none, megatron_execution, model, number_or_none, published_dir, read_table,
    shared_reference,
    register, system, system_attention_at, tiers)
from autopar.studies import published_foundry  # noqa: F401  (registers its tables)
from autopar.studies import published_finetune  # noqa: F401  (registers its table)
from autopar.studies import published_release  # noqa: F401  (registers its table)
from autopar.studies.published_moe import bridge_qwen3, simumax_moe


def predict(table: Table, rank: bool = True, space=None, partial: bool = False,
            options: dict | None = None, transform=None) -> pd.DataFrame:
    """One row per kept CSV row: label, status (predicted | skipped), reason,
    measured and predicted tokens/s/GPU and peak memory, errors, feasibility,
    and (with ``rank``) the published layout's rank among autopar's layouts.
    ``transform(case) -> case`` changes each case before it is predicted
    (``autopar.studies.crossval``: a constant set back to its unfitted value).

    With ``partial``, each row is also predicted over every completion of the
    table's unstated fields (``Table.unstated``; ``options`` replaces their
    values per field, e.g. a framework's options): ``feasible_any`` (some
    completion fits), the counts, the best completion's tokens/s/GPU, error
    and tier-1 memory, and the fields it chose (``chosen``)."""
    from autopar.model import evaluate_one

    recs = []
    for idx, c in cases(table):
        if transform is not None and isinstance(c, PublishedCase):
            c = transform(c)
        if isinstance(c, Skip):
            recs.append({"row": idx, "label": c.label, "status": "skipped",
                         "reason": c.reason})
            continue
        ex = c.execution
        s = evaluate_one(c.model, c.system, ex)
        n = ex["num_procs"]
        tok = c.measured["tokens_per_s_per_gpu"]
        pred_tok = (s["sample_rate"] * c.model.seq_size / n) if s["feasible"] else np.nan
        rec = {"row": idx, "label": c.label, "status": "predicted",
               "reason": "" if s["feasible"] else _reason(s, c.system),
               "feasible": bool(s["feasible"]),
               "tokens_per_s_per_gpu": tok, "pred_tokens_per_s_per_gpu": pred_tok,
               "tok_error": (pred_tok - tok) / tok,
               "peak_mem_gib": c.measured.get("peak_mem_gib", np.nan),
               "pred_mem_gib": _predicted_memory(c, s) / GIB}
        rec["mem_error"] = (rec["pred_mem_gib"] - rec["peak_mem_gib"]) / rec["peak_mem_gib"]
        if rank and s["feasible"]:
            rec.update(_rank(table, c, s["sample_rate"], space))
        if partial:
            rec.update(_completions(table, c, options))
        recs.append(rec)
    cols = ["row", "label", "status", "reason", "feasible", "tokens_per_s_per_gpu",
            "pred_tokens_per_s_per_gpu", "tok_error", "peak_mem_gib", "pred_mem_gib",
            "mem_error", "rank", "layouts", "best_over_published"]
    if partial:
        cols += list(PARTIAL_COLUMNS)
    return pd.DataFrame(recs).reindex(columns=cols)


def _predicted_memory(case: PublishedCase, s: dict) -> float:
    """The predicted tier-1 need to compare with the case's measured peak:
    the fuller stage's (``proc_mem_tier1_cap_req``), or the last pipeline
    stage's where the measurement is the last rank's
    (``measured["mem_stage"] == "last"``: Megatron-LM logs memory from rank
    world_size - 1 only, megatron/training/global_vars.py
    ``_set_tensorboard_writer``), by ``autopar.model.memory.stage_needs``."""
    if case.measured.get("mem_stage") != "last":
        return s["proc_mem_tier1_cap_req"]
    from autopar.io.layouts import to_columns
    from autopar.model import STATS, evaluate_columns
    from autopar.model.memory import MEMORY_PARTS, stage_needs
    out = evaluate_columns(case.model, case.system, to_columns([case.execution]),
                           stats=tuple(STATS) + tuple(MEMORY_PARTS))
    return float(stage_needs(out, case.system.memory_overhead)[1][0])


PARTIAL_COLUMNS = ("feasible_any", "completions", "feasible_completions",
                   "best_pred_tokens_per_s_per_gpu", "best_tok_error", "best_pred_mem_gib",
                   "chosen")


def partial_options(table: Table, options: dict | None = None) -> dict:
    """The values each unstated field of ``table`` is searched over: the
    table's own (``Table.unstated``), or ``options``' where it names the
    field."""
    options = options or {}
    return {f: options.get(f, v) for f, v in table.unstated.items()}


def _completions(table: Table, case: PublishedCase, options: dict | None) -> dict:
    """A published row predicted over the completions of its table's unstated
    fields (``autopar.search.partial.complete``)."""
    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS
    from autopar.search.partial import complete

    opts = partial_options(table, options)
    ex = case.execution
    stated = {f: ex.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS
              if f not in opts and (f in ex or f in EXT_DEFAULTS)}
    res = complete(case.model, case.system, stated, tuple(opts), opts,
                   source=f"{table.csv}: {case.label}", options_source=f"table {table.name}")
    tok = case.measured["tokens_per_s_per_gpu"]
    out = {"feasible_any": res.fits, "completions": res.completions,
           "feasible_completions": res.feasible, "best_pred_tokens_per_s_per_gpu": np.nan,
           "best_tok_error": np.nan, "best_pred_mem_gib": np.nan, "chosen": ""}
    if res.best is not None:
        pred = res.best.sample_rate * case.model.seq_size / ex["num_procs"]
        out.update(best_pred_tokens_per_s_per_gpu=pred, best_tok_error=(pred - tok) / tok,
                   best_pred_mem_gib=res.best.mem_gib,
                   chosen=", ".join(f"{f}={v}" for f, v in res.best.chosen.items()))
    elif res.reason:
        out["chosen"] = res.reason
    return out


def _reason(s: dict, system_: SystemSpec) -> str:
    from autopar.model.evaluate import reason_text
    out = {k: np.array([v]) for k, v in s.items()}
    return str(reason_text(out, system_)[0])


# Parameters the ranking search varies around a published case (the rest are
# held at the published layout's values).
RANK_PARAMS = ("tensor_par", "pipeline_par", "context_par", "pipeline_interleaving",
               "microbatch_size", "activation_recompute")
RANK_LIMIT = 2_000_000


def rank_space(table: Table, case: PublishedCase) -> dict:
    """The search space a published layout is ranked in: the parallelism sizes,
    interleaving, micro-batch and recompute searched (every value the rules
    allow, micro-batches up to 16); the framework's other options fixed at the
    published layout's; network tiers as the framework places them."""
    ex = case.execution
    params = {p: "derived" for p in RANK_PARAMS}
    params["microbatch_size"] = {"max": 16}
    params["pipeline_interleaving"] = {"max": 8}
    params.update({"tensor_par_net": "derived", "pipeline_par_net": "derived",
                   "data_par_net": "derived", "context_par_net": "derived"})
    fixed = {}
    from autopar.search.space import PARAMS
    for p in PARAMS:
        if p not in params:
            fixed[p] = ex[p] if p in ex else _default(p)
    params.update(table.search_space)
    for p in table.search_space:
        fixed.pop(p, None)
    return {"name": f"published-{table.name}", "batch_policy": "fixed",
            "params": params, "fixed": fixed}


def _default(p):
    from autopar.io.layouts import EXT_DEFAULTS
    return EXT_DEFAULTS[p]


def _rank(table: Table, case: PublishedCase, rate: float, space=None) -> dict:
    """Rank of the published layout (1 = autopar finds nothing faster) among
    the feasible layouts of the ranking space, by predicted throughput."""
    from autopar.model import evaluate_columns
    from autopar.search.space import Case, load_space

    ex = case.execution
    sp = load_space(space or rank_space(table, case), source=f"published:{table.name}")
    dt = ex["datatype"]
    c = Case(case.model, case.system, ex["num_procs"], ex["batch_size"], dt,
             batch_policy="fixed")
    total = sp.size(c)
    if total > RANK_LIMIT:
        return {"rank": np.nan, "layouts": total, "best_over_published": np.nan}
    better, feasible, best = 0, 0, 0.0
    for cols in sp.enumerate(c, chunk_size=1 << 16):
        out = evaluate_columns(case.model, case.system, cols, stats=("sample_rate",))
        r = out["sample_rate"][out["feasible"]]
        feasible += len(r)
        better += int((r > rate * (1 + 1e-9)).sum())
        if len(r):
            best = max(best, float(r.max()))
    return {"rank": better + 1, "layouts": feasible,
            "best_over_published": best / rate if rate > 0 else np.nan}


def summarize(rows: pd.DataFrame) -> dict:
    """One summary of a table's predictions."""
    pred = rows[rows.status == "predicted"]
    ok = pred[pred.feasible.astype(bool)] if len(pred) else pred
    err = ok.tok_error.abs() if len(ok) else pd.Series(dtype=float)
    mem = ok.mem_error.abs().dropna() if len(ok) else pd.Series(dtype=float)
    ranks = ok["rank"].dropna() if len(ok) else pd.Series(dtype=float)
    extra = {}
    if "feasible_any" in rows:
        # partial layouts: rows some completion fits, the best completion's error
        fit = pred[pred.feasible_any.astype(bool)] if len(pred) else pred
        best = fit.best_tok_error.abs() if len(fit) else pd.Series(dtype=float)
        extra = {"feasible_any": len(fit),
                 "median_abs_best_tok_error": float(best.median()) if len(best) else np.nan,
                 "worst_abs_best_tok_error": float(best.max()) if len(best) else np.nan}
    return {"rows": len(rows), "skipped": int((rows.status == "skipped").sum()),
            "predicted": len(pred), "feasible": int(pred.feasible.astype(bool).sum()) if len(pred) else 0,
            "median_abs_tok_error": float(err.median()) if len(err) else np.nan,
            "worst_abs_tok_error": float(err.max()) if len(err) else np.nan,
            "median_abs_mem_error": float(mem.median()) if len(mem) else np.nan,
            "median_rank": float(ranks.median()) if len(ranks) else np.nan,
            "rank1": int((ranks == 1).sum()) if len(ranks) else 0, **extra}


def report(names=None, rank: bool = True, partial: bool = False,
           options: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """Predictions of the named tables (all when None): the summary table and
    the per-row tables by name (``partial``, ``options``: as ``predict``)."""
    names = list(TABLES) if names is None else list(names)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise SpecError("command line", "--table",
                        f"unknown table {unknown[0]!r} (one of: {', '.join(TABLES)})")
    rows, summ = {}, []
    for n in names:
        r = predict(TABLES[n], rank=rank, partial=partial, options=options)
        rows[n] = r
        summ.append({"table": n, **summarize(r)})
    return pd.DataFrame(summ).set_index("table"), rows


# ----------------------------------------------------------------------------
# The tables.  Each row function states the framework defaults it assumes;
# docs/validation.md lists them.  ``unstated``: the execution fields among
# those assumptions, with the values the framework offers for each, searched
# by ``validate published --partial`` (docs/validation.md, "Partial layouts").

# Megatron's distributed optimizer (ZeRO-1) and its overlaps, where a source
# does not say it ran them: sharded optimizer state or none, the gradient
# reduce and the parameter gather each overlapped or not.
DIST_OPT_OPTIONS = {"optimizer_sharding": (True, False), "unsharded_grads": (True,),
                    "data_par_overlap": (True, False), "param_gather_overlap": (True, False)}

# NeMo 24.07 (H100 performance summary) -------------------------------------

NEMO_MODELS = {
    "GPT3-5B": ("gpt3-5B", {}), "GPT3-20B": ("gpt3-20B", {}),
    "GPT3-175B": ("gpt3-175B", {"vocab_size": 50304}),
    "LLAMA2-7B": ("llama2-7B", {}), "LLAMA2-13B": ("llama2-13B", {}),
    "LLAMA2-70B": ("llama2-70B", {}), "LLAMA3-8B": ("llama3-8B", {}),
    "LLAMA3-70B": ("llama3-70B", {}), "Nemotron-8B": ("nemotron-8B", {}),
    "Nemotron-22B": ("nemotron-22B", {}), "Nemotron-340B": ("nemotron4-340B", {}),
}
NEMO_SYSTEMS = {"DGX-H100": "h100_80g_nvl8", "DGX-B200": "b200_nvl8",
                "DGX-GB200": "gb200_nvl72", "DGX-H200": "h200"}
# NeMo 1.x launched by its launcher runs FlashAttention-2, not cuDNN's
# attention: the launcher's main config exports NVTE_FUSED_ATTN=0 ("Disable
# cudnn FA until we've tested it more"; NVIDIA/NeMo-Megatron-Launcher
# launcher_scripts/conf/config.yaml env_vars at 24.03.01 (5c7e280a), 24.03
# and 24.01 alike, and NVIDIA/NeMo-Framework-Launcher's at 24.05 and 24.07
# (8325688d)), and Transformer Engine's DotProductAttention reads it once
# (NVIDIA/TransformerEngine transformer_engine/pytorch/attention.py
# ``self.use_fused_attention = int(os.getenv("NVTE_FUSED_ATTN", "1")) and
# ...`` at da30634 (NeMo v1.23.0's Dockerfile pin) and v1.4): only
# flash-attn is left, with context parallelism or without
# (``AttnFuncWithCP`` runs ``_flash_attn_forward`` per step where
# ``use_fused_attention`` is off).  On H100 that kernel runs at
# FlashAttention-2's published 35% of the dense peak (``FA2_H100_PEAK_FRACTION``,
# autopar/studies/published_foundry.py).  NeMo 2 (25.04) is not launched so:
# its performance scripts export NVTE_FUSED_ATTN=1 (NVIDIA/NeMo v2.3.0
# scripts/performance/utils.py).
NEMO1_LAUNCHER_ATTENTION = {"h100_80g_nvl8": published_foundry.FA2_H100_PEAK_FRACTION}


def nemo1_system(name: str) -> SystemSpec:
    """The system file of a NeMo 1.x launcher run under ``NEMO1``, its
    attention kernel FlashAttention-2 at its published rate where one is
    published for the GPU (``NEMO1_LAUNCHER_ATTENTION``)."""
    rate = NEMO1_LAUNCHER_ATTENTION.get(name)
    return system(name, NEMO1) if rate is None else system_attention_at(name, NEMO1, rate)


# NeMo / Megatron-Core recipes: FP8 is Transformer Engine's per-tensor
# (delayed) scaling; MXFP8 its 1x32 block scaling.
PRECISIONS = {"FP8": ("bfloat16", "tensorwise"), "BF16": ("bfloat16", "none"),
              "FP8-MX": ("bfloat16", "mxfp8"), "MXFP8": ("bfloat16", "mxfp8"),
              "FP8-CS": ("bfloat16", "tensorwise")}


# The fine-tuning rows (SFT and LoRA, SQuAD v1.1 packed to 4096 tokens) ran
# NeMo-Framework-Launcher 24.07's examples/peft/llama/h100/*.sh (the runs'
# names: 7b_1node, 13b_1node, 70b_2node, *_lora; they set the table's GPUs,
# batch, TP and PP), which state what the table leaves blank: the SFT rows'
# interleaving (13B 10, 70B 20; the 70B with sequence parallelism and TP
# overlap) and, for LoRA, NeMo's default adapter (conf/peft/llama/sft.yaml
# ``lora_tuning``: adapter_dim 32, dropout 0, no target_modules, so
# nemo/collections/nlp/parts/peft_config.py ``get_target_modules`` gives
# ``attention_qkv``: one adapter on the fused QKV projection), the
# non-distributed ``fused_adam`` (nothing sharded) and, on the 70B TP 2
# run, no sequence parallelism (sft.yaml's default), under which NeMo turns
# ``ub_tp_comm_overlap`` off (megatron_base_model.py: "Pipelined
# tensor-parallel communication overlap is available with
# sequence-parallelism").  Packed sequences keep attention inside each
# SQuAD sample (GPTSFTPackedDataset's cu_seqlens, qkv_format 'thd' in
# megatron_gpt_model.py): ``attention_span`` NEMO_SQUAD_SPAN.
NEMO_FINETUNE_VP = {("sft", "LLAMA2-13B"): 10, ("sft", "LLAMA2-70B"): 20}
NEMO_LORA = {"adapter": "lora", "adapter_rank": 32, "adapter_targets": "qkv"}
# The length-weighted mean length of a SQuAD v1.1 sample ("{input} {output}":
# context, question, answer) in Llama 2 tokens, assumed: the training set's
# 87,599 samples hold ~1 kB of text each (TensorFlow Datasets' squad/v1.1:
# 94 MiB), ~4 characters a token, ~200 tokens a sample, x1.25 for the
# length weighting (spread of the contexts' lengths).  The predictions move
# by < 2 % between 190 and 512 (docs/validation.md).
NEMO_SQUAD_SPAN = 256


def _nemo_perf(row) -> PublishedCase | Skip:
    label = f"{row.workload} {row.model} {int(row.n_gpus)} GPUs"
    if row.model not in NEMO_MODELS:
        return Skip(f"no model file for {row.model}", label)
    name, changes = NEMO_MODELS[row.model]
    seq = int(row.seq_len)
    m = model(name, seq_size=seq, **changes)
    sy = nemo1_system(NEMO_SYSTEMS[row.system])
    n, tp, pp = int(row.n_gpus), int(row.tp), int(row.pp)
    cp = int_or_none(row.cp) or 1
    vp = int_or_none(row.vp) or NEMO_FINETUNE_VP.get((row.workload, row.model), 1)
    dp = n // (tp * pp * cp)
    datatype, fp8 = PRECISIONS[row.precision]
    lora = row.workload == "lora"
    # NeMo's GPT/Llama training configurations of the time synchronise
    # gradients in bf16 (distributed_fused_adam with grad_sync_dtype bf16):
    # no fp32 gradient buffers.  LoRA: fused_adam, sequence parallelism off
    # and with it the TP overlap (above).
    ex = megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=int(row.gbs),
                            mbs=int(row.mbs), vp=vp if pp > 1 else 1, datatype=datatype,
                            fp8=fp8, tp_overlap=not lora, fp32_grads=False,
                            dist_opt=not lora, sp=False if lora else None)
    if lora:
        ex.update(NEMO_LORA)
    if row.workload in ("sft", "lora"):
        ex["attention_span"] = NEMO_SQUAD_SPAN
    return PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": float(row.tokens_per_sec_per_gpu)},
                         label)


register(Table(
    "nemo_h100", "nemo_2407_h100_perf_summary.csv", _nemo_perf, "NeMo 24.07",
    "NeMo 24.07 performance summary on DGX H100 (final version of the page): pre-training "
    "SFT and LoRA in FP8",
    keep=lambda f: f.doc_version == "final",
    unstated={"activation_recompute": MCORE_RECOMPUTE, **DIST_OPT_OPTIONS,
              "tensor_par_overlap": ("ring", "none"), "fp32_grads": (False, True)}))


# NeMo long-sequence context-parallel runs ------------------------------------

def _nemo_cp(row) -> PublishedCase | Skip:
    n_page = int(row.n_gpus)
    n_layout = int(row.tp) * int(row.pp) * int(row.dp) * int(row.cp)
    label = f"{row.model} seq {int(row.seq_len)} on {n_layout} {row.system}" + (
        f" (page: {n_page} GPUs)" if n_page != n_layout else "")
    name = {"LLAMA3-8B": "llama3-8B", "LLAMA2-7B": "llama2-7B"}.get(row.model)
    if name is None:
        return Skip(f"no model file for {row.model}", label)
    seq = int(row.seq_len)
    m = model(name, seq_size=seq)
    # NeMo 1.x (24.03): Apex's distributed Adam with param remainders;
    # NeMo 2.3 (25.04): Megatron-Core's distributed optimizer, fp32 masters.
    nemo1 = str(row.container).startswith("NeMo24.")
    sy = nemo1_system(NEMO_SYSTEMS[row.system]) if nemo1 else system(
        NEMO_SYSTEMS[row.system], NEMO2_2504)
    tp, pp, cp, dp = int(row.tp), int(row.pp), int(row.cp), int(row.dp)
    # On the B200 rows the printed layout's TP*PP*DP*CP is not the GPU count
    # (a page inconsistency); the layout is trusted (it divides the global
    # batch) and the GPUs are its product.  Throughput per GPU is intensive.
    n = tp * pp * dp * cp
    gbs = int(row.global_batch)
    if gbs % dp:
        return Skip(f"global batch {gbs} not divisible by data_par {dp}", label)
    datatype, fp8 = PRECISIONS[row.precision]
    ex = megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=1,
                            datatype=datatype, fp8=fp8, tp_overlap=True, fp32_grads=False)
    if not nemo1:
        # NeMo 2.3's TE layers gather the sequence-parallel input again in
        # backward (NVIDIA/TransformerEngine transformer_engine/pytorch/module/
        # layernorm_linear.py backward, at bee4649 (2.2.0.dev0, NeMo v2.3.0's
        # pin) and at 3b2a7b0 (1.14, v2.3.0rc2's) alike).
        te_gathers_again(ex)
    # Reported TFLOP/s per GPU -> tokens/s/GPU with the FLOP count NeMo
    # reported them with: the whole s x s attention square, no causal half
    # (NVIDIA/NeMo nemo/utils/flops_formulas.py llama3 at v2.3.0, the 25.04
    # container's, read by nemo/lightning/pytorch/callbacks/flops_callback.py;
    # the causal half came with 6251117f4c, 2025-08-09, after the page's last
    # figures, 19fadb67b0, 2025-05-08; the 24.03 rows' NeMo 1.x tooling,
    # NVIDIA/NeMo-Framework-Launcher auto_configurator/autoconfig/scripts/
    # compare_throughput.py calculate_tflops, counts 4 B s^2 h per layer
    # forward, the whole square too).  docs/validation.md, "Long-context
    # attention under context parallelism, counted".
    tok = float(row.tflops_per_gpu_with_cp) * 1e12 / flops_per_token(m)
    return PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


register(Table(
    "nemo_long_cp", "nemo_long_sequence_cp.csv", _nemo_cp, "NeMo 24.03 / 25.04",
    "NeMo long-sequence runs with context parallelism (Llama 2 7B on H100, Llama 3 8B on "
    "B200), FP8; throughput from the reported TFLOP/s per GPU",
    unstated={"activation_recompute": MCORE_RECOMPUTE, **DIST_OPT_OPTIONS,
              "tensor_par_overlap": ("ring", "none"), "fp32_grads": (False, True),
              "microbatch_size": None, "context_par_comm": ("p2p", "a2a")}))


# Megatron GPT weak scaling: Megatron-LM 2021 (A100), Megatron-Core r0.8 (H100)

def _megatron_gpt(row, *, gpu: str, system_name: str, framework: str, vp_column: str, tflops_column: str, options,
                  per_token: Callable[[ModelSpec], float], overrides: dict | None = None,
                  mbs: int = 1) -> PublishedCase | Skip:
    """A row of a Megatron GPT scaling table: the model shape and layout as
    printed (micro-batch ``mbs`` and no context parallelism where the table
    leaves them blank), the framework options of the table (``options(row)``:
    keyword arguments of ``megatron_execution``), tokens/s/GPU from the
    printed TFLOP/s per GPU with the table's FLOP count per token."""
    label = f"{row.model} on {int(row.n_gpus)} {gpu}"
    h, L, H, s, V = (int(row.hidden), int(row.num_layers), int(row.attn_heads),
                     int(row.seq_len), int(row.vocab))
    m = gpt_model(row.model, h, L, H, s, V)
    sy = system(system_name, framework)
    n, tp, pp, dp = int(row.n_gpus), int(row.tp), int(row.pp), int(row.dp)
    ex = megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=int_or_none(row.get("cp")) or 1,
                            gbs=int(row.global_batch), mbs=int_or_none(row.get("micro_batch")) or mbs,
                            vp=int_or_none(row[vp_column]) or 1, **options(row))
    ex.update(overrides or {})
    tok = float(row[tflops_column]) * 1e12 / per_token(m)
    return PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


def _paper_flops_2021(m: ModelSpec) -> float:
    """The SC21 paper's FLOP count per token (it includes the recompute):
    96 s l h^2 (1 + s/6h + V/16lh) per sequence."""
    h, L, s, V = m.hidden, m.num_blocks, m.seq_size, m.vocab_size
    return 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


# Megatron-LM 2021: fp16, full recompute, no distributed optimizer, no
# sequence parallelism, a fused scale-mask-softmax (no FlashAttention in
# 2021); torch DDP overlaps the gradient all-reduce with backward, Megatron's
# local DDP does not.
register(Table(
    "megatron_2021", "megatron_lm_a100_2021_scaling.csv",
    partial(_megatron_gpt, gpu="A100", system_name="a100_80g", framework="megatron-core",
            vp_column="vp_derived",
            tflops_column="achieved_tflops_per_gpu",
            options=lambda row: dict(datatype="float16", recompute="full", sp=False,
                                     dist_opt=False, flash=False,
                                     dp_overlap=str(row.ddp_impl).strip() == "torch"),
            per_token=_paper_flops_2021, overrides={"attention_impl": "fused_softmax"}),
    "Megatron-LM 2021",
    "Megatron-LM's SC21 weak scaling (GPT 1.7B-1T on Selene A100), fp16, full recompute; "
    "throughput from achieved TFLOP/s with the paper's FLOP count",
    unstated={"attention_impl": ("fused_softmax", "unfused"), "fp32_grads": (False, True)}))


# Megatron-Core r0.8 README runs: bf16 (the MFU implies the bf16 peak), no
# recompute, sequence parallelism with TP, the distributed optimizer with
# overlapped grad reduce / param gather, TP communication overlap; Megatron's
# (non-causal) FLOP count.  The micro-batch is not stated (Megatron has no
# default): 2, read off the table itself.  The number of micro-batches sets
# both the window the gradient reduce-scatter hides in (the last
# micro-batch's backward: the PP 1 rows) and the pipeline bubble
# ((PP - 1) / micro-batches: the PP > 1 rows); with micro-batch 1 the PP 1
# rows come out 12-18% slow and the PP rows 2-12% fast, with 2 all but the
# smallest model within 5%, with 4 the 177B-462B layouts do not fit
# (docs/validation.md).
MCORE_MICRO_BATCH = 2
register(Table(
    "mcore_h100", "megatron_core_h100_weak_scaling.csv",
    partial(_megatron_gpt, gpu="H100", system_name="h100_80g_nvl8", framework="megatron-core",
            vp_column="vp",
            tflops_column="per_gpu_tflops",
            options=lambda row: dict(tp_overlap=True), per_token=flops_per_token,
            mbs=MCORE_MICRO_BATCH),
    "Megatron-Core r0.8",
    "Megatron-Core weak scaling on H100 (GPT 1.7B-462B), bf16; throughput from per-GPU "
    "TFLOP/s with Megatron's FLOP count",
    unstated={"microbatch_size": None, "activation_recompute": MCORE_RECOMPUTE,
              **DIST_OPT_OPTIONS, "tensor_par_overlap": ("ring", "none")}))


# torchtitan (FSDP2 + TP + PP + CP) on H100 / H200 ---------------------------

TITAN_MODELS = {"Llama 3.1 8B": "llama3-8B", "Llama 3 8B": "llama3-8B",
                "Llama 3.1 70B": "llama3-70B", "Llama 3 70B": "llama3-70B",
                "Llama 3.1 405B": "llama3-405B"}


# What the recipe applies when a run does not say (issue 24 item 1): the
# train config a benchmark page ran, read at the torchtitan commit the page
# cites (``git show <commit>:torchtitan/models/llama3/train_configs/<toml>``):
# page (by the CSV's ``source``) -> (commit, {model: (toml, training.seq_len)}).
# The async-TP page (June 2025) names commit 820504e and the Llama 3 8B / 70B
# runs; the Trainy page ran llama3_8b.toml at e7c0cae.  Both tomls say
# seq_len = 8192 at both commits.  (The December 2024 page's rows state 8192
# in the CSV already, read from the configs at 9dec370.)
TITAN_CONFIG_SEQ = {
    "asyncTP_llama3_h100_2025-06_torchtitan.md": (
        "820504e", {"Llama 3 8B": ("llama3_8b.toml", 8192),
                    "Llama 3 70B": ("llama3_70b.toml", 8192)}),
    "llama3-8b_h200_202506_trainy-whitefiber.md": (
        "e7c0cae", {"Llama 3.1 8B": ("llama3_8b.toml", 8192)}),
}


def titan_config_seq(row) -> tuple[int, str] | None:
    """The sequence length a torchtitan row ran with where the row does not
    state it: its page's train config at the cited commit
    (``TITAN_CONFIG_SEQ``), with the note saying so; None where the page has
    no config to read."""
    for page, (commit, tomls) in TITAN_CONFIG_SEQ.items():
        if page in str(row.source) and row.model in tomls:
            toml, seq = tomls[row.model]
            return seq, f"seq {seq} from {toml} @{commit}"
    return None


# Pages whose torchtitan compiles the loss with the model when a run turns
# compile on (torchtitan/components/loss.py build_cross_entropy_loss at
# 820504e and e7c0cae): frameworks/torchtitan-compile.json.  At 9dec370 (the
# December 2024 page) train.py leaves the loss eager ("compiling loss function
# causes CUDA errors"): frameworks/torchtitan.json.
TITAN_COMPILED_LOSS = ("asyncTP_llama3_h100_2025-06_torchtitan.md",
                       "llama3-8b_h200_202506_trainy-whitefiber.md")


def titan_framework(row) -> str:
    """The framework file a torchtitan row ran under: ``torchtitan`` where
    the run does not compile; where it does, ``torchtitan-compile`` where
    its commit compiles the loss too, else ``torchtitan-compile-blocks``
    (9dec370: the blocks compiled, the loss eager)."""
    if str(row.compile).strip() != "True":
        return "torchtitan"
    if any(p in str(row.source) for p in TITAN_COMPILED_LOSS):
        return "torchtitan-compile"
    return "torchtitan-compile-blocks"


def _titan(row) -> PublishedCase | Skip:
    label = f"{row.table}: {row.model} {int(row.n_gpus)} GPUs"
    seq = int_or_none(row.seq_len)
    if seq is None:
        from_config = titan_config_seq(row)
        if from_config is None:
            return Skip("sequence length not stated", label)
        seq, note = from_config
        label = f"{label} [{note}]"
    name = TITAN_MODELS.get(row.model)
    if name is None:
        return Skip(f"no model file for {row.model}", label)
    m = model(name, seq_size=seq)
    sy = system("h200" if "H200" in row.system else "h100_96g_nvl8", titan_framework(row))
    n = int(row.n_gpus)
    fsdp, tp, pp, cp = int(row.fsdp), int(row.tp), int(row.pp), int(row.cp)
    dp = n // (tp * pp * cp)
    local = int(row.local_batch)
    gbs = local * dp
    ckpt = str(row.activation_ckpt)
    # torchtitan's selective checkpointing (per-op policy) keeps the
    # attention's GEMM and SDPA outputs and recomputes the element-wise ops and
    # every second matmul: modelled as Megatron's MLP-only recompute, which
    # keeps the attention and recomputes the MLP's first GEMM and activation.
    recompute = "full" if ckpt.startswith("full") else "mlp_only"
    f8 = str(row.float8)
    fp8 = ("rowwise" if "rowwise" in f8 else "tensorwise" if ("float8" in f8 or f8 == "True")
           else "none")
    async_tp = str(row.async_tp).strip() == "True"
    # FSDP shards over the data-parallel and context-parallel ranks together.
    # Pipeline: torchtitan's default schedule has as many micro-batches as stages.
    mbs = max(local // pp, 1) if pp > 1 else local
    vp = 2 if "Interleaved" in str(row.pp_schedule) else 1
    # Norms and the MLP activation: run eagerly (training.compile off) they
    # are torchtitan's own PyTorch ops, not fused kernels: the configs'
    # norm_type "rmsnorm" is torchtitan/models/norms.py RMSNorm at 9dec370
    # (x.float(), pow, mean, rsqrt, multiply, type_as, times the weight:
    # separate kernels with fp32 intermediates, the reference RMSNorm that
    # layers.rms_norm counts unfused) and FeedForward.forward is
    # w2(F.silu(w1(x)) * w3(x)) (SiLU and the product apart); under
    # torch.compile inductor fuses both.  What a block keeps for backward
    # is the checkpointing policy's either way (block.op_policy_saves; full
    # recompute keeps the block input only).
    fused = titan_framework(row) != "torchtitan"
    ex = megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp,
                            recompute=recompute, sp=tp > 1, tp_overlap=async_tp,
                            dist_opt=False, fsdp=fsdp * cp > 1, dp_overlap=True, fp8=fp8,
                            fused=fused, cp_comm="p2p")
    meas = {"tokens_per_s_per_gpu": float(row.tokens_per_sec_per_gpu)}
    if number_or_none(row.peak_mem_gib) is not None:
        meas["peak_mem_gib"] = float(row.peak_mem_gib)
    return PublishedCase(m, sy, ex, meas, label)


register(Table(
    "torchtitan", "torchtitan_benchmarks.csv", _titan, "torchtitan",
    "torchtitan Llama 3 runs on H100 (FSDP2, TP, PP, CP, float8, async TP) and H200",
    unstated={"microbatch_size": None, "fp32_grads": (True, False)}))


# SimuMax: B200 step time and peak memory per layout (Megatron-LM) -----------

SIMUMAX_MODELS = {"llama3-70b": "llama3-70B", "llama3-405b": "llama3-405B"}
# What the runs' launcher changes in a model: the 405B runs use 16 query
# groups (MooreThreads/SimuMax@4dcaae5 simu_tools/megatron_scripts/scripts/
# run_pretrain_llama3.sh, llama3_405b: --num-query-groups 16; its model file
# configs/models/llama3-405b_padding_128.json, kv_head_num 16), not the
# published model's 8.
SIMUMAX_MODEL_CHANGES = {"llama3-405b": {"kv_heads": 16}}


def _simumax(row) -> PublishedCase | Skip:
    label = str(row.case)
    if int_or_none(row.ep) and int(row.ep) > 1 or str(row.model).startswith("deepseek"):
        return simumax_moe(row)
    name = SIMUMAX_MODELS.get(row.model)
    if name is None:
        return Skip(f"no model file for {row.model}", label)
    seq = int(row.seq_len)
    m = model(name, seq_size=seq, num_blocks=int(row.layers_truncated_to),
              **SIMUMAX_MODEL_CHANGES.get(str(row.model), {}))
    # The B200 file calibrated on this table (systems/b200_nvl8_megatron.json).
    sy = system("b200_nvl8_megatron", SIMUMAX_FRAMEWORK)
    n, tp, pp, dp, cp = (int(row.n_gpus), int(row.tp), int(row.pp), int(row.dp),
                         int(row.cp))
    vp = int_or_none(row.vp) or 1
    mbs, mbc = int(row.micro_batch), int(row.microbatch_count)
    gbs = mbs * mbc * dp
    # What the run does not state: the distributed optimizer (the measured
    # memory leaves no room for unsharded fp32 optimizer state: 70B-l12 with
    # PP 2 on 66.5 GiB), no gradient-reduce overlap (Megatron-LM's default;
    # the runs turn overlaps off); sequence parallelism with TP; TE
    # attention; CP by all-to-all (stated).
    ex = megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp,
                            dist_opt=True, dp_overlap=False, cp_comm="a2a")
    te_gathers_again(ex)
    step = float(row.real_step_ms) / 1e3
    tok = gbs * seq / step / n
    return PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok,
                                     "peak_mem_gib": float(row.real_peak_alloc_gib)}, label)


register(Table(
    "simumax_b200", "simumax_b200_measured.csv", _simumax, "Megatron-LM (SimuMax runs)",
    "Per-layout step time and peak allocated memory on 8 B200 (truncated-depth Llama 3 "
    "70B/405B and DeepSeek-V2/V3 MoE with expert parallelism), bf16",
    unstated={"optimizer_sharding": (True, False), "unsharded_grads": (True,),
              "moe_dispatcher": ("alltoall", "allgather")}))


# Megatron-Bridge Qwen3 30B-A3B (MoE) ----------------------------------------

# Megatron-Core's partial CPU activation offloading (model.cpu_offloading with
# cpu_offloading_num_layers, autopar's activation_offload_blocks), which a
# Bridge recipe may turn on without the performance page saying so: none
# (the assumed value, first) or any number of blocks the rules allow (one
# stage, no recompute; docs/validation.md, "Partial CPU activation
# offloading (Megatron-Core / TE), counted").
CPU_OFFLOAD_OPTIONS = {"activation_offload_blocks": None}

def _bridge_moe(row) -> PublishedCase | Skip:
    return bridge_qwen3(row)


register(Table(
    "bridge_qwen3_moe", "megatron_bridge_qwen3_30b_a3b.csv", _bridge_moe, "Megatron-Bridge",
    "Qwen3 30B-A3B (MoE, expert parallelism) on GB300/GB200/B300/B200/H100, fp8",
    unstated={"activation_recompute": ("none", "attn_only", "mlp_only", "full"),
              "fp32_grads": (False, True), "moe_dispatcher": ("deepep", "alltoall", "allgather"),
              "moe_overlap": (False, True), "data_par_overlap": (True, False),
              "param_gather_overlap": (True, False), **CPU_OFFLOAD_OPTIONS}))


# Tables registered by their own modules (llm-foundry MPT, NeMo-Megatron-Launcher).
