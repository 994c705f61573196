"""The analytical model: agreement with Calculon, validity rules, hand counts."""
from __future__ import annotations

import collections

import numpy as np
import pandas as pd
import pytest

import autopar
from autopar import model as M
from autopar.io.layouts import to_columns
from autopar.io.specs import load_model, load_system
from conftest import one_proc_execution


def _golden_groups(golden):
    groups = collections.defaultdict(list)
    for r in golden:
        groups[(r["model"], r["system"])].append(r)
    return groups


def test_golden_agreement(golden, reference):
    """Feasibility and key statistics agree with the reference on all 3,120 cases."""
    systems = reference / "calculon-golden" / "systems"
    total = agree = compared = 0
    within_01 = within_1 = 0
    for (mname, sname), rows in _golden_groups(golden).items():
        model = load_model(rows[0]["application"])
        system = load_system(systems / f"{sname}.json")
        out = M.evaluate_columns(model, system, to_columns([r["execution"] for r in rows]))
        for i, r in enumerate(rows):
            total += 1
            if bool(out["feasible"][i]) != r["ok"]:
                continue
            agree += 1
            if not r["ok"]:
                continue
            for key in ("sample_rate", "total_time", "proc_mem_tier1_cap_req"):
                compared += 1
                rel = abs(out[key][i] - r["stats"][key]) / abs(r["stats"][key])
                within_01 += rel <= 1e-3
                within_1 += rel <= 1e-2
    assert total == 3120
    assert agree / total >= 0.999
    assert compared > 3000
    assert within_01 / compared >= 0.995
    assert within_1 == compared


def test_golden_every_statistic(golden, reference):
    """Every statistic of every feasible case matches to 1e-9 (the same semantics)."""
    systems = reference / "calculon-golden" / "systems"
    worst = 0.0
    for (mname, sname), rows in _golden_groups(golden).items():
        model = load_model(rows[0]["application"])
        system = load_system(systems / f"{sname}.json")
        out = M.evaluate_columns(model, system, to_columns([r["execution"] for r in rows]))
        for i, r in enumerate(rows):
            if not r["ok"]:
                assert M.REASONS[out["reason_code"][i]].startswith("infeasible:")
                continue
            for key, want in r["stats"].items():
                if want is None:
                    assert np.isnan(out[key][i])
                    continue
                got = out[key][i]
                worst = max(worst, abs(got - want) / max(abs(want), 1e-300))
    assert worst < 1e-9


def test_golden_reasons_match(golden, reference):
    """The first failing rule is the reference's (memory, network tier, offload)."""
    systems = reference / "calculon-golden" / "systems"
    for (mname, sname), rows in _golden_groups(golden).items():
        model = load_model(rows[0]["application"])
        system = load_system(systems / f"{sname}.json")
        out = M.evaluate_columns(model, system, to_columns([r["execution"] for r in rows]))
        for i, r in enumerate(rows):
            if r["ok"]:
                continue
            ours = M.REASONS[out["reason_code"][i]].lower()
            theirs = r["error"].lower()
            if "mem tier1" in theirs:
                assert "mem tier1" in ours
            elif "mem tier2" in theirs:
                assert "mem tier2" in ours
            elif "offloading" in theirs:
                assert "offloading" in ours
            elif "network tier" in theirs:
                tier = theirs.split("network tier")[1][0]
                assert f"network tier{tier}" in ours
                assert ("big enough" in ours) == ("big enough" in theirs)


def test_megatron_published_errors_match_reference(reference):
    """Reproduces the Megatron-LM figures with the reference model's errors."""
    from autopar.studies.validate import megatron, summarize

    system = load_system(reference / "calculon-golden" / "systems" / "a100_80g.json")
    s = summarize(megatron(system))
    expect = {"fig1_activation_memory_gib": (2.08, 8.74),
              "fig7_activation_memory_percent": (6.69, 30.41),
              "tab5_batch_time_s": (3.65, 8.87)}
    for fig, (mean, mx) in expect.items():
        assert s.loc[fig, "mean_error_pct"] == pytest.approx(mean, abs=0.01)
        assert s.loc[fig, "max_error_pct"] == pytest.approx(mx, abs=0.01)


def test_validate_megatron_cli(cli, repo_root):
    r = cli("validate", "megatron")
    assert r.returncode == 0, r.stderr
    assert "tab5_batch_time_s" in r.stdout and "mean_error_pct" in r.stdout


# --- small hand-checked cases ------------------------------------------------

TINY = {"hidden": 64, "feedforward": 256, "seq_size": 32, "attn_heads": 4,
        "attn_size": 16, "num_blocks": 4}


@pytest.fixture
def tiny_system(repo_root):
    return load_system(repo_root / "systems" / "a100_80g.json")


_exe = one_proc_execution


def test_block_flops_and_weights_by_hand(tiny_system):
    """Forward flops and weight bytes of one GPT block, counted by hand."""
    m = load_model(TINY)
    out = autopar.evaluate(m, tiny_system, _exe()).iloc[0]
    h, f, s, H, d, b = 64, 256, 32, 4, 16, 2
    B = b * s
    matmuls = 2 * B * h * (3 * H * d) + 2 * B * (H * d) * h + 2 * B * h * f * 2
    attn = b * H * 2 * s * d * s * 2              # QK^T and attention x V
    softmax, dropout_attn = 5 * H * s * s * b, H * s * s * b
    layernorms, gelu = 2 * 9 * B * h, 8 * B * f
    dropouts, residuals = 2 * B * h, 2 * B * h
    assert out.block_fw_flops == matmuls + attn + softmax + dropout_attn + layernorms \
        + gelu + dropouts + residuals
    weights = (3 * h * H * d + H * d * h + 2 * h * f + 2 * 2 * h) * 2   # fp16, no biases
    assert out.block_weight_space == weights
    # Adam: fp32 master copy + two fp32 moments per weight.
    assert out.block_optimizer_space == pytest.approx(weights / 2 * 12)
    assert out.useful_flops > out.block_fw_flops


def test_column_of_one_equals_row_of_many(tiny_system):
    m = load_model(TINY)
    exes = [_exe(), _exe(activation_recompute="full"), _exe(microbatch_size=1),
            _exe(training=False), _exe(fused_activation=True)]
    many = autopar.evaluate(m, tiny_system, exes)
    for i, e in enumerate(exes):
        one = autopar.evaluate(m, tiny_system, e).iloc[0]
        pd.testing.assert_series_equal(one, many.iloc[i], check_names=False)


@pytest.mark.parametrize("change, reason", [
    (dict(tensor_par=2), "tensor_par * pipeline_par * data_par != num_procs"),
    (dict(batch_size=5, microbatch_size=1), None),
    (dict(num_procs=2, data_par=2, batch_size=6, microbatch_size=2),
     "local batch is not divisible by microbatch_size"),
    (dict(num_procs=2, data_par=2, batch_size=5), "batch_size is not divisible by data_par"),
    (dict(activation_recompute="full", training=False), "recompute is only for training"),
    (dict(pipeline_interleaving=2), "pipeline_interleaving must be 1"),
    (dict(optimizer_sharding=True), "optimizer_sharding needs data_par > 1"),
    (dict(tensor_par_overlap="ring"), "tensor_par_overlap needs tensor_par > 1"),
    (dict(seq_par_ag_redo=True), "seq_par_ag_redo needs tensor_par_comm_type rs_ag"),
    (dict(seq_par_ag_redo=True, tensor_par_comm_type="rs_ag", activation_recompute="full"),
     "not used with full recompute"),
    (dict(data_par_overlap=True), "data_par_overlap needs training and data_par > 1"),
    (dict(optimizer_offload=True, training=False), "optimizer_offload is only for training"),
    (dict(num_procs=3, tensor_par=3, tensor_par_net=1), "must be divisible by tensor_par"),
    (dict(num_procs=3, tensor_par=3), "network tier0 isn't fully used"),
    (dict(num_procs=2, pipeline_par=2, pipeline_interleaving=3),
     "pipeline_interleaving exceeds the blocks per processor"),
    (dict(num_procs=2, pipeline_par=2, pipeline_interleaving=2, num_blocks=6),
     "pipeline_interleaving must divide the blocks per processor"),
    (dict(num_procs=2, pipeline_par=2, weight_offload=True), "at least 3 blocks"),
    (dict(num_procs=16, tensor_par=16, tensor_par_net=0), "network tier0 isn't big enough"),
    (dict(num_procs=3, data_par=3, batch_size=6, data_par_net=0),
     "network tier0 isn't fully used"),
    (dict(num_procs=2, data_par=2, data_par_net=0), None),
    (dict(tensor_par_net=5), "network tier out of range"),
    (dict(datatype="float8"), "datatype not supported"),
])
def test_invalid_layouts(tiny_system, change, reason):
    m = load_model(dict(TINY, num_blocks=change.pop("num_blocks", TINY["num_blocks"])))
    row = autopar.evaluate(m, tiny_system, _exe(**change)).iloc[0]
    if reason is None:
        assert row.feasible and row.reason == ""
        return
    assert not row.feasible
    assert reason in row.reason
    assert np.isnan(row.sample_rate)


def test_memory_failure_says_how_much(tiny_system):
    big = dict(TINY, hidden=16384, feedforward=65536, attn_heads=128, attn_size=128,
               num_blocks=8)
    row = autopar.evaluate(load_model(big), tiny_system, _exe()).iloc[0]
    assert not row.feasible
    assert row.reason.startswith("infeasible: mem tier1 needs ")
    assert row.proc_mem_tier1_cap_req > 80 * 1024 ** 3
    assert np.isnan(row.total_time)


def test_uneven_blocks_shorten_the_bubble(tiny_system):
    """5 blocks on 2 stages: 3 blocks on the first, bubble shortened by one block."""
    m5 = load_model(dict(TINY, num_blocks=5))
    m6 = load_model(dict(TINY, num_blocks=6))
    e = _exe(num_procs=2, pipeline_par=2, batch_size=8, microbatch_size=1,
             pipeline_par_net=1)
    r5 = autopar.evaluate(m5, tiny_system, e).iloc[0]
    r6 = autopar.evaluate(m6, tiny_system, e).iloc[0]
    assert r5.fw_time == pytest.approx(r6.fw_time)          # 3 blocks per stage both
    assert r5.bubble_time < r6.bubble_time


def test_roofline_is_never_slower(reference):
    systems = reference / "calculon-golden" / "systems"
    m = load_model(reference / "calculon-golden" / "models" / "megatron-126M.json")
    no = load_system(systems / "a100_80g.json")
    roof = load_system(systems / "a100_80g_roofline.json")
    e = _exe(num_procs=8, data_par=8, batch_size=64, microbatch_size=4, data_par_net=0)
    a = autopar.evaluate(m, no, e).iloc[0]
    b = autopar.evaluate(m, roof, e).iloc[0]
    assert a.feasible and b.feasible
    assert b.block_fw_time < a.block_fw_time
    assert b.total_time < a.total_time


def test_dataframe_input_and_order(tiny_system):
    m = load_model(TINY)
    frame = pd.DataFrame([_exe(microbatch_size=1), _exe(microbatch_size=2),
                          _exe(tensor_par=2)], index=[10, 20, 30])
    t = autopar.evaluate(m, tiny_system, frame)
    assert list(t.index) == [10, 20, 30]
    assert t.feasible.tolist() == [True, True, False]
    assert t.loc[10, "block_fw_flops"] < t.loc[20, "block_fw_flops"]
    assert set(M.STATS) <= set(t.columns)


def test_system_without_second_memory_tier(repo_root):
    """mem2 of 0 GiB (Calculon's way to say 'none'): offloading cannot run."""
    import json
    data = json.loads((repo_root / "systems" / "a100_80g.json").read_text())
    data["mem2"] = dict(data["mem2"], GiB=0, GBps=0)
    system = load_system(data)
    m = load_model(dict(TINY, num_blocks=8))
    rows = autopar.evaluate(m, system, [_exe(), _exe(weight_offload=True)])
    assert rows.feasible.tolist() == [True, False]
    assert "mem tier2" in rows.reason[1]
    assert rows.fw_offload_exposed_time[0] == 0


def test_large_table_equals_small_calls(tiny_system):
    """90,000 layouts in one call (a table large enough to be mapped with its
    pages populated, computed rows spread among rows that break a rule or
    fail on memory) give exactly what calls of 7,000 rows give, also when the
    table reuses the mapping of an earlier one with other values; the
    statistics are rows of one (statistic, layout) table (frame.py wraps it)."""
    from autopar.model import speedups
    m = load_model(dict(hidden=4096, feedforward=16384, seq_size=2048, attn_heads=32,
                        attn_size=128, num_blocks=8))
    n = 90_000
    rng = np.random.default_rng(5)
    cols = {f: np.repeat(v, n) for f, v in to_columns([_exe(batch_size=16)]).items()}
    cols["microbatch_size"] = rng.choice([1, 2, 4, 8, 16, 3], n)     # 3: invalid
    cols["activation_recompute"] = rng.integers(0, 3, n).astype(np.int8)
    cols["tensor_par"] = np.where(rng.random(n) < 0.2, 2, 1)        # 2: invalid
    speedups._SPARE.clear()
    other = M.evaluate_columns(m, tiny_system, dict(cols, microbatch_size=np.ones(n, int)))
    assert not speedups._SPARE and not np.isnan(other["total_time"]).all()
    del other                   # its mapping is kept and reused by the next
    assert len(speedups._SPARE) == 1
    whole = M.evaluate_columns(m, tiny_system, cols)
    assert not speedups._SPARE
    assert whole[M.STATS[0]].base.shape == (len(M.STATS), n)
    code = whole["reason_code"]
    assert (code == 0).any() and (code == M.REASON_CODE[
        "infeasible: mem tier1 capacity exceeded"]).any() and (code == 2).any()
    parts = [M.evaluate_columns(m, tiny_system, {f: v[i:i + 7000] for f, v in cols.items()})
             for i in range(0, n, 7000)]
    # The rows that pass the rules alone (every row computed: written in order).
    ran = np.flatnonzero((code == 0) | (code == M.REASON_CODE[
        "infeasible: mem tier1 capacity exceeded"]))
    alone = M.evaluate_columns(m, tiny_system, {f: v[ran] for f, v in cols.items()})
    for name in list(M.STATS) + ["feasible", "reason_code"]:
        joined = np.concatenate([p[name] for p in parts])
        assert np.array_equal(whole[name], joined, equal_nan=name in M.STATS), name
        assert np.array_equal(whole[name][ran], alone[name], equal_nan=name in M.STATS), name
    # NaN where a rule is broken; on a memory failure, but for the requirements.
    memory = code == M.REASON_CODE["infeasible: mem tier1 capacity exceeded"]
    broken = (code != 0) & ~memory
    assert np.isnan(whole["total_time"][code != 0]).all()
    assert not np.isnan(whole["total_time"][code == 0]).any()
    assert np.isnan(whole["proc_mem_tier1_cap_req"][broken]).all()
    assert not np.isnan(whole["proc_mem_tier1_cap_req"][memory]).any()


@pytest.mark.parametrize("invalid", [0.0, 0.2])
def test_rows_that_fit_give_the_same_among_rows_that_do_not(tiny_system, invalid):
    """Memory is checked first and the times are computed only for the rows
    that fit: those rows give exactly what they give evaluated alone (where
    every row fits), with or without rows that break a rule among them, and
    a chunk whose rows all fail on memory gives NaN times but keeps the
    memory requirements and parts."""
    from autopar.model import evaluate as E
    m = load_model(dict(hidden=4096, feedforward=16384, seq_size=2048, attn_heads=32,
                        attn_size=128, num_blocks=8))
    n = 2 * E.CHUNK + 9000
    rng = np.random.default_rng(13)
    cols = {f: np.repeat(v, n) for f, v in to_columns([_exe(batch_size=16)]).items()}
    # The first rows (a whole chunk of the computed ones) need 153 GiB of
    # the 80: micro-batches of 16 without recompute; then a mix.
    head = int(1.3 * E.CHUNK)
    none = cols["activation_recompute"][0]
    cols["microbatch_size"] = np.where(np.arange(n) < head, 16,
                                       rng.choice([1, 2, 4, 8, 16], n))
    cols["activation_recompute"] = np.where(np.arange(n) < head, none,
                                            rng.integers(0, 3, n)).astype(np.int8)
    cols["tensor_par"] = np.where(rng.random(n) < invalid, 2, 1)      # 2: invalid
    whole = M.evaluate_columns(m, tiny_system, cols)
    code = whole["reason_code"]
    memory = code == M.REASON_CODE["infeasible: mem tier1 capacity exceeded"]
    fits = code == 0
    assert memory[:head].sum() >= E.CHUNK and fits.sum() > 1000 and memory[head:].any()
    assert ((code != 0) & ~memory).any() == (invalid > 0)
    alone = M.evaluate_columns(m, tiny_system, {f: v[fits] for f, v in cols.items()})
    assert alone["feasible"].all()
    for name in M.STATS:
        assert np.array_equal(whole[name][fits], alone[name]), name
        kept = name in E._MEM_REQ
        assert np.isnan(whole[name][memory]).all() != kept, name
    parts = M.evaluate_columns(m, tiny_system, cols, stats=E.MEMORY_PARTS)
    for name in E.MEMORY_PARTS:
        assert not np.isnan(parts[name][memory | fits]).any(), name


def test_a_large_freed_table_is_not_kept(tiny_system, monkeypatch):
    """A freed table's mapping is kept for the next call only up to
    _SPARE_BYTES: a larger one is not held between calls."""
    import mmap
    from autopar.model import speedups
    m = load_model(dict(hidden=4096, feedforward=16384, seq_size=2048, attn_heads=32,
                        attn_size=128, num_blocks=8))
    n = 90_000
    cols = {f: np.repeat(v, n) for f, v in to_columns([_exe(batch_size=16)]).items()}
    speedups._SPARE.clear()
    monkeypatch.setattr(speedups, "_SPARE_BYTES", len(M.STATS) * n * 8 - 1)
    out = M.evaluate_columns(m, tiny_system, cols)
    assert isinstance(out["total_time"].base.base, mmap.mmap)
    del out
    assert not speedups._SPARE
    monkeypatch.setattr(speedups, "_SPARE_BYTES", len(M.STATS) * n * 8)
    out = M.evaluate_columns(m, tiny_system, cols)
    del out
    assert len(speedups._SPARE) == 1
    speedups._SPARE.clear()


@pytest.mark.parametrize("values", [(1, 2, 4, 8), (-3, -1, 0, 1, 2, 5, 7), (1, 3, 1 << 20)])
def test_by_value_equals_the_direct_computation(values):
    """Integer functions by value table give what the operations give
    directly, also with zeros and negative values, and where the ranges
    are too wide for a table (computed directly)."""
    from autopar.model.lookup import Ranges, by_value
    rng = np.random.default_rng(len(values))
    a, b = (rng.choice(values, 50_000) for _ in range(2))
    c = rng.integers(1, 9, 50_000)

    def f(x, y, z):
        return (x * (96 // np.maximum(y, 1))) % z != 0

    def g(x):
        return -(-80 // np.maximum(x, 1))
    assert np.array_equal(by_value(f, a, b, c), f(a, b, c))
    assert np.array_equal(by_value(g, a), g(a))
    assert by_value(g, a).dtype == g(a).dtype
    # Ranges shared by several calls on the same columns give the same.
    ranges = Ranges()
    for _ in range(2):
        assert np.array_equal(by_value(f, a, b, c, ranges=ranges), f(a, b, c))
        assert np.array_equal(by_value(g, a, ranges=ranges), g(a))


def test_no_layouts_give_empty_columns(tiny_system, repo_root):
    """A table of no layouts (an empty slice of a search) gives every
    statistic as an empty column, with the new fields on too."""
    import sys
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import model_throughput as mt
    for model, system, draw in (
            (load_model(TINY), tiny_system, lambda m: to_columns([_exe()])),
            (load_model(repo_root / "models" / "llama3-70B.json"),
             load_system(repo_root / "systems" / "h100_80g_nvl8.json"),
             lambda m: mt.random_modern_layouts(m, 1024, 1024, 10))):
        cols = {f: v[:0] for f, v in draw(model).items()}
        out = M.evaluate_columns(model, system, cols)
        assert all(len(out[name]) == 0 for name in list(M.STATS) + ["feasible", "reason_code"])


def test_block_statistics_from_the_block_table_equal_the_pacing_sums(repo_root, monkeypatch):
    """The per-block statistics of a model whose blocks are alike, gathered
    straight from the distinct-block table into the result, are bit for bit
    what the pacing stage's sums give (the path of MoE models), on random
    layouts with every new field drawn, some breaking rules or memory."""
    import sys
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import model_throughput as mt
    from autopar.model import evaluate as E
    model = load_model(repo_root / "models" / "llama3-70B.json")
    system = load_system(repo_root / "systems" / "h100_80g_nvl8.json")
    cols = mt.random_modern_layouts(model, 1024, 1024, 3 * E.CHUNK // 2, seed=3)
    direct = M.evaluate_columns(model, system, cols)
    code = direct["reason_code"]
    assert (code == 0).sum() > 1000 and (code != 0).sum() > 1000
    monkeypatch.setattr(E, "direct_block_stats", lambda model: False)
    mixed = M.evaluate_columns(model, system, cols)
    for name in M.STATS:
        a, b = direct[name], mixed[name]
        assert np.array_equal(a.view(np.int64)[~np.isnan(a)], b.view(np.int64)[~np.isnan(b)]) \
            and np.array_equal(np.isnan(a), np.isnan(b)), name


def test_block_sums_name_the_calculon_statistics_they_report():
    """Every Calculon statistic a BlockSums field reports (its metadata) is a
    statistic of STATS, each from a field of its own, and every per-block
    time statistic of STATS is one of them."""
    from dataclasses import fields

    from autopar.model.block_sums import CALCULON, BlockSums
    names = {f.name for f in fields(BlockSums)}
    assert set(CALCULON) <= set(M.STATS)
    assert set(CALCULON.values()) <= names
    assert len(set(CALCULON.values())) == len(CALCULON)
    timed = {s for s in M.STATS if s.startswith(("block_", "baseblock_", "edgeblock_"))
             and s.endswith(("_time", "_exposed", "_flops", "_mem_accessed"))
             and "_pp_" not in s}
    assert len(timed) == 37 and timed <= set(CALCULON)
