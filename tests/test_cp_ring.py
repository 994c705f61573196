"""Context parallelism's attention as Transformer Engine runs it: the kernel
calls of the ring and of the all-to-all path, and the merges and copies
beside them (``layers.context_parallel_elementwise``; docs/validation.md
"The context-parallel ring, step by step, counted")."""
from __future__ import annotations

import dataclasses

import pytest

B200 = "systems/b200_nvl8.json"
MIB = 2.0 ** 20


def _ctx(cp, comm="p2p", seq=16384, tp=1, mbs=1, system=B200):
    """A bf16 Llama 3 8B context (32 heads, 8 KV heads, head size 128) at
    ``seq`` tokens split over ``cp`` ranks."""
    from autopar.io.layouts import to_columns
    from autopar.io.specs import load_model, load_system
    from autopar.model.context import LayoutContext
    from autopar.model.evaluate import normalize, typed_columns
    from conftest import one_proc_execution

    m = dataclasses.replace(load_model("models/llama3-8B.json"), seq_size=seq)
    ex = one_proc_execution(num_procs=tp * cp, tensor_par=tp, context_par=cp,
                            context_par_comm=comm, datatype="bfloat16",
                            batch_size=mbs, microbatch_size=mbs)
    cols = typed_columns(normalize(to_columns([ex])))
    return LayoutContext(m, load_system(system), cols, [2]), m


def _te_ring_calls(cp, s):
    """TE AttnFuncWithCPAndKVP2P.forward, causal, written out by hand: each
    rank holds chunks r and 2cp-1-r (c tokens each); step 0 attends its 2c
    queries to its own 2c keys causally, step i <= rank its 2c queries to
    the first chunk (c) of the received keys, step i > rank its second
    chunk's c queries to all 2c received keys.  Returns, per rank, the
    (queries, keys, causal) of each call and the query-key pairs it
    computes."""
    c = s // (2 * cp)
    ranks = []
    for rank in range(cp):
        calls = []
        for i in range(cp):
            if i == 0:
                q, k, causal = 2 * c, 2 * c, True
            elif i <= rank:
                q, k, causal = 2 * c, c, False
            else:
                q, k, causal = c, 2 * c, False
            pairs = q * k // 2 if causal else q * k
            calls.append((q, k, causal, pairs))
        ranks.append(calls)
    return ranks


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_kernel_calls_by_hand(cp, monkeypatch):
    """Every ring step's kernel call computes 2c^2 query-key pairs (the
    causal block of the local 2c queries at step 0, a 2c x c or c x 2c
    unmasked block after it), on every rank; the record is read at that
    call's GFLOP and the cp calls add up to the flash layer's executed work.
    Under all-to-all (``a2a``) one causal call over the whole sequence with
    heads / cp is the whole executed work."""
    import autopar.model.layers as layers

    s, heads, d = 16384, 32, 128
    local = s // cp
    c = local // 2
    for calls in _te_ring_calls(cp, s):
        assert len(calls) == cp
        assert calls[0][:3] == (2 * c, 2 * c, True)
        assert all(not causal for _, _, causal, _ in calls[1:])
        assert {p for *_, p in calls} == {2 * c * c}
        assert sum(p for *_, p in calls) == local * s // 2     # half the local rows x all keys
    per_call = 2 * (d + d) * heads * 2 * c * c                 # forward FLOPs of one call
    seen = []
    real = layers.measured_attention
    monkeypatch.setattr(layers, "measured_attention",
                        lambda ctx, L, call, executed, *a: (seen.append((call, executed)),
                                                            real(ctx, L, call, executed, *a)))
    for comm, calls_per_layer, heads_per_call in (("p2p", cp, heads), ("a2a", 1, heads // cp)):
        seen.clear()
        ctx, _ = _ctx(cp, comm)
        layers.flash_attention(ctx, 1.0, float(heads), float(local), float(d), 1024.0, 3,
                               sk=float(s))
        (call, executed), = seen
        executed = float(executed[0]) if hasattr(executed, "__len__") else float(executed)
        call = float(call[0]) if hasattr(call, "__len__") else float(call)
        assert executed == pytest.approx(cp * per_call, rel=1e-12)
        assert call * calls_per_layer == pytest.approx(executed, rel=1e-12)
        if comm == "p2p":
            assert call == pytest.approx(per_call, rel=1e-12)
        else:   # heads / cp, the whole sequence, causal
            assert call == pytest.approx(2 * (d + d) * heads_per_call * s * s / 2, rel=1e-12)


# Bytes by hand, Llama 3 8B bf16 at 16384 tokens, TP 1, one sequence: the
# local tokens t = 16384 / cp; Q and O t x 32 x 128 x 2 B, K + V t x 2 x
# 1024 x 2 B, the log-sum-exp t x 32 x 4 B.  cp 2: Q = O = 64 MiB, K+V 32
# MiB, lse 1 MiB; cp 4: halved.  Rank cp - 1 of the ring (TE 2.11):
#   forward  K/V concatenated into the send buffer 2 (K+V); lse cloned 2 lse;
#            output init 2 O + 2 lse; each later step: output merge 3 O +
#            2 lse, lse merge 3 lse.
#            cp 2: 64 + 2 + 130 + 197 = 393 MiB; cp 4: 32 + 1 + 65 + 3 x
#            98.5 = 393.5 MiB
#   backward K/V copied into the ring buffer 2 (K+V); dQ copied 2 Q, added
#            3 Q at each later step; dK/dV of the first chunk copied (K+V),
#            added 1.5 (K+V) at steps 1..cp-2, whole added 3 (K+V) last.
#            cp 2: 64 + 128 + 192 + 32 + 96 = 512 MiB; cp 4: 32 + 64 + 288
#            + 16 + 48 + 48 = 496 MiB
#   all-to-all: three read+write copies of Q, K, V, O (forward) and dO,
#            dQ, dK, dV (backward): 6 x (64 + 32 + 64) = 960 MiB at cp 2,
#            480 MiB at cp 4, each pass.
@pytest.mark.parametrize("cp, comm, fw_mib, bw_mib", [
    (2, "p2p", 393.0, 512.0), (4, "p2p", 393.5, 496.0),
    (2, "a2a", 960.0, 960.0), (4, "a2a", 480.0, 480.0)])
def test_merge_and_copy_bytes_by_hand(cp, comm, fw_mib, bw_mib):
    from autopar.model.layers import context_parallel_elementwise, finish

    ctx, _ = _ctx(cp, comm)
    local = 16384 / cp
    L = finish(ctx, context_parallel_elementwise(ctx, 1.0, 32.0, local, 128.0, 1024.0))
    assert float(L["mem_fw"][0]) / MIB == pytest.approx(fw_mib, rel=1e-12)
    assert float(L["mem_agrad"][0]) / MIB == pytest.approx(bw_mib, rel=1e-12)
    # memory-bound passes: the time is at least the bytes over the memory's rate
    assert float(L["time_fw"][0]) >= float(ctx.mem1.time(L["mem_fw"])[0]) > 0
    # nothing kept: no activation, weight or gradient memory
    for k in ("act_b", "weight_b", "out_b", "agrad_b", "optimizer"):
        assert float(L[k][0]) == 0.0
    # no context parallelism: nothing
    ctx1, _ = _ctx(1, comm)
    L1 = context_parallel_elementwise(ctx1, 1.0, 32.0, 16384.0, 128.0, 1024.0)
    assert float(L1["mem_fw"][0]) == float(L1["mem_agrad"][0]) == 0.0


def _without_merges(monkeypatch):
    import autopar.model.block as block

    real = block.context_parallel_elementwise

    def none(ctx, *a, **kw):
        L = real(ctx, *a, **kw)
        for k in ("fw", "agrad", "mem_fw", "mem_agrad"):
            L[k] = L[k] * 0.0
        return L
    monkeypatch.setattr(block, "context_parallel_elementwise", none)


def test_non_cp_row_unchanged_and_cp_row_slower(monkeypatch):
    """A row without context parallelism steps exactly as without the term;
    a ring row (CP 2) and an all-to-all row step slower by it, memory
    unchanged."""
    from autopar.io.specs import load_model, load_system
    from autopar.model.evaluate import evaluate_one
    from conftest import one_proc_execution

    m = dataclasses.replace(load_model("models/llama3-8B.json"), seq_size=16384)
    sy = load_system(B200)
    common = dict(datatype="bfloat16", batch_size=8, microbatch_size=1,
                  attention_impl="flash_v2", fused_activation=True)
    rows = {"cp1": one_proc_execution(num_procs=8, tensor_par=8, **common),
            "ring": one_proc_execution(num_procs=8, tensor_par=4, context_par=2,
                                       context_par_comm="p2p", **common),
            "a2a": one_proc_execution(num_procs=8, tensor_par=4, context_par=2,
                                      context_par_comm="a2a", **common)}
    with_term = {k: evaluate_one(m, sy, ex) for k, ex in rows.items()}
    _without_merges(monkeypatch)
    without = {k: evaluate_one(m, sy, ex) for k, ex in rows.items()}
    assert with_term["cp1"]["total_time"] == without["cp1"]["total_time"]
    for k in ("ring", "a2a"):
        assert with_term[k]["total_time"] > without[k]["total_time"]
        assert with_term[k]["total_time"] < 1.05 * without[k]["total_time"]
    for k in rows:
        assert with_term[k]["proc_mem_tier1_cap_req"] == without[k]["proc_mem_tier1_cap_req"]


def test_ring_backward_transfers_by_hand(h100):
    """The ring's link time under CP 4 (TE AttnFuncWithCPAndKVP2P): forward
    three K/V transfers; backward four, one per step: K/V at step 0, K/V
    with the dK/dV accumulated so far at steps 1 and 2, dK/dV at step 3."""
    from autopar.io.specs import load_model
    from autopar.model.evaluate import evaluate_one
    from conftest import one_proc_execution

    gpt = load_model({"name": "gpt-small", "hidden": 1024, "feedforward": 4096,
                      "seq_size": 4096, "attn_heads": 16, "attn_size": 64, "num_blocks": 8})
    net = h100.networks[0]
    ex = one_proc_execution(num_procs=8, data_par=2, context_par=4, context_par_comm="p2p",
                            batch_size=16, microbatch_size=1, datatype="bfloat16",
                            data_par_net=0, context_par_net=0)
    s = evaluate_one(gpt, h100, ex)
    assert s["feasible"], s
    chunk = 2 * 1 * 1024 * 1024 * 2      # K and V of 1024 local tokens, 1024 wide, bf16
    one = net.latency + chunk / (net.bandwidth * 1e9 * net.efficiency)
    two = net.latency + 2 * chunk / (net.bandwidth * 1e9 * net.efficiency)
    passes = 8 * 8                        # blocks x micro-batches (batch 16 / dp 2)
    assert s["cp_comm_link_time"] == pytest.approx(passes * (3 * one + 2 * one + 2 * two),
                                                   rel=1e-12)
    assert 0 <= s["cp_comm_exposed_time"] <= s["cp_comm_link_time"]
