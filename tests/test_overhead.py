"""An eager framework's host launch time (``time_overhead.launch_s``,
``autopar.model.overhead``): kernel counts by hand, the exposed time, the
opt-in default and the spec field."""
import dataclasses

import numpy as np
import pytest

from autopar.model.block_sums import BlockSums

from autopar.io.errors import SpecError
from autopar.io.layouts import CHOICES, to_columns
from autopar.io.specs import TimeOverhead, load_model, load_system, system_to_json
from autopar.model import evaluate_one
from autopar.model.overhead import block_kernels, launch_time
from autopar.model.rules import normalize

BASE = {"num_procs": 8, "tensor_par": 1, "pipeline_par": 1, "data_par": 8,
        "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
        "batch_size": 32, "microbatch_size": 1, "datatype": "bfloat16",
        "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": "none", "pipeline_interleaving": 1,
        "optimizer_sharding": False, "tensor_par_comm_type": "ar",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False,
        "data_par_overlap": False, "weight_offload": False,
        "activations_offload": False, "optimizer_offload": False, "training": True,
        "attention_impl": "flash_v2", "fused_norm": True}


def gpt(**kw):
    d = {"hidden": 256, "feedforward": 1024, "seq_size": 128, "attn_heads": 4,
         "attn_size": 64, "num_blocks": 4}
    d.update(kw)
    return load_model(d)


def kernels(model, **ex):
    cols = normalize(to_columns([dict(BASE, **ex)]))
    fw, bw = block_kernels(model, cols)
    return int(fw[0]), int(bw[0])


def test_block_kernels_by_hand():
    """GPT block, flash, fused norm and GeLU: forward 2 norms + flash + 4
    GEMMs (fused QKV, projection, MLP in/out) + GeLU + 2 residual adds + 2
    dropouts = 12; backward 2 x 2 norm kernels + 2 flash + 2 x 4 GEMMs + 4
    bias reductions + GeLU + 2 dropouts + 2 gradient sums = 23."""
    m = gpt()
    assert kernels(m) == (12, 23)
    # Llama: Q, K, V apart, gate/up/down (7 GEMMs, no biases), rotary on Q
    # and K, SiLU-and-multiply, no dropouts: 2 + 1 + 7 + 2 + 1 + 2 = 15;
    # backward 4 + 2 + 14 + 2 + 1 + 2 = 25.
    assert kernels(gpt(block="llama")) == (15, 25)
    # Unfused norms: four kernels each way instead of one and two.
    assert kernels(m, fused_norm=False) == (12 + 6, 23 + 4)
    # Unfused attention with the fused scale-mask-softmax: bmm, softmax,
    # dropout, bmm (4) forward, 2 + 2 + 1 + 1 = 6 backward, instead of 1 / 2.
    assert kernels(m, attention_impl="fused_softmax") == (12 + 3, 23 + 4)
    assert kernels(m, attention_impl="unfused") == (12 + 5, 23 + 6)
    # Full recompute re-runs the forward in the backward.
    assert kernels(m, activation_recompute="full") == (12, 23 + 12)
    # Tensor parallelism: 2 collectives a pass (all-reduce), 4 with
    # sequence parallelism's gather / reduce-scatter.
    tp = dict(num_procs=8, tensor_par=2, data_par=4)
    assert kernels(m, **tp) == (14, 25)
    assert kernels(m, **tp, tensor_par_comm_type="rs_ag") == (16, 27)
    # FSDP: one all-gather forward, an all-gather and a reduce-scatter back.
    assert kernels(m, optimizer_sharding=True, weight_sharding=True) == (13, 25)
    # Inference: no backward.
    assert kernels(m, training=False)[1] == 0


def test_launch_time_by_hand():
    """A pass exposes what issuing its kernels takes beyond its GPU time."""
    m = gpt()
    cols = normalize(to_columns([BASE, dict(BASE, activation_recompute="full")]))
    times = {"fw_time": np.array([50e-6, 50e-6]), "agrad_time": np.array([100e-6, 100e-6]),
             "wgrad_time": np.array([50e-6, 50e-6]), "re_time": np.array([0.0, 60e-6])}
    sums = BlockSums(**times)
    share = np.array([0.0, 1.0])
    t = launch_time(m, cols, sums, share, np.array([10, 10]), 10e-6)
    # fw: 12 x 10 us - 50 = 70 us; bw: 23 x 10 - 150 = 80 us; 10 passes.
    assert t[0] == pytest.approx(10 * (70e-6 + 80e-6))
    # recompute: bw 35 x 10 - (150 + 60) = 140 us.
    assert t[1] == pytest.approx(10 * (70e-6 + 140e-6))
    # Long passes hide the host; 0 s per kernel is Calculon's meaning.
    slow = BlockSums(**{k: v * 100 for k, v in times.items()})
    assert np.all(launch_time(m, cols, slow, share, np.array([10, 10]), 10e-6) == 0)
    assert launch_time(m, cols, sums, share, np.array([10, 10]), 0.0) == 0.0


@pytest.fixture(scope="module")
def a100():
    from pathlib import Path
    return load_system(Path(__file__).resolve().parent.parent / "systems" / "a100_80g.json")


def test_launch_time_in_the_batch(a100):
    """End to end: a small model with short passes runs at the host's pace
    (total time grows by the hand-computed exposure, memory unchanged); a
    large one does not move; no time_overhead = no change."""
    m = gpt()
    ex = dict(BASE, batch_size=64)
    s = 10e-6
    slow = dataclasses.replace(a100, time_overhead=TimeOverhead(launch_s=s))
    a, b = evaluate_one(m, a100, ex), evaluate_one(m, slow, ex)
    assert a["feasible"] and b["feasible"]
    passes = m.num_blocks * 64 // 8          # blocks x micro-batches
    fw = max(12 * s - a["block_fw_time"], 0.0)
    bw = max(23 * s - a["block_agrad_time"] - a["block_wgrad_time"], 0.0)
    assert fw > 0 and bw > 0
    assert b["total_time"] - a["total_time"] == pytest.approx(passes * (fw + bw), rel=1e-9)
    assert b["proc_mem_tier1_cap_req"] == a["proc_mem_tier1_cap_req"]
    big = gpt(hidden=4096, feedforward=16384, seq_size=2048, attn_heads=32, attn_size=128)
    assert evaluate_one(big, slow, ex)["total_time"] == evaluate_one(big, a100, ex)["total_time"]
    zero = dataclasses.replace(a100, time_overhead=TimeOverhead())
    assert evaluate_one(m, zero, ex) == a


@pytest.mark.parametrize("value", [-1e-6, 0.5, "x"])
def test_launch_s_spec_errors(a100, value):
    d = system_to_json(a100)
    d["time_overhead"] = {"launch_s": value}
    with pytest.raises(SpecError) as e:
        load_system(d)
    assert e.value.field == "time_overhead.launch_s"
    d["time_overhead"] = {"launch_s": 1e-05}
    back = system_to_json(load_system(d))
    assert back["time_overhead"]["launch_s"] == 1e-05
    assert load_system(back).time_overhead.launch_s == 1e-05
    assert "launch_s" not in system_to_json(a100).get("time_overhead", {})


def test_choices_the_counts_rely_on():
    assert CHOICES["attention_impl"].index("flash_v1") < CHOICES["attention_impl"].index(
        "flash_v2")


def test_attention_speed_replaces_the_flash_default(a100):
    """``time_overhead.attention_speed`` is the fused attention kernel's speed
    over the matrix curve: at the model's FlashAttention-2 default (0.75)
    nothing moves; at half of it the kernel takes twice as long (the
    difference doubles from 0.75 to 0.375 to 0.25 = a third), other
    attention implementations do not move, and memory does not."""
    m = gpt(seq_size=2048)
    ex = dict(BASE, batch_size=8)

    def with_speed(v):
        return dataclasses.replace(a100, time_overhead=TimeOverhead(attention_speed=v))
    base = evaluate_one(m, a100, ex)
    assert evaluate_one(m, with_speed(0.75), ex) == base
    half = evaluate_one(m, with_speed(0.375), ex)
    third = evaluate_one(m, with_speed(0.25), ex)
    d1 = half["block_fw_time"] - base["block_fw_time"]
    d2 = third["block_fw_time"] - base["block_fw_time"]
    assert d1 > 0 and d2 == pytest.approx(2 * d1, rel=1e-9)
    assert half["proc_mem_tier1_cap_req"] == base["proc_mem_tier1_cap_req"]
    unfused = dict(ex, attention_impl="fused_softmax")
    assert evaluate_one(m, with_speed(0.375), unfused) == evaluate_one(m, a100, unfused)
    d = system_to_json(a100)
    d["time_overhead"] = {"attention_speed": 3}
    with pytest.raises(SpecError) as e:
        load_system(d)
    assert e.value.field == "time_overhead.attention_speed"
    d["time_overhead"] = {"attention_speed": 0.4375}
    assert load_system(system_to_json(load_system(d))).time_overhead.attention_speed == 0.4375


def test_foundry_h100_attention_is_flash2_published_rate():
    """llm-foundry's H100 rows run FlashAttention-2 at its published 35% of
    peak: 0.35 over the H100 file's bf16 plateau (0.8); A100 rows keep the
    default."""
    from autopar.studies.published_foundry import foundry_system
    h = foundry_system("h100_80g_nvl8")
    assert h.time_overhead.attention_speed == pytest.approx(0.35 / 0.8, abs=1e-4)
    a = foundry_system("a100_40g")
    assert a.time_overhead is None or a.time_overhead.attention_speed == 0


def test_attention_backward_speed_moves_only_the_backward(a100):
    """``time_overhead.attention_backward_speed`` runs the fused kernel's
    backward (input gradients and recomputed scores, 3 x the forward's
    counted flops) at its own speed: the forward does not move, the
    backward's attention time scales as 1 / speed (halving it doubles the
    difference), the backward at ``attention_speed``'s value is exactly the
    one-rate count, and memory does not move; bad values are a SpecError."""
    m = gpt(seq_size=2048)
    ex = dict(BASE, batch_size=8)

    def with_speeds(fw, bw):
        return dataclasses.replace(a100, time_overhead=TimeOverhead(
            attention_speed=fw, attention_backward_speed=bw))
    one = evaluate_one(m, with_speeds(0.5, 0), ex)
    assert evaluate_one(m, with_speeds(0.5, 0.5), ex) == one
    half = evaluate_one(m, with_speeds(0.5, 0.25), ex)
    quarter = evaluate_one(m, with_speeds(0.5, 0.125), ex)
    assert half["block_fw_time"] == one["block_fw_time"]
    d1 = half["block_agrad_time"] - one["block_agrad_time"]
    d2 = quarter["block_agrad_time"] - one["block_agrad_time"]
    assert d1 > 0 and d2 == pytest.approx(3 * d1, rel=1e-9)
    # The backward's attention time at 0.5 equals d1 (doubling it at 0.25).
    slower_fw = evaluate_one(m, with_speeds(0.25, 0.5), ex)
    fw_attention = slower_fw["block_fw_time"] - one["block_fw_time"]
    assert d1 == pytest.approx(3 * fw_attention, rel=1e-9)   # 3 x the forward's work
    assert half["proc_mem_tier1_cap_req"] == one["proc_mem_tier1_cap_req"]
    d = system_to_json(a100)
    d["time_overhead"] = {"attention_backward_speed": -0.1}
    with pytest.raises(SpecError) as e:
        load_system(d)
    assert e.value.field == "time_overhead.attention_backward_speed"
    d["time_overhead"] = {"attention_speed": 0.42, "attention_backward_speed": 0.3409}
    back = load_system(system_to_json(load_system(d))).time_overhead
    assert (back.attention_speed, back.attention_backward_speed) == (0.42, 0.3409)


def test_attention_tile_counts_the_diagonal_tiles(a100):
    """``time_overhead.attention_tile``: a causal kernel computes the tiles
    on the diagonal whole, (n + 1) / 2n of the dense work for n tiles.  By
    hand at 512 tokens and tiles of 128 (n = 4): 5/8 instead of 1/2, so the
    kernel's forward time grows by a quarter; at 2048 (n = 16) by 1/16; a
    tile as long as the sequence computes the dense square (twice the
    half).  0 keeps the exact half; a negative or fractional tile is a
    SpecError."""
    ex = dict(BASE, batch_size=8)

    def fw_time(seq, speed, tile):
        sy = dataclasses.replace(a100, time_overhead=TimeOverhead(
            attention_speed=speed, attention_tile=tile))
        return evaluate_one(gpt(seq_size=seq), sy, ex)["block_fw_time"]
    for seq, n in ((512, 4), (2048, 16)):
        attention = 2 * (fw_time(seq, 0.5, 0) - fw_time(seq, 1.0, 0))   # the kernel at 0.5
        grown = fw_time(seq, 0.5, 128) - fw_time(seq, 0.5, 0)
        assert grown == pytest.approx(attention / n, rel=1e-9)
    attention = 2 * (fw_time(512, 0.5, 0) - fw_time(512, 1.0, 0))
    assert fw_time(512, 0.5, 512) - fw_time(512, 0.5, 0) == pytest.approx(attention, rel=1e-9)
    assert evaluate_one(gpt(seq_size=512), dataclasses.replace(
        a100, time_overhead=TimeOverhead(attention_tile=0)), ex) == evaluate_one(
        gpt(seq_size=512), a100, ex)
    d = system_to_json(a100)
    for bad in (-1, 1.5):
        d["time_overhead"] = {"attention_tile": bad}
        with pytest.raises(SpecError) as e:
            load_system(d)
        assert e.value.field == "time_overhead.attention_tile"
    d["time_overhead"] = {"attention_tile": 128}
    assert load_system(system_to_json(load_system(d))).time_overhead.attention_tile == 128


def test_grad_accum_bytes_adds_the_hooks_traffic(a100):
    """``time_overhead.grad_accum_bytes`` (NeMo Megatron 2022's optimizer hook
    adding each micro-batch's bf16 weight gradient into an fp32 buffer: 10
    bytes a weight) adds that traffic to the weight-gradient pass: per block
    10 x its weights at HBM bandwidth (the A100 file's 2039 GB/s at its 0.9
    efficiency for transfers over 100 MB), once per micro-batch and block;
    the forward, the input-gradient pass and memory do not move; 0 is no
    change; bad values name the field."""
    m = gpt(hidden=4096, feedforward=16384, seq_size=2048, attn_heads=32, attn_size=128)
    ex = dict(BASE, batch_size=16, microbatch_size=2)

    def with_bytes(v):
        return dataclasses.replace(a100, time_overhead=TimeOverhead(grad_accum_bytes=v))
    base, hook = evaluate_one(m, a100, ex), evaluate_one(m, with_bytes(10), ex)
    h = 4096
    weights = 12 * h * h + 13 * h              # QKV, projection, MLP, biases, two norms
    d = hook["block_wgrad_mem_time"] - base["block_wgrad_mem_time"]
    assert d == pytest.approx(10 * weights / (2039e9 * 0.9), rel=0.01)
    assert hook["block_wgrad_time"] - base["block_wgrad_time"] == pytest.approx(d, rel=1e-9)
    passes = m.num_blocks * 16 // 8 // 2       # blocks x micro-batches per rank
    assert hook["total_time"] - base["total_time"] == pytest.approx(passes * d, rel=1e-6)
    for k in ("block_fw_time", "block_agrad_time", "proc_mem_tier1_cap_req"):
        assert hook[k] == base[k]
    assert evaluate_one(m, with_bytes(0), ex) == base
    d = system_to_json(a100)
    for bad in (-1, 100, "x"):
        d["time_overhead"] = {"grad_accum_bytes": bad}
        with pytest.raises(SpecError) as e:
            load_system(d)
        assert e.value.field == "time_overhead.grad_accum_bytes"
    d["time_overhead"] = {"grad_accum_bytes": 10}
    assert load_system(system_to_json(load_system(d))).time_overhead.grad_accum_bytes == 10
    assert "grad_accum_bytes" not in system_to_json(a100).get("time_overhead", {})


def test_default_records_are_calculon_s_count(a100):
    """MemoryOverhead() and TimeOverhead() (every field at its default) give
    the very figures of a system without the records (Calculon's count), over
    layouts that reach the terms the fields switch: tensor and sequence
    parallelism, pipelines, recompute modes, sharding, overlap, fp8 on H100."""
    from pathlib import Path

    import autopar
    from autopar.io.specs import MemoryOverhead
    m = gpt(hidden=2048, feedforward=8192, seq_size=1024, attn_heads=16, attn_size=128,
            num_blocks=8)
    h100 = load_system(Path(__file__).resolve().parent.parent / "systems" /
                       "h100_80g_nvl8.json")
    exes = []
    for tp, pp, rec, shard, over in ((1, 1, "none", False, "none"), (2, 2, "full", True, "ring"),
                                     (4, 1, "attn_only", True, "pipe"),
                                     (2, 4, "mlp_only", False, "none")):
        exes.append(dict(BASE, tensor_par=tp, pipeline_par=pp, data_par=8 // (tp * pp) or 1,
                         num_procs=max(8, tp * pp), activation_recompute=rec,
                         optimizer_sharding=shard, tensor_par_overlap=over,
                         tensor_par_comm_type="rs_ag" if tp > 1 else "ar",
                         seq_par_ag_redo=tp > 1 and rec != "full"))
    for system in (a100, h100):
        if system is h100:
            exes += [dict(e, fp8_recipe="tensorwise") for e in exes]
        plain = autopar.evaluate(m, system, exes)
        rec = autopar.evaluate(m, dataclasses.replace(
            system, memory_overhead=MemoryOverhead(), time_overhead=TimeOverhead()), exes)
        assert plain["feasible"].all()
        assert plain.equals(rec)
