"""The newcomer's commands: ``autopar --version``, ``autopar list ...`` and an
example in every command's ``--help`` (issue 25, item 6)."""
from __future__ import annotations

import shlex
from importlib import metadata

import pytest

from autopar.cli import COMMAND_OF, COMMANDS, EXAMPLES, build_parser, main
from autopar.io import shipped


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {metadata.version('autopar')}"


@pytest.mark.parametrize("kind, folder", [("models", "models"), ("systems", "systems"),
                                          ("spaces", "search_spaces"),
                                          ("frameworks", "frameworks")])
def test_list_names_every_shipped_file_once_with_a_description(capsys, kind, folder):
    assert main(["list", kind]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == shipped.names(folder)
    assert all(len(line.split(None, 1)) == 2 for line in lines)     # a description each


def test_list_describes_models_by_size_and_systems_by_memory(capsys):
    main(["list", "models"])
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "174B parameters" in out["gpt3-175B"]                   # blocks only: no embedding
    assert "46.7B parameters (12.9B active; 8 experts, top-2)" in out["mixtral-8x7B"]
    main(["list", "systems"])
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "80 GiB per processor" in out["a100_80g"] and "40 GiB" in out["a100_40g"]


def test_list_refuses_an_unknown_kind_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["list", "gpus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpus" in err


@pytest.mark.parametrize("name", [COMMAND_OF.get(m, m) for m in COMMANDS])
def test_every_command_help_has_an_example_that_parses(capsys, name):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    text = capsys.readouterr().out
    assert "example" in text.split("options:")[-1]
    assert EXAMPLES[name]
    for line in EXAMPLES[name]:
        assert f"  {line}" in text                      # as written, not re-wrapped
        argv = shlex.split(line)
        assert argv[0] == "autopar"
        if argv[1] == name:
            args = parser.parse_args(argv[1:])
            assert args.command == name


def test_top_level_help_shows_examples(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "  autopar list models" in text and f"  {EXAMPLES['exhaustive'][0]}" in text
