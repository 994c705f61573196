"""Published fine-tuning and Muon figures against the model
(autopar.studies.published_finetune; docs/validation.md, "Fine-tuning and
Muon")."""
from __future__ import annotations

import pytest

from autopar.studies.published_finetune import predict


@pytest.fixture(scope="module")
def rows():
    return {r["name"]: r for r in predict()}


def test_every_row_cites_its_source_and_runs(rows):
    assert len(rows) == 4
    for r in rows.values():
        assert r["source"] and "arXiv" in r["source"]
        assert r["feasible"], r["name"]


def test_qlora_65b_fits_one_48gb_gpu_and_full_finetuning_does_not(rows):
    q = rows["QLoRA LLaMA-65B on one 48 GB GPU"]
    full = rows["16-bit full fine-tuning of LLaMA-65B"]
    assert q["ok"] and q["value"] <= 48.0
    # The 4-bit base alone is 65.2e9 x 0.516 bytes: what it needs cannot be less.
    assert q["value"] > 65.2 * 0.516
    assert full["ok"] and full["value"] >= 780.0
    assert full["value"] / q["value"] > 16


def test_lora_peak_within_the_documented_error(rows):
    # docs/validation.md: +1.0 % (was -19.6 % before the run's two 1e9-element
    # gradient buckets and the Llama loss's three fp32 logits copies were
    # counted).
    r = rows["plain LoRA Llama 2 7B, 8,192 tokens, 8 A100"]
    assert abs(r["error_pct"]) < 5.0 and r["ok"]


def test_longlora_counted_terms_by_hand():
    # The two counted terms, by hand: two 16-bit buckets of 1e9 elements
    # (4e9 bytes) instead of the framework file's one of 5e8 (0.931 GiB),
    # and 1.5 more fp32 copies of the 8,192 x 32,000 logits.
    import dataclasses
    from autopar.model import evaluate_one
    from autopar.studies.published_finetune import ROWS, _case
    row = next(r for r in ROWS if "LongLoRA" in r.source)
    model, system = _case(row)
    plain = dataclasses.replace(row, overhead=None)
    m2, s2 = _case(plain)
    a = evaluate_one(model, system, row.execution)["proc_mem_tier1_cap_req"]
    b = evaluate_one(m2, s2, row.execution)["proc_mem_tier1_cap_req"]
    expect = (4e9 - 0.931 * 1024 ** 3) + 1.5 * 8192 * 32000 * 4
    assert a - b == pytest.approx(expect, rel=1e-9)


def test_muon_overhead_small_and_positive(rows):
    r = rows["Muon over AdamW, end to end"]
    assert 0.0 < r["value"] < 3.0


# ------------------------------------------- NeMo 24.07 SFT and LoRA rows

def test_nemo_lora_rows_map_the_launcher_recipe():
    from autopar.studies.published import TABLES, cases
    table = TABLES["nemo_h100"]
    got = {c.label: c for _, c in cases(table) if hasattr(c, "execution")}
    lora = {k: c for k, c in got.items() if k.startswith("lora ")}
    sft = {k: c for k, c in got.items() if k.startswith("sft ")}
    assert len(lora) == 3 and len(sft) == 3
    for c in lora.values():
        ex = c.execution
        # NeMo 24.07's default LoRA: rank 32 on the fused QKV projection;
        # fused_adam (nothing sharded); packed SQuAD's per-sample attention.
        assert (ex["adapter"], ex["adapter_rank"], ex["adapter_targets"]) == \
            ("lora", 32, "qkv")
        assert not ex["optimizer_sharding"] and ex["attention_span"] == 256
    # The 70B LoRA run on TP 2 has no sequence parallelism, so no TP overlap.
    ex70 = lora["lora LLAMA2-70B 8 GPUs"].execution
    assert ex70["tensor_par_comm_type"] == "ar" and ex70["tensor_par_overlap"] == "none"
    # SFT: the launcher scripts' interleaving; full training.
    assert sft["sft LLAMA2-13B 8 GPUs"].execution["pipeline_interleaving"] == 10
    assert sft["sft LLAMA2-70B 16 GPUs"].execution["pipeline_interleaving"] == 20
    assert all(c.execution.get("adapter", "none") == "none" for c in sft.values())


def test_nemo_finetune_rows_predicted_within_the_bar():
    import numpy as np
    from autopar.studies.published import TABLES, predict
    rows = predict(TABLES["nemo_h100"], rank=False)
    ft = rows[rows.label.str.match(r"^(sft|lora) ")]
    assert len(ft) == 6 and (ft.status == "predicted").all() and ft.feasible.all()
    err = ft.set_index("label").tok_error.abs()
    # Measured (docs/validation.md): LoRA +4.1 %, -1.2 %, -5.9 %; SFT
    # +19.8 %, -0.9 %, +6.9 %; median 5.0 %.  With FlashAttention-2 at its
    # published H100 rate (the launcher's NVTE_FUSED_ATTN=0, "Long-context
    # rows, round 2"): LoRA +2.9 %, -2.0 %, -6.4 %; SFT +19.1 %, -1.4 %,
    # +6.4 %; median 4.7 %.
    assert err.filter(like="lora").max() < 0.09
    assert err.max() < 0.22
    assert float(np.median(err)) < 0.08


# ------------------------------------------------ Qwen's LoRA profile (A100)

def test_qwen_lora_rows_predicted_and_the_rest_skipped_with_reasons():
    import numpy as np
    from autopar.studies.published import TABLES, predict
    rows = predict(TABLES["qwen_lora_a100"], rank=False)
    assert len(rows) == 84
    pred = rows[rows.status == "predicted"]
    assert len(pred) == 18 and pred.feasible.all()
    assert set(rows[rows.status == "skipped"].reason.str.split().str[0]) <= {
        "trainable", "Q-LoRA", "DeepSpeed", "no"}
    err = pred.set_index("label").tok_error
    # Measured (docs/validation.md): 7B and 14B from 512 tokens within
    # 7.1 % (PEFT's element-wise adapter work counted, frameworks/hf-peft.json);
    # the host-bound short runs (1.8B up to 1024 tokens, 7B at 256: the same
    # seconds an iteration at 256 and 512 tokens) predicted far too fast.
    long = err[[not k.startswith("Qwen-1.8B") and not k.endswith("seq 256") for k in err.index]]
    assert len(long) == 10 and long.abs().max() < 0.09
    assert (err[["Qwen-1.8B LoRA seq 256", "Qwen-1.8B LoRA seq 512"]] > 1.0).all()
    assert float(np.median(err.abs())) < 0.07
    # Peak memory with the loss's buffers (frameworks/hf-peft.json: 12 bytes
    # a logit), AdamW's step temporaries and PEFT's saved dropout masks and
    # casts counted: median |error| 10.4 % (19.2 % before), the 8,192-token
    # rows within 10 %; every row still
    # below the README's figure (what is left -- the allocator, the CUDA
    # context -- is not counted), so an over-count would show here.
    mem = pred.set_index("label").mem_error
    assert float(np.median(mem.abs())) < 0.115
    assert (mem < 0).all()
    assert mem.filter(like="seq 8192").abs().max() < 0.10


def test_qwen_lora_loss_buffers_by_hand():
    # Qwen's loss under the Trainer's bf16 autocast (frameworks/hf-peft.json,
    # citations): the bf16 logits (2 bytes a logit), their shifted contiguous
    # copy (2), cross_entropy's fp32 cast (4) and its saved fp32 log-softmax
    # (4): 12 bytes a logit of the micro-batch's seq x 151,936, where the
    # default counts 2 + 4.
    import dataclasses
    from autopar.model import evaluate_one
    from autopar.studies.published import TABLES
    from autopar.studies.published_base import cases, PublishedCase
    case = next(c for _, c in cases(TABLES["qwen_lora_a100"])
                if isinstance(c, PublishedCase) and c.label == "Qwen-7B LoRA seq 2048")
    over = case.system.memory_overhead
    assert over.logits_fp32_copies == 2.5 and over.reserved_GiB == 0.0

    def need(copies):
        o = dataclasses.replace(over, logits_fp32_copies=copies)
        s = dataclasses.replace(case.system, memory_overhead=o)
        return evaluate_one(case.model, s, case.execution)["proc_mem_tier1_cap_req"]
    logits = 2048 * 151936
    assert need(2.5) - need(0.0) == pytest.approx(10.0 * logits, rel=1e-9)
    assert need(2.5) - need(1.0) == pytest.approx(6.0 * logits, rel=1e-9)


def test_qwen_lora_optimizer_step_by_hand():
    # AdamW's foreach step (frameworks/hf-peft.json: 8 bytes a trained
    # parameter) on Qwen-7B's LoRA adapters, r 64 as autopar lays them out
    # (q, k, v, o of h x h; the MLP's input of h x 2 ff; its output of
    # ff x h) in 32 blocks: at 256 tokens the step's peak (static state +
    # temporaries) is above the batch's; at 8,192 tokens it is not.
    import dataclasses
    from autopar.io.layouts import to_columns
    from autopar.model import evaluate_columns
    from autopar.model.memory import MEMORY_PARTS
    from autopar.studies.published import TABLES
    from autopar.studies.published_base import cases, PublishedCase
    h, ff, r, blocks = 4096, 11008, 64, 32
    adapters = blocks * r * (4 * 2 * h + (h + 2 * ff) + (ff + h))
    got = {}
    for _, c in cases(TABLES["qwen_lora_a100"]):
        if isinstance(c, PublishedCase) and c.label in ("Qwen-7B LoRA seq 256",
                                                        "Qwen-7B LoRA seq 8192"):
            over = c.system.memory_overhead
            assert over.optimizer_step_bytes == 8.0
            plain = dataclasses.replace(c.system, memory_overhead=dataclasses.replace(
                over, optimizer_step_bytes=0.0))
            out = evaluate_columns(c.model, c.system, to_columns([c.execution]),
                                   stats=("proc_mem_tier1_cap_req",) + MEMORY_PARTS)
            without = evaluate_columns(c.model, plain, to_columns([c.execution]),
                                       stats=("proc_mem_tier1_cap_req",))
            got[c.model.seq_size] = ({k: float(v[0]) for k, v in out.items()},
                                     float(without["proc_mem_tier1_cap_req"][0]))
    short, short_without = got[256]
    assert short["mem_trained_params_last"] == adapters
    assert short["proc_mem_tier1_cap_req"] == pytest.approx(
        short["mem_static_last"] + 8 * adapters, rel=1e-12)
    assert short["proc_mem_tier1_cap_req"] > short_without
    long, long_without = got[8192]
    assert long["proc_mem_tier1_cap_req"] == long_without


def test_qwen_lora_adapter_saved_bytes_by_hand():
    # PEFT 0.5's adapter keeps its dropout mask (1 byte) and lora_A's bf16
    # cast of the dropped-out input (2) for each element of its input
    # (frameworks/hf-peft.json adapter_saved_bytes 3), in the block that is
    # recomputed: autopar's Qwen adapters take inputs of h (q, k, v, o and
    # the MLP's input) and ff (the MLP's output): 3 x seq x (5 h + ff).
    # Nothing without training.
    import dataclasses
    from autopar.model import evaluate_one
    from autopar.studies.published import TABLES
    from autopar.studies.published_base import cases, PublishedCase
    case = next(c for _, c in cases(TABLES["qwen_lora_a100"])
                if isinstance(c, PublishedCase) and c.label == "Qwen-7B LoRA seq 8192")
    over = case.system.memory_overhead
    assert over.adapter_saved_bytes == 3.0

    def need(saved, **kw):
        s = dataclasses.replace(case.system, memory_overhead=dataclasses.replace(
            over, adapter_saved_bytes=saved))
        return evaluate_one(case.model, s, dict(case.execution, **kw))["proc_mem_tier1_cap_req"]
    h, ff, s = 4096, 11008, 8192
    assert need(3.0) - need(0.0) == pytest.approx(3 * s * (5 * h + ff), rel=1e-9)
    infer = {"training": False, "activation_recompute": "none"}
    assert need(3.0, **infer) == need(0.0, **infer)


def test_qwen_lora_rows_slower_with_the_peft_adapter_work():
    # Without the framework's adapter bytes the 7B/14B rows come out 15-30 %
    # fast: the counted term is what brings them in.
    import dataclasses
    from autopar.studies.published import TABLES, predict
    from autopar.studies.published_base import system

    def bare(case):
        return dataclasses.replace(case, system=system("a100_80g"))
    with_peft = predict(TABLES["qwen_lora_a100"], rank=False)
    without = predict(TABLES["qwen_lora_a100"], rank=False, transform=bare)
    a = with_peft[with_peft.status == "predicted"].pred_tokens_per_s_per_gpu.to_numpy()
    b = without[without.status == "predicted"].pred_tokens_per_s_per_gpu.to_numpy()
    assert (a < b).all() and (b / a).min() > 1.05
