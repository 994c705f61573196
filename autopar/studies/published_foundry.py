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
  figures of 2022).  The README does not state the layouts; the rows take
  the launcher's ``conf/training/gpt3/{5b,175b}.yaml`` of the dates the
  figures were written (NeMo Megatron 22.08 and 22.03, ``LAUNCHER_RUNS``),
  under ``frameworks/nemo-megatron-2022.json``.

What each table leaves unstated and what is assumed: ``docs/validation.md``.
"""
from __future__ import annotations

import dataclasses
import functools

from autopar.studies import published_base as P

# MPT configurations (d_model, n_heads, n_layers) of llm-foundry's
# scripts/train/yamls/pretrain/mpt-<size>.yaml; expansion_ratio 4.
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
              "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
              "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_VOCAB = 50368
FOUNDRY_SYSTEMS = {"a100_40gb": "a100_40g", "a100_80gb": "a100_80g",
                   "h100_80gb": "h100_80g_nvl8"}
# Which attention kernel each row ran (counted from the benchmark scripts of
# the tables' commits, mosaicml/llm-foundry scripts/train/benchmarking/):
# ``submit_benchmarks.py`` sets ``model.attn_config.attn_impl`` from its
# ``--attn_impl`` flag, default ``'triton'``; ``sweep.sh`` (b2a43a147,
# 2023-10-19: the H100 BF16 / FP8 and A100 tables, llm-foundry v0.3.0 with
# its ``gpu`` extra) never passes the flag, so those runs used the Triton
# FlashAttention kernel (llmfoundry/models/layers/flash_attn_triton.py); the
# large-scale H100 table (``sweep.py``, 5e85bd62d, 2024-01-06, ``gpu-flash2``
# extra, flash-attn 2.4.2) passes ``--attn_impl flash`` for 1b, 3b, 7b and
# 70b and ``--attn_impl triton`` for 13b and 30b.
FLASH2_LARGE_SCALE = ("H100 80GB BF16 (Large Scale", frozenset({"1b", "3b", "7b", "70b"}))

# Published rates of those kernels, as fractions of the GPU's dense bf16 peak:
# * FlashAttention-2: 50-73% on A100 (Dao 2023, arXiv 2307.08691, abstract),
#   35% on H100 (Shah et al. 2024, "FlashAttention-3", arXiv 2407.08608,
#   abstract: FlashAttention-2 "has yet to take advantage of new capabilities
#   present in recent hardware, ... achieving only 35% utilization on the
#   H100 GPU").  On A100 the model's default (0.75 of the matrix curve: 66%
#   of peak) is inside that range; the H100 rows use 35%.
# * The Triton kernel is FlashAttention(-1)'s algorithm in Triton, begun from
#   the Triton tutorial's fused attention (its docstring); it "only has been
#   tested on A100", and its forward is "generally faster than CUDA forward,
#   while Triton backward is generally slower".  On A100, forward and
#   backward separately: Triton's own performance regression test of its
#   fused attention (openai/triton python/test/regression/
#   test_performance.py, ``flash_attention_data['a100']``, the version
#   without the seq_par/causal arguments, early 2023: causal, 4 x 48 heads
#   of 64, 4096 tokens, fp16) holds the forward at 37% and the backward at
#   25% of the tensor-core peak, the backward's work counted as 2.5 x the
#   forward's (``total_flops *= 2.5``, as flash-attention's
#   benchmarks/benchmark_flash_attention.py ``flops()`` counts it).
# * The Triton kernel on H100 (``HOPPER_WITHOUT_HOPPER_CODE``): every
#   llm-foundry row compiled it with triton-pre-mlir (llm-foundry v0.3.0 and
#   5e85bd62d setup.py: ``triton-pre-mlir@git+https://github.com/vchiley/
#   triton.git@triton_pre_mlir_sm90``; flash_attn_triton.py ``import
#   triton_pre_mlir as triton``), Triton's code generator from before its
#   MLIR rewrite (and so before Triton had any Hopper path): its
#   lib/codegen/selection/generator.cc sends every tensor-core dot on
#   ``sm() >= 80`` to ``visit_mma16816`` (Ampere's mma.16816), and the
#   fork's lib/driver/llvm.cc ``llir_to_ptx`` only lets LLVM's NVPTX target
#   name sm_90 (``max_nvvm_cc = 90``): Ampere-class code on Hopper, as
#   FlashAttention-2 is.  No figure of it on H100 is published; it is taken
#   to gain from A100 to H100 what FlashAttention-2 gains, 35% of the H100's
#   peak over 50% of the A100's (the low end of FlashAttention-2's A100
#   range, so an upper bound; the high end, 73%, would make it slower
#   still): a factor 0.7 on each A100 fraction, forward 25.9%, backward
#   17.5%.  (Before: FlashAttention-2's 35% over the least of the "1.3-2.5x"
#   by which FlashAttention-2 beat the Triton kernel on A100, 26.9% for both
#   passes, which made the kernel 2.7x faster on H100 than on A100 where
#   FlashAttention-2 gains 1.5-2.2x; the fwd + bwd rate now, 19.3%, is
#   35% / 1.8, inside that 1.3-2.5.)
FA2_A100_PEAK_FRACTION = (0.50, 0.73)
FA2_H100_PEAK_FRACTION = 0.35
TRITON_A100_PEAK_FRACTION = (0.37, 0.25)
HOPPER_WITHOUT_HOPPER_CODE = FA2_H100_PEAK_FRACTION / min(FA2_A100_PEAK_FRACTION)
TRITON_PEAK_FRACTION = {
    "a100_40g": TRITON_A100_PEAK_FRACTION, "a100_80g": TRITON_A100_PEAK_FRACTION,
    "h100_80g_nvl8": tuple(round(r * HOPPER_WITHOUT_HOPPER_CODE, 4)
                           for r in TRITON_A100_PEAK_FRACTION)}
# A published backward rate counts the kernel's backward as
# ``P.KERNEL_BACKWARD_WORK`` forwards (the sources above); the model counts
# ``P.MODEL_BACKWARD_WORK`` (``P.system_attention_at``).
# The Triton kernel's causal loop (flash_attn_triton.py at the tables'
# commits): forward tiles of BLOCK = 128 queries x 128 keys, the loop over
# keys ending at the tile holding the diagonal (``end_n``); backward tiles of
# BLOCK_M = BLOCK_N = 128 (its only autotune configs), the loop over queries
# starting at the diagonal's tile (``begin_m``).  A tile that straddles the
# diagonal is computed whole.
TRITON_TILE = 128


def attention_kernel(section: str, name: str) -> str:
    """The attention kernel a llm-foundry row ran: ``"flash"``
    (FlashAttention-2) or ``"triton"`` (``FLASH2_LARGE_SCALE``)."""
    prefix, models = FLASH2_LARGE_SCALE
    return "flash" if section.startswith(prefix) and name in models else "triton"


@functools.cache
def foundry_system(name: str, kernel: str = "flash"):
    """The system file of a llm-foundry GPU with the row's attention kernel
    at its published rate (``time_overhead.attention_speed`` = the rate as a
    fraction of peak over the file's bf16 matrix plateau; where the forward
    and backward rates are apart, ``attention_backward_speed`` = the
    backward's, on the model's count of the backward's work): FlashAttention-2
    on H100 (one rate); the Triton kernel on A100 (its published forward and
    backward) and on H100 (those carried to H100 as FlashAttention-2's
    rate is, ``HOPPER_WITHOUT_HOPPER_CODE``), with its causal tile
    (``attention_tile``).  FlashAttention-2 on A100: the model's default."""
    if kernel == "triton":
        rate, backward = TRITON_PEAK_FRACTION[name]
        return P.system_attention_at(name, "llm-foundry", rate, backward, TRITON_TILE)
    if name == "h100_80g_nvl8":
        return P.system_attention_at(name, "llm-foundry", FA2_H100_PEAK_FRACTION)
    return P.system(name, "llm-foundry")


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
    with the backward (FSDP's default), fused norms and GeLU as fused
    kernels; ``amp_fp8``: Transformer Engine's per-tensor (delayed) scaling
    on the block's GEMMs; the attention kernel the row's benchmark script
    chose (``attention_kernel``: the
    Triton FlashAttention kernel, ``flash_v1``'s algorithm, or
    FlashAttention-2) at its published rate (``foundry_system``)."""
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
    kernel = attention_kernel(str(row["section"]), name)
    sy = foundry_system(FOUNDRY_SYSTEMS[gpu], kernel)
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
    ex["attention_impl"] = "flash_v2" if kernel == "flash" else "flash_v1"
    if not full:
        # SHARD_GRAD_OP shards the gradients too (ZeRO-2), and gathers the
        # updated weights once a step.
        ex["unsharded_grads"] = False
    tok = float(row["Throughput (T/s/GPU)"])
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


# What the llm-foundry table leaves unstated (``validate published
# --partial``): every row states the layout (FSDP over every GPU, micro-batch,
# accumulation), sharding, precision, FSDP mixed precision, checkpointing and
# offload; the attention kernel is in the benchmark scripts (counted above).
# Not stated anywhere for the runs: whether FSDP's gathers and gradient
# reduce-scatters ran behind compute (the scripts of the A100 / H100 BF16
# tables set no prefetch; Composer's defaults then, BACKWARD_POST and no
# forward prefetch, with limit_all_gathers) -- overlapped or not.
FOUNDRY_UNSTATED = {"data_par_overlap": (True, False)}


P.register(P.Table(
    "llm_foundry_mpt", "llm_foundry_mpt_throughput.csv", foundry_row,
    "llm-foundry (Composer + PyTorch FSDP)",
    "MosaicML llm-foundry MPT 125M-70B throughput, pure data parallelism with FSDP "
    "(FULL_SHARD / SHARD_GRAD_OP), A100 40/80GB and H100, bf16 and fp8, 12-step runs",
    unstated=FOUNDRY_UNSTATED))


# NeMo-Megatron-Launcher GPT-3 on DGX A100 ------------------------------------

# When the README's GPT-3 tables were measured, and with what.  The README at
# 80353286 (2023-10-04) that the table cites carries figures written long
# before: the 5B weak scaling first appears in NVIDIA/NeMo-Megatron-Launcher
# a2b2f83a (2022-09-06), the 175B weak scaling in 1f1e6be5 (2022-09-07), the
# 5B convergence run (160 GPUs, global batch 1440) in 261d93af (2022-03-24);
# none changed afterwards (``git log -S``).  The launcher's
# conf/training/gpt3/{5b,175b}.yaml of those dates, not those of 2023, say
# what ran (the 22.08 release, c6ac205a 2022-08-30, and 22.03, 261d93af):
#
# * 5B weak scaling (22.08): TP 1, PP 1, micro-batch 2, global batch 2048,
#   activations_checkpoint_granularity full with method block and 0 layers
#   (NeMo 1.11's ParallelTransformer._checkpointed_forward then checkpoints
#   no layer: no recompute), no sequence parallelism, distributed_fused_adam.
# * 175B weak scaling (22.08): TP 8, PP 8 (no interleaving), micro-batch 2,
#   selective recompute (the core attention), sequence parallelism,
#   distributed_fused_adam (NeMo turns its overlapped gradient sync off with
#   pipeline or sequence parallelism).  64 GPUs, the table's first column,
#   is exactly one TP 8 x PP 8 model.
# * 5B convergence run (22.03): TP 2, PP 1, micro-batch 2, global batch 1440,
#   method block with 0 layers (no recompute), fused_adam (no sharding;
#   O2's fp32 main gradients all-reduced after the backward: NeMo 1.7
#   MegatronGPTModel.training_step, allreduce_main_grads).
#
# The 2023 yamls the table's notes name (TP 1 / MBS 4 for 5B; TP 4, PP 8,
# VP 12, MBS 1 for 175B; Megatron-Core GPT, transformer_engine False) came
# with NeMo Framework 23.x and post-date every figure.
# What the rest of those stacks did (fp32 master weights and gradients,
# unfused attention with Apex's fused softmax, ...): frameworks/
# nemo-megatron-2022.json, with file@commit citations; docs/validation.md
# "NeMo-Megatron-Launcher 2023: what the configurations turn on".


@dataclasses.dataclass(frozen=True)
class LauncherRun:
    """One run of the Launcher's README as its configuration of the time set
    it: the model file, the layout, recompute (autopar's
    ``activation_recompute``), sequence parallelism, the optimizer (Apex's
    distributed fused Adam or plain fused Adam) and whether the gradient
    reduction ran behind the backward, and where that is written;
    ``grad_accum_fusion``: the linear layers' weight-gradient GEMMs
    accumulate into the optimizer's fp32 buffer themselves
    (``launcher_system``)."""
    model: str
    tp: int
    pp: int
    vp: int
    mbs: int
    sp: bool
    recompute: str
    dist_opt: bool
    dp_overlap: bool
    source: str
    grad_accum_fusion: bool = False


LAUNCHER_FRAMEWORK = "nemo-megatron-2022"
_L22_08 = "NVIDIA/NeMo-Megatron-Launcher@c6ac205a (2022-08-30, 22.08)"
# (model, stated global batch or None) -> the run.
LAUNCHER_RUNS = {
    ("GPT-3 5B", None): LauncherRun(
        "gpt3-5B", tp=1, pp=1, vp=1, mbs=2, sp=False, recompute="none", dist_opt=True,
        dp_overlap=True, source=f"{_L22_08} conf/training/gpt3/5b.yaml"),
    ("GPT-3 175B", None): LauncherRun(
        "gpt3-175B", tp=8, pp=8, vp=1, mbs=2, sp=True, recompute="attn_only", dist_opt=True,
        dp_overlap=False, source=f"{_L22_08} conf/training/gpt3/175b.yaml",
        grad_accum_fusion=True),
    ("GPT-3 5B", 1440): LauncherRun(
        "gpt3-5B", tp=2, pp=1, vp=1, mbs=2, sp=False, recompute="none", dist_opt=False,
        dp_overlap=False,
        source="NVIDIA/NeMo-Megatron-Launcher@261d93af (2022-03-24, 22.03) "
               "conf/training/gpt3/5b.yaml"),
}
LAUNCHER_GLOBAL_BATCH = 2048


# What the Launcher's README leaves unstated (``validate published
# --partial``): the whole layout but the model, the GPUs and the sequence
# (global batch only on the convergence row); the configurations of the
# time (``LAUNCHER_RUNS``) are the evidence the row function uses, but the
# README does not say the runs used them.  Searched: tensor, pipeline and
# interleaving sizes, micro-batch (every value autopar's rules allow),
# recompute (Megatron-Core's none / selective / full), sequence parallelism
# (rs_ag or plain all-reduce) and TP communication overlap; the distributed
# optimizer's overlaps.  Stated by no one, so not searched: the global batch
# (the launcher's 2048).
LAUNCHER_UNSTATED = {"tensor_par": None, "pipeline_par": None, "pipeline_interleaving": None,
                     "microbatch_size": None, "activation_recompute": P.MCORE_RECOMPUTE,
                     "tensor_par_comm_type": ("rs_ag", "ar"),
                     "tensor_par_overlap": ("none", "ring"),
                     "data_par_overlap": (True, False), "param_gather_overlap": (True, False)}


def launcher_execution(run: LauncherRun, system_, n: int, gbs: int) -> dict:
    """The execution of ``run`` on ``n`` GPUs at global batch ``gbs``: the
    layout and options of ``LAUNCHER_RUNS``, with what NeMo Megatron
    22.03-22.08 did besides (``frameworks/nemo-megatron-2022.json``): bf16
    O2 with fp32 main gradients, unfused attention with the fused
    scale-mask-softmax, the weights all-gathered in the optimizer step (not
    overlapped), and with sequence parallelism the column-parallel layers'
    input all-gathered again in backward (``seq_par_ag_redo``: Apex saved
    the shard)."""
    dp = n // (run.tp * run.pp)
    ex = P.megatron_execution(system_, n=n, tp=run.tp, pp=run.pp, dp=dp, gbs=gbs,
                              mbs=run.mbs, vp=run.vp, sp=run.sp, recompute=run.recompute,
                              dist_opt=run.dist_opt, dp_overlap=run.dp_overlap,
                              flash=False, fp32_grads=True)
    ex.update(attention_impl="fused_softmax", param_gather_overlap=False,
              seq_par_ag_redo=run.sp and run.tp > 1)
    return ex


def launcher_system(run: LauncherRun):
    """The A100 system under ``frameworks/nemo-megatron-2022.json`` for
    ``run``: where the run's yaml keeps ``gradient_accumulation_fusion:
    True`` and NeMo honours it (v1.11.0 megatron_base_model.py
    ``_validate_config`` turns it off only without pipeline parallelism or
    without O2: the 175B at PP 8), the linear layers' weight-gradient GEMMs
    accumulate into fp32 ``main_grad`` themselves (Apex@6f7d8ac3
    apex/transformer/tensor_parallel/layers.py
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``:
    ``wgrad_gemm_accum_fp32(..., weight.main_grad)``, ``grad_weight =
    None``), ``main_grad`` being a view of the distributed optimizer's
    contiguous fp32 buffer (NeMo v1.11.0 nemo/core/optim/optimizers.py
    ``MegatronDistributedFusedAdam._init_param_state``: ``param.main_grad =
    self.grad_buffer_view(param)``); the hook's ``_grad_copy`` then finds
    no ``.grad`` on them and adds nothing, so its bytes stay on the norms
    only (``time_overhead.grad_accum_in_gemm``)."""
    sy = P.system("a100_80g", LAUNCHER_FRAMEWORK)
    if run.grad_accum_fusion:
        sy = dataclasses.replace(sy, time_overhead=dataclasses.replace(
            sy.time_overhead, grad_accum_in_gemm=True))
    return sy


def launcher_row(row) -> "P.PublishedCase | P.Skip":
    """One NeMo-Megatron-Launcher row: the run's configuration of the time
    (``LAUNCHER_RUNS``, keyed by model and the stated global batch; 2048,
    the launcher's, where none is stated) on the A100 system under
    ``frameworks/nemo-megatron-2022.json`` (``launcher_execution``)."""
    n = int(row.n_gpus)
    stated = P.int_or_none(row.global_batch)
    label = f"{row.model} {n} GPUs" + (f" gbs {stated}" if stated else "")
    run = LAUNCHER_RUNS.get((row.model, stated))
    if run is None:
        return P.Skip(f"no launcher configuration for {row.model}"
                      + (f" at global batch {stated}" if stated else ""), label)
    m = P.model(run.model, seq_size=int(row.seq_len))
    sy = launcher_system(run)
    if n % (run.tp * run.pp):
        return P.Skip(f"{n} GPUs do not hold TP {run.tp} x PP {run.pp}", label)
    dp = n // (run.tp * run.pp)
    gbs = stated or LAUNCHER_GLOBAL_BATCH
    if gbs % (dp * run.mbs):
        return P.Skip(f"global batch {gbs} not divisible by data_par {dp} x "
                      f"micro-batch {run.mbs}", label)
    if m.num_blocks % (run.pp * run.vp):
        return P.Skip(f"{m.num_blocks} blocks do not split into PP {run.pp} x VP {run.vp}",
                      label)
    ex = launcher_execution(run, sy, n, gbs)
    tok = float(row.tokens_per_sec) / n
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)


P.register(P.Table(
    "nemo_launcher_a100", "nemo_launcher_a100_gpt3_scaling.csv", launcher_row,
    "NeMo Megatron 22.03-22.08 (NeMo-Megatron-Launcher README)",
    "GPT-3 5B and 175B weak scaling on DGX A100 80GB; layouts from the launcher's "
    "configurations of the dates the figures were written (not stated by the source)",
    unstated=LAUNCHER_UNSTATED))
