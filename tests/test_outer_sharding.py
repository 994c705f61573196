"""Megatron-FSDP's hybrid sharding with the optimizer state sharded across
the instances too (``optimizer_outer_sharding``; Megatron-LM's
``--outer-dp-sharding-strategy optim``): memory and the extra collectives
counted by hand on a small case, the user-input errors, the launch round
trip and the formats that refuse it, and the Bridge recipe it predicts."""
from __future__ import annotations

import pytest

from autopar.io.errors import SpecError
from autopar.io.launch import get
from autopar.io.specs import load_execution, load_model
from autopar.model import evaluate_one
from autopar.model.rules import REASONS
from tests.conftest import REPO_ROOT, one_proc_execution

GPT = {"hidden": 1024, "feedforward": 4096, "seq_size": 2048, "attn_heads": 16,
       "attn_size": 64, "num_blocks": 8}
# data_par 8 in 4 instances of 2 ranks (sharding_group 2)
HSDP = dict(optimizer_sharding=True, weight_sharding=True, sharding_group=2,
            data_par_overlap=True)


@pytest.fixture(scope="module")
def gpt():
    return load_model(dict(GPT, name="gpt-small"))


def exe(**kw):
    base = dict(num_procs=8, data_par=8, batch_size=16, microbatch_size=1,
                datatype="bfloat16", data_par_net=0)
    base.update(kw)
    return one_proc_execution(**base)


def run(model, system, **kw):
    s = evaluate_one(model, system, exe(**kw))
    assert s["feasible"], s
    return s


def collective(net, op, nbytes, peers):
    """A collective's seconds as the system file states it (scale and
    offset of the op, latency, bandwidth x efficiency), by hand."""
    scale, offset = net.ops[op]
    size = nbytes * scale
    size = size + size / peers * (offset or 0.0)
    return net.latency + size / (net.bandwidth * 1e9 * net.efficiency)


def test_memory_optimizer_over_the_whole_group_weights_and_grads_over_the_instance(gpt, h100):
    hsdp = run(gpt, h100, **HSDP)
    outer = run(gpt, h100, **HSDP, optimizer_outer_sharding=True)
    fsdp = run(gpt, h100, optimizer_sharding=True, weight_sharding=True, data_par_overlap=True)
    # optimizer state and fp32 master weights: / 8 ranks, not / 2
    assert outer["optimizer_space"] == pytest.approx(hsdp["optimizer_space"] / 4, rel=1e-12)
    assert outer["optimizer_space"] == pytest.approx(fsdp["optimizer_space"], rel=1e-12)
    # weights and gradients stay sharded over the instance's 2 ranks
    for k in ("block_weight_space", "block_weight_grad_space", "weight_space"):
        assert outer[k] == pytest.approx(hsdp[k], rel=1e-12), k
        assert outer[k] > 3 * fsdp[k], k
    saved = hsdp["optimizer_space"] - outer["optimizer_space"]
    assert hsdp["proc_mem_tier1_cap_req"] - outer["proc_mem_tier1_cap_req"] == \
        pytest.approx(saved, rel=1e-9)


def test_the_cross_instance_collectives_counted(gpt, h100):
    hsdp = run(gpt, h100, **HSDP)
    outer = run(gpt, h100, **HSDP, optimizer_outer_sharding=True)
    whole = run(gpt, h100, optimizer_sharding=True)         # whole weights: a block's bytes
    block = whole["block_weight_space"]
    net = h100.networks[0]
    # Gradients: each block's instance shard (block / 2) reduce-scattered over
    # the 4 instances instead of all-reduced, once a step, 8 blocks.
    ar = collective(net, "all_reduce", block / 2, 4)
    rs = collective(net, "reduce_scatter", block / 2, 4)
    assert hsdp["dp_comm_link_time"] - outer["dp_comm_link_time"] == \
        pytest.approx(8 * (ar - rs), rel=1e-9)
    # Weights: once a step, before the first forward, each block's instance
    # shard all-gathered from the 4 instances' pieces.
    ag = collective(net, "all_gather", block / 2, 4)
    assert outer["weight_gather_link_time"] - hsdp["weight_gather_link_time"] == \
        pytest.approx(8 * ag, rel=1e-9)
    # the first block's outer gather is exposed whole, the others at most so
    gained = outer["weight_gather_exposed_time"] - hsdp["weight_gather_exposed_time"]
    assert ag * (1 - 1e-9) <= gained <= 8 * ag * (1 + 1e-9)


def test_the_model_refuses_it_without_hybrid_weight_sharding(gpt, h100):
    for kw in (dict(optimizer_sharding=True, sharding_group=2),          # no weight sharding
               dict(optimizer_sharding=True, weight_sharding=True),      # no instances
               dict(optimizer_sharding=True, weight_sharding=True, sharding_group=8)):
        s = evaluate_one(gpt, h100, exe(**kw, optimizer_outer_sharding=True))
        assert not s["feasible"]
        assert REASONS[s["reason_code"]].startswith("invalid: optimizer_outer_sharding"), kw
    assert evaluate_one(gpt, h100, exe(**HSDP, optimizer_outer_sharding=False))["feasible"]


@pytest.mark.parametrize("kw", [dict(optimizer_sharding=True, sharding_group=2),
                                dict(optimizer_sharding=True, weight_sharding=True),
                                dict(optimizer_sharding=True, weight_sharding=True,
                                     sharding_group=8)])
def test_spec_error_names_the_field(kw):
    with pytest.raises(SpecError, match="optimizer_outer_sharding"):
        load_execution(exe(**kw, optimizer_outer_sharding=True))


def test_spec_error_on_a_wrong_type():
    with pytest.raises(SpecError, match="optimizer_outer_sharding"):
        load_execution(exe(**HSDP, optimizer_outer_sharding="sometimes"))
    assert load_execution(exe(**HSDP, optimizer_outer_sharding=True))["optimizer_outer_sharding"]
    # the default is not written (Calculon's meaning)
    assert "optimizer_outer_sharding" not in load_execution(exe(**HSDP))


def _fsdp_layout(**kw):
    ex = {"num_procs": 8, "tensor_par": 1, "pipeline_par": 1, "data_par": 8,
          "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0, "batch_size": 32,
          "microbatch_size": 1, "datatype": "bfloat16", "fused_activation": True,
          "attention_type": "multihead", "activation_recompute": "none",
          "pipeline_interleaving": 1, "optimizer_sharding": True,
          "tensor_par_comm_type": "ar", "tensor_par_overlap": "none",
          "seq_par_ag_redo": False, "data_par_overlap": True, "weight_offload": False,
          "activations_offload": False, "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2", "fused_norm": True, "unsharded_grads": False,
          "weight_sharding": True, "sharding_group": 2, "fp32_grads": True,
          "optimizer_outer_sharding": True}
    ex.update(kw)
    return ex


@pytest.fixture(scope="module")
def llama():
    return load_model(REPO_ROOT / "models" / "llama2-7B.json")


@pytest.mark.parametrize("fmt,written", [
    ("megatron", ("--use-megatron-fsdp", "--num-distributed-optimizer-instances 4",
                  "--outer-dp-sharding-strategy optim")),
    ("bridge", ("ddp.use_megatron_fsdp=true", "ddp.num_distributed_optimizer_instances=4",
                "ddp.outer_dp_sharding_strategy=optim"))])
def test_megatron_and_bridge_round_trip(llama, fmt, written):
    F = get(fmt)
    ex = _fsdp_layout()
    assert F.refuse_layout(llama, ex) is None
    text = F.write(llama, ex)
    for w in written:
        assert w in text, (w, text)
    back = F.read(text, f"test.{fmt}").execution
    assert back["optimizer_outer_sharding"] is True and back["sharding_group"] == 2
    assert back["weight_sharding"] and back["optimizer_sharding"]
    # HSDP without it writes no outer strategy and reads back False
    plain = F.write(llama, _fsdp_layout(optimizer_outer_sharding=False))
    assert "outer" not in plain
    assert not F.read(plain, f"test.{fmt}").execution.get("optimizer_outer_sharding", False)


def test_megatron_refuses_and_rejects_it_without_hybrid_fsdp(llama):
    mt = get("megatron")
    why = mt.refuse_layout(llama, _fsdp_layout(sharding_group=0))
    assert why.startswith("megatron: optimizer_outer_sharding=true")
    # a launch that asks for it without Megatron-FSDP's hybrid sharding
    text = mt.write(llama, _fsdp_layout(optimizer_outer_sharding=False))
    bad = text.replace("--num-distributed-optimizer-instances 4",
                       "--num-distributed-optimizer-instances 1 "
                       "--outer-dp-sharding-strategy optim")
    with pytest.raises(SpecError, match="outer"):
        mt.read(bad, "bad.sh")
    wrong = text.replace("--num-distributed-optimizer-instances 4",
                         "--num-distributed-optimizer-instances 4 "
                         "--outer-dp-sharding-strategy full")
    with pytest.raises(SpecError, match="outer"):
        mt.read(wrong, "wrong.sh")


@pytest.mark.parametrize("fmt,why", [("torchtitan", "dp_replicate"), ("deepspeed", "hpZ")])
def test_torchtitan_and_deepspeed_refuse_with_the_reason(llama, fmt, why):
    got = get(fmt).refuse_layout(llama, _fsdp_layout())
    assert got is not None and "optimizer_outer_sharding" in got and why in got, got


def test_the_hybrid_sharded_bridge_recipe_is_predicted():
    from autopar.studies import recipes_moe as R
    from autopar.studies.published import Skip
    name = "deepseek_v3_pretrain_128gpu_gb300_fp8mx_hsdp_config"
    c = dict(R.cases())[name]
    assert not isinstance(c, Skip), c
    ex = c.execution
    # 128 GPUs, EP 32, 4 instances of 32 data-parallel ranks
    assert ex["optimizer_outer_sharding"] and ex["sharding_group"] == 32 \
        and ex["data_par"] == 128 and ex["weight_sharding"]
    s = evaluate_one(c.model, c.system, ex)
    assert s["feasible"]
    # (without the outer strategy the experts' state is whole on each rank,
    # the instance's expert group being one rank: it does not fit, so read
    # its requirements on unbounded memory)
    from autopar.studies.validate import unbounded
    replicated = evaluate_one(c.model, unbounded(c.system),
                              dict(ex, optimizer_outer_sharding=False))
    assert s["optimizer_space"] < replicated["optimizer_space"]
    assert s["weight_space"] == pytest.approx(replicated["weight_space"], rel=1e-12)


def test_a_space_offers_it_only_with_hybrid_weight_sharding(gpt, h100):
    from autopar.model import evaluate_columns
    from autopar.search.space import Case, load_space
    space = load_space({"params": {
        "tensor_par": "derived", "pipeline_par": "derived", "optimizer_sharding": "derived",
        "weight_sharding": "derived", "sharding_group": "derived",
        "optimizer_outer_sharding": "derived"},
        "fixed": {"pipeline_interleaving": 1, "tensor_par_comm_type": "rs_ag",
                  "seq_par_ag_redo": False, "data_par_overlap": True,
                  "tensor_par_overlap": "none", "weight_offload": False,
                  "activations_offload": False, "optimizer_offload": False,
                  "fused_activation": True, "attention_type": "multihead",
                  "activation_recompute": "none", "microbatch_size": 1,
                  "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
                  "attention_impl": "flash_v2"}})
    case = Case(gpt, h100, 8, 16, "bfloat16", batch_policy="fixed")
    on = 0
    for cols in space.enumerate(case):
        out = evaluate_columns(gpt, h100, cols, stats=("sample_rate",))
        bad = [REASONS[c] for c in out["reason_code"] if REASONS[c].startswith("invalid")]
        assert not bad, bad[:3]
        outer = cols["optimizer_outer_sharding"]
        g, dp = cols["sharding_group"], cols["data_par"]
        assert (~outer | (cols["weight_sharding"] & (g > 0) & (g < dp))).all()
        on += int(outer.sum())
    assert on > 0


def test_expert_divisors_under_outer_sharding():
    import numpy as np

    from autopar.model.context import expert_shard_counts, shard_counts
    # data_par 8, EP 4: an expert-data-parallel group of 2; 4 instances of
    # 2 ranks hold 1 expert-data-parallel rank each
    cols = {"data_par": np.array([8, 8]), "tensor_par": np.array([1, 1]),
            "context_par": np.array([1, 1]), "expert_par": np.array([4, 4]),
            "expert_tensor_par": np.array([1, 1]),
            "optimizer_sharding": np.array([True, True]),
            "unsharded_grads": np.array([False, False]),
            "weight_sharding": np.array([True, True]), "sharding_group": np.array([2, 2]),
            "optimizer_outer_sharding": np.array([True, False])}
    optim, grad, weight = shard_counts(cols)
    assert optim.tolist() == [8, 2] and grad.tolist() == [2, 2] and weight.tolist() == [2, 2]
    x_optim, x_grad = expert_shard_counts(cols, weight)
    # outer: the experts' optimizer over the whole expert group (2), their
    # gradients over the instance's expert group (1 rank); without it both
    # over the instance's expert group ("DP-Shard only")
    assert x_optim.tolist() == [2, 1] and x_grad.tolist() == [1, 1]
