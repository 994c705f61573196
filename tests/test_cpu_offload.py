"""Partial CPU activation offloading (issue 24, ``activation_offload_blocks``):
Megatron-Core's ``cpu_offloading`` with ``cpu_offloading_num_layers`` N, run by
Transformer Engine's ``DefaultOffloadSynchronizer`` (cpu_offload.py).  Hand
counts of the memory on a small case, the exposed copy time against a
step-by-step replay of TE's schedule, the rules, and the recipes it lets
autopar predict."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.io.specs import SpecError, load_execution, load_model, load_system
from autopar.model import REASONS, evaluate_one

from conftest import REPO_ROOT, one_proc_execution

MODEL = REPO_ROOT / "models/gpt3-13B.json"          # 40 blocks
SYSTEM = REPO_ROOT / "systems/a100_80g.json"
BLOCKS = 40


def _system(gbps: float):
    """a100_80g with a host link of ``gbps`` at one flat efficiency (so a
    copy's time is bytes / bandwidth, countable by hand)."""
    data = json.loads(SYSTEM.read_text())
    data["mem1"]["GiB"] = 100000          # every case evaluates (the counts, not the fit)
    data["mem2"].update(GBps=gbps, MB_efficiency=[[0, 1.0]])
    return load_system(data)


def _execution(n: int, **kw) -> dict:
    # batch 4 at micro-batch 2: two micro-batches, one stage
    return one_proc_execution(activation_offload_blocks=n, **kw)


def _replay_forward(blocks: int, n: int, f: float, c: float) -> float:
    """Stall of one forward under TE's DefaultOffloadSynchronizer, replayed
    block by block: ``fwd_step(j)`` starts the copy of block j - 1 (< n) on
    the offload stream after the one before it, then makes block j wait for
    the copy of block j - (blocks - n) (``finish_offload_map``)."""
    t, prev, ends = 0.0, 0.0, {}
    for j in range(blocks):
        if 1 <= j <= n:
            ends[j - 1] = max(t, prev) + c
            prev = ends[j - 1]
        i = j - (blocks - n)
        if 0 <= i < n:
            t = max(t, ends[i])
        t += f
    return t - blocks * f


def _replay_backward(blocks: int, n: int, b: float, c: float) -> float:
    """Stall of one backward: ``bwd_step(k)`` starts the reload of block
    k - blocks + 1 + n (``start_reload_map``), block k < n waits for its own
    reload (``pop_tensor``)."""
    t, prev, ends = 0.0, 0.0, {}
    for k in range(blocks - 1, -1, -1):
        i = k - blocks + 1 + n
        if 0 <= i < n:
            ends[i] = max(t, prev) + c
            prev = ends[i]
        if k < n:
            t = max(t, ends[k])
        t += b
    return t - blocks * b


def test_zero_is_calculon_and_the_memory_moves_block_by_block():
    model, system = load_model(MODEL), _system(32)
    plain = evaluate_one(model, system, one_proc_execution())
    zero = evaluate_one(model, system, _execution(0))
    assert plain == zero
    storage = plain["block_act_storage_space"]
    assert storage > 0
    for n in (1, 10, 39):
        s = evaluate_one(model, system, _execution(n))
        assert s["feasible"]
        # the n offloaded blocks' saved activations leave tier 1 (one
        # micro-batch in flight on the one stage) and sit in host memory
        assert s["act_space"] == pytest.approx(plain["act_space"] - n * storage, rel=1e-12)
        assert s["proc_mem_tier1_cap_req"] == pytest.approx(
            plain["proc_mem_tier1_cap_req"] - n * storage, rel=1e-12)
        assert s["proc_mem_tier2_cap_req"] == pytest.approx(
            plain["proc_mem_tier2_cap_req"] + n * storage, rel=1e-12)
        # nothing else of the step changes but the exposed copies
        assert s["fw_time"] == plain["fw_time"] and s["bw_time"] == plain["bw_time"]


@pytest.mark.parametrize("gbps", [4, 32, 1000])
@pytest.mark.parametrize("n", [1, 5, 20, 38, 39])
def test_exposed_copies_are_what_tes_schedule_waits(gbps, n):
    model, system = load_model(MODEL), _system(gbps)
    plain = evaluate_one(model, system, _execution(0))
    s = evaluate_one(model, system, _execution(n))
    micro = 2
    f = plain["fw_time"] / (BLOCKS * micro)          # one block's forward (TP 1, PP 1)
    b = plain["bw_time"] / (BLOCKS * micro)          # and backward, no recompute
    c = plain["block_act_storage_space"] / (gbps * 1e9)
    fw = micro * _replay_forward(BLOCKS, n, f, c)
    bw = micro * _replay_backward(BLOCKS, n, b, c)
    assert s["fw_offload_exposed_time"] == pytest.approx(fw, rel=1e-9, abs=1e-12)
    assert s["bw_offload_exposed_time"] == pytest.approx(bw, rel=1e-9, abs=1e-12)
    assert s["total_time"] == pytest.approx(plain["total_time"] + fw + bw, rel=1e-9)
    if n == BLOCKS - 1:       # every block waits for its own copy: nothing hidden
        assert fw == pytest.approx(micro * n * c) and bw == pytest.approx(micro * n * c)
    if gbps == 1000 and n <= 20:      # a fast link with room: all hidden
        assert fw == pytest.approx(0, abs=1e-12) and bw == pytest.approx(0, abs=1e-12)
        assert s["fw_offload_exposed_time"] == 0 and s["bw_offload_exposed_time"] == 0


@pytest.mark.parametrize("kw, why", [
    ({"pipeline_par": 2, "num_procs": 2}, "pipeline_par 1"),
    ({"activation_recompute": "full"}, "activation recompute"),
    ({"activations_offload": True}, "activations_offload"),
    ({"training": False, "activation_recompute": "none"}, "training"),
])
def test_io_refuses_what_megatron_refuses_naming_the_field(kw, why):
    with pytest.raises(SpecError) as e:
        load_execution(_execution(4, **kw), model=load_model(MODEL), source="ex.json")
    assert e.value.field == "activation_offload_blocks" and why in e.value.message


def test_io_refuses_offloading_every_block_and_a_negative_count(tmp_path, capsys):
    model = load_model(MODEL)
    assert load_execution(_execution(BLOCKS - 1), model=model)["activation_offload_blocks"] \
        == BLOCKS - 1
    with pytest.raises(SpecError) as e:
        load_execution(_execution(BLOCKS), model=model)
    assert e.value.field == "activation_offload_blocks" and "40 blocks" in e.value.message
    with pytest.raises(SpecError) as e:
        load_execution(_execution(-1))
    assert e.value.field == "activation_offload_blocks"
    f = tmp_path / "ex.json"
    f.write_text(json.dumps(_execution(BLOCKS)))
    assert main(["estimate", str(MODEL), str(SYSTEM), str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "activation_offload_blocks" in err[0]


@pytest.mark.parametrize("n, kw, reason", [
    (4, {"pipeline_par": 2, "num_procs": 2}, "invalid: activation_offload_blocks needs"),
    (4, {"activation_recompute": "attn_only"}, "invalid: activation_offload_blocks needs"),
    (BLOCKS, {}, "invalid: activation_offload_blocks must be"),
])
def test_the_model_flags_a_layout_it_is_given(n, kw, reason):
    s = evaluate_one(load_model(MODEL), load_system(SYSTEM), _execution(n, **kw))
    assert not s["feasible"] and REASONS[s["reason_code"]].startswith(reason)


def test_bridge_table_searches_it_where_megatron_takes_it():
    """``validate published --partial`` on the Qwen3 Bridge table: the pp 1
    rows' completions gain every offloaded count of the 48 blocks with no
    recompute (192 + 47 x 48), the pp 2 rows none (the rules refuse it
    there); offloading only costs time here, so no best completion picks it
    and the default completion is the one it was."""
    from autopar.studies.published import TABLES, predict
    table = TABLES["bridge_qwen3_moe"]
    assert table.unstated["activation_offload_blocks"] is None
    rows = predict(table, rank=False, partial=True)
    pp2 = rows.label.str.contains(" pp2 ")
    assert pp2.any() and (~pp2).any()
    assert (rows[~pp2].completions == 192 + 47 * 48).all()
    assert (rows[pp2].completions == 192).all()
    assert rows.chosen.str.contains("activation_offload_blocks=0").all()
    assert rows.feasible.all()


@pytest.mark.parametrize("framework", ["torchtitan", "deepspeed-zero3", "llm-foundry",
                                       "hf-peft"])
def test_a_framework_without_it_cuts_it_from_a_space(framework):
    """A space that searches the field keeps only 0 under a framework whose
    offloading is not TE's schedule (its ``options``); Megatron's keep it."""
    from autopar.search.space import framework_space, load_space
    base = load_space("small").to_dict()
    base["fixed"].pop("activation_offload_blocks", None)
    base["params"]["activation_offload_blocks"] = "derived"
    space = load_space(base, source="mine.yaml")
    assert space.allowed["activation_offload_blocks"].values is None
    assert framework_space(space, framework).allowed["activation_offload_blocks"].values == (0,)
    assert framework_space(space, "megatron-bridge").allowed["activation_offload_blocks"] \
        == space.allowed["activation_offload_blocks"]


def test_ranking_does_not_recommend_offloading_for_nothing():
    """Two layouts equally fast, the offloaded one with less tier-1 memory:
    the one without offloading is recommended (offloading is a kind of
    offloading for the tie-break before memory); alone, memory decides."""
    import numpy as np
    from autopar.search.ranking import order
    cols = {"sample_rate": np.array([10.0, 10.0]),
            "proc_mem_tier1_cap_req": np.array([50.0, 60.0]),
            "activation_offload_blocks": np.array([8, 0]),
            "pipeline_par": np.array([1, 1])}
    assert order(cols).tolist() == [1, 0]
    cols["activation_offload_blocks"] = np.array([0, 0])
    assert order(cols).tolist() == [0, 1]
