"""torchtitan's context parallelism as PyTorch runs it (``time_overhead.
cp_ring_impl``: ``torch.distributed.tensor.experimental`` ring attention):
the per-step SDPA calls, the fp32 merges and copies beside them, the K/V
all-gather and the fp32 dK/dV ring (docs/validation.md, "torchtitan's
context parallelism (PyTorch ring attention), counted")."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_cp_ring import _te_ring_calls

H100 = "systems/h100_96g_nvl8.json"
MIB = 2.0 ** 20


def _ctx(cp, impl="torch_allgather", seq=16384):
    """A bf16 Llama 3 8B context (32 heads, 8 KV heads, head size 128) at
    ``seq`` tokens over ``cp`` ranks, torchtitan's framework with the ring
    implementation ``impl``."""
    from autopar.io.frameworks import load_framework, with_framework
    from autopar.io.layouts import to_columns
    from autopar.io.specs import load_model, load_system
    from autopar.model.context import LayoutContext
    from autopar.model.evaluate import normalize, typed_columns
    from conftest import one_proc_execution

    fw = load_framework("frameworks/torchtitan.json")
    fw = dataclasses.replace(fw, time_overhead=dataclasses.replace(
        fw.time_overhead, cp_ring_impl=impl))
    sy = with_framework(load_system(H100), fw)
    m = dataclasses.replace(load_model("models/llama3-8B.json"), seq_size=seq)
    ex = one_proc_execution(num_procs=cp, tensor_par=1, context_par=cp,
                            context_par_comm="p2p", datatype="bfloat16",
                            batch_size=1, microbatch_size=1)
    cols = typed_columns(normalize(to_columns([ex])))
    return LayoutContext(m, sy, cols, [2]), cols


# torch's _templated_ring_attention with load balancing makes the calls TE's
# AttnFuncWithCPAndKVP2P makes: rank r holds chunks r and 2cp-1-r, step 0
# causal over its own 2c keys, every later step c x 2c or 2c x c unmasked
_torch_ring_calls = _te_ring_calls


def test_per_step_calls_by_hand_cp4():
    """cp = 4: four SDPA calls a rank, every one 2c^2 query-key pairs; their
    sum is the flash layer's executed (causal) work: the kernel time is the
    flash layer's, at the backend's speed (no measured H100 record)."""
    from autopar.model.layers import _FLASH_CAUSAL, finish, flash_attention

    cp, s, heads, d = 4, 16384, 32, 128
    local = s // cp
    c = local // 2
    for calls in _torch_ring_calls(cp, s):
        assert len(calls) == cp and calls[0][2] and not any(x[2] for x in calls[1:])
        assert {p for *_, p in calls} == {2 * c * c}
    pairs = sum(p for *_, p in _torch_ring_calls(cp, s)[cp - 1])
    ctx, _ = _ctx(cp)
    L = finish(ctx, flash_attention(ctx, 1.0, float(heads), float(local), float(d), 1024.0, 3,
                                    sk=float(s)))
    assert float(L["fw"][0]) * _FLASH_CAUSAL == pytest.approx(4 * heads * d * pairs, rel=1e-12)


# Bytes by hand, Llama 3 8B bf16 at 16384 tokens, cp 4, rank 3: t = 4096
# local tokens; Q = O = t x 32 x 128 x 2 B = 32 MiB; K and V repeated to
# the 32 query heads (repeat_kv) 32 MiB each, K+V = 64 MiB; lse t x 32 x 4 B
# = 0.5 MiB; fp32 copies twice the bf16 bytes.
#   forward  contiguous K, V 2 x 64; three cats to send 3 x 2 x 64; step 0
#            out to fp32 32 + 64; three merges (out to fp32 32 + 64; 8 fp32
#            O = 512; 14 lse = 7) 3 x 615; result to bf16 64 + 32:
#            128 + 384 + 96 + 1845 + 96 = 2549 MiB
#   backward fp32 zeros dQ 64 + dK/dV 128; contiguous + three cats 4 x 128;
#            step 0 add 2 x 128 + 64; three half adds 0.5 x 320 and cats
#            2 x 128: 3 x 416; four dK/dV cats 4 x 256; four dQ adds
#            4 x (128 + 32); casts 64 + 32 and 128 + 64:
#            192 + 512 + 320 + 1248 + 1024 + 640 + 288 = 4224 MiB
def test_merge_bytes_by_hand_cp4():
    from autopar.model.layers import context_parallel_elementwise, finish

    cp = 4
    ctx, _ = _ctx(cp)
    L = finish(ctx, context_parallel_elementwise(ctx, 1.0, 32.0, 16384 / cp, 128.0, 1024.0))
    assert float(L["mem_fw"][0]) / MIB == pytest.approx(2549.0, rel=1e-12)
    assert float(L["mem_agrad"][0]) / MIB == pytest.approx(4224.0, rel=1e-12)
    assert float(L["time_fw"][0]) >= float(ctx.mem1.time(L["mem_fw"])[0]) > 0
    # TE's ring (the default) counts its own merges, fewer bytes
    ctx_te, _ = _ctx(cp, "te")
    Lte = context_parallel_elementwise(ctx_te, 1.0, 32.0, 16384 / cp, 128.0, 1024.0)
    assert float(Lte["mem_fw"][0]) / MIB == pytest.approx(393.5, rel=1e-12)


def test_exchange_by_hand_cp4():
    """The forward's one all-gather of the repeated K/V, hidden behind step
    0's attention; the backward's second all-gather and cp fp32 dK/dV
    transfers, the last exposed whole."""
    from autopar.model.communication import context_exchange

    cp, s = 4, 16384
    ctx, cols = _ctx(cp)
    chunk = 2 * (s / cp) * 32 * 128 * 2                       # K + V at the query width, bf16
    net = ctx.cp_net
    gather = float(net.time("all_gather", cp * chunk, cp)[0])
    dkv = float(net.time("p2p", 2 * chunk, 2)[0])
    for attn_fw, attn_bw in ((0.0, 0.0), (1.0, 1.0)):
        z = ctx.zeros
        cx = context_exchange(ctx, cols, 1.0, s / cp, 32 * 128.0, 8 * 128.0,
                              z + attn_fw, z + attn_bw, z.astype(bool))
        assert float(cx.fw_link[0]) == pytest.approx(gather, rel=1e-12)
        assert float(cx.bw_link[0]) == pytest.approx(gather + cp * dkv, rel=1e-12)
        assert float(cx.fw_size[0]) == pytest.approx((cp - 1) * chunk, rel=1e-12)
        if attn_fw == 0:
            assert float(cx.fw_exp[0]) == pytest.approx(gather, rel=1e-12)
            assert float(cx.bw_exp[0]) == pytest.approx(gather + cp * dkv, rel=1e-12)
        else:       # a second of attention hides all but the last dK/dV
            assert float(cx.fw_exp[0]) == 0.0
            assert float(cx.bw_exp[0]) == pytest.approx(dkv, rel=1e-12)


def test_non_cp_torchtitan_row_unchanged_cp_row_slower():
    """Rows without context parallelism predict the same under either ring;
    a CP 8 row is slower under PyTorch's than under TE's."""
    from autopar.model import evaluate_one
    from autopar.studies.published import TABLES
    from autopar.studies.published_base import cases

    by_row = dict(cases(TABLES["torchtitan"]))
    for row, cp in ((3, 1), (0, 1), (6, 8)):
        c = by_row[row]
        assert c.execution.get("context_par", 1) == cp
        t = c.system.time_overhead
        assert t.cp_ring_impl == "torch_allgather"
        te = dataclasses.replace(c.system, time_overhead=dataclasses.replace(t, cp_ring_impl="te"))
        rate = evaluate_one(c.model, c.system, c.execution)["sample_rate"]
        rate_te = evaluate_one(c.model, te, c.execution)["sample_rate"]
        if cp == 1:
            assert rate == rate_te
        else:
            assert rate < rate_te


@pytest.mark.parametrize("value", ["ring", 3, True])
def test_cp_ring_impl_bad_value_is_a_spec_error(tmp_path, value):
    from autopar.io.errors import SpecError
    from autopar.io.frameworks import load_framework

    doc = json.loads(open("frameworks/torchtitan.json").read())
    doc["time_overhead"]["cp_ring_impl"] = value
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(SpecError) as e:
        load_framework(str(p))
    assert "time_overhead.cp_ring_impl" in str(e.value)
    assert str(p) in str(e.value) or "bad.json" in str(e.value)


def test_alltoall_rotation_by_hand_cp4():
    """``torch_alltoall``: one permute of the local (repeated) K/V per step,
    cp - 1 in each pass, beside the backward's cp fp32 dK/dV transfers."""
    from autopar.model.communication import context_exchange

    cp, s = 4, 16384
    ctx, cols = _ctx(cp, "torch_alltoall")
    chunk = 2 * (s / cp) * 32 * 128 * 2
    step = float(ctx.cp_net.time("p2p", chunk, 2)[0])
    dkv = float(ctx.cp_net.time("p2p", 2 * chunk, 2)[0])
    z = ctx.zeros
    cx = context_exchange(ctx, cols, 1.0, s / cp, 32 * 128.0, 8 * 128.0, z, z, z.astype(bool))
    assert float(cx.fw_link[0]) == pytest.approx((cp - 1) * step, rel=1e-12)
    assert float(cx.fw_exp[0]) == pytest.approx((cp - 1) * step, rel=1e-12)
    assert float(cx.bw_link[0]) == pytest.approx((cp - 1) * step + cp * dkv, rel=1e-12)
