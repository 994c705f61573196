"""Published measurements of fine-tuning and of Muon, predicted.

A handful of figures the papers state with enough of their setting to lay
the run out (issue 28, item 5): each row names its source, what it measured
(peak memory per GPU, or a bound the paper states), the setting it gives and
what autopar assumes where the source is silent.  ``predict()`` returns one
row per measurement with the prediction beside it; ``docs/validation.md``
("Fine-tuning and Muon") shows the table.  Not the performance-summary
tables that are not in ``../shared``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.io.frameworks import load_framework, with_framework
from autopar.io.shipped import shipped_dir
from autopar.io.specs import load_model, load_system
from autopar.model import evaluate_one

GB = 1e9


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    measured: str              # what the source states
    model: str                 # models/<model>.json
    seq_size: int
    system: str                # systems/<system>.json
    capacity_GB: float | None  # the GPU's memory where the file's differs
    execution: dict
    kind: str                  # "memory_GB" (peak per GPU), "at_most_GB", "at_least_GB",
    #                            "overhead_pct" (Muon over Adam, a range)
    value: float | tuple
    assumed: str
    framework: str | None = None   # frameworks/<name>.json, where the source names one
    # memory_overhead fields the run's own configuration sets (replacing the
    # framework file's), each counted from the run's code or config
    overhead: dict | None = None


def _exe(n: int, **kw) -> dict:
    e = {"num_procs": n, "tensor_par": 1, "pipeline_par": 1, "data_par": n,
         "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
         "batch_size": n, "microbatch_size": 1, "datatype": "bfloat16",
         "fused_activation": True, "attention_type": "multihead",
         "activation_recompute": "full", "pipeline_interleaving": 1,
         "optimizer_sharding": False, "tensor_par_comm_type": "ar",
         "tensor_par_overlap": "none", "seq_par_ag_redo": False,
         "data_par_overlap": False, "weight_offload": False,
         "activations_offload": False, "optimizer_offload": False, "training": True,
         "attention_impl": "flash_v2", "fused_norm": True}
    e.update(kw)
    return e


ROWS = (
    Row("QLoRA LLaMA-65B on one 48 GB GPU",
        "Dettmers et al. 2023, QLoRA, arXiv:2305.14314 (abstract: a 65B model "
        "fine-tuned on a single 48GB GPU)",
        "fits in 48 GB", "llama-65B", 512, "a100_80g", 48.0,
        _exe(1, adapter="qlora", adapter_rank=64, adapter_targets="all"),
        "at_most_GB", 48.0,
        "r 64 on all linear layers (the paper's setup); micro-batch 1 of 512 tokens "
        "(source 384 + target 128), gradient checkpointing; Adam state of the adapters "
        "in fp32 beside a bf16 copy"),
    Row("16-bit full fine-tuning of LLaMA-65B",
        "Dettmers et al. 2023, QLoRA, arXiv:2305.14314 (introduction: more than 780 GB "
        "of GPU memory for regular 16-bit fine-tuning of a 65B model)",
        "more than 780 GB", "llama-65B", 512, "a100_80g", 1e6,
        _exe(1), "at_least_GB", 780.0,
        "one processor with unbounded memory; Adam, bf16 weights and gradients, fp32 "
        "master copy and moments, gradient checkpointing"),
    Row("plain LoRA Llama 2 7B, 8,192 tokens, 8 A100",
        "Chen et al. 2023, LongLoRA, arXiv:2309.12307 (efficiency table, plain LoRA "
        "row; as listed in huggingface.co/datasets/odyn-network/"
        "benchmark-finetune-lora-v1)",
        "25.7 GB peak per GPU", "llama2-7B", 8192, "a100_80g", None,
        _exe(8, adapter="lora", adapter_rank=8, adapter_targets="attention",
             optimizer_sharding=True, fused_norm=False, fused_activation=False),
        "memory_GB", 25.7,
        "LongLoRA's fine-tune.py: LoRA rank 8 on q, k, v, o (dropout 0), bf16 base; micro-"
        "batch 1 a GPU, FlashAttention-2, gradient checkpointing; Hugging Face Llama "
        "(transformers 4.34, requirements.txt): RMSNorm and SwiGLU as separate ops; "
        "DeepSpeed ZeRO-2 (frameworks/deepspeed-zero2.json) with the repository's "
        "ds_configs/stage2.json: reduce_bucket_size 1e9 with overlap_comm, so two 16-bit "
        "gradient buckets of 1e9 elements (3.73 GiB); the loss holds three fp32 copies of "
        "the logits at its peak (LlamaForCausalLM.forward)",
        framework="deepspeed-zero2",
        # DeepSpeed v0.10.3 deepspeed/runtime/zero/stage_1_and_2.py
        # DeepSpeedZeroOptimizer.backward: with contiguous_gradients it
        # allocates ipg_buffer of reduce_bucket_size elements in the 16-bit
        # dtype, and a second one with overlap_comm ("double buffers");
        # LongLoRA's ds_configs/stage2.json sets reduce_bucket_size 1e9 and
        # overlap_comm true: 2 x 1e9 x 2 bytes.  transformers 4.34
        # LlamaForCausalLM.forward: logits.float() (fp32 logits, returned),
        # shift_logits = logits[..., :-1, :].contiguous() (a second fp32
        # copy), CrossEntropyLoss's log_softmax output (a third, saved for
        # backward): 12 bytes a logit at the peak, when the bf16 logits are
        # already freed -- the model's 2 (bf16 logits) + 2.5 fp32 copies.
        overhead={"reserved_GiB": 2 * 1e9 * 2 / 1024 ** 3, "logits_fp32_copies": 2.5}),
)

# Muon's end-to-end overhead over AdamW, 1 to 3 % in Moonshot's runs (Liu et
# al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982, Sec. 2.3;
# quoted and reproduced at 1.1 % on 4 GPUs by J. Wei, "Reproducing and
# Validating Distributed Muon", huggingface.co/blog/bird-of-paradise).  The
# paper's layouts are not stated: a Llama-3-8B proxy with ZeRO-1 on 64 H100
# and a 4M-token batch stands for them (assumed).
MUON = Row("Muon over AdamW, end to end",
           "Liu et al. 2025, Muon is Scalable for LLM Training, arXiv:2502.16982 "
           "(distributed Muon: 1-3 % end-to-end overhead)",
           "1-3 % longer steps", "llama3-8B", 8192, "h100_80g_nvl8", None,
           _exe(64, batch_size=512, tensor_par=1, data_par=64, optimizer_sharding=True,
                unsharded_grads=True, data_par_net=1, data_par_overlap=True),
           "overhead_pct", (1.0, 3.0),
           "Llama-3-8B proxy, 64 H100, ZeRO-1, 512 x 8,192 tokens a batch")


def _case(row: Row):
    model = load_model(shipped_dir("models") / f"{row.model}.json")
    model = dataclasses.replace(model, seq_size=row.seq_size)
    system = load_system(shipped_dir("systems") / f"{row.system}.json")
    if row.capacity_GB is not None:
        mem1 = dataclasses.replace(system.mem1, GiB=row.capacity_GB * GB / 1024 ** 3)
        system = dataclasses.replace(system, mem1=mem1)
    if row.framework is not None:
        system = with_framework(system, load_framework(row.framework))
    if row.overhead:
        over = dataclasses.replace(system.memory_overhead, **row.overhead)
        system = dataclasses.replace(system, memory_overhead=over)
    return model, system


def predict() -> list[dict]:
    """One dict per published figure: the row's name, source, measured
    figure, prediction and whether it agrees (``ok``; for a peak, the
    error in %)."""
    out = []
    for row in ROWS + (MUON,):
        model, system = _case(row)
        s = evaluate_one(model, system, row.execution)
        need = s["proc_mem_tier1_cap_req"] / GB
        rec = {"name": row.name, "source": row.source, "measured": row.measured,
               "assumed": row.assumed, "feasible": bool(s["feasible"])}
        if row.kind == "overhead_pct":
            adam = evaluate_one(model, system, dict(row.execution, optimizer="adam"))
            muon = evaluate_one(model, system, dict(row.execution, optimizer="muon"))
            pct = 100.0 * (muon["total_time"] / adam["total_time"] - 1.0)
            lo, hi = row.value
            rec.update(predicted=f"{pct:.2f} % longer steps", value=pct, ok=lo <= pct <= hi)
        elif row.kind == "memory_GB":
            err = 100.0 * (need / row.value - 1.0)
            rec.update(predicted=f"{need:.1f} GB", value=need, error_pct=err,
                       ok=abs(err) <= 15.0)
        elif row.kind == "at_most_GB":
            rec.update(predicted=f"{need:.1f} GB", value=need, ok=need <= row.value)
        else:
            rec.update(predicted=f"{need:.0f} GB", value=need, ok=need >= row.value)
        out.append(rec)
    return out


# ----------------------------------------------------------------------------
# Qwen's LoRA profile (throughput): the table ``qwen_lora_a100``.
#
# QwenLM/Qwen README.md, "Profiling of Memory and Speed": peak memory and
# seconds per iteration of Qwen 1.8B-72B fine-tuned with LoRA, LoRA (emb),
# Q-LoRA and in full on A100-SXM4-80G GPUs, batch 1 a GPU and gradient
# accumulation 8 (an iteration is 8 sequences a GPU), FlashAttention-2, for
# sequences of 256-8192 tokens.  The runs are the repository's finetune.py
# (Hugging Face Trainer + PEFT): bf16 weights, gradient checkpointing (every
# finetune/*.sh passes --gradient_checkpointing), LoRA of r 64 on c_attn (the
# fused QKV projection), c_proj (the attention's output and the MLP's down
# projection: PEFT matches the name's suffix), w1 and w2 (the MLP's two
# input projections) -- autopar's ``all`` (it counts q, k, v as three
# adapters and w1, w2 as one of twice the width: a few MFLOPs a token off),
# dropout 0.05 on each adapter's input not counted; sequences padded to the
# length (finetune.py ``preprocess`` pads every sample to max_len), so
# every token is computed; Qwen's modeling code runs its RMSNorm and SwiGLU
# as separate PyTorch ops unless flash-attention's optional csrc/layer_norm
# is built (the README leaves it commented out): unfused norms and
# activation.  Skipped: LoRA (emb) (the embedding and output layer trained
# beside the adapters: not modelled), Q-LoRA (GPTQ int4 checkpoints through
# auto-gptq, not NF4), full-parameter and multi-GPU rows (their DeepSpeed
# configuration and, across nodes, the network are not stated; memory is
# printed summed over the GPUs), 72B (no model file).

QWEN_MODELS = {"Qwen-1.8B": "qwen-1.8B", "Qwen-7B": "qwen-7B", "Qwen-14B": "qwen-14B"}
QWEN_LORA = {"adapter": "lora", "adapter_rank": 64, "adapter_targets": "all"}


def _qwen_lora(row):
    from autopar.studies.published_base import PublishedCase, Skip, model, system
    label = f"{row.model} {row.method} seq {int(row.seq_len)}"
    if str(row.s_per_it) in ("", "nan"):
        return Skip("no figure printed (out of memory)", label)
    if row.method != "LoRA":
        why = {"LoRA (emb)": "trainable embedding and output layer beside the adapters "
                             "are not modelled",
               "Q-LoRA": "Q-LoRA here is GPTQ int4 (auto-gptq), not NF4"}
        return Skip(why.get(row.method, "DeepSpeed configuration (and network) not stated"),
                    label)
    if row.model not in QWEN_MODELS:
        return Skip(f"no model file for {row.model}", label)
    seq = int(row.seq_len)
    m = model(QWEN_MODELS[row.model], seq_size=seq)
    sy = system("a100_80g", "hf-peft")
    per_gpu = int(row.batch_per_gpu) * int(row.grad_accum)
    ex = _exe(1, batch_size=per_gpu, microbatch_size=int(row.batch_per_gpu),
              fused_activation=False, fused_norm=False, **QWEN_LORA)
    tok = seq * per_gpu / float(row.s_per_it)
    return PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok,
                                     "peak_mem_gib": float(row.memory_G)}, label)


def _register():
    from autopar.studies.published_base import Table, register
    register(Table(
        "qwen_lora_a100", "qwen_lora_a100.csv", _qwen_lora, "Hugging Face + PEFT (Qwen)",
        "Qwen 1.8B/7B/14B LoRA on one A100 80GB (QwenLM/Qwen README profile): "
        "sequences of 256-8192 tokens; LoRA (emb), Q-LoRA, full and multi-GPU rows skipped",
        unstated={"fused_norm": (False, True), "fused_activation": (False, True)}))


_register()
