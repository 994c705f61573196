"""LLaMA blocks, grouped-query and flash attention, fused kernels, sweeps."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar.io.specs import load_model, load_system
from conftest import one_proc_execution

# A small LLaMA: 4 heads of 16, 2 key/value heads, SwiGLU 96 wide.
SMALL = {"hidden": 64, "feedforward": 96, "seq_size": 32, "attn_heads": 4,
         "attn_size": 16, "num_blocks": 4, "block": "llama", "kv_heads": 2}


@pytest.fixture
def system(repo_root):
    return load_system(repo_root / "systems" / "a100_80g.json")


def _exe(**kw):
    return one_proc_execution(**{"datatype": "bfloat16", "fused_activation": True, **kw})


def _one(model, system, **kw):
    return autopar.evaluate(load_model(model), system, _exe(**kw)).iloc[0]


def test_llama_weights_by_hand(system):
    h, f, H, KV, d = 64, 96, 4, 2, 16
    row = _one(SMALL, system)
    attn = h * H * d + 2 * h * KV * d + H * d * h      # Q, K, V (grouped), output
    mlp = h * 2 * f + f * h                            # gate+up, down
    norms = 2 * h                                      # two RMSNorm scales, no bias
    assert row.block_weight_space == (attn + mlp + norms) * 2


def test_llama_forward_flops_by_hand(system):
    h, f, s, H, KV, d, b = 64, 96, 32, 4, 2, 16, 2
    B = b * s
    row = _one(SMALL, system)
    matmuls = 2 * B * (h * H * d + 2 * h * KV * d + H * d * h + h * 2 * f + f * h)
    attention = 2 * (2 * b * H * s * s * d) + 5 * b * H * s * s     # QK^T, PV, softmax
    norms = 2 * 4 * B * h
    rotary = 3 * B * (H * d + KV * d)
    swiglu = 6 * B * f
    residuals = 2 * B * h
    assert row.block_fw_flops == matmuls + attention + norms + rotary + swiglu + residuals


def test_flash_attention_counts_the_same_work_and_stores_no_scores(system):
    s, H, b = 32, 4, 2
    plain = _one(SMALL, system)
    flash = _one(SMALL, system, attention_impl="flash_v2")
    # The same counted matmul flops, without the softmax pass.
    assert flash.block_fw_flops == plain.block_fw_flops - 5 * b * H * s * s
    # The s x s scores and probabilities are no longer stored.
    assert flash.block_act_storage_space < plain.block_act_storage_space - b * H * s * s * 2
    # v1 is slower than v2 for the same work.
    v1 = _one(SMALL, system, attention_impl="flash_v1")
    assert v1.block_fw_time > flash.block_fw_time
    assert v1.block_fw_flops == flash.block_fw_flops


def test_fused_norm_saves_fp32_intermediates_and_traffic(system):
    h, s, b = 64, 32, 2
    unfused = _one(SMALL, system)
    fused = _one(SMALL, system, fused_norm=True)
    assert unfused.block_act_storage_space - fused.block_act_storage_space == 2 * b * s * h * 8
    assert fused.block_fw_mem_accessed < unfused.block_fw_mem_accessed
    assert fused.block_fw_flops == unfused.block_fw_flops


def test_gpt_block_ignores_norm_fusion_and_keeps_calculon_counts(system):
    gpt = dict(SMALL, block="gpt", kv_heads=None)
    a = _one(gpt, system)
    b = _one(gpt, system, fused_norm=True)
    assert a.block_fw_time == b.block_fw_time
    assert a.block_act_storage_space == b.block_act_storage_space


def test_grouped_query_attention_shrinks_kv(system):
    full = _one(dict(SMALL, kv_heads=4), system)
    grouped = _one(SMALL, system)
    single = _one(dict(SMALL, kv_heads=1), system)
    assert full.block_weight_space > grouped.block_weight_space > single.block_weight_space
    assert full.block_weight_space - grouped.block_weight_space == 2 * 64 * 2 * 16 * 2


def test_vocabulary_adds_embedding_output_and_logits(system):
    none = _one(SMALL, system)
    vocab = _one(dict(SMALL, vocab_size=1000), system)
    h, V, s, b = 64, 1000, 32, 2
    params = 2 * V * h                                       # embedding + output, one stage
    per_param = 2 + 2 + 12                                   # bf16 weight and grad, Adam fp32
    logits = b * s * V * (2 + 4)
    assert vocab.proc_mem_tier1_cap_req - none.proc_mem_tier1_cap_req == pytest.approx(
        params * per_param + logits)
    assert vocab.total_time > none.total_time


def test_pipeline_memory_is_the_fuller_of_first_and_last_stage(system):
    # Two stages, two micro-batches: the first stage holds two in flight and
    # the embedding; the last holds one, the output layer and the logits.
    kw = dict(num_procs=2, pipeline_par=2, batch_size=4, microbatch_size=2)
    h, s, b = 64, 32, 2
    for V in (100, 50000):
        none = _one(SMALL, system, **kw)
        row = _one(dict(SMALL, vocab_size=V), system, **kw)
        static = none.weight_space + none.weight_grad_space + none.optimizer_space
        matrix = V * h * (2 + 2 + 12)
        first = static + matrix + none.act_space + none.act_grad_space
        act_last = none.block_act_working_space + none.block_act_storage_space * (2 * 1 - 1)
        last = static + matrix + act_last + none.act_grad_space + b * s * V * (2 + 4)
        assert none.proc_mem_tier1_cap_req == pytest.approx(
            static + none.act_space + none.act_grad_space)
        assert row.proc_mem_tier1_cap_req == pytest.approx(max(first, last))
    assert last > first          # with a large vocabulary the last stage is fuller


def test_interleaved_last_stage_holds_megatron_warmup(system):
    # Megatron's interleaved 1F1B: the last of p = 2 ranks with v = 2 chunks
    # warms up with (v - 1) * p = 2 chunk forwards and holds one more, 3
    # chunks of one block each: 1.5 stages' worth of one micro-batch (before:
    # 1 + (p - 1) / (v p) = 1.25).  With a large vocabulary the last stage is
    # the fuller one and its activations set the need.
    from autopar.model.memory import last_stage_in_flight
    from autopar.model.pipeline import schedule
    import numpy as np
    cols = {"pipeline_par": np.array([2, 2, 4, 4]),
            "pipeline_interleaving": np.array([1, 2, 2, 2]),
            "batch_size": np.array([8, 8, 8, 1]), "data_par": np.array([1, 1, 1, 1]),
            "microbatch_size": np.array([1, 1, 1, 1])}
    # p=4, v=2, m=8: (1 * 4 + 1) / 2; m=1: capped at the m * v = 2 chunks there are.
    assert last_stage_in_flight(schedule(cols, 8)).tolist() == [1.0, 1.5, 2.5, 1.0]
    kw = dict(num_procs=2, pipeline_par=2, pipeline_interleaving=2, batch_size=8,
              microbatch_size=1)
    V, h, s, b = 50000, 64, 32, 1
    none = _one(SMALL, system, **kw)
    row = _one(dict(SMALL, vocab_size=V), system, **kw)
    static = none.weight_space + none.weight_grad_space + none.optimizer_space
    blocks = 2
    act_last = none.block_act_working_space + none.block_act_storage_space * (blocks * 1.5 - 1)
    last = static + V * h * (2 + 2 + 12) + act_last + none.act_grad_space + b * s * V * (2 + 4)
    assert row.proc_mem_tier1_cap_req == pytest.approx(last)


def test_loss_buffers_gathered_or_split_by_hand(system):
    # The loss's buffers on the last stage: the bf16 logits and c fp32 copies
    # of one micro-batch's s x b x V logits, whole on every tensor rank when
    # the framework gathers them, V / tp of them when it does not (Megatron's
    # vocab-parallel cross entropy); fragmentation grows them as any
    # transient tensor.
    import dataclasses

    from autopar.io.specs import MemoryOverhead
    V, s, b, tp = 1000, 32, 2, 2
    model = load_model(dict(SMALL, vocab_size=V))
    exe = _exe(num_procs=2, tensor_par=2)

    def need(copies, gathered, fraction=0.0):
        over = MemoryOverhead(0.0, fraction, copies, gathered)
        return autopar.evaluate(model, dataclasses.replace(system, memory_overhead=over),
                                exe).iloc[0].proc_mem_tier1_cap_req

    per_copy = s * b * V * 4
    assert need(17, True) - need(1, True) == pytest.approx(16 * per_copy)
    assert need(17, False) - need(1, False) == pytest.approx(16 * per_copy / tp)
    assert need(2, True) - need(2, False) == pytest.approx(
        s * b * V * (2 + 2 * 4) * (1 - 1 / tp))
    assert need(17, True, 0.15) - need(1, True, 0.15) == pytest.approx(1.15 * 16 * per_copy)


def test_time_overhead_slows_pipelined_steps(system, tmp_path, cli, repo_root):
    import dataclasses

    from autopar.io.specs import TimeOverhead
    slow = dataclasses.replace(system, time_overhead=TimeOverhead(0.05))
    for pp in (1, 2):
        kw = dict(num_procs=pp, pipeline_par=pp, batch_size=8)
        base = autopar.evaluate(load_model(SMALL), system, _exe(**kw)).iloc[0]
        row = autopar.evaluate(load_model(SMALL), slow, _exe(**kw)).iloc[0]
        grow = 1.05 if pp > 1 else 1.0
        assert row.total_time == pytest.approx(grow * base.total_time)
        assert row.pp_comm_exposed_time - base.pp_comm_exposed_time == pytest.approx(
            (grow - 1) * base.total_time)
    data = json.loads((repo_root / "systems" / "a100_80g.json").read_text())
    data["time_overhead"] = {"pipeline_fraction": 1.5}
    bad = tmp_path / "sys.json"
    bad.write_text(json.dumps(data))
    model = tmp_path / "m.json"
    model.write_text(json.dumps(SMALL))
    exe = tmp_path / "e.json"
    exe.write_text(json.dumps(_exe()))
    r = cli("estimate", model, bad, exe)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "sys.json" in r.stderr and "time_overhead.pipeline_fraction" in r.stderr


def test_unsharded_grads_keep_whole_gradients(system):
    kw = dict(num_procs=8, data_par=8, batch_size=16, microbatch_size=2, data_par_net=0,
              optimizer_sharding=True)
    zero2 = _one(SMALL, system, **kw)
    megatron = _one(SMALL, system, unsharded_grads=True, **kw)
    assert megatron.optimizer_space == zero2.optimizer_space
    assert megatron.block_weight_grad_space == pytest.approx(8 * zero2.block_weight_grad_space)


def test_fork_style_flash_and_structure_type(system, tmp_path, cli, repo_root):
    model = tmp_path / "m.json"
    model.write_text(json.dumps(SMALL))
    exe = _exe(attention_type="flash", structure_type="llama")
    path = tmp_path / "e.json"
    path.write_text(json.dumps(exe))
    r = cli("estimate", model, repo_root / "systems" / "a100_80g.json", path, "--json")
    assert r.returncode == 0, r.stderr
    flash = _one(SMALL, system, attention_impl="flash_v2")
    assert json.loads(r.stdout)["block_fw_flops"] == flash.block_fw_flops
    path.write_text(json.dumps(_exe(structure_type="gpt")))
    r = cli("estimate", model, repo_root / "systems" / "a100_80g.json", path)
    assert r.returncode == 2
    assert "structure_type" in r.stderr and "Traceback" not in r.stderr


def test_memory_overhead_field(system, repo_root):
    import dataclasses

    from autopar.io.specs import MemoryOverhead
    base = _one(SMALL, system)
    over = dataclasses.replace(system, memory_overhead=MemoryOverhead(2.0, 0.5))
    row = autopar.evaluate(load_model(SMALL), over, _exe()).iloc[0]
    static = base.weight_space + base.weight_grad_space + base.optimizer_space
    transient = base.act_space + base.act_checkpoint_size + base.act_grad_space
    assert base.proc_mem_tier1_cap_req == pytest.approx(static + transient)
    # Fragmentation is charged on transient tensors, the reserve once.
    assert row.proc_mem_tier1_cap_req == pytest.approx(
        static + 1.5 * transient + 2 * 1024 ** 3)


def test_shipped_llama_models_load(repo_root):
    for name in ("llama-7B", "llama-13B", "llama-30B", "llama-65B", "llama2-7B",
                 "llama2-13B", "llama2-70B", "llama3-8B", "llama3-70B", "llama3-405B"):
        m = load_model(repo_root / "models" / f"{name}.json")
        assert m.block == "llama" and m.vocab_size > 0 and m.kv_heads


def test_validate_sweep_on_measured_data(reference, repo_root, tmp_path, cli):
    csv = reference / "measured" / "llama-sweeps" / "llama_13B_65B_a100.csv"
    out = tmp_path / "pred.csv"
    r = cli("validate", csv, "--system", repo_root / "systems" / "a100_80g_dgx_hdr200.json",
            "--framework", "megatron-llama-sweeps-fitted", "--output", out)
    assert r.returncode == 0, r.stderr
    import pandas as pd
    rows = pd.read_csv(out)
    assert {"pred_feasible", "pred_step_time_s"} <= set(rows.columns)
    assert len(rows) == 603
    from autopar.studies.validate import sweep_report
    rep = sweep_report(rows).loc["overall"]
    # The bars (the calibrated model reaches 0.960 / 0.953 / 4.4% / 2.0%
    # with the favourite chosen among layouts that fit with its 5 GiB headroom),
    # and no sweep's favourite is a layout that ran out of memory.
    assert rows.pred_fits_headroom.sum() < rows.pred_feasible.sum()
    assert rep.oom_agreement >= 0.95
    assert rep.spearman >= 0.90
    assert rep.median_abs_error <= 0.10
    assert rep.top1_regret <= 0.03
    for name, g in rows.groupby("sweep"):
        fav = g[g.pred_fits_headroom].sort_values("pred_step_time_s").iloc[0]
        assert fav.status == "ok", name


def test_validate_sweep_models_uneven_pipeline_stages(tmp_path, repo_root):
    # LLaMA 30B: 60 blocks and 52 heads.  Pipeline 8 does not divide the
    # blocks: Megatron places fewer blocks on some stages and runs it, so it
    # is modelled (8 blocks' memory on the fullest stage, the stages lacking
    # blocks shorten the bubble); tensor 8 does not divide the heads: invalid.
    import pandas as pd

    from autopar.studies.validate import sweep_report, validate_sweep
    cols = "sweep,model,seq_size,global_batch,world_size,tensor_par,pipeline_par," \
           "microbatch_size,checkpointing,kernel,sequence_parallel,status,step_time_s,mfu\n"
    rows = ["s,llama-30B,2048,2048,128,4,8,1,every_layer,flash_attention2,False,ok,110.0,0.45",
            "s,llama-30B,2048,2048,128,8,4,1,every_layer,flash_attention2,False,error,,",
            "s,llama-30B,2048,2048,128,4,4,1,every_layer,flash_attention2,False,ok,100.0,0.5"]
    csv = tmp_path / "s.csv"
    csv.write_text(cols + "\n".join(rows) + "\n")
    from autopar.io.frameworks import system_under
    system = system_under(repo_root / "systems" / "a100_80g_dgx_hdr200.json",
                          "megatron-llama-sweeps")
    out = validate_sweep(csv, system, models_dir=repo_root / "models")
    assert out.pred_feasible.tolist() == [True, False, True]
    assert "divisible by tensor_par" in out.pred_reason[1]
    assert pd.isna(out.pred_step_time_s[1]) and (out.pred_step_time_s[[0, 2]] > 0).all()
    assert sweep_report(out).loc["overall", "oom_agreement"] == 1.0
    # Eight stages of at most 8 blocks hold less than four stages of 15.
    assert out.pred_mem_gib[2] > out.pred_mem_gib[0]
    # The stages lacking blocks (4 of 64 block slots empty) shorten the
    # bubble against a pipeline whose 8 stages were all full.
    from autopar.model.frame import evaluate
    from autopar.studies.validate import sweep_execution
    model = load_model(repo_root / "models" / "llama-30B.json")
    ex = sweep_execution(next(pd.read_csv(csv).itertuples()), system)
    full = evaluate(load_model(dict(json.loads((repo_root / "models" / "llama-30B.json")
                                               .read_text()), num_blocks=64)), system, ex)
    uneven = evaluate(model, system, ex)
    assert uneven.bubble_time[0] < full.bubble_time[0]


def test_validate_sweep_bad_input(tmp_path, cli, repo_root):
    bad = tmp_path / "bad.csv"
    bad.write_text("sweep,model\nx,llama-13B\n")
    r = cli("validate", bad, "--system", repo_root / "systems" / "a100_80g_dgx_hdr200.json")
    assert r.returncode == 2
    assert "bad.csv" in r.stderr and "Traceback" not in r.stderr
    r = cli("validate", tmp_path / "missing.csv", "--system",
            repo_root / "systems" / "a100_80g_dgx_hdr200.json")
    assert r.returncode == 2 and "missing.csv" in r.stderr


def test_sweep_takes_the_frameworks_activation_fusion(tmp_path, repo_root, cli):
    """The sweep's format does not state the activation's fusion; a
    framework's ``defaults.fused_activation`` replaces the sweep's assumption
    (fused), its other defaults do not touch what a row states.  The LLaMA
    sweeps' counted framework says unfused (Megatron-LM 2023's SwiGLU), so
    its predicted peaks are higher than under the same records without it:
    by silu(gate), f / tensor_par bf16 elements a token and block."""
    import pandas as pd

    from autopar.io.frameworks import load_framework, system_under
    from autopar.studies.validate import sweep_execution, validate_sweep
    cols = "sweep,model,seq_size,global_batch,world_size,tensor_par,pipeline_par," \
           "microbatch_size,checkpointing,kernel,sequence_parallel,status,step_time_s,mfu\n"
    csv = tmp_path / "s.csv"
    csv.write_text(cols + "s,llama-13B,2048,2048,64,2,1,1,disabled,flash_attention2,False,"
                          "ok,30.0,0.5\n")
    fw = load_framework("megatron-llama-sweeps")
    assert fw.defaults == {"fused_activation": False}
    system = system_under(repo_root / "systems" / "a100_80g_dgx_hdr200.json", fw)
    row = next(pd.read_csv(csv).itertuples())
    assert sweep_execution(row, system)["fused_activation"] is True
    ex = sweep_execution(row, system, {"fused_activation": False, "tensor_par": 8})
    assert ex["fused_activation"] is False and ex["tensor_par"] == 2
    plain = validate_sweep(csv, system, models_dir=repo_root / "models")
    counted = validate_sweep(csv, system, models_dir=repo_root / "models",
                             defaults=fw.defaults)
    grow = 1 + fw.memory_overhead.fraction
    silu = 40 * 2048 * 13824 / 2 * 2 * grow / 1024 ** 3    # 40 blocks, one micro-batch
    assert counted.pred_mem_gib[0] - plain.pred_mem_gib[0] == pytest.approx(silu, rel=1e-6)
    # the command line passes the framework's defaults
    out = tmp_path / "pred.csv"
    r = cli("validate", csv, "--system", repo_root / "systems" / "a100_80g_dgx_hdr200.json",
            "--framework", "megatron-llama-sweeps", "--output", out)
    assert r.returncode == 0, r.stderr
    assert pd.read_csv(out).pred_mem_gib[0] == pytest.approx(counted.pred_mem_gib[0])
