"""Framework specs (autopar/io/frameworks.py, frameworks/): loading, bad input,
the shipped files, applying a framework, and the counted terms' hand counts."""
from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.io import shipped
from autopar.io.errors import SpecError
from autopar.io.frameworks import (FrameworkSpec, check_options, framework_to_json,
                                   load_framework, with_defaults, with_framework)
from autopar.io.layouts import ALL_FIELDS
from autopar.io.specs import MemoryHeadroom, MemoryOverhead, TimeOverhead, load_system
from tests.conftest import REPO_ROOT

SHIPPED = shipped.names("frameworks")


def test_every_shipped_framework_loads_and_round_trips():
    assert {"megatron-core", "megatron-bridge", "torchtitan", "llm-foundry", "nemo1-apex",
            "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"} <= set(SHIPPED)
    for name in SHIPPED:
        fw = load_framework(name)
        assert fw.name == name and fw.description
        assert set(fw.defaults) <= set(ALL_FIELDS)
        back = load_framework(framework_to_json(fw))
        assert dataclasses.replace(back, source=fw.source) == fw
        # every record field and default it states is free (fitted) or cited
        data = json.loads((REPO_ROOT / "frameworks" / f"{name}.json").read_text())
        for rec in ("memory_overhead", "time_overhead", "memory_headroom", "defaults"):
            for k in data.get(rec, {}):
                term = f"{rec}.{k}"
                assert term in fw.free or fw.citations.get(term), (name, term)


def test_found_by_name_and_path_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = load_framework("megatron-core")
    assert by_name.source == str(REPO_ROOT / "frameworks/megatron-core.json")
    assert load_framework("frameworks/torchtitan.json").name == "torchtitan"
    assert load_framework("torchtitan.json").memory_overhead.checkpoint_split
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"name": "mine", "time_overhead": {"pipeline_fraction": 0.1}}))
    fw = load_framework(str(own))
    assert fw.time_overhead == TimeOverhead(0.1) and fw.memory_overhead is None


@pytest.mark.parametrize("data, field", [
    ({}, "name"),
    ({"name": 3}, "name"),
    ({"name": "x", "extra": 1}, "extra"),
    ({"name": "x", "memory_overhead": {"fraction": 1.5}}, "memory_overhead.fraction"),
    ({"name": "x", "memory_overhead": {"copies": 1}}, "memory_overhead.copies"),
    ({"name": "x", "time_overhead": {"pipeline_fraction": -1}}, "time_overhead.pipeline_fraction"),
    ({"name": "x", "memory_headroom": {"GiB": -1}}, "memory_headroom.GiB"),
    ({"name": "x", "defaults": {"tensor_parr": 2}}, "defaults.tensor_parr"),
    ({"name": "x", "defaults": {"activation_recompute": "some"}}, "defaults.activation_recompute"),
    ({"name": "x", "defaults": {"fp32_grads": "yes"}}, "defaults.fp32_grads"),
    ({"name": "x", "options": {"tensor_par": 1}}, "options.tensor_par"),
    ({"name": "x", "options": {"tensor_par": [1, 0]}}, "options.tensor_par[1]"),
    ({"name": "x", "options": {"tensor_par": [1, 1]}}, "options.tensor_par"),
    ({"name": "x", "options": {"tensor_par": [1]}, "defaults": {"tensor_par": 2}},
     "defaults.tensor_par"),
    ({"name": "x", "free": ["memory_overhead.nope"]}, "free[0]"),
    ({"name": "x", "free": "memory_overhead.fraction"}, "free"),
    ({"name": "x", "citations": {"a": 1}}, "citations.a"),
])
def test_bad_input_names_the_field(data, field):
    with pytest.raises(SpecError) as e:
        load_framework(data, source="fw.json")
    assert e.value.field == field and e.value.source == "fw.json"


def test_bad_files(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_framework(str(tmp_path / "none.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(SpecError, match="expected a JSON object"):
        load_framework(str(tmp_path / "list.json"))
    with pytest.raises(SpecError, match="expected a file path"):
        load_framework(3)


def test_with_framework_replaces_the_software_records():
    system = load_system("systems/a100_80g.json")
    assert with_framework(system, None) is system
    fw = FrameworkSpec("x", memory_overhead=MemoryOverhead(1.0, 0.1), time_overhead=TimeOverhead(0.02))
    s = with_framework(system, fw)
    assert s.memory_overhead == MemoryOverhead(1.0, 0.1) and s.time_overhead == TimeOverhead(0.02)
    assert s.matrix == system.matrix and s.networks == system.networks
    # a record the framework leaves out is Calculon's (none), whatever the system had
    loaded = dataclasses.replace(system, memory_overhead=MemoryOverhead(5.0),
                                 memory_headroom=MemoryHeadroom(2.0, 1.0))
    s = with_framework(loaded, FrameworkSpec("bare"))
    assert s.memory_overhead is None and s.time_overhead is None
    assert s.memory_headroom == MemoryHeadroom(2.0, 1.0)        # kept: the framework states none
    s = with_framework(loaded, FrameworkSpec("h", memory_headroom=MemoryHeadroom(3.0, 0.5)))
    assert s.memory_headroom == MemoryHeadroom(3.0, 0.5)
    with pytest.raises(SpecError, match="memory_headroom.GiB"):
        with_framework(system, FrameworkSpec("big", memory_headroom=MemoryHeadroom(90.0)))


def test_defaults_and_options():
    fw = load_framework("llm-foundry")
    ex = with_defaults(fw, {"tensor_par": 1, "weight_sharding": False})
    assert ex["weight_sharding"] is False and ex["optimizer_sharding"] is True
    check_options(fw, {"tensor_par": 1}, "ex.json")
    with pytest.raises(SpecError) as e:
        check_options(fw, {"tensor_par": 2}, "ex.json")
    assert e.value.field == "tensor_par" and "llm-foundry" in str(e.value)
    check_options(None, {"tensor_par": 2}, "ex.json")
    assert with_defaults(None, {"a": 1}) == {"a": 1}
