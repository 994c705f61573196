"""LatentMoE (``moe.latent_size``; Nemotron 3 Super / Ultra): hand counts of
one MoE block on a tiny model (parameters, FLOPs, dispatch bytes), the
default keeping today's meaning, and bad values refused by field."""
from __future__ import annotations

import pytest

from conftest import bf16_one_proc_execution as execution

from autopar import model as M
from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, model_to_json
from autopar.model.params import parameter_counts

MOE = {"experts": 4, "top_k": 2, "expert_feedforward": 32}


def tiny(moe, **kw):
    shape = {"hidden": 64, "feedforward": 128, "seq_size": 32, "attn_heads": 4,
             "attn_size": 16, "num_blocks": 2, "block": "llama", "name": "tiny", "moe": moe}
    shape.update(kw)
    return load_model(shape)


def run(model, system, **kw):
    return M.evaluate_one(model, system, load_execution(execution(**kw)))


def test_latent_zero_is_todays_moe(h100):
    """``latent_size`` 0 (the default) changes nothing."""
    a = run(tiny(MOE), h100)
    b = run(tiny({**MOE, "latent_size": 0}), h100)
    for key in ("block_fw_flops", "block_agrad_flops", "block_weight_space",
                "block_act_storage_space", "total_time"):
        assert a[key] == b[key], key


def test_latent_block_flops_and_weights_hand_count(h100):
    """4 experts of 32 (SwiGLU), top-2, 32 tokens of 64, latent 16: the
    experts' GEMMs and the weighted sum run at 16 instead of 64, and each
    token passes the two projections (2 T h d each way)."""
    T, h, d, k, E, f = 32, 64, 16, 2, 4, 32
    a, b = run(tiny(MOE), h100), run(tiny({**MOE, "latent_size": d}), h100)
    assert a["feasible"] and b["feasible"]
    experts = lambda w: 2 * T * k * (w * 2 * f + f * w)       # fc1 (gate+up), fc2
    combine = lambda w: 2 * T * k * w                          # the weighted sum, forward
    assert a["block_fw_flops"] - b["block_fw_flops"] == \
        experts(h) + combine(h) - experts(d) - combine(d) - 2 * (2 * T * h * d)
    # weights (bf16): the experts at width 16 and the two projections
    assert (a["block_weight_space"] - b["block_weight_space"]) / 2 == \
        E * 3 * f * (h - d) - 2 * h * d


def test_latent_parameter_counts(h100):
    """Parameters: each expert 3 x d x f, the block two h x d projections;
    active = shared part + top_k / experts of the routed."""
    d = 16
    a = parameter_counts(tiny(MOE), h100)
    b = parameter_counts(tiny({**MOE, "latent_size": d}), h100)
    assert a["routed"] == 4 * 3 * 64 * 32
    assert b["routed"] == 4 * 3 * d * 32
    assert b["moe_block"] - b["routed"] == a["moe_block"] - a["routed"] + 2 * 64 * d


def test_latent_dispatch_bytes_hand_count(roomy):
    """EP 4 on one NVLink domain: a dispatch or combine sends 3/4 of the
    token copies (T x top_k) at the latent width, a quarter of the hidden's."""
    net = roomy.networks[0]
    kw = dict(num_procs=4, data_par=4, batch_size=4, expert_par=4)
    a = run(tiny(MOE, seq_size=4096), roomy, **kw)
    b = run(tiny({**MOE, "latent_size": 16}, seq_size=4096), roomy, **kw)
    bw = net.bandwidth * 1e9 * net.efficiency
    one = lambda w: net.latency + 4096 * 2 * w * 2 * 3 / 4 / bw
    assert a["ep_comm_link_time"] == pytest.approx(2 * 4 * one(64))
    assert b["ep_comm_link_time"] == pytest.approx(2 * 4 * one(16))


def test_latent_json_round_trip():
    m = tiny({**MOE, "latent_size": 16})
    assert m.moe.latent_size == 16
    assert model_to_json(m)["moe"]["latent_size"] == 16
    assert "latent_size" not in model_to_json(tiny(MOE))["moe"]
    assert load_model(model_to_json(m)) == m


@pytest.mark.parametrize("value", [-1, 1.5, "16", True])
def test_latent_bad_values_name_the_field(value):
    with pytest.raises(SpecError) as e:
        tiny({**MOE, "latent_size": value})
    assert e.value.field == "moe.latent_size"


@pytest.mark.parametrize("shared", [0, 1])
def test_latent_saved_activations_hand_count(h100, shared):
    """Saved activations (bf16 elements, 32 tokens, top-2, 64 -> 16): the
    permuted copies the first expert GEMM keeps and the weighted sum's kept
    outputs (2 x T k each way) at 16 instead of 64; the up projection keeps
    its T x 16 input; the down projection keeps the T x 64 normalised input
    unless a shared expert's first GEMM keeps that tensor already."""
    T, h, d, k = 32, 64, 16, 2
    moe = {**MOE, "shared_experts": shared}
    a, b = run(tiny(moe), h100), run(tiny({**moe, "latent_size": d}), h100)
    want = 2 * T * k * (d - h) + T * d + (0 if shared else T * h)
    assert (b["block_act_storage_space"] - a["block_act_storage_space"]) / 2 == want
