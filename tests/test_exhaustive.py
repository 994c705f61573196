"""Exhaustive search: results, outputs, the command line and Ray."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from autopar.search.exhaustive import exhaustive, top_json
from autopar.io.layouts import FIELDS
from autopar.io.specs import load_execution

from conftest import REPO_ROOT

MODEL = "models/gpt3-13B.json"
SYSTEM = "systems/a100_80g.json"
SMALL = dict(num_procs=64, max_batch_size=32, datatype="float16", space="small")


@pytest.fixture(scope="module")
def small_all():
    """Every layout of a small case, with statistics (4,176 layouts)."""
    return exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, keep_all=True, top_n=10,
                      progress=False, **SMALL)


def _tmp_leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------ the reference

def test_turing_530b_reproduces_the_reference(reference):
    system = reference / "calculon-golden" / "systems" / "a100_80g.json"
    table, s = exhaustive(REPO_ROOT / "models/turing-530B.json", system, 5128, 2520,
                          "float16", space=REPO_ROOT / "search_spaces/calculon.yaml",
                          top_n=3, progress=False)
    assert s["layouts"] == 10_944
    # Calculon accepts 1,080 of them; its best is layout 6,021 (ties after it)
    # (tests/test_ranking.py: the optimum is reported as Calculon picks it)
    assert s["feasible"] == 1_080
    assert s["optimum"]["sample_rate"] == pytest.approx(111.16, abs=0.005)
    opt = s["optimum"]["execution"]
    assert (opt["weight_offload"], opt["activations_offload"], opt["optimizer_offload"]) \
        == (True, True, True)
    # the recommendation (autopar.search.ranking): as fast, offloading the
    # weights only (what it needs to fit); Calculon's pick offloads all three
    assert s["best"]["sample_rate"] == s["optimum"]["sample_rate"]
    assert list(table.index) == [6045, 5661, 6109]
    best = s["best"]["execution"]
    assert (best["weight_offload"], best["activations_offload"], best["optimizer_offload"]) \
        == (True, False, False)
    assert (best["tensor_par"], best["pipeline_par"], best["data_par"],
            best["batch_size"], best["microbatch_size"]) == (8, 1, 641, 1923, 3)
    assert {k: v for k, v in best.items() if "offload" not in k} \
        == {k: v for k, v in opt.items() if "offload" not in k}
    assert sum(s["infeasible"].values()) + s["feasible"] == s["layouts"]


# ---------------------------------------------------------------- results

def test_top_n_is_the_stable_sort_of_all(small_all):
    every, s = small_all
    assert len(every) == s["layouts"] == 4176
    assert int(every["feasible"].sum()) == s["feasible"] > 0
    counts = every.loc[~every["feasible"], "reason"].value_counts()
    assert {k: int(v) for k, v in counts.items() if v} == s["infeasible"]
    want = every[every["feasible"]].sort_values("sample_rate", ascending=False, kind="stable")
    top, s2 = exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, top_n=10, progress=False,
                         chunk_size=333, **SMALL)
    assert list(top.index) == list(want.index[:10])
    assert np.array_equal(top["sample_rate"].to_numpy(), want["sample_rate"].to_numpy()[:10])
    assert s2["best"]["sample_rate"] == want["sample_rate"].iloc[0]
    assert s2["feasible"] == s["feasible"] and s2["infeasible"] == s["infeasible"]
    assert s2["chunks"] == 13
    # ties exist in this case, and the first enumerated wins
    rates = want["sample_rate"].to_numpy()
    assert (rates[1:] == rates[:-1]).any()


def test_all_rows_files(tmp_path, small_all):
    every, s = small_all
    pq_path, csv_path = tmp_path / "all.parquet", tmp_path / "all.csv"
    for path in (pq_path, csv_path):
        exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, progress=False, chunk_size=1000,
                   all_path=path, **SMALL)
    back = pd.read_parquet(pq_path)
    assert len(back) == s["layouts"]
    assert list(back.columns[:23]) == list(FIELDS)
    assert list(back["tensor_par_comm_type"].astype(str)) == \
        list(every["tensor_par_comm_type"].astype(str))
    assert np.allclose(back["sample_rate"], every["sample_rate"], equal_nan=True)
    assert (back["reason"].astype(str) == every["reason"].astype(str)).all()
    csv = pd.read_csv(csv_path)
    assert len(csv) == s["layouts"] and int(csv["feasible"].sum()) == s["feasible"]
    assert set(csv["activation_recompute"]) == {"full", "attn_only", "none"}
    assert _tmp_leftovers(tmp_path) == []


def test_top_json_layout(small_all):
    every, _ = small_all
    out = top_json(every, 3)
    assert list(out) == ["0", "1", "2"]
    assert set(out["0"]) == {"execution", "stats"}
    assert list(out["0"]["execution"]) == list(FIELDS)
    assert out["0"]["stats"]["sample_rate"] >= out["1"]["stats"]["sample_rate"]
    json.dumps(out, allow_nan=False)


def test_interrupted_search_writes_nothing(tmp_path, monkeypatch):
    from autopar import model as perf
    real, calls = perf.evaluate_columns, []

    def interrupted(*args, **kw):    # the user presses Ctrl-C during chunk 3
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(perf, "evaluate_columns", interrupted)
    path = tmp_path / "all.parquet"
    with pytest.raises(KeyboardInterrupt):
        exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, progress=False, chunk_size=1000,
                   all_path=path, **SMALL)
    assert len(calls) == 3
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------ command line

def test_cli_writes_outputs_that_estimate_accepts(cli, tmp_path):
    out = {k: tmp_path / f"{k}.json" for k in ("best", "top", "summary")}
    r = cli("exhaustive", MODEL, SYSTEM, "--num-procs", 64, "--max-batch-size", 32,
            "--datatype", "float16", "--space", "search_spaces/small.yaml", "--top-n", 4,
            "--output", out["best"], "--top", out["top"], "--summary", out["summary"],
            "--all", tmp_path / "all.parquet", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "best:" in r.stdout
    best = json.loads(out["best"].read_text())
    assert list(best) == list(FIELDS)
    load_execution(out["best"])                      # a valid Calculon execution
    top = json.loads(out["top"].read_text())
    assert list(top) == ["0", "1", "2", "3"] and top["0"]["execution"] == best
    summary = json.loads(out["summary"].read_text())
    for key in ("layouts", "feasible", "infeasible", "seconds", "best"):
        assert key in summary
    assert summary["layouts"] == 4176
    assert summary["best"]["execution"] == best
    assert len(pd.read_parquet(tmp_path / "all.parquet")) == 4176
    assert _tmp_leftovers(tmp_path) == []
    # the exported execution round-trips through `autopar estimate`
    e = cli("estimate", MODEL, SYSTEM, out["best"], "--json")
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["sample_rate"] == pytest.approx(summary["best"]["sample_rate"],
                                                                rel=1e-12)


def test_cli_no_feasible_layout(cli, tmp_path):
    best = tmp_path / "best.json"
    r = cli("exhaustive", "models/gpt3-175B.json", SYSTEM, "--num-procs", 8,
            "--max-batch-size", 8, "--datatype", "float16", "--space", "small",
            "--output", best, "--summary", tmp_path / "s.json", "--all", tmp_path / "a.csv")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no feasible layout among 3,384 layouts" in lines[0]
    assert "mem tier1 capacity exceeded" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,field", [
    (["--num-procs", 0], "--num-procs"),
    (["--space", "search_spaces/nope.yaml"], "file"),
    (["--output", "/nonexistent-dir/best.json"], "--output"),
    (["--datatype", "float8"], "datatype"),           # the A100 file has no float8
])
def test_cli_bad_input(cli, args, field):
    base = {"--num-procs": 64, "--max-batch-size": 32, "--datatype": "float16"}
    extra = []
    for k, v in zip(args[::2], args[1::2]):
        if k in base:
            base[k] = v
        else:
            extra += [k, v]
    flat = [x for kv in base.items() for x in kv]
    r = cli("exhaustive", MODEL, SYSTEM, *flat, *extra)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: ")
    assert f": {field}: " in lines[0]


def test_cli_bad_space_file(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  tensor_par: derived\n  pipeline_par: [0]\n")
    r = cli("exhaustive", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 8,
            "--datatype", "float16", "--space", bad)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"autopar: error: {bad}: params.pipeline_par[0]: "
                                "expected an integer >= 1, got 0")


# --------------------------------------------------------------------- Ray

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster(monkeypatch):
    """A real single-node Ray cluster on loopback, stopped afterwards.

    Token authentication stays on (Ray 2.60's default): the node and this
    driver both run with ``RAY_AUTH_MODE=token`` and read ~/.ray/auth_token
    (``ray start --head`` creates it when missing).  A process-wide
    "disabled" here would stay cached in Ray's config and break the local
    Rays that later tests start (with token auth, their default).
    """
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="apray-", dir="/tmp")
    ray_bin = Path(sys.executable).with_name("ray")
    env = dict(os.environ, RAY_AUTH_MODE="token")
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                pytest.fail("ray start exited early")
            if subprocess.run([str(ray_bin), "status", f"--address={address}"], env=env,
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail("Ray cluster did not come up")
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # workers leave the process group; end those of this cluster by id
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if temp in cmd:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_address_gives_the_local_result(ray_cluster, small_all):
    every, local = small_all
    top, s = exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, top_n=10, progress=False,
                        chunk_size=700, address=ray_cluster, **SMALL)
    assert s["runner"] == f"ray:{ray_cluster}" and s["chunks"] == 6
    assert s["best"] == local["best"]
    assert s["feasible"] == local["feasible"] and s["infeasible"] == local["infeasible"]
    want = every[every["feasible"]].sort_values("sample_rate", ascending=False, kind="stable")
    assert list(top.index) == list(want.index[:10])


def test_unreachable_ray_address_is_one_line_error():
    from autopar.io.specs import SpecError
    port = _free_port()             # nothing listens there
    with pytest.raises(SpecError) as e:
        exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, progress=False,
                   address=f"127.0.0.1:{port}", **SMALL)
    assert e.value.field == "address" and "no Ray cluster answers" in e.value.message
