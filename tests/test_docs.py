"""The docs as a user meets them: every Python snippet in README.md and
docs/*.md runs as written (from a folder outside the project: the shipped
models/, systems/ and spaces are found), every linked image exists, and
``tune --help`` states the real default encodings.

A snippet that needs something a test cannot have (a cluster) is marked on
the line before its fence with ``<!-- snippet: skip REASON -->`` and is
reported as skipped with that reason."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- snippet: skip (?P<skip>.*?) -->\n)?```python\n(?P<code>.*?)```",
                   re.S)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _snippets():
    for doc in DOCS:
        text = doc.read_text()
        for k, m in enumerate(FENCE.finditer(text)):
            line = text[:m.start()].count("\n") + 1
            yield pytest.param(m.group("code"), m.group("skip"),
                               id=f"{doc.relative_to(REPO_ROOT)}:{line}")


def test_the_docs_have_python_snippets():
    assert len(list(_snippets())) >= 2


@pytest.mark.parametrize("code, skip", list(_snippets()))
def test_python_snippet_runs_as_written(code, skip, tmp_path):
    if skip:
        pytest.skip(skip)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    assert list(tmp_path.iterdir()) == []          # a snippet that says "none" writes nothing


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_image_links_exist(doc):
    for link in IMAGE.findall(doc.read_text()):
        if "://" in link:
            continue
        assert (doc.parent / link).is_file(), f"{doc.name}: {link}"


def test_tune_help_states_the_default_encodings(cli):
    from autopar.search.samplers import default_encodings
    DEFAULT_ENCODINGS = default_encodings()
    text = " ".join(cli("tune", "--help").stdout.split())
    assert "named for tpe" in text and DEFAULT_ENCODINGS["tpe"] == "named"
    assert "default: index;" not in text
    for sampler, enc in DEFAULT_ENCODINGS.items():
        assert re.search(rf"{enc} for [a-z, ]*\b{sampler}\b", text), sampler
