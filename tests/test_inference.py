"""Inference from the command line (issue 25): ``--inference`` on every
command that searches layouts, ``training: false`` in an experiment's case.

Small cases (GPT-3 13B on 64 A100, the small space): each command's layouts
are inference layouts (``training: false``) and agree with the Python API's
``training=False`` search, which differs from the training one."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from conftest import REPO_ROOT, run_autopar

MODEL = "models/gpt3-13B.json"
SYSTEM = "systems/a100_80g.json"
CASE = ["--num-procs", 64, "--max-batch-size", 64, "--datatype", "float16", "--space", "small"]


@pytest.fixture(scope="module")
def optimum():
    """The best inference and training rates of the case (Python API, fast risk)."""
    import autopar
    out = {}
    for training in (False, True):
        _, s = autopar.exhaustive(REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, 64, 64, "float16",
                                  space="small", training=training)
        out[training] = s["best"]
    assert out[False]["sample_rate"] != out[True]["sample_rate"]
    return out


def _case_file(tmp_path, kind: str, training=False, **extra) -> str:
    case = {"model": str(REPO_ROOT / MODEL), "system": str(REPO_ROOT / SYSTEM),
            "num_procs": 64, "max_batch_size": 64, "datatype": "float16", "space": "small"}
    if training is not None:
        case["training"] = training
    data = {"kind": kind, "case": case, **extra}
    p = tmp_path / f"{kind}.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_exhaustive_inference(tmp_path, optimum):
    r = run_autopar("exhaustive", MODEL, SYSTEM, *CASE, "--inference", "--risk", "fast",
                    "--output", tmp_path / "best.json", "--summary", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    best = json.loads((tmp_path / "best.json").read_text())
    summary = json.loads((tmp_path / "s.json").read_text())
    assert best["training"] is False and summary["training"] is False
    assert best == optimum[False]["execution"]
    assert summary["best"]["sample_rate"] == pytest.approx(optimum[False]["sample_rate"])
    assert ", inference" in r.stdout.splitlines()[0]
    # without the flag: training, as before
    r = run_autopar("exhaustive", MODEL, SYSTEM, *CASE, "--risk", "fast",
                    "--output", tmp_path / "train.json")
    assert json.loads((tmp_path / "train.json").read_text())["training"] is True


def test_tune_inference(tmp_path):
    r = run_autopar("tune", MODEL, SYSTEM, *CASE, "--inference", "--sampler", "random",
                    "--trials", 12, "--seed", 0, "--no-progress",
                    "--output", tmp_path / "best.json", "--trials-out", tmp_path / "t.csv")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "best.json").read_text())["training"] is False
    trials = pd.read_csv(tmp_path / "t.csv")
    assert len(trials) == 12 and not trials["training"].any()


@pytest.mark.parametrize("kind, extra", [
    ("exhaustive", {"output": "best.json"}),
    ("tune", {"sampler": "random", "trials": 8, "seed": 1, "output": "best.json"}),
])
def test_run_file_with_training_false(kind, extra, tmp_path, optimum):
    extra = {**extra, "output": str(tmp_path / extra["output"])}
    r = run_autopar("run", _case_file(tmp_path, kind, **extra), "--no-progress")
    assert r.returncode == 0, r.stderr
    best = json.loads((tmp_path / "best.json").read_text())
    assert best["training"] is False
    if kind == "exhaustive":
        # exhaustive's default risk (safe) may pick a slower layout than the
        # fast optimum, never a faster one
        import autopar
        rate = autopar.evaluate(autopar.load_model(REPO_ROOT / MODEL),
                                autopar.load_system(REPO_ROOT / SYSTEM), [best])["sample_rate"]
        assert float(rate.iloc[0]) <= optimum[False]["sample_rate"] * (1 + 1e-12)


@pytest.mark.parametrize("value", ["no", 0, "false"])
def test_bad_training_value_is_one_line(value, tmp_path):
    r = run_autopar("run", _case_file(tmp_path, "exhaustive", training=value))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "case.training" in r.stderr, r.stderr


def test_compare_inference(tmp_path, optimum):
    """A comparison of a ``training: false`` case, and ``compare --inference``
    on a training file: the optimum and the samplers' layouts are inference."""
    from autopar.studies.compare import compare, load_experiment
    exp = load_experiment({"kind": "compare", "name": "inf", "case": {
        "model": MODEL, "system": SYSTEM, "num_procs": 64, "max_batch_size": 64,
        "datatype": "float16", "space": "small", "training": False},
        "samplers": ["random"], "seeds": [0], "trials": 6, "budgets": [6]},
        base_dir=REPO_ROOT)
    assert exp.case.training is False
    res = compare(exp, tmp_path / "a", progress=False, risk=None)
    opt = json.loads((tmp_path / "a" / "optimum.json").read_text())
    assert opt["training"] is False and opt["execution"]["training"] is False
    assert opt["sample_rate"] == pytest.approx(optimum[False]["sample_rate"])
    assert all(r["best_execution"] is None or r["best_execution"]["training"] is False
               for r in res.runs)
    f = _case_file(tmp_path, "compare", training=None, samplers=["random"], seeds=[0],
                   trials=6, budgets=[6])
    r = run_autopar("compare", f, "--inference", "--risk", "fast", "--output-dir",
                    tmp_path / "b", "--no-progress")
    assert r.returncode == 0, r.stderr
    opt = json.loads((tmp_path / "b" / "optimum.json").read_text())
    assert opt["training"] is False and opt["execution"]["training"] is False


def _executions(table) -> list:
    """The best layouts a study's table holds (JSON text per row)."""
    return [json.loads(e) if isinstance(e, str) else e for e in table["execution"]
            if isinstance(e, (str, dict))]


def test_cliffs_inference(tmp_path):
    r = run_autopar("cliffs", "--model", MODEL, "--system", SYSTEM, "--max-batch-size", 64,
                    "--datatype", "float16", "--space", "small", "--num-procs", "32,64",
                    "--inference", "--output-dir", tmp_path / "c", "--no-progress")
    assert r.returncode == 0, r.stderr
    written = [f for f in (tmp_path / "c").iterdir() if f.suffix == ".csv"]
    assert written and all(not e["training"] for f in written
                           for e in _executions(pd.read_csv(f)))
    from autopar.studies.cliffs import sweep
    spec = {"kind": "cliffs", "name": "c", "num_procs": [32, 64], "case": {
        "model": str(REPO_ROOT / MODEL), "system": str(REPO_ROOT / SYSTEM),
        "max_batch_size": 64, "datatype": "float16", "space": "small", "training": False}}
    res = sweep(spec, None, progress=False)
    execs = _executions(res.table)
    assert len(execs) == 2 and all(e["training"] is False for e in execs)
    trained = sweep({**spec, "case": {**spec["case"], "training": True}}, None, progress=False)
    assert list(trained.table["sample_rate"]) != list(res.table["sample_rate"])


def test_codesign_inference(tmp_path):
    """A co-design study's inner searches lay out inference when its case
    says so, or with ``codesign --inference``."""
    from autopar.studies.codesign import codesign
    study = {"kind": "codesign", "name": "inf", "case": {
        "model": str(REPO_ROOT / MODEL), "system": str(REPO_ROOT / SYSTEM),
        "max_batch_size": 64, "datatype": "float16", "space": "small", "training": False},
        "hardware": {"num_procs": [64], "mem1.GiB": {"values": [40, 80], "cost": 20}},
        "cost": {"processor": 10000}, "objectives": ["sample_rate", "cost"],
        "search": {"sampler": "exhaustive"}}
    res = codesign(study, None, progress=False)
    execs = _executions(res.table)
    assert len(execs) == 2 and all(e["training"] is False for e in execs)
    del study["case"]["training"]
    f = tmp_path / "study.yaml"
    f.write_text(yaml.safe_dump(study))
    for flag, training in (("--inference", False), ("--no-progress", True)):
        r = run_autopar("codesign", f, flag, "--output-dir", tmp_path / flag, "--no-progress")
        assert r.returncode == 0, r.stderr
        execs = _executions(pd.read_csv(tmp_path / flag / "systems.csv"))
        assert len(execs) == 2 and all(e["training"] is training for e in execs)


def test_advise_inference(tmp_path):
    from test_advise import POOR
    cfg = tmp_path / "poor.json"
    cfg.write_text(json.dumps({**POOR, "num_procs": 64, "pipeline_par": 16, "data_par": 2,
                               "batch_size": 64}))
    r = run_autopar("advise", MODEL, SYSTEM, "--from", cfg, "--space", "small", "--inference",
                    "--output", tmp_path / "a.json")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "a.json").read_text())
    rows = [out["user"], *out["near"], *out["overall"]]
    assert all(row["execution"]["training"] is False for row in rows)
    # the training-only fields of the config are set as inference has them
    assert out["filled"] == {"activation_recompute": "none", "training": False}
    assert out["gain"] > 0
