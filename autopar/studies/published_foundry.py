"""Row functions and registrations of two published tables of short,
data-parallel runs: MosaicML llm-foundry's MPT throughput table and
NeMo-Megatron-Launcher's GPT-3 weak scaling on DGX A100.

``autopar.studies.published`` owns the registry; this module registers

* ``llm_foundry_mpt`` (``llm_foundry_mpt_throughput.csv``): MPT 125M-70B
  trained with Composer and PyTorch FSDP, pure data parallelism (no TP/PP),
  on A100 40GB / 80GB and H100 80GB, sequences of 512 to 65,536 tokens,
  bf16 and fp8; 12-step runs.  The MPT shapes are those of llm-foundry's
  ``scripts/train/yamls/pretrain/mpt-*.yaml`` (``MPT_SHAPES``: d_model,
  n_heads, n_layers; expansion ratio 4, vocabulary 50368).  The table's
  ``NumParams`` column is matched exactly by 12 L d^2 + 13 L d + 50368 d +
  seq d + 2 d: the benchmarked models had biases on their linear layers and
  LayerNorms and learned position embeddings of the run's sequence length
  (MPTConfig's defaults then: ``no_bias`` off, ``learned_pos_emb`` on), i.e.
  the GPT block autopar models.
* ``nemo_launcher_a100`` (``nemo_launcher_a100_gpt3_scaling.csv``): GPT-3
  5B and 175B weak scaling on DGX A100 80GB (NeMo-Megatron-Launcher README,
  2023).  The README does not state the layouts; the row notes give the
  launcher's default ``conf/training/gpt3/{5b,175b}.yaml`` of the same
  commit, which the source says may not match the runs.

What each table leaves unstated and what is assumed: ``docs/validation.md``.
"""
from __future__ import annotations

import dataclasses
import functools

from autopar.io.specs import TimeOverhead
from autopar.studies import published_base as P

# MPT configurations (d_model, n_heads, n_layers) of llm-foundry's
# scripts/train/yamls/pretrain/mpt-<size>.yaml; expansion_ratio 4.
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
              "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
              "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_VOCAB = 50368
FOUNDRY_SYSTEMS = {"a100_40gb": "a100_40g", "a100_80gb": "a100_80g",
                   "h100_80gb": "h100_80g_nvl8"}
# FlashAttention-2 on H100 reaches 35% of the GPU's peak (Shah et al. 2024,
# "FlashAttention-3", arXiv 2407.08608, abstract: "FlashAttention-2 ...
# achieving only 35% utilization on the H100 GPU"); llm-foundry's runs use
# FlashAttention-2 or its Triton kernel, not Hopper-specific attention.  On
# A100 the model's default (0.75 of the matrix curve: 66% of peak) is inside
# the 50-73% the FlashAttention-2 paper reports (Dao 2023, arXiv 2307.08691),
# so the A100 rows keep it.
FA2_H100_PEAK_FRACTION = 0.35


@functools.cache
def foundry_system(name: str):
    """The system file of a llm-foundry GPU; on H100 with FlashAttention-2's
    published rate (``time_overhead.attention_speed`` = 35% of peak over the
    file's bf16 matrix plateau)."""
    sy = P.system(name, "llm-foundry")
    if name != "h100_80g_nvl8":
        return sy
    plateau = max(e for _, e in sy.matrix["bfloat16"].gflops_efficiency)
    t = sy.time_overhead or TimeOverhead()
    return dataclasses.replace(sy, time_overhead=dataclasses.replace(
        t, attention_speed=round(FA2_H100_PEAK_FRACTION / plateau, 4)))


def mpt_params(name: str, seq: int) -> int:
    """Parameters of an MPT model as benchmarked: the table's ``NumParams``
    (linear and LayerNorm biases, learned position embeddings of ``seq``)."""
    d, _, L = MPT_SHAPES[name]
    return L * (12 * d * d + 13 * d) + MPT_VOCAB * d + seq * d + 2 * d


def foundry_row(row) -> "P.PublishedCase | P.Skip":
    """One llm-foundry row: FSDP over every GPU as the row's
    ``Sharding Strategy`` says (FULL_SHARD = ZeRO-3, ``weight_sharding``;
    SHARD_GRAD_OP = ZeRO-2, optimizer state and gradients sharded, weights
    whole), full activation checkpointing where ``Activation Checkpointing``
    is True, FSDP's mixed precision as ``MP Mode`` says (PURE: gradients
    reduced in bf16; DEFAULT: in fp32), gradient reduce-scatter overlapped
    with the backward (FSDP's default), flash attention (the README's text),
    fused norms and GeLU as fused kernels; ``amp_fp8``: Transformer Engine's
    per-tensor (delayed) scaling on the block's GEMMs; on H100 the attention
    kernel at FlashAttention-2's published rate (``foundry_system``)."""
    name = str(row["Model"])
    n, seq = int(row["# GPUs"]), int(row["SeqLen (T)"])
    gpu = str(row["GPU"])
    label = f"{name} seq {seq} {n}x {gpu} {row['Precision']}"
    if name not in MPT_SHAPES:
        return P.Skip(f"no MPT shape for {name}", label)
    if gpu not in FOUNDRY_SYSTEMS:
        return P.Skip(f"no system file for {gpu}", label)
    if str(row["Activation CPUOffload"]).strip() == "True":
        return P.Skip("activation CPU offload is not modelled", label)
    d, heads, L = MPT_SHAPES[name]
    m = P.gpt_model(f"mpt-{name}", d, L, heads, seq, MPT_VOCAB)
    sy = foundry_system(FOUNDRY_SYSTEMS[gpu])
    mbs, accum = int(row["MicroBatchSize"]), int(row["GradAccum"])
    gbs = int(row["GlobalBatchSize"])
    if gbs != mbs * accum * n:
        return P.Skip(f"global batch {gbs} is not micro-batch x accumulation x GPUs", label)
    strategy = str(row["Sharding Strategy"]).strip()
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return P.Skip(f"sharding strategy {strategy} is not modelled", label)
    full = strategy == "FULL_SHARD"
    precision = str(row["Precision"]).strip()
    fp8 = "tensorwise" if precision == "amp_fp8" else "none"
    pure = str(row["MP Mode"]).strip() == "PURE"
    recompute = "full" if str(row["Activation Checkpointing"]).strip() == "True" else "none"
    ex = P.megatron_execution(sy, n=n, tp=1, pp=1, dp=n, gbs=gbs, mbs=mbs,
                              recompute=recompute, dist_opt=not full, fsdp=full,
                              dp_overlap=True, fp8=fp8, fp32_grads=not pure)
    if not full:
        # SHARD_GRAD_OP shards the gradients too (ZeRO-2), and gathers the
        # updated weights once a step.
        ex["unsharded_grads"] = False
    tok = float(row["Throughput (T/s/GPU)"])
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


P.register(P.Table(
    "llm_foundry_mpt", "llm_foundry_mpt_throughput.csv", foundry_row,
    "llm-foundry (Composer + PyTorch FSDP)",
    "MosaicML llm-foundry MPT 125M-70B throughput, pure data parallelism with FSDP "
    "(FULL_SHARD / SHARD_GRAD_OP), A100 40/80GB and H100, bf16 and fp8, 12-step runs"))


# NeMo-Megatron-Launcher GPT-3 on DGX A100 ------------------------------------

# The launcher's conf/training/gpt3/<size>.yaml defaults (the row notes):
# model file, TP, PP, interleaving, micro-batch, sequence parallelism.
LAUNCHER_LAYOUTS = {"GPT-3 5B": ("gpt3-5B", 1, 1, 1, 4, False),
                    "GPT-3 175B": ("gpt3-175B", 4, 8, 12, 1, True)}
LAUNCHER_GLOBAL_BATCH = 2048


def launcher_row(row) -> "P.PublishedCase | P.Skip":
    """One NeMo-Megatron-Launcher row: the launcher's default layout for the
    model (``LAUNCHER_LAYOUTS``), global batch 2048 unless the row states
    one (then the largest micro-batch up to the default that divides it), bf16 with ``megatron_amp_O2``, no recompute, Apex's distributed
    fused Adam with overlapped gradient and parameter sync (gradients synced
    in bf16, master weights as 16-bit remainders: NeMo 1.x, as ``nemo_h100``),
    flash attention (NeMo 1.x builds its Megatron-Core GPT, ``mcore_gpt:
    True``, from Transformer Engine's layer spec, whose attention is fused;
    with the unfused attention the 5B default, micro-batch 4, does not fit
    in 80 GB: 105-111 GiB predicted)."""
    n = int(row.n_gpus)
    label = f"{row.model} {n} GPUs" + (f" gbs {int(row.global_batch)}"
                                       if P.int_or_none(row.global_batch) else "")
    if row.model not in LAUNCHER_LAYOUTS:
        return P.Skip(f"no launcher default layout for {row.model}", label)
    name, tp, pp, vp, mbs, sp = LAUNCHER_LAYOUTS[row.model]
    m = P.model(name, seq_size=int(row.seq_len))
    sy = P.system("a100_80g", "nemo1-apex")      # Apex master-weight remainders
    if n % (tp * pp):
        return P.Skip(f"{n} GPUs do not hold TP {tp} x PP {pp}", label)
    dp = n // (tp * pp)
    gbs = P.int_or_none(row.global_batch) or LAUNCHER_GLOBAL_BATCH
    if gbs % dp:
        return P.Skip(f"global batch {gbs} not divisible by data_par {dp}", label)
    # A stated global batch the default micro-batch does not divide (the
    # convergence run: 1440 on 160 GPUs, 9 per rank) takes the largest
    # micro-batch below the default that does.
    mbs = max(b for b in range(1, mbs + 1) if (gbs // dp) % b == 0)
    if m.num_blocks % (pp * vp):
        return P.Skip(f"{m.num_blocks} blocks do not split into PP {pp} x VP {vp}", label)
    ex = P.megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, gbs=gbs, mbs=mbs, vp=vp,
                              sp=sp, fp32_grads=False)
    tok = float(row.tokens_per_sec) / n
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


P.register(P.Table(
    "nemo_launcher_a100", "nemo_launcher_a100_gpt3_scaling.csv", launcher_row,
    "NeMo-Megatron-Launcher (NeMo 1.x, 2023)",
    "GPT-3 5B and 175B weak scaling on DGX A100 80GB; layouts from the launcher's default "
    "configurations (not stated by the source)"))

