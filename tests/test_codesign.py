"""Co-design: hardware dimensions, nested search, Pareto fronts, samplers'
regret, exported front points, and the processor-count sweep.

Everything runs for real on a small case (GPT-3 13B on 32-64 processors, a
few dozen systems): the model, Optuna studies with SQLite storage, a local
Ray, the command line.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from autopar.io.specs import SpecError, load_model, load_system, system_to_json

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "gpt3-13B.json"
SYSTEM = ROOT / "systems" / "a100_80g.json"
# The small space with offloading allowed, so that the second tier matters.
SPACE = {
    "name": "test-inner", "batch_policy": "max",
    "params": {"tensor_par": "derived", "pipeline_par": "derived",
               "pipeline_interleaving": {"max": 2}, "activation_recompute": ["full", "attn_only"],
               "weight_offload": "derived", "activations_offload": "derived",
               "optimizer_offload": "derived", "microbatch_size": {"max": 2},
               "tensor_par_net": "derived", "pipeline_par_net": "derived",
               "data_par_net": "derived"},
    "fixed": {"optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
              "seq_par_ag_redo": False, "data_par_overlap": True, "tensor_par_overlap": "none",
              "fused_activation": True, "attention_type": "multihead"},
}
HARDWARE = {
    "num_procs": [32, 64],
    "mem1.GiB": {"values": [2, 12, 80], "cost": 20},
    "mem2.GiB": {"values": [0, 256], "cost": 4},
    "mem2.GBps": {"values": [8, 64], "cost": 20},
    "networks[1].bandwidth": {"values": [12.5, 50], "cost": 60},
}
COST = {"processor": 10000}


def study_dict(**extra) -> dict:
    d = {"kind": "codesign", "name": "tiny",
         "case": {"model": str(MODEL), "system": str(SYSTEM), "max_batch_size": 256,
                  "datatype": "float16", "space": SPACE},
         "hardware": json.loads(json.dumps(HARDWARE)), "cost": dict(COST),
         "objectives": ["sample_rate", "cost"]}
    d.update(extra)
    return d


def expected_cost(row) -> float:
    per = COST["processor"] + 20 * row["mem1.GiB"] + 60 * row["networks[1].bandwidth"]
    if row["mem2.GiB"]:
        per += 4 * row["mem2.GiB"] + 20 * row["mem2.GBps"]
    return row["num_procs"] * per


def dominates(a, b) -> bool:
    """a, b: (sample_rate, cost); a dominates b."""
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The tiny study: enumerated, then NSGA-II and MOTPE against it."""
    from autopar.studies.codesign import codesign
    out = tmp_path_factory.mktemp("codesign") / "out"
    study = study_dict(compare={"samplers": [{"sampler": "nsga2", "population": 6}, "motpe"],
                                "seeds": 1, "trials": 12, "budgets": [6, 12]})
    res = codesign(study, out, progress=False)
    return res, out


# --------------------------------------------------------------------------
# Hardware dimensions

@pytest.mark.parametrize("hardware, field, words", [
    ({"mem3.GiB": [1]}, "hardware.mem3.GiB", "no such field"),
    ({"mem1..GiB": [1]}, "hardware.mem1..GiB", "field path"),
    ({"processing_mode": [1]}, "hardware.processing_mode", "not a numeric field"),
    ({"networks[5].size": [8]}, "hardware.networks[5].size", "no such field"),
    ({"networks[0].size": [8, 12.5]}, "hardware.networks[0].size.values[1]", "integers"),
    ({"networks[0].efficiency": [0.5, 1.5]}, "hardware.networks[0].efficiency", "invalid system"),
    ({"mem1.GiB": {"min": 0, "max": 80, "log": True}}, "hardware.mem1.GiB.min", "log range"),
    ({"mem1.GiB": {"values": [40], "min": 10}}, "hardware.mem1.GiB.min", "not both"),
    ({"mem1.GiB": {"min": 80, "max": 40}}, "hardware.mem1.GiB.max", ">= min"),
    ({"mem1.GiB": {"values": [40], "cost": -1}}, "hardware.mem1.GiB.cost", ">= 0"),
    ({"mem1.GiB": {"values": [40], "price": 1}}, "hardware.mem1.GiB.price", "unknown key"),
    ({"mem1.GiB": "big"}, "hardware.mem1.GiB", "expected a list"),
    ({"num_procs": [0, 8]}, "hardware.num_procs.values[0]", ">= 1"),
])
def test_bad_hardware_names_file_and_field(hardware, field, words):
    from autopar.io.hardware import parse_hardware
    base = system_to_json(load_system(SYSTEM))
    with pytest.raises(SpecError) as e:
        parse_hardware("study.yaml", hardware, None, base, 64)
    assert e.value.source == "study.yaml"
    assert e.value.field == field
    assert words in e.value.message


def test_ranges_grids_and_cost():
    from autopar.io.hardware import parse_hardware
    base = system_to_json(load_system(SYSTEM))
    hw = parse_hardware("s", {"mem1.GiB": {"min": 40, "max": 160, "step": 40, "cost": 2},
                              "mem2.GBps": {"min": 50, "max": 500, "num": 3, "log": True},
                              "networks[0].size": {"min": 8, "max": 64, "num": 4, "log": True}},
                        {"processor": 100, "fixed": 7}, base, 16)
    assert hw.dim("mem1.GiB").values == (40, 80, 120, 160)
    assert hw.dim("mem2.GBps").values == (50, 158.114, 500)
    assert hw.dim("networks[0].size").values == (8, 16, 32, 64)
    assert hw.size() == 4 * 3 * 4
    assert hw.cost({"mem1.GiB": 80, "mem2.GBps": 50, "networks[0].size": 8}) == 7 + 16 * (100 + 160)
    # a continuous range cannot be enumerated
    hw2 = parse_hardware("s", {"mem1.GiB": {"min": 40, "max": 160}}, None, base, 16)
    with pytest.raises(SpecError, match="continuous"):
        hw2.size()


def test_mem2_zero_means_no_second_tier(tmp_path):
    from autopar.io.hardware import parse_hardware
    from autopar.search.space import Case, load_space
    base = system_to_json(load_system(SYSTEM))
    hw = parse_hardware("s", {"mem2.GiB": {"values": [0, 256], "cost": 4},
                              "mem2.GBps": {"values": [8, 64], "cost": 20}}, None, base, 32)
    grid = list(hw.grid())
    assert grid == [{"mem2.GiB": 0}, {"mem2.GiB": 256, "mem2.GBps": 8},
                    {"mem2.GiB": 256, "mem2.GBps": 64}]
    assert hw.cost({"mem2.GiB": 0, "mem2.GBps": 64}) == 0        # an absent tier costs nothing
    system = hw.system({"mem2.GiB": 0, "mem2.GBps": 64})
    assert system.mem2.GiB == 0
    assert system.mem2.GBps == base["mem2"]["GBps"]              # inactive: left as the base
    case = Case(load_model(MODEL), system, 32, 256, "float16")
    space = load_space(SPACE)
    cols = next(space.enumerate(case))
    for f in ("weight_offload", "activations_offload", "optimizer_offload"):
        assert not cols[f].any()
    with_tier = Case(load_model(MODEL), hw.system({"mem2.GiB": 256, "mem2.GBps": 8}), 32, 256,
                     "float16")
    assert space.size(with_tier) > space.size(case)
    # exported and read back, it is still a system without a tier
    path = tmp_path / "s.json"
    path.write_text(json.dumps(system_to_json(system)))
    assert load_system(path).mem2.GiB == 0


def test_nvlink_size_keeps_must_be_filled():
    from autopar.io.hardware import parse_hardware
    from autopar.studies.nested import best_layout
    from autopar.search.space import Case, load_space
    base = system_to_json(load_system(SYSTEM))
    hw = parse_hardware("s", {"networks[0].size": [4, 16]}, None, base, 64)
    space = load_space(SPACE)
    for size in (4, 16):
        system = hw.system({"networks[0].size": size})
        assert system.networks[0].size == size and system.networks[0].must_be_filled
        best = best_layout(Case(load_model(MODEL), system, 64, 256, "float16"), space)
        ex = best["execution"]
        on0 = 1
        for par, net in (("tensor_par", "tensor_par_net"), ("pipeline_par", "pipeline_par_net"),
                         ("data_par", "data_par_net")):
            if ex[par] > 1 and ex[net] == 0:
                on0 *= ex[par]
        assert on0 > 1 and size % on0 == 0           # the domain is used and filled exactly


# --------------------------------------------------------------------------
# The nested search

def test_inner_search_matches_exhaustive():
    from autopar.search.exhaustive import exhaustive
    from autopar.io.hardware import build_system
    from autopar.studies.nested import best_layout
    from autopar.search.space import Case, load_space
    model = load_model(MODEL)
    space = load_space(SPACE)
    base = system_to_json(load_system(SYSTEM))
    for values, n in (({}, 64), ({"mem1.GiB": 12, "mem2.GiB": 256}, 32)):
        system = build_system(base, values)
        mine = best_layout(Case(model, system, n, 256, "float16"), space)
        _, summary = exhaustive(model, system, num_procs=n, max_batch_size=256,
                                datatype="float16", space=space, progress=False)
        assert mine["state"] == "COMPLETE"
        # the inner search measures a system by its fastest layout: the
        # optimum (autopar.search.ranking recommends among near ties)
        assert mine["execution"] == summary["optimum"]["execution"]
        assert mine["sample_rate"] == pytest.approx(summary["optimum"]["sample_rate"], rel=1e-12)
        assert mine["layouts"] == summary["layouts"]
        assert mine["feasible_layouts"] == summary["feasible"]


def test_inner_sampler_finds_a_real_layout():
    from autopar.io.hardware import build_system
    from autopar.model import evaluate_one
    from autopar.studies.nested import Inner, best_layout
    from autopar.search.space import Case, load_space
    model = load_model(MODEL)
    system = build_system(system_to_json(load_system(SYSTEM)), {"mem1.GiB": 40})
    case = Case(model, system, 64, 256, "float16")
    space = load_space(SPACE)
    full = best_layout(case, space)
    sampled = best_layout(case, space, Inner("random", 40, 1))
    assert sampled["state"] == "COMPLETE" and sampled["layouts"] == 40
    assert 0 < sampled["sample_rate"] <= full["sample_rate"]
    assert space.check(case, sampled["execution"]) == ""
    assert evaluate_one(model, system, sampled["execution"])["sample_rate"] == sampled["sample_rate"]


def test_infeasible_hardware_is_pruned(compared):
    res, _ = compared
    t = res.truth
    tiny = t[(t["mem1.GiB"] == 2) & (t["mem2.GiB"] == 0)]
    assert len(tiny) == 4 and (tiny["state"] == "PRUNED").all()
    assert tiny["sample_rate"].isna().all()
    assert tiny["reason"].str.startswith("no layout fits: infeasible: mem tier1").all()
    assert (t.loc[t["mem1.GiB"] == 80, "state"] == "COMPLETE").all()
    # 2 GiB of HBM runs with a second tier to offload to
    offload = t[(t["mem1.GiB"] == 2) & (t["mem2.GiB"] > 0) & (t["state"] == "COMPLETE")]
    assert len(offload)
    ex = json.loads(offload["execution"].iloc[0])
    assert ex["weight_offload"] or ex["activations_offload"] or ex["optimizer_offload"]


def test_front_matches_brute_force_enumeration(compared):
    from autopar.search.exhaustive import exhaustive
    from autopar.io.hardware import build_system
    res, _ = compared
    model = load_model(MODEL)
    base = system_to_json(load_system(SYSTEM))
    points = []
    for _, row in res.truth.iterrows():
        values = {k: row[k] for k in HARDWARE if k != "num_procs" and row[k] == row[k]}
        assert row["cost"] == pytest.approx(expected_cost({**row, "mem2.GBps": row["mem2.GBps"]}))
        _, summary = exhaustive(model, build_system(base, values), num_procs=int(row["num_procs"]),
                                max_batch_size=256, datatype="float16", space=SPACE,
                                progress=False)
        rate = summary["best"]["sample_rate"] if summary["best"] else math.nan
        if math.isnan(rate):
            assert row["state"] == "PRUNED"
            continue
        assert row["sample_rate"] == pytest.approx(rate, rel=1e-12)
        points.append((rate, expected_cost(row), int(row["system"])))
    truth = {p[2] for p in points if not any(dominates(q[:2], p[:2]) for q in points)}
    assert set(res.truth_front["system"]) == truth
    assert len(truth) >= 3


def test_front_has_no_dominated_point(compared):
    _, out = compared
    front = pd.read_csv(out / "front.csv")
    systems = pd.read_csv(out / "systems.csv")
    pts = list(zip(front["sample_rate"], front["cost"]))
    assert not any(dominates(a, b) for a in pts for b in pts)
    assert list(front["cost"]) == sorted(front["cost"])
    on = set(front["system"])
    for _, r in systems[systems["state"] == "COMPLETE"].iterrows():
        if r["system"] not in on:
            assert any(dominates(p, (r["sample_rate"], r["cost"])) or
                       p == (r["sample_rate"], r["cost"]) for p in pts)


def test_samplers_regret_reported_like_compare(compared):
    res, out = compared
    regret = pd.read_csv(out / "regret.csv")
    assert list(regret["sampler"]) == ["nsga2", "motpe", "exhaustive"]
    for b in (6, 12):
        col = regret[f"regret_median@{b}"].iloc[:2]
        assert ((col >= 0) & (col <= 1)).all()
    curves = pd.read_csv(out / "curves.csv")
    assert set(curves.columns) >= {"sampler", "seed", "trial", "hypervolume", "regret"}
    for _, g in curves.groupby("sampler"):
        r = g.sort_values("trial")["regret"].to_numpy()
        assert len(r) == 12 and (np.diff(r) <= 1e-12).all()
    runs = pd.read_csv(out / "runs.csv")
    assert (runs["on_true_front"] <= runs["front_points"]).all()
    truth_pts = set(zip(res.truth_front["sample_rate"], res.truth_front["cost"]))
    for label, fr in res.sampler_fronts.items():
        found = sum(p in truth_pts for p in zip(fr["sample_rate"], fr["cost"]))
        assert runs.loc[runs["sampler"] == label, "on_true_front"].iloc[0] == found
    assert runs["on_true_front"].sum() > 0
    # no sampled point beats the true front
    truth = list(zip(res.truth_front["sample_rate"], res.truth_front["cost"]))
    for label, fr in res.sampler_fronts.items():
        for p in zip(fr["sample_rate"], fr["cost"]):
            assert not any(dominates(p, q) for q in truth), label
    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"] == len(res.truth) == 36
    assert (out / "regret.png").stat().st_size > 10_000
    assert (out / "front.png").stat().st_size > 10_000


def test_exported_front_points_reevaluate(compared, cli):
    import autopar
    _, out = compared
    front = pd.read_csv(out / "front.csv")
    assert len(front) >= 3
    for _, row in front.iterrows():
        system = load_system(out / row["system_file"])
        ex = json.loads((out / row["execution_file"]).read_text())
        got = autopar.evaluate(MODEL, system, ex)
        assert bool(got["feasible"].iloc[0])
        assert got["sample_rate"].iloc[0] == pytest.approx(row["sample_rate"], rel=1e-12)
        assert got["total_time"].iloc[0] == pytest.approx(row["total_time"], rel=1e-12)
        assert system.mem1.GiB == row["mem1.GiB"] and system.mem2.GiB == row["mem2.GiB"]
        assert ex["num_procs"] == row["num_procs"]
    # and through the command line
    row = front.iloc[-1]
    p = cli("estimate", MODEL, out / row["system_file"], out / row["execution_file"], "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["sample_rate"] == pytest.approx(row["sample_rate"], rel=1e-12)


# --------------------------------------------------------------------------
# Samplers with storage, resumed

def test_nsga2_with_sqlite_storage_resumes(tmp_path):
    from autopar.studies.codesign import load_study, run_search
    from autopar.studies.nested import Runner
    url = f"sqlite:///{tmp_path / 'cd.db'}"
    st = load_study(study_dict(search={"sampler": "nsga2", "population": 4, "trials": 6,
                                       "seed": 3, "storage": url}))
    with Runner("serial") as r:
        first = run_search(st, st.search, r)
        from dataclasses import replace
        more = run_search(st, replace(st.search, trials=10), r)
    assert list(first["trial"]) == list(range(6))
    assert list(more["trial"]) == list(range(10))
    cols = ["state", "mem1.GiB", "num_procs", "cost", "sample_rate"]
    assert more[cols].iloc[:6].reset_index(drop=True).equals(first[cols])
    import optuna
    study = optuna.load_study(study_name=st.search.study_name or
                              "autopar-codesign-tiny-nsga2-seed3", storage=url)
    assert len(study.trials) == 10
    pruned = more["state"] == "PRUNED"
    assert {t.state.name for t in study.trials} <= {"COMPLETE", "PRUNED"}
    assert sum(t.state.name == "PRUNED" for t in study.trials) == int(pruned.sum())


# --------------------------------------------------------------------------
# The processor-count sweep on Ray

def test_sweep_on_ray_matches_serial_and_listens_on_loopback(tmp_path):
    import ray
    from autopar.studies.cliffs import sweep
    from autopar.search.cluster import start_local_ray
    spec = {"kind": "cliffs", "name": "t",
            "case": {"model": str(MODEL), "system": str(SYSTEM), "max_batch_size": 256,
                     "datatype": "float16", "space": "small"},
            "num_procs": {"min": 24, "max": 64, "step": 8}}
    serial = sweep(spec, progress=False)
    start_local_ray(num_cpus=2)
    try:
        addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
        assert addresses == {"127.0.0.1"}
        on_ray = sweep(spec, tmp_path / "out", parallel="ray", workers=2, progress=False)
    finally:
        ray.shutdown()
    cols = [c for c in serial.table.columns if c != "eval_s"]
    assert on_ray.table[cols].equals(serial.table[cols])
    t = serial.table
    assert list(t["num_procs"]) == [24, 32, 40, 48, 56, 64]
    ok = t["state"] == "COMPLETE"
    assert ok.all()
    assert t["relative"].max() == pytest.approx(1.0)
    # 40 = 8 * 5: the data-parallel size carries the 5, the batch shrinks to 240
    r40 = t.set_index("num_procs").loc[40]
    assert r40["batch_size"] % 5 == 0 and r40["batch_size"] < 256
    assert (tmp_path / "out" / "cliffs.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"] == 6


# --------------------------------------------------------------------------
# The command line

def test_cli_codesign_file(tmp_path, cli):
    study = study_dict(search={"sampler": "nsga2", "population": 4, "trials": 6},
                       output_dir="out")
    del study["hardware"]["mem2.GBps"]
    del study["hardware"]["num_procs"]
    study["case"]["num_procs"] = 32
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    p = cli("codesign", path, "--no-progress", cwd=tmp_path)   # output_dir: from the current folder
    assert p.returncode == 0, p.stderr
    assert "front" in p.stdout and "base system" in p.stdout
    out = tmp_path / "out"
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == 6 and set(trials["state"]) <= {"COMPLETE", "PRUNED"}
    front = pd.read_csv(out / "front.csv")
    assert (out / front["system_file"].iloc[0]).is_file()
    base = json.loads((out / "summary.json").read_text())["base_system"]
    assert base["mem1.GiB"] == 80 and base["state"] == "COMPLETE"
    assert base["cost"] == pytest.approx(32 * (10000 + 20 * 80 + 4 * 512 + 60 * 25))


def test_cli_bad_study_exit_2_writes_nothing(tmp_path, cli):
    study = study_dict(output_dir="out")
    study["hardware"]["networks[1].bandwith"] = [25]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(study))
    p = cli("codesign", path, cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(path) in lines[0] and "hardware.networks[1].bandwith" in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_cliffs_arguments(tmp_path, cli):
    p = cli("cliffs", "--model", MODEL, "--system", SYSTEM, "--max-batch-size", 256,
            "--datatype", "float16", "--space", "small", "--num-procs", "32:64:16",
            "--output-dir", tmp_path, "--no-progress")
    assert p.returncode == 0, p.stderr
    t = pd.read_csv(tmp_path / "cliffs.csv")
    assert list(t["num_procs"]) == [32, 48, 64]
    p = cli("cliffs", "--model", MODEL, "--num-procs", "32:64")
    assert p.returncode == 2 and "--system" in p.stderr
