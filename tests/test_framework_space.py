"""Searches under --framework: only layouts the framework can run
(the spec's options; autopar.search.space.Space.within / framework_space)."""
from __future__ import annotations

import json

import pytest

from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework
from autopar.search.space import Case, framework_space, load_space

from conftest import REPO_ROOT

MODEL = "models/gpt3-5B.json"
SYSTEM = "systems/a100_80g.json"
ARGS = ("--num-procs", 16, "--max-batch-size", 64, "--datatype", "bfloat16",
        "--space", "small", "--no-progress")


def _case():
    from autopar.io.specs import load_model, load_system
    return Case(load_model(REPO_ROOT / MODEL), load_system(REPO_ROOT / SYSTEM), 16, 64,
                "bfloat16")


def test_space_within_options_keeps_only_what_the_framework_runs():
    space = load_space("small")
    foundry = load_framework("llm-foundry")
    cut = framework_space(space, "llm-foundry")
    assert cut.allowed["tensor_par"].values == (1,)
    assert cut.allowed["pipeline_par"].values == (1,)
    assert cut.allowed["activation_recompute"].values == ("none", "full")
    n, seen = 0, set()
    for cols in cut.enumerate(_case()):
        n += len(cols["tensor_par"])
        seen |= {(int(t), int(p), int(r)) for t, p, r in
                 zip(cols["tensor_par"], cols["pipeline_par"], cols["activation_recompute"])}
    full = sum(len(c["tensor_par"]) for c in space.enumerate(_case()))
    assert 0 < n < full
    from autopar.io.layouts import CHOICES
    codes = {CHOICES["activation_recompute"].index(v)
             for v in foundry.options["activation_recompute"]}
    assert {(t, p) for t, p, _ in seen} == {(1, 1)} and {r for *_, r in seen} <= codes
    # a framework without options (or none): the space unchanged
    assert framework_space(space, None) is space
    assert framework_space(space, "nemo1-apex").allowed == space.allowed


def test_space_within_says_when_nothing_is_left():
    base = load_space("small").to_dict()
    base["params"]["tensor_par"] = [2, 4]
    with pytest.raises(SpecError) as e:
        framework_space(load_space(base, source="mine.yaml"), "llm-foundry")
    assert e.value.field == "params.tensor_par" and "llm-foundry" in str(e.value)
    base = load_space("small").to_dict()
    del base["params"]["pipeline_par"]
    base["fixed"]["pipeline_par"] = 2
    with pytest.raises(SpecError) as e:
        framework_space(load_space(base, source="mine.yaml"), "llm-foundry")
    assert e.value.field == "fixed.pipeline_par" and e.value.source == "mine.yaml"


def test_exhaustive_with_framework_recommends_only_runnable_layouts(cli, tmp_path):
    plain, fw = tmp_path / "plain.json", tmp_path / "fw.json"
    r = cli("exhaustive", MODEL, SYSTEM, *ARGS, "--top-n", 5, "--top", plain)
    assert r.returncode == 0, r.stderr
    top = json.loads(plain.read_text())
    # without the framework the favourite splits tensors (the test's premise)
    assert top["0"]["execution"]["tensor_par"] > 1
    r = cli("exhaustive", MODEL, SYSTEM, *ARGS, "--top-n", 5, "--top", fw,
            "--framework", "llm-foundry")
    assert r.returncode == 0, r.stderr
    top = json.loads(fw.read_text())
    assert len(top) == 5
    for entry in top.values():
        ex = entry["execution"]
        assert ex["tensor_par"] == 1 and ex["pipeline_par"] == 1
        assert ex["activation_recompute"] in ("none", "full")


def test_exhaustive_framework_and_a_space_it_cannot_run_is_one_line_exit_2(cli, tmp_path):
    base = load_space("small").to_dict()
    del base["params"]["tensor_par"]
    base["fixed"]["tensor_par"] = 2
    import yaml
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(base))
    args = [a if a != "small" else path for a in ARGS]
    r = cli("exhaustive", MODEL, SYSTEM, *args, "--framework", "llm-foundry")
    assert r.returncode == 2
    assert "tp2.yaml" in r.stderr and "fixed.tensor_par" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_tune_with_framework_searches_only_runnable_layouts(cli, tmp_path):
    out, trials = tmp_path / "best.json", tmp_path / "trials.csv"
    r = cli("tune", MODEL, SYSTEM, "--num-procs", 16, "--max-batch-size", 64,
            "--datatype", "bfloat16", "--space", "small", "--sampler", "random",
            "--trials", 12, "--seed", 0, "--output", out, "--trials-out", trials,
            "--framework", "llm-foundry")
    assert r.returncode == 0, r.stderr
    best = json.loads(out.read_text())
    assert best["tensor_par"] == 1 and best["pipeline_par"] == 1
    import pandas as pd
    t = pd.read_csv(trials)
    cols = [c for c in t.columns if c.endswith("tensor_par") and "net" not in c]
    assert cols and (t[cols[0]].dropna() == 1).all()
