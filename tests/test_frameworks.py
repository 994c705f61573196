"""Framework specs (autopar/io/frameworks.py, frameworks/): loading, bad input,
the shipped files, applying a framework, and the counted terms' hand counts."""
from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.io import shipped
from autopar.io.errors import SpecError
from autopar.io.frameworks import (FrameworkSpec, check_options, framework_to_json,
                                   load_framework, with_framework)
from autopar.io.layouts import ALL_FIELDS
from autopar.io.specs import MemoryHeadroom, MemoryOverhead, TimeOverhead, load_system
from tests.conftest import REPO_ROOT

SHIPPED = shipped.names("frameworks")


def test_every_shipped_framework_loads_and_round_trips():
    assert {"megatron-core", "megatron-bridge", "torchtitan", "llm-foundry", "nemo1-apex",
            "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"} <= set(SHIPPED)
    for name in SHIPPED:
        fw = load_framework(name)
        assert fw.name == name and fw.description
        assert set(fw.defaults) <= set(ALL_FIELDS)
        back = load_framework(json.loads(json.dumps(framework_to_json(fw))))
        assert dataclasses.replace(back, source=fw.source) == fw
        # every record field and default it states is free (fitted) or cited
        data = json.loads((REPO_ROOT / "frameworks" / f"{name}.json").read_text())
        for rec in ("memory_overhead", "time_overhead", "memory_headroom", "defaults"):
            for k in data.get(rec, {}):
                term = f"{rec}.{k}"
                assert term in fw.free or fw.citations.get(term), (name, term)


def test_found_by_name_and_path_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = load_framework("megatron-core")
    assert by_name.source == str(REPO_ROOT / "frameworks/megatron-core.json")
    assert load_framework("frameworks/torchtitan.json").name == "torchtitan"
    assert load_framework("torchtitan.json").memory_overhead.checkpoint_split
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"name": "mine", "time_overhead": {"pipeline_fraction": 0.1}}))
    fw = load_framework(str(own))
    assert fw.time_overhead == TimeOverhead(0.1) and fw.memory_overhead is None


@pytest.mark.parametrize("data, field", [
    ({}, "name"),
    ({"name": 3}, "name"),
    ({"name": "x", "extra": 1}, "extra"),
    ({"name": "x", "memory_overhead": {"fraction": 1.5}}, "memory_overhead.fraction"),
    ({"name": "x", "memory_overhead": {"copies": 1}}, "memory_overhead.copies"),
    ({"name": "x", "time_overhead": {"pipeline_fraction": -1}}, "time_overhead.pipeline_fraction"),
    ({"name": "x", "memory_headroom": {"GiB": -1}}, "memory_headroom.GiB"),
    ({"name": "x", "defaults": {"tensor_parr": 2}}, "defaults.tensor_parr"),
    ({"name": "x", "defaults": {"activation_recompute": "some"}}, "defaults.activation_recompute"),
    ({"name": "x", "defaults": {"fp32_grads": "yes"}}, "defaults.fp32_grads"),
    ({"name": "x", "options": {"tensor_par": 1}}, "options.tensor_par"),
    ({"name": "x", "options": {"tensor_par": [1, 0]}}, "options.tensor_par[1]"),
    ({"name": "x", "options": {"tensor_par": [1, 1]}}, "options.tensor_par"),
    ({"name": "x", "options": {"tensor_par": [1]}, "defaults": {"tensor_par": 2}},
     "defaults.tensor_par"),
    ({"name": "x", "free": ["memory_overhead.nope"]}, "free[0]"),
    ({"name": "x", "free": "memory_overhead.fraction"}, "free"),
    ({"name": "x", "citations": {"a": 1}}, "citations.a"),
])
def test_bad_input_names_the_field(data, field):
    with pytest.raises(SpecError) as e:
        load_framework(data, source="fw.json")
    assert e.value.field == field and e.value.source == "fw.json"


def test_bad_files(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_framework(str(tmp_path / "none.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(SpecError, match="expected a JSON object"):
        load_framework(str(tmp_path / "list.json"))
    with pytest.raises(SpecError, match="expected a file path"):
        load_framework(3)


def test_with_framework_replaces_the_software_records():
    system = load_system("systems/a100_80g.json")
    assert with_framework(system, None) is system
    fw = FrameworkSpec("x", memory_overhead=MemoryOverhead(1.0, 0.1), time_overhead=TimeOverhead(0.02))
    s = with_framework(system, fw)
    assert s.memory_overhead == MemoryOverhead(1.0, 0.1) and s.time_overhead == TimeOverhead(0.02)
    assert s.matrix == system.matrix and s.networks == system.networks
    # a record the framework leaves out is Calculon's (none), whatever the system had
    loaded = dataclasses.replace(system, memory_overhead=MemoryOverhead(5.0),
                                 memory_headroom=MemoryHeadroom(2.0, 1.0))
    s = with_framework(loaded, FrameworkSpec("bare"))
    assert s.memory_overhead is None and s.time_overhead is None
    assert s.memory_headroom == MemoryHeadroom(2.0, 1.0)        # kept: the framework states none
    s = with_framework(loaded, FrameworkSpec("h", memory_headroom=MemoryHeadroom(3.0, 0.5)))
    assert s.memory_headroom == MemoryHeadroom(3.0, 0.5)
    with pytest.raises(SpecError, match="memory_headroom.GiB"):
        with_framework(system, FrameworkSpec("big", memory_headroom=MemoryHeadroom(90.0)))


def test_defaults_and_options():
    fw = load_framework("llm-foundry")
    from autopar.io.specs import load_execution
    ex = load_execution({**LAYOUT, "tensor_par": 1, "weight_sharding": False},
                        defaults=fw.defaults)
    assert "weight_sharding" not in ex and ex["optimizer_sharding"] is True   # stated wins
    del ex["activation_recompute"]
    assert load_execution(ex, defaults=fw.defaults)["activation_recompute"] == "none"
    with pytest.raises(SpecError, match="activation_recompute"):
        load_execution(ex)                 # without the recipe's default it is missing
    check_options(fw, {"tensor_par": 1}, "ex.json")
    with pytest.raises(SpecError) as e:
        check_options(fw, {"tensor_par": 2}, "ex.json")
    assert e.value.field == "tensor_par" and "llm-foundry" in str(e.value)
    check_options(None, {"tensor_par": 2}, "ex.json")


# ----------------------------------------------------------------------------
# Applying a framework: evaluate, the commands, experiment files.

LAYOUT = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 2, "data_par": 2,
          "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
          "batch_size": 64, "microbatch_size": 1, "datatype": "bfloat16",
          "fused_activation": True, "attention_type": "multihead",
          "activation_recompute": "full", "pipeline_interleaving": 1,
          "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
          "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": True,
          "weight_offload": False, "activations_offload": False,
          "optimizer_offload": False, "training": True}


def test_no_framework_is_bit_identical_and_a_framework_is_its_system():
    import autopar
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/a100_80g_dgx_hdr200.json")
    plain = autopar.evaluate(model, hw, [LAYOUT])
    again = autopar.evaluate(model, hw, [LAYOUT], framework=None)
    assert plain.drop(columns="reason").equals(again.drop(columns="reason"))
    # framework= is the same as evaluating on the system under it
    fw = load_framework("megatron-llama-sweeps")
    a = autopar.evaluate(model, hw, [LAYOUT], framework="megatron-llama-sweeps")
    b = autopar.evaluate(model, with_framework(hw, fw), [LAYOUT])
    assert a.drop(columns="reason").equals(b.drop(columns="reason"))
    # and its records act: more memory than the hardware alone
    assert a.proc_mem_tier1_cap_req[0] > plain.proc_mem_tier1_cap_req[0] + 3 * 2 ** 30


def test_recipe_defaults_fill_unstated_fields():
    import autopar
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/h100_80g_nvl8.json")
    core = autopar.evaluate(model, hw, [LAYOUT], framework="megatron-core")
    explicit = autopar.evaluate(model, hw, [{**LAYOUT, "fp32_grads": True,
                                             "attention_impl": "flash_v2", "fused_norm": True}])
    assert core.drop(columns="reason").equals(explicit.drop(columns="reason"))
    # a stated field wins over the recipe's default
    stated = autopar.evaluate(model, hw, [{**LAYOUT, "fp32_grads": False}],
                              framework="megatron-core")
    assert stated.weight_grad_space[0] < core.weight_grad_space[0]
    import pandas as pd
    frame = autopar.evaluate(model, hw, pd.DataFrame([LAYOUT]), framework="megatron-core")
    assert frame.drop(columns="reason").equals(core.drop(columns="reason"))
    with pytest.raises(SpecError, match="llm-foundry cannot run tensor_par"):
        autopar.evaluate(model, hw, [LAYOUT], framework="llm-foundry")


def test_framework_option_on_the_commands(cli, tmp_path, repo_root):
    ex = tmp_path / "ex.json"
    ex.write_text(json.dumps(LAYOUT))
    args = ("estimate", "models/llama-13B.json", "systems/a100_80g_dgx_hdr200.json", ex, "--json")
    plain, fw = cli(*args), cli(*args, "--framework", "megatron-llama-sweeps")
    assert plain.returncode == 0 and fw.returncode == 0, plain.stderr + fw.stderr
    p, f = json.loads(plain.stdout), json.loads(fw.stdout)
    assert p["memory_headroom_GiB"] == 0 and f["memory_headroom_GiB"] == 17
    assert f["proc_mem_tier1_cap_req"] > p["proc_mem_tier1_cap_req"]
    by_path = cli(*args, "--framework", repo_root / "frameworks" / "megatron-llama-sweeps.json")
    assert json.loads(by_path.stdout) == f
    # bad framework input: one line naming the file and the field, exit 2
    bad = tmp_path / "fw.json"
    bad.write_text(json.dumps({"name": "x", "memory_overhead": {"fraction": 2}}))
    r = cli(*args, "--framework", bad)
    assert r.returncode == 2 and "fw.json" in r.stderr and "memory_overhead.fraction" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli(*args, "--framework", "no-such-framework")
    assert r.returncode == 2 and "no-such-framework" in r.stderr
    r = cli(*args, "--framework", "llm-foundry")
    assert r.returncode == 2 and "tensor_par" in r.stderr and "ex.json" in r.stderr
    # exhaustive: the framework's headroom and memory records reach the search
    space = ("--num-procs", 8, "--max-batch-size", 64, "--datatype", "bfloat16",
             "--space", "llama")
    s0, s1 = tmp_path / "s0.json", tmp_path / "s1.json"
    r0 = cli("exhaustive", "models/llama-13B.json", "systems/a100_80g_dgx_hdr200.json",
             *space, "--summary", s0)
    r1 = cli("exhaustive", "models/llama-13B.json", "systems/a100_80g_dgx_hdr200.json",
             *space, "--framework", "megatron-llama-sweeps", "--summary", s1)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr + r1.stderr
    a, b = json.loads(s0.read_text()), json.loads(s1.read_text())
    assert b["memory_headroom_GiB"] == 17 and b["feasible"] < a["feasible"]


def test_framework_in_an_experiment_case(tmp_path, repo_root):
    from autopar.io.experiment import parse_case
    case = {"model": str(repo_root / "models/llama-13B.json"),
            "system": str(repo_root / "systems/a100_80g_dgx_hdr200.json"),
            "num_procs": 8, "max_batch_size": 64, "datatype": "bfloat16"}
    plain = parse_case("exp.yaml", tmp_path, case)
    assert plain.framework_file is None and plain.system.memory_overhead is None
    named = parse_case("exp.yaml", tmp_path, {**case, "framework": "megatron-llama-sweeps"})
    assert named.system.memory_overhead.reserved_GiB == 3
    assert named.system.memory_headroom.GiB == 17
    (tmp_path / "fw").mkdir()
    (tmp_path / "fw/mine.json").write_text(json.dumps({"name": "mine",
                                                       "time_overhead": {"pipeline_fraction": 0.1}}))
    path = parse_case("exp.yaml", tmp_path, {**case, "framework": "fw/mine.json"})
    assert path.system.time_overhead.pipeline_fraction == 0.1
    with pytest.raises(SpecError) as e:
        parse_case("exp.yaml", tmp_path, {**case, "framework": 3})
    assert e.value.field == "case.framework"


def test_shipped_systems_are_hardware_only():
    for name in shipped.names("systems"):
        s = load_system(name if "/" in name else f"systems/{name}.json")
        assert s.memory_overhead is None and s.time_overhead is None, name
        assert s.memory_headroom is None, name


# ----------------------------------------------------------------------------
# Counted terms, by hand.

def _one_stage(model, system, **kw):
    import autopar
    ex = {**LAYOUT, "num_procs": 4, "pipeline_par": 1, "data_par": 2, "batch_size": 8,
          "microbatch_size": 2, **kw}
    return autopar.evaluate(model, system, [ex]).iloc[0]


def test_megatron_loss_counted_by_hand():
    """Megatron-Core's vocab-parallel cross entropy holds the bf16 logits of
    its vocabulary shard and one fp32 copy of them (cast once, then
    max-subtracted, exponentiated, normalised and turned into the gradient
    in place): (2 + 4) bytes x tokens x V / tensor_par on the last stage.
    Against a loss on gathered logits with the same one fp32 copy the need
    is smaller by (2 + 4) x tokens x V x (1 - 1 / tensor_par)."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/a100_80g.json")
    core = load_framework("megatron-core").memory_overhead
    assert (core.logits_fp32_copies, core.logits_gathered) == (1.0, False)
    assert load_framework("megatron-llama-sweeps").memory_overhead.logits_gathered is False
    tokens, V, tp = 2 * model.seq_size, model.vocab_size, LAYOUT["tensor_par"]
    split = _one_stage(model, with_framework(hw, load_framework("megatron-core")))
    gathered = _one_stage(model, dataclasses.replace(
        hw, memory_overhead=dataclasses.replace(core, logits_gathered=True)))
    assert gathered.proc_mem_tier1_cap_req - split.proc_mem_tier1_cap_req == \
        pytest.approx((2 + 4) * tokens * V * (1 - 1 / tp), rel=1e-12)
    none = _one_stage(model, dataclasses.replace(
        hw, memory_overhead=dataclasses.replace(core, logits_fp32_copies=0.0)))
    assert split.proc_mem_tier1_cap_req - none.proc_mem_tier1_cap_req == \
        pytest.approx(4 * tokens * V / tp, rel=1e-12)


def test_megatron_2023_loss_holds_two_fp32_copies_by_hand():
    """The Megatron-LM of 2023 (the LLaMA sweeps' framework) subtracts the
    max out of place in its vocab-parallel cross entropy (until 9634c0e,
    2024-06): the fp32 upcast and the max-subtracted fp32 copy are both
    alive at the loss's forward peak beside the bf16 logits, 10 B a shard
    element.  Against Megatron-Core's one copy, the sweeps' last stage needs
    4 B x tokens x V / tensor_par more, grown by the framework's allocator
    fraction (the loss buffers are transient)."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/a100_80g.json")
    over = load_framework("megatron-llama-sweeps").memory_overhead
    assert (over.logits_fp32_copies, over.logits_gathered) == (2.0, False)
    base = load_framework("megatron-llama-sweeps-counted-base").memory_overhead
    assert (base.logits_fp32_copies, base.logits_gathered) == (2.0, False)
    tokens, V, tp = 2 * model.seq_size, model.vocab_size, LAYOUT["tensor_par"]
    two = _one_stage(model, dataclasses.replace(hw, memory_overhead=over))
    one = _one_stage(model, dataclasses.replace(
        hw, memory_overhead=dataclasses.replace(over, logits_fp32_copies=1.0)))
    assert two.proc_mem_tier1_cap_req - one.proc_mem_tier1_cap_req == \
        pytest.approx((1 + over.fraction) * 4 * tokens * V / tp, rel=1e-12)


def test_apex_master_remainders_counted_by_hand():
    """NeMo 1.x / Apex store_param_remainders: the fp32 master of a bf16
    weight is the weight and a 2-byte remainder, so the optimizer holds
    8 (Adam moments) + 2 bytes per parameter instead of 8 + 4."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/h100_80g_nvl8.json")
    apex = _one_stage(model, with_framework(hw, load_framework("nemo1-apex")))
    core = _one_stage(model, with_framework(hw, load_framework("megatron-core")))
    assert apex.optimizer_space / core.optimizer_space == pytest.approx(10 / 12, rel=1e-12)


def test_deepspeed_bucket_counted_by_hand():
    """ZeRO-2/3's contiguous gradient bucket: reduce_bucket_size 5e8
    elements of 16-bit gradients, reserved; stage 1 has none."""
    bucket = 5e8 * 2 / 2 ** 30
    for stage, want in ((1, 0.0), (2, bucket), (3, bucket)):
        got = load_framework(f"deepspeed-zero{stage}").memory_overhead.reserved_GiB
        assert got == pytest.approx(want, abs=1e-3), stage
    fw = load_framework("deepspeed-zero2")
    assert fw.defaults["optimizer_sharding"] and not fw.defaults["unsharded_grads"]
    assert load_framework("deepspeed-zero1").defaults["unsharded_grads"]
    assert load_framework("deepspeed-zero3").defaults["weight_sharding"]


def test_torchtitan_checkpoints_split_over_tensor_ranks():
    """torchtitan's full activation checkpointing keeps each block's input,
    which sequence parallelism leaves split over the tensor ranks: the
    checkpoint is 1 / tensor_par of Calculon's whole one."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/h100_96g_nvl8.json")
    titan = _one_stage(model, with_framework(hw, load_framework("torchtitan")))
    whole = _one_stage(model, hw)
    assert titan.act_checkpoint_size * LAYOUT["tensor_par"] == \
        pytest.approx(whole.act_checkpoint_size, rel=1e-12)


def test_torchtitan_loss_counted_by_hand():
    """torchtitan's eager loss casts the logits (its vocabulary shard) to
    fp32 and runs PyTorch's cross entropy: at its backward peak three fp32
    copies are alive (the saved log-softmax, the nll gradient and the
    log-softmax gradient) and, without pipeline stages, the bf16 logits are
    already freed (train.py deletes them before backward).  Compiled
    (torchtitan-compile), the loss keeps the bf16 logits and writes a bf16
    gradient: half an fp32 copy beside them."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/h100_96g_nvl8.json")
    tokens, V, tp = 2 * model.seq_size, model.vocab_size, LAYOUT["tensor_par"]
    unit = tokens * V / tp

    def need(fw, **over):
        o = dataclasses.replace(fw.memory_overhead, **over)
        return _one_stage(model, dataclasses.replace(with_framework(hw, fw),
                                                     memory_overhead=o)).proc_mem_tier1_cap_req

    titan = load_framework("torchtitan")
    o = titan.memory_overhead
    assert (o.logits_fp32_copies, o.logits_gathered, o.logits_kept) == (3.0, False, "pipelined")
    bare = need(titan, logits_fp32_copies=0.0, logits_kept="always")    # bf16 logits only
    assert need(titan) - bare == pytest.approx((3 * 4 - 2) * unit, rel=1e-12)
    assert need(titan, logits_kept="always") - bare == pytest.approx(3 * 4 * unit, rel=1e-12)
    comp = load_framework("torchtitan-compile")
    c = comp.memory_overhead
    assert (c.logits_fp32_copies, c.logits_kept) == (0.5, "always")
    assert need(comp) - bare == pytest.approx(2 * unit, rel=1e-12)
    # everything else is torchtitan's but the compiled blocks' saves; the
    # December 2024 compile (blocks compiled, loss eager) has torchtitan's loss
    assert dataclasses.replace(c, logits_fp32_copies=3.0, logits_kept="pipelined",
                               selective_saves="op_eager") == o
    assert comp.defaults == titan.defaults and comp.options == titan.options
    blocks = load_framework("torchtitan-compile-blocks")
    assert blocks.memory_overhead == dataclasses.replace(o, selective_saves="op_compiled")


def test_fsdp_reshard_policy_counted_by_hand():
    """FSDP2 with reshard_after_forward=False (torchtitan's default under
    pipeline parallelism) keeps every block's gathered weights from its
    forward to its backward: (blocks per stage - 2) more whole blocks than
    the gathered block and the prefetched next one; without pipeline stages
    torchtitan reshards, and "always" is the count without the field."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/h100_96g_nvl8.json")
    titan = load_framework("torchtitan")
    assert titan.memory_overhead.fsdp_reshard == "unless_pipelined"
    sharded = {"weight_sharding": True, "optimizer_sharding": True, "data_par": 2,
               "activation_recompute": "full"}

    def need(policy, pp):
        over = dataclasses.replace(titan.memory_overhead, fsdp_reshard=policy)
        s = dataclasses.replace(hw, memory_overhead=over)
        return _one_stage(model, s, pipeline_par=pp, num_procs=2 * pp * 2, **sharded)

    blocks = model.num_blocks / 2
    per_block = need("always", 2).weight_space / blocks * 2     # a whole (gathered) block
    extra = need("unless_pipelined", 2).proc_mem_tier1_cap_req \
        - need("always", 2).proc_mem_tier1_cap_req
    assert extra == pytest.approx((blocks - 2) * per_block, rel=1e-9)
    assert need("unless_pipelined", 1).proc_mem_tier1_cap_req == \
        need("always", 1).proc_mem_tier1_cap_req
    assert need("never", 1).proc_mem_tier1_cap_req > need("always", 1).proc_mem_tier1_cap_req
    with pytest.raises(SpecError) as e:
        load_framework({"name": "x", "memory_overhead": {"fsdp_reshard": "sometimes"}})
    assert e.value.field == "memory_overhead.fsdp_reshard"


def test_optimizer_step_temporaries_counted_by_hand():
    """memory_overhead.optimizer_step_bytes: the optimizer step's
    temporaries (PyTorch 2.0's foreach AdamW: sqrt(v) and sqrt(v) + eps)
    beside the static state, after the activations are freed: a second peak
    of static + bytes x the parameters the processor's optimizer steps (its
    blocks' and the embedding / output matrix's, over the optimizer's
    shards).  0, the default, is the count without the field."""
    from autopar.io.specs import load_model
    model = load_model("models/llama-13B.json")
    hw = load_system("systems/a100_80g.json")
    core = load_framework("megatron-core").memory_overhead
    assert core.optimizer_step_bytes == 0.0

    def run(step, **kw):
        s = dataclasses.replace(hw, memory_overhead=dataclasses.replace(
            core, optimizer_step_bytes=step))
        return _one_stage(model, s, **kw)
    base = run(0.0)
    # bf16 weights: parameters = bytes / 2; tensor_par 2, optimizer_sharding
    # over data_par 2.
    tp, shards = LAYOUT["tensor_par"], 2
    trained = (base.weight_space / 2 + 2 * model.vocab_size * model.hidden / tp) / shards
    assert run(64.0).proc_mem_tier1_cap_req - run(32.0).proc_mem_tier1_cap_req == \
        pytest.approx(32 * trained, rel=1e-12)
    # A step smaller than the batch's transient peak changes nothing.
    assert run(1e-3).proc_mem_tier1_cap_req == base.proc_mem_tier1_cap_req
    # Nothing is stepped in inference.
    infer = {"training": False, "activation_recompute": "none", "optimizer_sharding": False,
             "data_par_overlap": False}
    assert run(0.0, **infer).feasible
    assert run(64.0, **infer).proc_mem_tier1_cap_req == run(0.0, **infer).proc_mem_tier1_cap_req
    back = load_framework({"name": "x", "memory_overhead": {"optimizer_step_bytes": 8}})
    assert back.memory_overhead.optimizer_step_bytes == 8.0
    assert load_framework(framework_to_json(back)).memory_overhead == back.memory_overhead
    for field in ("optimizer_step_bytes", "adapter_saved_bytes"):
        for bad in (-1, 65, "8"):
            with pytest.raises(SpecError) as e:
                load_framework({"name": "x", "memory_overhead": {field: bad}})
            assert e.value.field == f"memory_overhead.{field}"


def test_tune_and_validate_take_the_framework(cli, tmp_path, reference):
    case = ("models/llama-13B.json", "systems/a100_80g_dgx_hdr200.json", "--num-procs", 8,
            "--max-batch-size", 64, "--datatype", "bfloat16", "--space", "llama",
            "--sampler", "random", "--trials", 8, "--seed", 1)
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    r0 = cli("tune", *case, "--trials-out", a)
    r1 = cli("tune", *case, "--framework", "megatron-llama-sweeps", "--trials-out", b)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr + r1.stderr
    import pandas as pd
    t0, t1 = pd.read_csv(a), pd.read_csv(b)
    both = t0.proc_mem_tier1_cap_req.notna() & t1.proc_mem_tier1_cap_req.notna()
    assert both.any()
    assert (t1.proc_mem_tier1_cap_req[both] > t0.proc_mem_tier1_cap_req[both]).all()
    csv = reference / "measured" / "llama-sweeps" / "llama_13B_65B_a100.csv"
    r = cli("validate", csv, "--system", "systems/a100_80g_dgx_hdr200.json", "--framework",
            "megatron-llama-sweeps")
    assert r.returncode == 0 and "17 GiB of memory headroom" in r.stdout


def test_run_an_experiment_with_a_framework(cli, tmp_path, repo_root):
    import yaml
    exp = {"kind": "exhaustive", "name": "fw",
           "case": {"model": str(repo_root / "models/llama-13B.json"),
                    "system": str(repo_root / "systems/a100_80g_dgx_hdr200.json"),
                    "num_procs": 8, "max_batch_size": 64, "datatype": "bfloat16",
                    "space": "llama", "framework": "megatron-llama-sweeps"},
           "summary": "out/summary.json"}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    r = cli("run", path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["memory_headroom_GiB"] == 17            # the framework's headroom


def test_partial_layout_draws_unknown_fields_from_the_framework(cli, tmp_path):
    """estimate of a partial layout under a framework: the unknown fields
    take the values the framework can express (llm-foundry: no tensor
    parallelism), the fields left out its recipe's defaults."""
    part = {**LAYOUT, "num_procs": 8, "tensor_par": "?", "pipeline_par": 1, "data_par": "?"}
    path = tmp_path / "part.json"
    path.write_text(json.dumps(part))
    args = ("estimate", "models/llama-7B.json", "systems/a100_80g.json", path, "--json")
    plain = json.loads(cli(*args).stdout)
    foundry = json.loads(cli(*args, "--framework", "llm-foundry").stdout)
    assert plain["options"] == {"tensor_par": None}
    assert foundry["options"] == {"tensor_par": [1]}
    assert foundry["stated"]["weight_sharding"] is True
    assert plain["stated"]["weight_sharding"] is False


def test_readme_lists_every_record_field():
    """frameworks/README.md's field list names every key the two records
    read (a field added without its line fails here)."""
    from autopar.io.specs import ADAPTER_BYTES_KEYS
    text = (REPO_ROOT / "frameworks" / "README.md").read_text()
    keys = [f"memory_overhead.{f.name}" for f in dataclasses.fields(MemoryOverhead)]
    keys += ["time_overhead." + {"adapter_bytes": "adapter_elementwise_bytes"}.get(f.name, f.name)
             for f in dataclasses.fields(TimeOverhead)]
    for k in keys:
        assert text.count(f"| `{k}` |") == 1, k
    assert all(k in text for k in ADAPTER_BYTES_KEYS)


def _table_rows(path, header: str) -> list[str]:
    """The rows of the table under ``header`` (a line's start) in ``path``."""
    lines = path.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(at) == 1, header
    rows = []
    for line in lines[at[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_and_docs_tables_are_the_files():
    """frameworks/README.md lists every shipped file once, with its current
    values, and docs/validation.md ("Framework specs") every term of every
    file with its citation: both exactly as tests/framework_tables.py renders
    them from the files (run it to print the rows after changing a file)."""
    from framework_tables import readme_rows, term_rows
    readme = _table_rows(REPO_ROOT / "frameworks" / "README.md", "| file | memory_overhead")
    listed = [r.split(" | ")[0] for r in readme]
    assert sorted(listed) == sorted(f"| `{n}.json`" for n in SHIPPED)      # each once
    assert readme == readme_rows()
    terms = _table_rows(REPO_ROOT / "docs" / "validation.md", "| file | term | value | kind |")
    assert terms == term_rows()
    # every stated term of every file has its row, cited unless fitted
    for name in SHIPPED:
        data = json.loads((REPO_ROOT / "frameworks" / f"{name}.json").read_text())
        n = sum(len(data.get(r, {})) for r in ("memory_overhead", "time_overhead",
                                                 "memory_headroom", "defaults", "options"))
        assert sum(r.startswith(f"| `{name}.json` | `") for r in terms) == n, name
