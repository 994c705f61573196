"""``validate published`` reads autopar's own tables (package data written
from the published figures, autopar/data/published): present for every
registered table, shipped in the wheel, and giving the same cases as the
source tables where those are present (issue 25, item 6)."""
from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tomllib

import pandas as pd
import pytest

from autopar.studies import published as P
import autopar.studies.published_foundry  # noqa: F401  (registers its tables)
import autopar.studies.published_moe  # noqa: F401

from conftest import REPO_ROOT


def test_tables_are_package_data_for_every_registered_table(monkeypatch):
    monkeypatch.delenv("AUTOPAR_PUBLISHED", raising=False)
    assert P.published_dir() == P.PACKAGED
    assert P.PACKAGED.is_relative_to(REPO_ROOT / "autopar")
    conf = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = conf["package-data"]["autopar"]
    for table in P.TABLES.values():
        f = P.PACKAGED / table.csv
        assert f.is_file(), table.name
        rel = str(f.relative_to(REPO_ROOT / "autopar"))
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel
        frame = pd.read_csv(f)
        assert len(frame) and frame["source"].notna().all(), table.name
        assert "notes" not in frame


@pytest.mark.parametrize("name", sorted(P.TABLES))
def test_packaged_table_gives_the_source_tables_cases(reference, monkeypatch, name):
    table = P.TABLES[name]
    if not (reference / "measured" / "published" / table.csv).is_file():
        pytest.skip(f"{table.csv}: written here from its source (the row's `source`), "
                    "no collected copy in ../shared to compare with")
    monkeypatch.delenv("AUTOPAR_PUBLISHED", raising=False)
    ours = P.cases(table)
    monkeypatch.setenv("AUTOPAR_PUBLISHED", str(reference / "measured" / "published"))
    theirs = P.cases(table)
    assert len(ours) == len(theirs) > 0
    for (i, a), (j, b) in zip(ours, theirs):
        assert i == j and type(a) is type(b)
        assert a == b, (name, i)
    # every figure kept is the source's, as published
    src = pd.read_csv(reference / "measured" / "published" / table.csv)
    own = pd.read_csv(P.PACKAGED / table.csv)
    pd.testing.assert_frame_equal(own, src[list(own.columns)], check_dtype=False)


def test_validate_published_runs_without_the_shared_folder(tmp_path):
    """From a folder outside the project, with the package found by path only
    and no ../shared beside it: the tables come from the package."""
    env = {k: v for k, v in os.environ.items() if k != "AUTOPAR_PUBLISHED"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    r = subprocess.run([sys.executable, "-c",
                        "import autopar.studies.published as P, sys;"
                        "P.shared_reference = None;"
                        "from autopar.cli import main;"
                        "sys.exit(main(['validate', 'published', '--table', 'megatron_2021',"
                        " '--no-rank']))"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "megatron_2021" in r.stdout
