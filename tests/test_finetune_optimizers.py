"""Optimizers beyond Adam and fine-tuning (issue 28, items 1 and 4): the
state, step and Newton-Schulz of each optimizer and the frozen weights,
adapters, NF4 storage and padded sequences of LoRA / QLoRA / SFT, counted by
hand for a small GPT block; the defaults keep Calculon's figures
(tests/test_model.py)."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.io.specs import SpecError, load_execution, load_model
from autopar.model import evaluate_one
from autopar.model.finetune import NF4_BYTES
from autopar.model.hardware import ComputeEngine
from autopar.model.optimizers import newton_schulz_flops
from autopar.io.layouts import CHOICES
from tests.conftest import REPO_ROOT, one_proc_execution

h, f, BLOCKS = 1024, 4096, 8
GPT = {"hidden": h, "feedforward": f, "seq_size": 2048, "attn_heads": 16,
       "attn_size": 64, "num_blocks": BLOCKS}
# One GPT block: Q, K, V, O (h x h each), the MLP (h x f, f x h); two
# LayerNorms (weight and bias).
MATRICES = [(h, h)] * 4 + [(h, f), (f, h)]
P_M = sum(m * n for m, n in MATRICES)
P_V = 2 * 2 * h
TOKENS = 2 * 2048                 # micro-batch 2 x seq_size


@pytest.fixture(scope="module")
def gpt():
    return load_model(dict(GPT, name="gpt-small"))


def run(model, system, **kw):
    s = evaluate_one(model, system, one_proc_execution(**kw))
    assert s["feasible"], s
    return s


# ------------------------------------------------------------------ optimizers

def test_newton_schulz_flops_by_hand():
    # Five iterations of A = X X^T (2 m m n), B = bA + cAA (2 m m m),
    # X = aX + BX (2 m m n) on m x n, m <= n.
    assert newton_schulz_flops(2, 3) == 5 * (2 * 2 * 2 * 3 + 2 * 2 * 2 * 2 + 2 * 2 * 2 * 3)
    assert newton_schulz_flops(3, 2) == newton_schulz_flops(2, 3)
    assert sum(newton_schulz_flops(m, n) for m, n in MATRICES) == 300 * 2 ** 30


@pytest.mark.parametrize("optimizer,state_bytes,per_param", [
    # float16 weights: a 4-byte fp32 master copy, plus the optimizer's state.
    ("adam", 12 * (P_M + P_V), 11),                       # two fp32 moments
    ("sgd", 8 * (P_M + P_V), 4),                          # one momentum buffer
    ("muon", 8 * P_M + 12 * P_V, None),                   # momentum; AdamW vectors
    ("adafactor", 4 * P_M + 4 * sum(m + n for m, n in MATRICES) + 8 * P_V, 12),
])
def test_optimizer_state_and_step_by_hand(gpt, roomy, optimizer, state_bytes, per_param):
    s = run(gpt, roomy, optimizer=optimizer)
    assert s["block_optimizer_space"] == state_bytes
    assert s["optimizer_space"] == BLOCKS * state_bytes
    # The step reads the state once (Calculon's count for Adam).
    assert s["block_optim_mem_accessed"] == state_bytes
    flops = (P_M + P_V) * per_param if per_param else P_M * 9 + P_V * 11
    assert s["block_optim_flops"] == flops
    if optimizer != "muon":
        assert s["optim_step_time"] == pytest.approx(BLOCKS * s["block_optim_time"], rel=1e-12)
    # Nothing else changes.
    adam = run(gpt, roomy)
    assert s["fw_time"] == adam["fw_time"] and s["bw_time"] == adam["bw_time"]
    assert s["weight_space"] == adam["weight_space"]


def test_muon_newton_schulz_time_by_hand(gpt, roomy):
    s = run(gpt, roomy, optimizer="muon")
    dt = np.array([CHOICES["datatype"].index("float16")])
    engine = ComputeEngine(roomy.matrix, dt, [int(dt[0])])
    ns = float(engine.time(np.array([300.0 * 2 ** 30]))[0])
    # One processor: every matrix orthogonalised here, nothing exchanged.
    assert s["optim_step_time"] == pytest.approx(BLOCKS * (s["block_optim_time"] + ns),
                                                 rel=1e-12)


def test_muon_sharded_owner_computes_and_exchanges(gpt, roomy):
    kw = dict(num_procs=8, data_par=8, batch_size=16, microbatch_size=1,
              optimizer_sharding=True)
    s = run(gpt, roomy, optimizer="muon", **kw)
    dt = np.array([CHOICES["datatype"].index("float16")])
    engine = ComputeEngine(roomy.matrix, dt, [int(dt[0])])
    ns = float(engine.time(np.array([300.0 * 2 ** 30 / 8]))[0])      # 1/8 of the matrices
    net = roomy.networks[0]
    share = 4.0 * P_M / 8                 # a rank's fp32 share of the block's matrices
    gather = net.latency + share * (1 - 1 / 8) / (net.bandwidth * 1e9 * net.efficiency)
    assert s["optim_step_time"] == pytest.approx(
        BLOCKS * (s["block_optim_time"] + ns + 2 * gather), rel=1e-12)
    # Sharded state: an eighth of the unsharded.
    assert s["block_optimizer_space"] == pytest.approx((8 * P_M + 12 * P_V) / 8, rel=1e-12)


# ----------------------------------------------------------------- fine-tuning

R = 16
# Adapters on q, k, v, o and the MLP: r (n + k) each.
ADAPTER = R * sum(m + n for m, n in MATRICES)


def test_lora_freezes_base_and_adds_adapters_by_hand(gpt, roomy):
    full = run(gpt, roomy)
    lora = run(gpt, roomy, adapter="lora", adapter_rank=R)
    # Weights: the base (float16) and the adapters.
    assert lora["block_weight_space"] == 2 * (P_M + P_V) + 2 * ADAPTER
    # Only the adapters have gradients (float16) and optimizer state (Adam).
    assert lora["block_weight_grad_space"] == 2 * ADAPTER
    assert lora["block_optimizer_space"] == 12 * ADAPTER
    # No weight-gradient GEMM of a frozen weight: only the adapters',
    # 2 r (n + k) FLOPs a token; forward and input gradient gain as much.
    assert lora["block_wgrad_flops"] == 2 * TOKENS * ADAPTER
    assert lora["block_fw_flops"] - full["block_fw_flops"] == 2 * TOKENS * ADAPTER
    assert lora["block_agrad_flops"] - full["block_agrad_flops"] == 2 * TOKENS * ADAPTER
    # The base's weight-gradient GEMMs are a third of its GEMM FLOPs.
    assert full["block_wgrad_flops"] >= 2 * TOKENS * P_M
    assert lora["bw_time"] < full["bw_time"]


def test_lora_targets_and_rank(gpt, roomy):
    qv = run(gpt, roomy, adapter="lora", adapter_rank=8, adapter_targets="qv")
    att = run(gpt, roomy, adapter="lora", adapter_rank=8, adapter_targets="attention")
    assert qv["block_weight_grad_space"] == 2 * 8 * (2 * h + 2 * h)
    assert att["block_weight_grad_space"] == 2 * 8 * 4 * (2 * h)


def test_lora_fused_qkv_adapter_by_hand(gpt, roomy):
    # NeMo's attention_qkv: one adapter on the fused QKV projection, A of
    # h x r and B of r x 3h (q, k, v of h each here): r (h + 3h) weights.
    qkv = run(gpt, roomy, adapter="lora", adapter_rank=8, adapter_targets="qkv")
    full = run(gpt, roomy)
    assert qkv["block_weight_grad_space"] == 2 * 8 * (h + 3 * h)
    assert qkv["block_optimizer_space"] == 12 * 8 * (h + 3 * h)
    assert qkv["block_fw_flops"] - full["block_fw_flops"] == 2 * TOKENS * 8 * (h + 3 * h)
    # Fewer weights than three adapters of its own for q, k and v.
    att = run(gpt, roomy, adapter="lora", adapter_rank=8, adapter_targets="attention")
    assert qkv["block_weight_grad_space"] < att["block_weight_grad_space"] - 2 * 8 * 2 * h


def test_attention_span_shortens_only_the_flash_core_by_hand(gpt, roomy):
    # Packed documents (attention_span l): the FlashAttention core computes
    # 4 mbs heads s l d forward FLOPs instead of 4 mbs heads s s d; nothing
    # else changes.
    flash = {"attention_impl": "flash_v2"}
    whole = run(gpt, roomy, **flash)
    packed = run(gpt, roomy, attention_span=256, **flash)
    heads, d, s, mbs = GPT["attn_heads"], GPT["attn_size"], GPT["seq_size"], 2
    assert whole["block_fw_flops"] - packed["block_fw_flops"] == \
        4 * mbs * heads * s * (s - 256) * d
    assert packed["fw_time"] < whole["fw_time"]
    assert packed["block_weight_space"] == whole["block_weight_space"]
    assert packed["proc_mem_tier1_cap_req"] == whole["proc_mem_tier1_cap_req"]
    # A span of the whole sequence (or more) is the default's figures.
    same = run(gpt, roomy, attention_span=s, **flash)
    assert same["total_time"] == whole["total_time"]
    # An unfused attention computes the masked s x s scores in full.
    unfused = run(gpt, roomy, attention_impl="unfused")
    unfused_packed = run(gpt, roomy, attention_impl="unfused", attention_span=256)
    assert unfused_packed["total_time"] == unfused["total_time"]


def test_framework_adapter_elementwise_bytes_by_hand(gpt, roomy):
    # A framework's adapter work beyond its GEMMs (PEFT 0.5: casts, dropout,
    # scaling, the add; frameworks/hf-peft.json): per adapter of n inputs
    # and k outputs, B (n fw_in + k fw_out) bytes forward and B (n bw_in +
    # k bw_out) backward, B the micro-batch's tokens.
    from autopar.io.frameworks import load_framework, with_framework
    peft = with_framework(roomy, load_framework("hf-peft"))
    fw_in, fw_out, bw_in, bw_out = peft.time_overhead.adapter_bytes
    assert (fw_in, fw_out, bw_in, bw_out) == (21, 10, 27, 4)
    plain = run(gpt, roomy, adapter="lora", adapter_rank=R)
    framed = run(gpt, peft, adapter="lora", adapter_rank=R)
    sum_n = sum(m for m, n in MATRICES)          # the adapters' inputs
    sum_k = sum(n for m, n in MATRICES)          # and outputs
    assert framed["block_fw_mem_accessed"] - plain["block_fw_mem_accessed"] == \
        TOKENS * (sum_n * fw_in + sum_k * fw_out)
    assert framed["block_agrad_mem_accessed"] - plain["block_agrad_mem_accessed"] == \
        TOKENS * (sum_n * bw_in + sum_k * bw_out)
    assert framed["total_time"] > plain["total_time"]
    # Without adapters the framework's record changes nothing.
    assert run(gpt, peft)["total_time"] == run(gpt, roomy)["total_time"]


def test_qlora_stores_nf4_and_dequantises(gpt, roomy):
    lora = run(gpt, roomy, adapter="lora")
    q = run(gpt, roomy, adapter="qlora")
    assert NF4_BYTES == pytest.approx(4.127 / 8, abs=1e-4)
    # Block matrices in NF4 (4.127 bits); norms and adapters stay float16.
    assert q["block_weight_space"] == pytest.approx(
        P_M * NF4_BYTES + 2 * P_V + 2 * ADAPTER, rel=1e-12)
    # Each forward GEMM reads the 4-bit weight and writes it dequantised.
    assert q["block_fw_mem_accessed"] - lora["block_fw_mem_accessed"] == pytest.approx(
        P_M * (NF4_BYTES + 2), rel=1e-12)
    assert q["block_weight_grad_space"] == lora["block_weight_grad_space"]


def test_lora_syncs_only_adapter_gradients(gpt, roomy):
    kw = dict(num_procs=8, data_par=8, batch_size=16, microbatch_size=1)
    full = run(gpt, roomy, **kw)
    lora = run(gpt, roomy, adapter="lora", **kw)
    assert full["block_dp_size"] == 2 * (P_M + P_V)
    assert lora["block_dp_size"] == 2 * ADAPTER


def test_padded_sequences_count_real_tokens(gpt, roomy):
    from autopar.io.layouts import to_columns
    from autopar.model.evaluate import STATS, evaluate_columns
    assert "token_rate" not in STATS            # on request only

    def rates(**kw):
        out = evaluate_columns(gpt, roomy, to_columns([one_proc_execution(**kw)]),
                               stats=("sample_rate", "total_time", "token_rate"))
        return {k: float(v[0]) for k, v in out.items() if k != "reason_code"}

    packed, padded = rates(), rates(sequence_fill=40)
    assert packed["token_rate"] == pytest.approx(packed["sample_rate"] * 2048, rel=1e-12)
    assert padded["total_time"] == packed["total_time"]
    assert padded["token_rate"] == pytest.approx(0.4 * packed["token_rate"], rel=1e-12)


@pytest.mark.parametrize("field,value", [
    ("optimizer", "lion"), ("adapter", "dora"), ("adapter_rank", 0),
    ("sequence_fill", 101), ("sequence_fill", 0), ("adapter_targets", "mlp")])
def test_bad_fields_name_the_field(field, value):
    with pytest.raises(SpecError) as e:
        load_execution(one_proc_execution(**{field: value}), source="x.json")
    assert field in str(e.value)


def test_defaults_leave_layouts_as_they_were(gpt, roomy):
    a = run(gpt, roomy)
    b = run(gpt, roomy, optimizer="adam", adapter="none", adapter_rank=64,
            adapter_targets="qv", sequence_fill=100)
    for k in a:
        assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), k


def test_finetune_space_searches_the_recipe_fields():
    from autopar.io.specs import load_system
    from autopar.search.space import Case, load_space
    from tests.conftest import REPO_ROOT
    model = load_model(REPO_ROOT / "models" / "llama2-7B.json")
    case = Case(model, load_system(REPO_ROOT / "systems" / "a100_80g.json"), 8, 64, "bfloat16")
    space = load_space("finetune")
    assert space.fixed["adapter"] == "lora" and space.fixed["adapter_rank"] == 16
    n = space.size(case)
    assert n > 0
    spec = space.spec
    wide = load_space({
        "name": "wide", "batch_policy": spec.batch_policy,
        "params": {**{p: a.to_yaml() for p, a in spec.allowed.items()},
                   "adapter": ["lora", "qlora"], "optimizer": "derived",
                   "adapter_targets": "derived"},
        "fixed": {p: v for p, v in spec.fixed.items()
                  if p not in ("adapter", "optimizer", "adapter_targets")}})
    # Each recipe multiplies the layouts: 2 adapters x 4 optimizers x 4 targets
    # (all, attention, qv, qkv).
    assert len(CHOICES["adapter_targets"]) == 4
    assert wide.size(case) == 32 * n
    chunk = next(iter(wide.enumerate(case, 10 ** 6)))
    assert set(np.unique(chunk["optimizer"])) == set(range(4))
    # Without an adapter the rank and targets are forced to their defaults.
    full = load_space({"name": "full", "batch_policy": spec.batch_policy,
                       "params": {**{p: a.to_yaml() for p, a in spec.allowed.items()},
                                  "adapter": "derived", "adapter_rank": [8, 16]},
                       "fixed": {p: v for p, v in spec.fixed.items()
                                 if p not in ("adapter", "adapter_rank")}})
    # none: rank forced (1 layout); lora, qlora: ranks 8 and 16.
    assert full.size(case) == (1 + 2 * 2) * n


@pytest.mark.parametrize("optimizer,state,per_param", [
    # (fp32 state bytes of a matrix of n x k, of a vector of v; FLOPs a parameter)
    ("adam", lambda n, k: 8 * n * k, 11), ("sgd", lambda n, k: 4 * n * k, 4),
    ("adafactor", lambda n, k: 4 * (n + k), 12), ("muon", lambda n, k: 4 * n * k, 9)])
def test_optimizer_step_time_by_hand(gpt, roomy, optimizer, state, per_param):
    """Each weighted layer's step: its update FLOPs on the vector engine plus
    its master copy and state read once from memory (Calculon's count),
    added (the system's no_overlap mode)."""
    from autopar.model.hardware import MemoryTier
    assert roomy.processing_mode == "no_overlap"
    dt = np.array([CHOICES["datatype"].index("float16")])
    vector = ComputeEngine(roomy.vector, dt, [int(dt[0])])
    mem = MemoryTier(roomy.mem1)
    expected = 0.0
    for n, k in MATRICES:
        expected += float(vector.time(np.array([n * k * per_param]))[0])
        expected += float(mem.time(np.array([4.0 * n * k + state(n, k)]))[0])
    for _ in range(2):          # two LayerNorms, 2 h weights each (Muon: AdamW)
        v = 2 * h
        vec_state = {"adam": 8, "muon": 8, "sgd": 4, "adafactor": 4}[optimizer] * v
        vec_flops = {"muon": 11}.get(optimizer, per_param) * v
        expected += float(vector.time(np.array([vec_flops]))[0])
        expected += float(mem.time(np.array([4.0 * v + vec_state]))[0])
    s = run(gpt, roomy, optimizer=optimizer)
    assert s["block_optim_time"] == pytest.approx(expected, rel=1e-12)


def test_qlora_with_fp8_is_refused(gpt, roomy):
    s = evaluate_one(gpt, roomy, one_proc_execution(adapter="qlora", datatype="bfloat16",
                                                    fp8_recipe="tensorwise"))
    assert not s["feasible"]
    from autopar.model.rules import REASONS
    assert "qlora" in REASONS[int(s["reason_code"])]
    assert run(gpt, roomy, adapter="lora", datatype="bfloat16", fp8_recipe="tensorwise")


@pytest.mark.parametrize("bad", [{"forward_input": -1}, {"forward_in": 3}, [21, 10, 27, 4]])
def test_adapter_elementwise_bytes_bad_input_names_the_field(bad):
    from autopar.io.frameworks import load_framework
    with pytest.raises(SpecError) as e:
        load_framework({"name": "x", "time_overhead": {"adapter_elementwise_bytes": bad}})
    assert "adapter_elementwise_bytes" in str(e.value)


def test_attention_span_shortens_multi_head_latent_attention_too(roomy):
    # DeepSeek-V2's MLA core (heads x (qk 192, v 128)): forward FLOPs
    # 2 mbs heads s span (dqk + dv) instead of ... s s ...
    import dataclasses
    m = load_model(REPO_ROOT / "models" / "deepseek-v2.json")
    m = dataclasses.replace(m, num_blocks=2, seq_size=4096)
    kw = {"attention_impl": "flash_v2", "datatype": "bfloat16", "microbatch_size": 1}
    whole = evaluate_one(m, roomy, one_proc_execution(**kw))
    packed = evaluate_one(m, roomy, one_proc_execution(attention_span=512, **kw))
    heads, dqk, dv, s = m.attn_heads, 192, 128, 4096
    assert whole["block_fw_flops"] - packed["block_fw_flops"] == \
        2 * heads * s * (s - 512) * (dqk + dv)
    assert packed["fw_time"] < whole["fw_time"]
