"""autopar run from outside the project: the shipped files are found through
one lookup (autopar.io.shipped), and the wheel's package data carries them.
(.ci/run also builds a wheel, installs it in a second venv and runs it.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from conftest import REPO_ROOT

from autopar.io import shipped


def _cli_elsewhere(tmp_path, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "autopar.cli", *map(str, args)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_shipped_dirs_are_the_projects_folders():
    for kind in shipped.KINDS:
        assert shipped.shipped_dir(kind) == REPO_ROOT / kind
    assert "calculon" in shipped.names("search_spaces")
    assert "a100_80g" in shipped.names("systems") and "gpt3-175B" in shipped.names("models")


def test_resolve_prefers_the_users_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve("systems/a100_80g.json") == REPO_ROOT / "systems/a100_80g.json"
    assert shipped.resolve("calculon", "search_spaces") == REPO_ROOT / "search_spaces/calculon.yaml"
    (tmp_path / "systems").mkdir()
    (tmp_path / "systems/a100_80g.json").write_text("{}")
    assert shipped.resolve("systems/a100_80g.json") == Path("systems/a100_80g.json")
    assert shipped.resolve("systems/nope.json") == Path("systems/nope.json")


def test_wheel_package_data_covers_every_shipped_file():
    conf = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for kind in shipped.KINDS:
        pkg = f"autopar._shipped.{kind}"
        assert pkg in conf["packages"] and conf["package-dir"][pkg] == kind
        globs = conf["package-data"][pkg]
        files = [f.name for f in (REPO_ROOT / kind).iterdir() if f.is_file()]
        assert files and all(any(fnmatch(f, g) for g in globs) for f in files), kind


def test_commands_find_shipped_files_from_another_folder(tmp_path):
    r = _cli_elsewhere(tmp_path, "validate", "megatron")
    assert r.returncode == 0, r.stderr
    assert "tab5_batch_time" in r.stdout
    r = _cli_elsewhere(tmp_path, "exhaustive", "models/gpt3-175B.json", "systems/a100_80g.json",
                       "--num-procs", 64, "--max-batch-size", 64, "--datatype", "float16",
                       "--space", "search_spaces/small.yaml", "--output", "best.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "best.json").read_text())["num_procs"] == 64
    r = _cli_elsewhere(tmp_path, "exhaustive", "models/none.json", "systems/a100_80g.json",
                       "--num-procs", 64, "--max-batch-size", 64, "--datatype", "float16")
    assert r.returncode == 2 and "models/none.json" in r.stderr and "Traceback" not in r.stderr
