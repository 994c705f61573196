"""``autopar run FILE.yaml``: experiments described declaratively."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from autopar.cli.run import parse
from autopar.io.experiment import read
from autopar.io.layouts import FIELDS
from autopar.io.specs import SpecError

CASE = {"model": "../models/gpt3-175B.json", "system": "../systems/a100_80g.json",
        "num_procs": 1024, "max_batch_size": 1536, "datatype": "float16", "space": "calculon"}


def write(folder: Path, data: dict, name: str = "exp.yaml") -> Path:
    """An experiment file in ``folder/experiments`` whose ../ paths reach the repo."""
    path = folder / "experiments" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def sandbox(tmp_path, repo_root):
    """A folder with models/ and systems/ linked from the repo."""
    for d in ("models", "systems"):
        (tmp_path / d).symlink_to(repo_root / d)
    return tmp_path


def test_run_tune_file_writes_best_and_trials(sandbox, cli):
    path = write(sandbox, {"kind": "tune", "name": "t", "case": CASE, "sampler": "random",
                           "trials": 12, "seed": 5, "storage": "sqlite:///out/t.db",
                           "output": "out/best.json", "trials_out": "out/trials.csv"})
    r = cli("run", path, cwd=sandbox)       # outputs: from the current folder
    assert r.returncode == 0, r.stderr
    assert "experiment t (tune)" in r.stdout
    table = pd.read_csv(sandbox / "out" / "trials.csv", keep_default_na=False, na_values=[""])
    assert len(table) == 12
    best = json.loads((sandbox / "out" / "best.json").read_text())
    row = table.loc[table["sample_rate"].idxmax()]
    assert best == {f: (row[f].item() if hasattr(row[f], "item") else row[f]) for f in FIELDS}
    assert (sandbox / "out" / "t.db").is_file()
    # run again: the study in storage is complete, nothing new is sampled
    again = cli("run", path, cwd=sandbox)
    assert again.returncode == 0, again.stderr
    pd.testing.assert_frame_equal(
        table.drop(columns=["elapsed_s"]),
        pd.read_csv(sandbox / "out" / "trials.csv", keep_default_na=False,
                    na_values=[""]).drop(columns=["elapsed_s"]))


def test_run_exhaustive_file(sandbox, cli):
    path = write(sandbox, {"kind": "exhaustive", "case": {**CASE, "space": "small"},
                           "top_n": 3, "output": "out/best.json", "top": "out/top.json"})
    r = cli("run", path, cwd=sandbox)
    assert r.returncode == 0, r.stderr
    best = json.loads((sandbox / "out" / "best.json").read_text())
    top = json.loads((sandbox / "out" / "top.json").read_text())
    assert best == top["0"]["execution"] and len(top) == 3


def test_run_compare_file_dispatches_to_compare(sandbox, cli):
    small = {**CASE, "model": "../models/gpt3-13B.json", "num_procs": 64,
             "max_batch_size": 512, "space": "small"}
    path = write(sandbox, {"kind": "compare", "name": "c", "case": small,
                           "samplers": ["random"], "seeds": 1, "trials": 5, "budgets": [5],
                           "output_dir": "out/c"})
    r = cli("run", path, cwd=sandbox)
    assert r.returncode == 0, r.stderr
    assert (sandbox / "out" / "c" / "summary.csv").is_file()


@pytest.mark.parametrize("change, field", [
    ({"kind": "anneal"}, "kind"),
    ({"colour": "blue"}, "colour"),
    ({"trials": "many"}, "trials"),
    ({"sampler": "annealing"}, "sampler"),
    ({"case": {**CASE, "num_procs": 0}}, "case.num_procs"),
    ({"case": {k: v for k, v in CASE.items() if k != "model"}}, "case.model"),
    ({"case": {**CASE, "gpus": 8}}, "case.gpus"),
])
def test_bad_experiment_is_one_line_exit_2(sandbox, cli, change, field):
    data = {"kind": "tune", "case": CASE, "trials": 5, "output": "out/best.json", **change}
    path = write(sandbox, data)
    r = cli("run", path, cwd=sandbox)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and f": {field}: " in lines[0], lines
    assert not (sandbox / "out").exists()


def test_missing_model_file_is_named(sandbox, cli):
    path = write(sandbox, {"kind": "tune", "case": {**CASE, "model": "../models/nope.json"},
                           "trials": 5})
    r = cli("run", path)
    assert r.returncode == 2 and "nope.json" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_experiment_file(cli, tmp_path):
    r = cli("run", tmp_path / "nope.yaml")
    assert r.returncode == 2 and "nope.yaml" in r.stderr


def test_sampler_options_are_tunes_keyword_options():
    import inspect

    from autopar.io.experiment import SAMPLER_OPTIONS
    from autopar.search.tune import tune_arguments as tune
    decided = {"model", "system", "num_procs", "max_batch_size", "datatype", "sampler",
               "trials", "space", "seed", "storage", "address", "progress", "study_name",
               "batch_policy", "training", "return_study"}   # the experiment decides these
    params = inspect.signature(tune).parameters
    assert set(SAMPLER_OPTIONS) == {n for n, p in params.items() if n not in decided and
                                    p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def test_shipped_experiments_are_valid(repo_root):
    from autopar.studies.compare import load_experiment
    from autopar.cli.run import EXTERNAL_KINDS
    files = sorted((repo_root / "experiments").glob("*.yaml"))
    kinds = set()
    for f in files:
        data = read(f)
        kind, ns = parse(data, str(f), f.parent)
        kinds.add(kind)
        if kind == "compare":
            load_experiment(f)
        elif kind not in EXTERNAL_KINDS:
            assert Path(ns.model).is_file() and Path(ns.system).is_file()
    assert {"tune", "exhaustive", "compare"} <= kinds


def test_relative_sqlite_storage_is_relative_to_the_current_folder(sandbox, monkeypatch):
    # issue 16: outputs (a study's storage included) are relative to the
    # current folder, as on the command line; inputs to the file's folder
    tmp_path = sandbox          # the case's ../models and ../systems resolve here
    (tmp_path / "experiments").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    data = {"kind": "tune", "case": CASE, "storage": "sqlite:///r/x.db"}
    _, ns = parse(data, "f.yaml", tmp_path / "experiments")
    assert ns.storage == f"sqlite:///{(tmp_path / 'cwd' / 'r' / 'x.db').resolve()}"
    _, ns = parse({**data, "storage": "sqlite:////abs/x.db"}, "f.yaml", tmp_path / "experiments")
    assert ns.storage == "sqlite:////abs/x.db"
    with pytest.raises(SpecError):
        parse({**data, "backend": "spark"}, "f.yaml", tmp_path / "experiments")
