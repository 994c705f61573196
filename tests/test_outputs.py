"""Where outputs go and how they name their inputs: one rule.

Outputs named in an experiment file or on the command line are relative to
the current folder; inputs named in a file, to the file's folder; paths
written inside an output resolve from the output file itself."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

SMALL_CASE = {"model": "../models/gpt3-13B.json", "system": "../systems/a100_80g.json",
              "num_procs": 64, "max_batch_size": 512, "datatype": "float16", "space": "small"}


@pytest.fixture
def sandbox(tmp_path):
    for d in ("models", "systems"):
        (tmp_path / d).symlink_to(REPO_ROOT / d)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "elsewhere").mkdir()
    return tmp_path


def _compare_file(sandbox, **extra) -> Path:
    path = sandbox / "experiments" / "c.yaml"
    path.write_text(yaml.safe_dump({"kind": "compare", "name": "c", "case": SMALL_CASE,
                                    "samplers": ["random"], "seeds": 1, "trials": 5,
                                    "budgets": [5], **extra}))
    return path


def test_optimum_names_model_and_system_from_its_own_folder(sandbox, cli):
    path = _compare_file(sandbox, output_dir="deep/er/c")
    cwd = sandbox / "elsewhere"
    r = cli("run", path, cwd=cwd)
    assert r.returncode == 0, r.stderr
    out = cwd / "deep" / "er" / "c"          # from the current folder, not the file's
    opt = json.loads((out / "optimum.json").read_text())
    assert (out / opt["model"]).resolve() == (REPO_ROOT / "models/gpt3-13B.json").resolve()
    assert (out / opt["system"]).resolve() == (REPO_ROOT / "systems/a100_80g.json").resolve()
    assert opt["model_name"] == "gpt3-13B"
    assert not (sandbox / "experiments" / "deep").exists()


@pytest.mark.parametrize("how", ["compare", "run"])
def test_output_dir_none_writes_nothing(sandbox, cli, how):
    path = _compare_file(sandbox)
    cwd = sandbox / "elsewhere"
    r = cli(how, path, "--output-dir", "none", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "optimum" in r.stdout and "wrote" not in r.stdout
    assert list(cwd.iterdir()) == [] and not (sandbox / "experiments" / "none").exists()


def test_output_dir_none_in_a_file_is_one_line(sandbox, cli):
    path = _compare_file(sandbox, output_dir="none")
    r = cli("run", path, cwd=sandbox / "elsewhere")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert str(path) in line and "output_dir" in line
    assert list((sandbox / "elsewhere").iterdir()) == []


def test_exhaustive_summary_keeps_the_files(tmp_path, cli):
    summary = tmp_path / "s" / "summary.json"
    summary.parent.mkdir()
    r = cli("exhaustive", "models/gpt3-13B.json", "systems/a100_80g.json", "--num-procs", 64,
            "--max-batch-size", 64, "--datatype", "float16", "--space", "small",
            "--summary", summary)
    assert r.returncode == 0, r.stderr
    s = json.loads(summary.read_text())
    assert s["model"] == "gpt3-13B" and s["system"] == "a100_80g"
    assert (summary.parent / s["model_file"]).resolve() == (REPO_ROOT / "models/gpt3-13B.json").resolve()
    assert (summary.parent / s["system_file"]).resolve() == (REPO_ROOT / "systems/a100_80g.json").resolve()


OUTPUT_KEYS = ("output", "trials_out", "top", "summary", "all", "output_dir", "storage_path")


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "experiments").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_examples_write_under_results_not_into_the_project(path):
    """Run from the project (the usual way), an example writes only under
    results/ (ignored by git), never over docs/ or other tracked files."""
    data = yaml.safe_load(path.read_text())
    outs = [data[k] for k in OUTPUT_KEYS if data.get(k)]
    storage = data.get("storage") or ""
    if storage.startswith("sqlite:///"):
        outs.append(storage[len("sqlite:///"):])
    for out in outs:
        where = (REPO_ROOT / out).resolve()
        assert where.is_relative_to(REPO_ROOT / "results"), (path.name, out)
    assert "/results/" in (REPO_ROOT / ".gitignore").read_text()
