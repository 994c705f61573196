"""``memory_overhead.head_weights_sharded`` (Megatron-FSDP shards the
embedding's and the output layer's weights and gathers the output layer's
around the loss) and the recipes' ``gradient_accumulation_fusion`` False (no
Transformer Engine dummy weight gradients): hand counts."""
from __future__ import annotations

import json

import pytest

from autopar.io.specs import load_execution, load_model, load_system
from autopar.model import evaluate_one
from autopar.studies import recipe_table as T

from conftest import REPO_ROOT, one_proc_execution

MODEL = REPO_ROOT / "models/llama2-7B.json"
SYSTEM = REPO_ROOT / "systems/a100_80g.json"


def _system(**over):
    data = json.loads(SYSTEM.read_text())
    data["mem1"]["GiB"] = 100000
    data["memory_overhead"] = {"logits_fp32_copies": 0, **over}
    return load_system(data)


def _fsdp(dp: int, **kw):
    return one_proc_execution(num_procs=dp, data_par=dp, batch_size=2 * dp,
                              datatype="bfloat16", optimizer_sharding=True,
                              weight_sharding=True, data_par_net=0, **kw)


@pytest.mark.parametrize("dp", [2, 8])
def test_head_matrices_sharded_and_the_output_layer_gathered(dp):
    model = load_model(MODEL)
    ex = load_execution(_fsdp(dp))
    whole = evaluate_one(model, _system(), ex)
    sharded = evaluate_one(model, _system(head_weights_sharded=True), ex)
    matrix = model.vocab_size * model.hidden * 2          # one bf16 matrix, TP 1
    # one stage holds both matrices: each at 1/dp instead of whole, plus the
    # output layer's whole weight gathered at the peak
    saved = 2 * matrix * (1 - 1 / dp) - matrix
    assert whole["proc_mem_tier1_cap_req"] - sharded["proc_mem_tier1_cap_req"] == \
        pytest.approx(saved, rel=1e-9)
    # nothing else moves
    assert whole["total_time"] == sharded["total_time"]


def test_no_effect_without_weight_sharding():
    model = load_model(MODEL)
    ex = load_execution(one_proc_execution(num_procs=4, data_par=4, batch_size=8,
                                           datatype="bfloat16", optimizer_sharding=True,
                                           unsharded_grads=True, data_par_net=0))
    a = evaluate_one(model, _system(), ex)
    b = evaluate_one(model, _system(head_weights_sharded=True), ex)
    assert a == b


def test_recipe_without_wgrad_fusion_drops_the_dummy_gradients():
    sy = _system(dummy_wgrad=True, wgrad_accumulation_fusion=True)
    off = T.without_wgrad_fusion(sy, {"model.gradient_accumulation_fusion": "False"})
    assert not off.memory_overhead.dummy_wgrad
    assert not off.memory_overhead.wgrad_accumulation_fusion
    assert T.without_wgrad_fusion(sy, {"gradient_accumulation_fusion": "true"}) is sy
    assert T.without_wgrad_fusion(sy, {}) is sy
    model = load_model(MODEL)
    ex = load_execution(_fsdp(8))
    with_dummy, without = evaluate_one(model, sy, ex), evaluate_one(model, off, ex)
    # TE's dummy gradients: one bf16 tensor per distinct weight shape of the
    # block (the fused QKV 3h x h, the projection h x h, the SwiGLU's fc1
    # 2f x h, fc2 h x f) and the output layer's whole matrix; under
    # Megatron-FSDP the gradients are sharded either way, so the buffer
    # fusion changes nothing else
    h, f, V = model.hidden, model.feedforward, model.vocab_size
    dummies = 2 * (3 * h * h + h * h + 2 * f * h + h * f) + 2 * V * h
    assert with_dummy["proc_mem_tier1_cap_req"] - without["proc_mem_tier1_cap_req"] == \
        pytest.approx(dummies, rel=1e-12)
