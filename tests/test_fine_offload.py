"""Fine-grained activation offloading (issue 24, ``activation_offload_modules``):
Megatron-Core's ``fine_grained_activation_offloading`` with ``offload_modules``
(NVIDIA/Megatron-LM@2a75ac1 megatron/core/pipeline_parallel/
fine_grained_activation_offload.py).  A hand count of the memory on a small
case, the exposed reload time against a step-by-step replay of the offload
and reload streams, the rules, the launch formats and the recipes it lets
autopar predict."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.io.launch import get
from autopar.io.launch.mcore import NOT_SETTINGS
from autopar.io.layouts import CHOICES, offload_modules_value, to_columns
from autopar.io.specs import SpecError, load_execution, load_model, load_system
from autopar.model import REASONS, evaluate_columns, evaluate_one

from conftest import REPO_ROOT, one_proc_execution
from test_launch_cpu_offload import _layout as cpu_offload_layout

MODEL = REPO_ROOT / "models/gpt3-13B.json"          # 40 blocks, GPT, unfused attention
SYSTEM = REPO_ROOT / "systems/a100_80g.json"
BLOCKS = 40


def _system(gbps: float):
    """a100_80g with a host link of ``gbps`` at one flat efficiency (a
    copy's time is bytes / bandwidth) and room for every case."""
    data = json.loads(SYSTEM.read_text())
    data["mem1"]["GiB"] = 100000
    data["mem2"].update(GBps=gbps, MB_efficiency=[[0, 1.0]])
    return load_system(data)


def _groups(model, modules: str) -> float:
    """Bytes one block saves inside the offloaded modules' groups, counted by
    hand for the GPT block (float16, micro-batch 2, unfused attention core:
    Korthikanti et al.'s terms): ``core_attn`` keeps Q and K for the score
    GEMM (2 b s H d elements), the softmax output (a s^2 b), the dropout mask
    (a s^2 b bytes) and the dropped-out scores with V for the second GEMM
    (a s^2 b + b s H d); ``attn_proj`` keeps its input (b s H d)."""
    b, s, a = 2, model.seq_size, model.attn_heads
    hd = model.attn_heads * model.attn_size
    core = 2 * (3 * b * s * hd) + 2 * 2 * a * s * s * b + a * s * s * b
    proj = 2 * b * s * hd
    return core + (proj if "attn_proj" in modules else 0)


@pytest.mark.parametrize("modules", ["core_attn", "core_attn+attn_proj"])
def test_memory_hand_count_fast_link(modules):
    """A link fast enough that every copy is done within the next block's
    forward: of the 40 blocks of the one micro-batch in flight, the last
    block keeps its groups (Megatron keeps a chunk's last group of each
    name) and the block before it is still being copied; the other 38
    blocks' groups are in host memory."""
    model, system = load_model(MODEL), _system(1e6)
    plain = evaluate_one(model, system, one_proc_execution())
    s = evaluate_one(model, system, one_proc_execution(activation_offload_modules=modules))
    moved = 38 * _groups(model, modules)
    assert s["act_space"] == pytest.approx(plain["act_space"] - moved, rel=1e-12)
    assert s["proc_mem_tier1_cap_req"] == pytest.approx(
        plain["proc_mem_tier1_cap_req"] - moved, rel=1e-12)
    assert s["proc_mem_tier2_cap_req"] == pytest.approx(
        plain["proc_mem_tier2_cap_req"] + moved, rel=1e-12)
    # nothing of the step's compute changes, and a fast link hides the copies
    assert s["fw_time"] == plain["fw_time"] and s["bw_time"] == plain["bw_time"]
    assert s["fw_offload_exposed_time"] == 0 and s["bw_offload_exposed_time"] == 0


def _offloaded_backward(model, system, modules: str) -> float:
    """The backward time (activation and weight gradients) of the block's
    layers inside the offloaded groups: the model's own layer times (the
    block's sum ``bw_offload``), which the replay takes as given."""
    from autopar.model.block import block
    from autopar.model.context import LayoutContext
    from autopar.model.rules import normalize
    from autopar.model.evaluate import typed_columns
    cols = typed_columns(normalize(to_columns([load_execution(one_proc_execution(
        activation_offload_modules=modules))])))
    dts = [CHOICES["datatype"].index(d) for d in system.datatypes]
    sums = block(LayoutContext(model, system, cols, dts), cols)
    return float(sums.bw_offload[0])


def _replay(blocks: int, f: float, b: float, b_off: float, c: float) -> tuple[int, float]:
    """One micro-batch on one stage replayed on three streams: the compute
    runs block j's forward in [j f, (j + 1) f]; the copy of block j < blocks
    - 1 (the last block's groups stay) is queued on the device-to-host stream
    at (j + 1) f and frees its GPU copy when done.  Backward, block k: its
    offloaded layers (``b_off``) wait for block k's reload; when they are done
    block k - 1's reload is queued on the host-to-device stream (after its
    copy out); the rest of the block (``b - b_off``) runs.  Returns the
    blocks whose copies are not done at the end of the forward and the
    compute stream's wait in backward."""
    d2h, done = 0.0, []
    for j in range(blocks - 1):
        d2h = max(d2h, (j + 1) * f) + c
        done.append(d2h)
    t_end = blocks * f
    outstanding = sum(1 for e in done if e > t_end)
    t, h2d, reload_end, waited = t_end, 0.0, {}, 0.0
    for k in range(blocks - 1, -1, -1):
        if k < blocks - 1:
            ready = reload_end[k]
            waited += max(0.0, ready - t)
            t = max(t, ready)
        t += b_off
        if k >= 1:
            h2d = max(t, done[k - 1], h2d) + c
            reload_end[k - 1] = h2d
        t += b - b_off
    return outstanding, waited


@pytest.mark.parametrize("gbps", [4, 12, 32, 1000])
def test_memory_and_exposed_time_follow_the_streams(gbps):
    """A slower link leaves copies outstanding at the end of the forward
    (their GPU copies still held) and makes the backward wait for reloads:
    both as a replay of the three streams says."""
    model, system = load_model(MODEL), _system(gbps)
    modules = "core_attn+attn_proj"
    plain = evaluate_one(model, system, one_proc_execution())
    s = evaluate_one(model, system, one_proc_execution(activation_offload_modules=modules))
    micro = 2                                       # batch 4 at micro-batch 2
    f = plain["fw_time"] / (BLOCKS * micro)
    b = plain["bw_time"] / (BLOCKS * micro)
    g = _groups(model, modules)
    c = g / (gbps * 1e9)
    b_off = _offloaded_backward(model, system, modules)
    assert 0 < b_off < b
    outstanding, waited = _replay(BLOCKS, f, b, b_off, c)
    resident = 1 + max(outstanding, 1)          # the kept block and those in flight
    moved = (BLOCKS - resident) * g
    assert s["act_space"] == pytest.approx(plain["act_space"] - moved, rel=1e-9)
    assert s["bw_offload_exposed_time"] == pytest.approx(micro * waited, rel=1e-9, abs=1e-12)
    assert s["fw_offload_exposed_time"] == 0
    if gbps == 1000:
        assert waited == 0 and outstanding == 0
    if gbps == 4:
        assert waited > 0 and outstanding > 30


def test_default_is_calculon_and_columns_agree():
    model, system = load_model(MODEL), _system(32)
    plain = evaluate_one(model, system, one_proc_execution())
    assert evaluate_one(model, system,
                        one_proc_execution(activation_offload_modules="none")) == plain
    # a table that mixes rows with and without the field gives each row its
    # own figures: a few rows (evaluated as they are) and more than 64 (the
    # distinct blocks evaluated once and gathered back: the field is keyed)
    values = ("none", "core_attn", "core_attn+attn_proj")
    for n in (3, 120):
        rows = [load_execution(one_proc_execution(activation_offload_modules=values[i % 3],
                                                  microbatch_size=1 + i % 2))
                for i in range(n)]
        out = evaluate_columns(model, system, to_columns(rows))
        for i in range(0, n, 1 if n < 10 else 7):
            one = evaluate_one(model, system, rows[i])
            assert out["proc_mem_tier1_cap_req"][i] == pytest.approx(
                one["proc_mem_tier1_cap_req"], rel=1e-12)
            assert out["total_time"][i] == pytest.approx(one["total_time"], rel=1e-12)
    rows = [load_execution(one_proc_execution(activation_offload_modules=v)) for v in values]
    out = evaluate_columns(model, system, to_columns(rows))
    assert out["proc_mem_tier1_cap_req"][0] == plain["proc_mem_tier1_cap_req"]
    assert out["proc_mem_tier1_cap_req"][2] < out["proc_mem_tier1_cap_req"][1] \
        < out["proc_mem_tier1_cap_req"][0]


def test_the_field_reads_a_list_or_joined_names():
    assert offload_modules_value(["attn_proj", "core_attn"]) == "core_attn+attn_proj"
    assert offload_modules_value("core_attn+attn_proj") == "core_attn+attn_proj"
    assert offload_modules_value([]) == "none"
    assert "none" in CHOICES["activation_offload_modules"]
    assert "attn_proj" not in CHOICES["activation_offload_modules"]
    ex = load_execution(one_proc_execution(activation_offload_modules=["attn_proj",
                                                                       "core_attn"]))
    assert ex["activation_offload_modules"] == "core_attn+attn_proj"


@pytest.mark.parametrize("value, why", [
    (["attn_proj"], "needs core_attn"),
    (["qkv_linear"], "does not count"),
    (["bogus"], "unknown module"),
    (["expert_fc1"], "no routed experts"),
    (7, "expected a list"),
])
def test_bad_values_name_the_field(value, why):
    with pytest.raises(SpecError) as e:
        load_execution(one_proc_execution(activation_offload_modules=value),
                       model=load_model(MODEL), source="ex.json")
    assert e.value.field == "activation_offload_modules" and why in e.value.message


@pytest.mark.parametrize("kw, why", [
    ({"activation_recompute": "full"}, "activation_recompute full"),
    ({"activations_offload": True}, "activations_offload"),
    ({"activation_offload_blocks": 4}, "cpu_offloading"),
    ({"training": False}, "training"),
])
def test_rules_name_the_field(kw, why):
    ex = one_proc_execution(activation_offload_modules="core_attn", **kw)
    with pytest.raises(SpecError) as e:
        load_execution(ex, model=load_model(MODEL), source="ex.json")
    assert e.value.field == "activation_offload_modules" and why in e.value.message


def test_the_model_refuses_what_the_rules_refuse():
    model, system = load_model(MODEL), _system(32)
    ex = one_proc_execution(activation_offload_modules="core_attn", activation_recompute="full")
    cols = to_columns([ex])
    out = evaluate_columns(model, system, cols)
    assert REASONS[int(out["reason_code"][0])].startswith(
        "invalid: activation_offload_modules needs training")
    cols = to_columns([one_proc_execution(activation_offload_modules="expert_fc1")])
    out = evaluate_columns(model, system, cols)
    assert "without routed experts" in REASONS[int(out["reason_code"][0])]


def test_cli_refuses_in_one_line(tmp_path, capsys):
    f = tmp_path / "ex.json"
    f.write_text(json.dumps(one_proc_execution(activation_offload_modules=["attn_proj"])))
    assert main(["estimate", str(MODEL), str(SYSTEM), str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "activation_offload_modules" in err[0]


# ---------------------------------------------------------------------------
# launch formats

def _layout(**kw):
    """Llama 2 7B on 8 GPUs, one stage (the partial-offload tests' layout),
    the attention core and projection offloaded instead of whole blocks."""
    return cpu_offload_layout(**{"activation_offload_blocks": 0,
                                 "activation_offload_modules": "core_attn+attn_proj", **kw})


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_export_import_round_trip(fmt):
    llama = load_model(REPO_ROOT / "models" / "llama2-7B.json")
    lf = get(fmt)
    ex = _layout()
    text = lf.write(llama, ex)
    if fmt == "megatron":
        assert "--fine-grained-activation-offloading \\" in text
        assert "--offload-modules core_attn attn_proj" in text
        assert "export NVTE_CPU_OFFLOAD_V1=1" in text
    else:
        assert "model.fine_grained_activation_offloading=true" in text
        assert "model.offload_modules=" in text and "NVTE_CPU_OFFLOAD_V1=1" in text
    back = lf.read(text, f"test.{fmt}").execution
    assert back["activation_offload_modules"] == "core_attn+attn_proj"
    nets = {f: ex[f] for f in NOT_SETTINGS if f in ex}
    assert load_execution({**nets, **back}, model=llama)["activation_offload_modules"] \
        == "core_attn+attn_proj"
    # off is written as off and read back as none
    text = lf.write(llama, _layout(activation_offload_modules="none"))
    assert "offload-modules" not in text and "offload_modules" not in text
    assert lf.read(text, "t").execution.get("activation_offload_modules", "none") == "none"


def test_import_refuses_modules_autopar_does_not_count():
    lf = get("bridge")
    base = ("model.tensor_model_parallel_size=1\nmodel.pipeline_model_parallel_size=1\n"
            "model.fine_grained_activation_offloading=true\n")
    with pytest.raises(SpecError) as e:
        lf.read(base + "model.offload_modules=[qkv_linear]\n", "t")
    assert e.value.field == "model.offload_modules"
    with pytest.raises(SpecError) as e:
        lf.read(base, "t")
    assert e.value.field == "model.offload_modules"


@pytest.mark.parametrize("fmt, why", [("torchtitan", "torchtitan offloads no module"),
                                      ("deepspeed", "per-module activation offloading")])
def test_other_frameworks_refuse_with_their_reason(fmt, why):
    llama = load_model(REPO_ROOT / "models" / "llama2-7B.json")
    lf = get(fmt)
    why_got = lf.refuse_layout(llama, _layout(weight_sharding=False, unsharded_grads=False))
    assert why_got is not None and "activation_offload_modules" in why_got and why in why_got


# ---------------------------------------------------------------------------
# recipes

def test_deepseek_gb300_recipes_offload_and_fit():
    from autopar.studies import recipe_table as T
    from autopar.studies import recipes_moe as R
    import pandas as pd
    frame = pd.concat([T.read(p) for p in T.CSVS])
    for name in ("deepseek_v3_pretrain_64gpu_gb300_bf16_fsdp_config",
                 "deepseek_v3_pretrain_64gpu_gb300_fp8mx_fsdp_config"):
        row = frame[frame.recipe == name].iloc[0]
        c = R.recipe_case(row)
        assert c.execution["activation_offload_modules"] == "core_attn+attn_proj"
        ex = load_execution(c.execution, system=c.system, model=c.model)
        s = evaluate_one(c.model, c.system, ex)
        assert s["feasible"], name
        off = dict(c.execution, activation_offload_modules="none")
        s0 = evaluate_one(c.model, c.system, load_execution(off, system=c.system,
                                                            model=c.model))
        assert s["proc_mem_tier1_cap_req"] < s0["proc_mem_tier1_cap_req"]
    assert R.fine_offload_modules("fine_grained:core_attn;attn_proj") == "core_attn+attn_proj"
    assert R.fine_offload_modules("activations:expert_fc1") == "expert_fc1"
    assert R.fine_offload_modules("").startswith("none")
    # a module autopar does not count stays on the GPU (the peak errs high);
    # fused_group_mlp is counted (tests/test_fused_group_mlp_offload.py), and
    # Megatron-Core refuses it beside expert_fc1
    assert R.fine_offload_modules("fine_grained:qkv_linear") == "none"
    assert R.fine_offload_modules("activations:expert_fc1;qkv_linear") == "expert_fc1"
    assert R.fine_offload_modules("fine_grained:fused_group_mlp") == "fused_group_mlp"
    assert R.fine_offload_modules("activations:expert_fc1;fused_group_mlp").startswith(
        "offloading")
    assert R.fine_offload_modules("cpu:weights").startswith("offloading")


def test_estimate_shows_the_host_share(tmp_path, capsys):
    data = json.loads(SYSTEM.read_text())
    data["mem1"]["GiB"] = 1000
    sys_f, ex_f = tmp_path / "s.json", tmp_path / "ex.json"
    sys_f.write_text(json.dumps(data))
    ex_f.write_text(json.dumps(one_proc_execution(
        activation_offload_modules=["core_attn", "attn_proj"], batch_size=1,
        microbatch_size=1)))
    assert main(["estimate", str(MODEL), str(sys_f), str(ex_f)]) == 0
    out = capsys.readouterr().out
    assert "activation_offload_modules=core_attn+attn_proj" in out
    acts = next(l for l in out.splitlines() if l.strip().startswith("activations"))
    req = next(l for l in out.splitlines() if l.strip().startswith("requirement"))
    # the offloaded groups are the tier-2 requirement, shown on the row
    assert float(acts.split()[-1]) == float(req.split()[-1]) > 0
