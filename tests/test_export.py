"""--format: autopar's own execution format keeps every field; Calculon's is
refused in one line for what Calculon cannot represent."""
from __future__ import annotations

import json

import pytest

from autopar.io.errors import SpecError
from autopar.io.export import export_execution
from autopar.io.layouts import FIELDS
from conftest import one_proc_execution

SMALL = ["--num-procs", 8, "--max-batch-size", 16, "--datatype", "bfloat16"]


def test_calculon_format_of_a_plain_gpt_layout_is_the_23_fields(cli, tmp_path):
    out, top = tmp_path / "best.json", tmp_path / "top.json"
    r = cli("exhaustive", "models/gpt3-13B.json", "systems/a100_80g.json", *SMALL,
            "--space", "small", "--format", "calculon", "--output", out, "--top", top,
            "--top-n", 3)
    assert r.returncode == 0, r.stderr
    assert list(json.loads(out.read_text())) == list(FIELDS)
    assert all(list(e["execution"]) == list(FIELDS) for e in json.loads(top.read_text()).values())
    r = cli("estimate", "models/gpt3-13B.json", "systems/a100_80g.json", out)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("command", ["exhaustive", "tune"])
def test_calculon_format_refuses_a_llama_model(cli, tmp_path, command):
    out = tmp_path / "best.json"
    extra = ["--trials", 5] if command == "tune" else []
    r = cli(command, "models/llama2-7B.json", "systems/a100_80g.json", *SMALL,
            "--space", "small", "--format", "calculon", "--output", out, *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "--format" in line and "block=llama" in line and "vocab_size=32000" in line
    assert "--format autopar" in line
    assert not out.exists()


def test_calculon_format_refuses_a_space_with_extension_fields(cli, tmp_path):
    out = tmp_path / "best.json"
    r = cli("exhaustive", "models/gpt3-13B.json", "systems/a100_80g.json", *SMALL,
            "--space", "llama", "--format", "calculon", "--output", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "attention_impl" in line and not out.exists()


def test_autopar_format_keeps_the_extensions(cli, tmp_path):
    out = tmp_path / "best.json"
    r = cli("exhaustive", "models/llama2-7B.json", "systems/a100_80g.json", *SMALL,
            "--space", "llama", "--output", out)
    assert r.returncode == 0, r.stderr
    best = json.loads(out.read_text())
    assert best.get("attention_impl") == "flash_v2"      # FlashAttention wins on memory and time
    r = cli("estimate", "models/llama2-7B.json", "systems/a100_80g.json", out, "--json")
    assert r.returncode == 0, r.stderr


def test_export_execution_refuses_an_extension_field():
    ex = one_proc_execution(attention_impl="flash_v2")
    assert export_execution(ex, "autopar") == ex
    with pytest.raises(SpecError) as e:
        export_execution(ex, "calculon")
    assert "attention_impl=flash_v2" in e.value.message
    plain = one_proc_execution(attention_impl="unfused")
    assert list(export_execution(plain, "calculon")) == list(FIELDS)


@pytest.mark.parametrize("command", ["exhaustive", "tune", "compare"])
def test_help_says_which_format_is_which(cli, command):
    r = cli(command, "--help")
    text = " ".join(r.stdout.split())
    assert "autopar (default) keeps every field" in text
    assert "calculon writes exactly Calculon's 23 fields" in text
