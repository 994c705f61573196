"""Loading and validating model, system and execution specs."""
from __future__ import annotations

import copy
import json

import pytest

from autopar.io.layouts import ALL_FIELDS, FIELDS, to_columns
from autopar.io.specs import (ModelSpec, SpecError, SystemSpec, load_execution,
                           load_model, load_system, model_to_json, system_to_json)
from conftest import DELETE, set_key

MODEL_NAMES = ("anthropic-52B chinchilla gopher-280B gpt3-13B gpt3-175B lamda "
               "megatron-126M megatron-1T megatron-22B megatron-40B megatron-5B "
               "palm-540B turing-530B").split()
LLAMA = {  # name: (hidden, heads, kv_heads, blocks, feedforward, seq, vocab)
    "llama-7B": (4096, 32, 32, 32, 11008, 2048, 32000),
    "llama-13B": (5120, 40, 40, 40, 13824, 2048, 32000),
    "llama-30B": (6656, 52, 52, 60, 17920, 2048, 32000),
    "llama-65B": (8192, 64, 64, 80, 22016, 2048, 32000),
    "llama2-7B": (4096, 32, 32, 32, 11008, 4096, 32000),
    "llama2-13B": (5120, 40, 40, 40, 13824, 4096, 32000),
    "llama2-70B": (8192, 64, 8, 80, 28672, 4096, 32000),
    "llama3-8B": (4096, 32, 8, 32, 14336, 8192, 128256),
    "llama3-70B": (8192, 64, 8, 80, 28672, 8192, 128256),
    "llama3-405B": (16384, 128, 8, 126, 53248, 8192, 128256),
}
SYSTEMS = ("a100_80g", "a100_80g_dgx_hdr200", "h100_80g_nvl8", "h200")


# ---------------------------------------------------------------- good files

@pytest.mark.parametrize("name", MODEL_NAMES + list(LLAMA))
def test_project_models_load_and_round_trip(repo_root, name):
    path = repo_root / "models" / f"{name}.json"
    m = load_model(path)
    assert isinstance(m, ModelSpec)
    assert m.name == name and m.source == str(path)
    assert load_model(model_to_json(m), source=str(path)) == m
    # model_to_json is a plain Calculon application (+ extension keys)
    assert json.loads(json.dumps(model_to_json(m)))["hidden"] == m.hidden


@pytest.mark.parametrize("name", list(LLAMA))
def test_llama_shapes(repo_root, name):
    hidden, heads, kv, blocks, ff, seq, vocab = LLAMA[name]
    m = load_model(repo_root / "models" / f"{name}.json")
    assert (m.block, m.hidden, m.attn_heads, m.kv_heads, m.num_blocks,
            m.feedforward, m.seq_size, m.vocab_size) == \
        ("llama", hidden, heads, kv, blocks, ff, seq, vocab)
    assert m.attn_size * m.attn_heads == m.hidden


def test_gpt_models_are_plain_calculon(repo_root):
    for name in MODEL_NAMES:
        data = json.loads((repo_root / "models" / f"{name}.json").read_text())
        assert set(data) == {"hidden", "feedforward", "seq_size", "attn_heads",
                             "attn_size", "num_blocks"}, name
    m = load_model(repo_root / "models" / "gpt3-175B.json")
    assert (m.block, m.kv_heads, m.vocab_size) == ("gpt", None, 0)
    assert (m.hidden, m.attn_heads, m.num_blocks) == (12288, 96, 96)


def test_project_models_match_reference_shapes(repo_root, reference):
    # Published shapes; the one deliberate difference is megatron-126M, which
    # follows NeMo's GPT-3 126M config (12 heads of 64) rather than 16 of 48.
    for name in MODEL_NAMES:
        ref = load_model(reference / "calculon-golden" / "models" / f"{name}.json")
        ours = load_model(repo_root / "models" / f"{name}.json")
        if name == "megatron-126M":
            assert ours.attn_heads * ours.attn_size == ref.attn_heads * ref.attn_size
            continue
        assert model_to_json(ours) == model_to_json(ref) | {"name": name}, name


@pytest.mark.parametrize("name", SYSTEMS)
def test_project_systems_load_and_round_trip(repo_root, name):
    path = repo_root / "systems" / f"{name}.json"
    s = load_system(path)
    assert isinstance(s, SystemSpec)
    assert s.name == name and s.description
    again = load_system(json.loads(json.dumps(system_to_json(s))), source=str(path))
    assert again == s
    assert len(s.networks) == 2 and s.networks[0].size == 8
    assert s.networks[0].ops["p2p"] == (1.0, 0.0)


def test_system_facts(repo_root):
    a100 = load_system(repo_root / "systems" / "a100_80g.json")
    h100 = load_system(repo_root / "systems" / "h100_80g_nvl8.json")
    h200 = load_system(repo_root / "systems" / "h200.json")
    assert a100.datatypes == ("float16", "bfloat16", "float32")
    assert h100.datatypes == ("float8", "float16", "bfloat16", "float32")
    assert a100.matrix["float16"].tflops == 312 and a100.mem1.GiB == 80
    assert a100.networks[0].bandwidth == 300 and a100.networks[1].bandwidth == 25
    assert h100.matrix["bfloat16"].tflops == 989 and h100.matrix["float8"].tflops == 1979
    assert h100.networks[0].bandwidth == 450 and h100.networks[1].bandwidth == 50
    assert h200.mem1.GiB == 140 and h200.mem1.GBps == 4800
    assert h200.matrix == h100.matrix


def test_reference_files_load_unchanged(reference):
    base = reference / "calculon-golden"
    for path in sorted((base / "systems").glob("*.json")):
        s = load_system(path)
        assert s.name == path.stem and s.datatypes
    for path in sorted((base / "models").glob("*.json")):
        assert load_model(path).hidden > 0
    for path in sorted((reference / "measured" / "megatron-seqsel").rglob("*.json")):
        if path.name != "published.json":
            assert list(load_execution(path)) == list(FIELDS)


def test_execution_order_and_columns(execution, repo_root):
    shuffled = dict(reversed(list(execution.items())))
    system = load_system(repo_root / "systems" / "a100_80g.json")
    e = load_execution(shuffled, system=system)
    assert list(e) == list(FIELDS) and e == execution
    cols = to_columns([e])
    assert cols["tensor_par"][0] == 8 and len(cols) == len(ALL_FIELDS)


def test_execution_file_and_gzip(tmp_path, execution):
    import gzip
    plain = tmp_path / "e.json"
    plain.write_text(json.dumps(execution))
    packed = tmp_path / "e.json.gz"
    with gzip.open(packed, "wt") as fh:
        fh.write(json.dumps(execution))
    assert load_execution(plain) == load_execution(packed) == execution


def test_spec_objects_pass_through(repo_root):
    m = load_model(repo_root / "models" / "gpt3-175B.json")
    s = load_system(repo_root / "systems" / "a100_80g.json")
    assert load_model(m) is m and load_system(s) is s


# ---------------------------------------------------------------- bad input

def _model(repo_root):
    return json.loads((repo_root / "models" / "gpt3-175B.json").read_text())


def _system(repo_root):
    return json.loads((repo_root / "systems" / "a100_80g.json").read_text())



BAD_MODELS = [
    ("missing key", set_key("hidden", DELETE), "hidden", "missing key"),
    ("unknown key", set_key("hiden", 1), "hiden", "unknown key"),
    ("string int", set_key("hidden", "12288"), "hidden", "expected an integer"),
    ("bool int", set_key("num_blocks", True), "num_blocks", "expected an integer"),
    ("float int", set_key("hidden", 12288.0), "hidden", "expected an integer"),
    ("zero", set_key("attn_heads", 0), "attn_heads", ">= 1"),
    ("negative", set_key("seq_size", -2048), "seq_size", ">= 1"),
    ("block", set_key("block", "bert"), "block", "unknown value"),
    ("kv_heads", set_key("kv_heads", 7), "kv_heads", "must divide"),
    ("kv_heads zero", set_key("kv_heads", 0), "kv_heads", ">= 1"),
    ("vocab", set_key("vocab_size", -1), "vocab_size", ">= 0"),
    ("name", set_key("name", 3), "name", "expected a string"),
]


@pytest.mark.parametrize("case", BAD_MODELS, ids=[c[0] for c in BAD_MODELS])
def test_bad_model(repo_root, case):
    _, mutate, field, words = case
    with pytest.raises(SpecError) as err:
        load_model(mutate(_model(repo_root)))
    assert err.value.source == "dict"
    assert err.value.field == field and words in err.value.message


BAD_SYSTEMS = [
    ("unknown top key", set_key("extra", 1), "extra", "unknown key"),
    ("missing top key", set_key("mem2", DELETE), "mem2", "missing key"),
    ("efficiency > 1", set_key("matrix", "float16", "gflops_efficiency", 1, 1, 1.5),
     "matrix.float16.gflops_efficiency[1]", "(0, 1]"),
    ("efficiency 0", set_key("mem1", "MB_efficiency", 0, 1, 0),
     "mem1.MB_efficiency[0]", "(0, 1]"),
    ("not descending", set_key("vector", "float16", "gflops_efficiency", 1, 0, 16),
     "vector.float16.gflops_efficiency[1]", "strictly descending"),
    ("not ending at 0", set_key("mem2", "MB_efficiency", 3, 0, 0.5),
     "mem2.MB_efficiency[3]", "must be 0"),
    ("bad pair", set_key("mem2", "MB_efficiency", 0, [100]),
     "mem2.MB_efficiency[0]", "pair"),
    ("empty table", set_key("mem2", "MB_efficiency", []), "mem2.MB_efficiency", "non-empty"),
    ("processing mode", set_key("processing_mode", "overlap"), "processing_mode",
     "unknown value"),
    ("processor usage", set_key("networks", 0, "processor_usage", 1.0),
     "networks[0].processor_usage", "[0, 1)"),
    ("missing op", set_key("networks", 1, "ops", "all_reduce", DELETE),
     "networks[1].ops.all_reduce", "missing key"),
    ("unknown op", set_key("networks", 1, "ops", "broadcast", [1.0, 0]),
     "networks[1].ops.broadcast", "unknown key"),
    ("p2p offset", set_key("networks", 0, "ops", "p2p", [1.0, 0]),
     "networks[0].ops.p2p", "no offset"),
    ("collective offset null", set_key("networks", 1, "ops", "reduce_scatter", [1.0, None]),
     "networks[1].ops.reduce_scatter", "numeric offset"),
    ("op scale", set_key("networks", 1, "ops", "all_gather", [0, 0]),
     "networks[1].ops.all_gather", "> 0"),
    ("unknown datatype", set_key("matrix", "int8", {"tflops": 1, "gflops_efficiency": [[0, 1]]}),
     "matrix.int8", "unknown datatype"),
    ("bandwidth", set_key("networks", 0, "bandwidth", -300), "networks[0].bandwidth", "> 0"),
    ("net size zero", set_key("networks", 1, "size", 0), "networks[1].size", ">= 1"),
    ("net size float", set_key("networks", 1, "size", 8.0), "networks[1].size",
     "expected an integer"),
    ("mem size", set_key("mem1", "GiB", 0), "mem1.GiB", "> 0"),
    ("network key", set_key("networks", 1, "latency", DELETE), "networks[1].latency",
     "missing key"),
    ("must_be_filled", set_key("networks", 0, "must_be_filled", 1),
     "networks[0].must_be_filled", "true or false"),
    ("tflops type", set_key("matrix", "float16", "tflops", "312"), "matrix.float16.tflops",
     "expected a number"),
    ("no networks", set_key("networks", []), "networks", "non-empty"),
]


@pytest.mark.parametrize("case", BAD_SYSTEMS, ids=[c[0] for c in BAD_SYSTEMS])
def test_bad_system(repo_root, case):
    _, mutate, field, words = case
    with pytest.raises(SpecError) as err:
        load_system(mutate(_system(repo_root)))
    assert err.value.field == field and words in err.value.message, err.value


def test_system_without_common_datatype(repo_root):
    data = _system(repo_root)
    data["vector"] = {"float8": {"tflops": 1, "gflops_efficiency": [[0, 1]]}}
    with pytest.raises(SpecError, match="no datatype is listed in both"):
        load_system(data)


BAD_EXECUTIONS = [
    ("missing key", set_key("training", DELETE), "training", "missing key"),
    ("unknown key", set_key("sequence_par", True), "sequence_par", "unknown key"),
    ("enum", set_key("activation_recompute", "some"), "activation_recompute",
     "unknown value"),
    ("datatype", set_key("datatype", "int8"), "datatype", "unknown value"),
    ("bool int", set_key("tensor_par", True), "tensor_par", "expected an integer"),
    ("float int", set_key("batch_size", 1536.0), "batch_size", "expected an integer"),
    ("zero", set_key("microbatch_size", 0), "microbatch_size", ">= 1"),
    ("negative tier", set_key("data_par_net", -1), "data_par_net", ">= 0"),
    ("string bool", set_key("training", "yes"), "training", "true or false"),
    ("int bool", set_key("weight_offload", 0), "weight_offload", "true or false"),
]


@pytest.mark.parametrize("case", BAD_EXECUTIONS, ids=[c[0] for c in BAD_EXECUTIONS])
def test_bad_execution(execution, case):
    _, mutate, field, words = case
    with pytest.raises(SpecError) as err:
        load_execution(mutate(copy.deepcopy(execution)))
    assert err.value.field == field and words in err.value.message


def test_execution_against_system(repo_root, execution):
    a100 = load_system(repo_root / "systems" / "a100_80g.json")
    h100 = load_system(repo_root / "systems" / "h100_80g_nvl8.json")
    fp8 = dict(execution, datatype="float8")
    assert load_execution(fp8)["datatype"] == "float8"          # no system: fine
    assert load_execution(fp8, system=h100)["datatype"] == "float8"
    with pytest.raises(SpecError) as err:
        load_execution(fp8, system=a100)
    assert err.value.field == "datatype" and "float8" in err.value.message
    with pytest.raises(SpecError) as err:
        load_execution(dict(execution, pipeline_par_net=2), system=a100)
    assert err.value.field == "pipeline_par_net" and "2 networks" in err.value.message
    # Cross-field rules are the model's job ("invalid: ..."), not the loader's.
    assert load_execution(dict(execution, num_procs=1000), system=a100)["num_procs"] == 1000


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(SpecError) as err:
        load_model(missing)
    assert (err.value.source, err.value.field) == (str(missing), "(file)")
    assert "no such file" in err.value.message

    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "hidden": 1,\n  "feedforward": ,\n}\n')
    with pytest.raises(SpecError) as err:
        load_model(broken)
    assert err.value.field == "(file)" and "line 3" in err.value.message

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(SpecError) as err:
        load_system(listed)
    assert err.value.field == "(root)" and "a list" in err.value.message

    nan = tmp_path / "nan.json"
    nan.write_text('{"hidden": NaN}')
    with pytest.raises(SpecError, match="NaN is not a valid JSON number"):
        load_model(nan)

    dup = tmp_path / "dup.json"
    dup.write_text('{"hidden": 1, "hidden": 2}')
    with pytest.raises(SpecError, match="duplicate key 'hidden'"):
        load_model(dup)

    with pytest.raises(SpecError) as err:
        load_execution(tmp_path)
    assert "directory" in err.value.message

    with pytest.raises(SpecError) as err:
        load_execution(42)
    assert err.value.source == "dict" and err.value.field == "(root)"


# ------------------------------------------------- software records, every field

def test_every_shipped_system_round_trips_through_json_text(repo_root):
    """load -> system_to_json -> JSON text -> load is the identity for every
    file in systems/ (the four above also check their networks)."""
    from autopar.io import shipped
    names = shipped.names("systems")
    assert len(names) >= 12
    for name in names:
        path = repo_root / "systems" / f"{name}.json"
        s = load_system(path)
        assert load_system(json.loads(json.dumps(system_to_json(s))), source=str(path)) == s


# One value per field of each record, none the field's default (the count
# without it): a field added to MemoryOverhead / TimeOverhead without a value
# here fails the test below, and one its *_json function does not write back
# fails the round trip.
MEMORY_VALUES = {
    "reserved_GiB": 1.5, "fraction": 0.1, "logits_fp32_copies": 2.5,
    "logits_gathered": True, "checkpoint_split": True, "master_weight_bytes": 2.0,
    "autograd_inputs": True, "fsdp_reshard": "never", "dummy_wgrad": True,
    "backward_transient": "op", "moe_probs_in_activation": True,
    "cp_a2a_output_copy": True, "pipeline_grads": "whole", "logits_kept": "pipelined",
    "selective_saves": "op_eager", "fp8_weight_copy": False, "fp8_primary_weights": True,
    "proj_saves_original": True,
    "optimizer_step_bytes": 8.0, "adapter_saved_bytes": 3.0, "pipeline_in_flight": "capped",
    "pipeline_recv_buffers": True, "wgrad_accumulation_fusion": True,
    "te_userbuffers": True, "te_userbuffers_rs": "ring_exchange", "cuda_graphs": "scoped",
    "head_weights_sharded": True}
TIME_VALUES = {
    "pipeline_fraction": 0.04, "moe_block_s": 0.003, "moe_host_op_s": 2e-5, "launch_s": 5e-6,
    "attention_speed": 0.5, "attention_backward_speed": 0.4, "attention_tile": 128,
    "grad_accum_bytes": 10.0, "grad_accum_in_gemm": True, "adapter_bytes": (21.0, 10.0, 27.0, 4.0),
    "tp_overlap_chunks": True, "tp_gather_fp8": True,
    "fp8_linear_speedup": (("rowwise", (1024.0, 4096.0), (4096.0,), (4096.0, 8192.0),
                            (1.1, 1.2, 1.3, 1.4)),),
    "separate_projections": True, "cp_ring_impl": "torch_alltoall"}
# The file's key where it is not the field's name.
TIME_KEYS = {"adapter_bytes": "adapter_elementwise_bytes"}


def test_every_overhead_field_round_trips_and_defaults_to_calculon(repo_root):
    import dataclasses

    from autopar.io.specs import MemoryOverhead, TimeOverhead
    for cls, values in ((MemoryOverhead, MEMORY_VALUES), (TimeOverhead, TIME_VALUES)):
        fields = dataclasses.fields(cls)
        assert {f.name for f in fields} == set(values), cls.__name__
        for f in fields:
            assert values[f.name] != f.default, (cls.__name__, f.name)
    a100 = load_system(repo_root / "systems" / "a100_80g.json")
    full = dataclasses.replace(a100, memory_overhead=MemoryOverhead(**MEMORY_VALUES),
                               time_overhead=TimeOverhead(**TIME_VALUES))
    assert load_system(json.loads(json.dumps(system_to_json(full)))) == dataclasses.replace(
        full, source="dict")
    # every default is written as nothing beyond the records' leading keys
    plain = dataclasses.replace(a100, memory_overhead=MemoryOverhead(),
                                time_overhead=TimeOverhead())
    d = system_to_json(plain)
    assert set(d["memory_overhead"]) == {"reserved_GiB", "fraction", "logits_fp32_copies",
                                         "logits_gathered"}
    assert set(d["time_overhead"]) == {"pipeline_fraction"}
    assert load_system(d) == dataclasses.replace(plain, source="dict")


@pytest.mark.parametrize("record, key", [("memory_overhead", k) for k in MEMORY_VALUES] + [
    ("time_overhead", TIME_KEYS.get(k, k)) for k in TIME_VALUES])
def test_every_overhead_field_refuses_a_bad_value_by_name(repo_root, record, key):
    d = json.loads((repo_root / "systems" / "a100_80g.json").read_text())
    d[record] = {key: "x"}
    with pytest.raises(SpecError) as e:
        load_system(d, source="s.json")
    assert e.value.field == f"{record}.{key}" and e.value.source == "s.json"


@pytest.mark.parametrize("record, key, bad, said", [
    ("memory_overhead", "fraction", 1.0, "[0, 1)"),
    ("memory_overhead", "master_weight_bytes", 4.5, "[0, 4]"),
    ("memory_overhead", "optimizer_step_bytes", -1, "[0, 64] bytes a parameter"),
    ("memory_overhead", "adapter_saved_bytes", 65, "[0, 64] bytes an element"),
    ("time_overhead", "pipeline_fraction", 1, "[0, 1)"),
    ("time_overhead", "moe_block_s", 1.0, "[0, 1) seconds"),
    ("time_overhead", "moe_host_op_s", 0.01, "[0, 0.01) seconds"),
    ("time_overhead", "launch_s", 0.01, "[0, 0.01) seconds"),
    ("time_overhead", "attention_speed", 2.5, "[0, 2]"),
    ("time_overhead", "attention_backward_speed", -0.1, "[0, 2]"),
    ("time_overhead", "grad_accum_bytes", 100, "[0, 64] bytes")])
def test_overhead_ranges_are_refused_with_the_range(repo_root, record, key, bad, said):
    """Checker.within: the value out of its range (an open end excluded)
    names the field, the range and the value given."""
    d = json.loads((repo_root / "systems" / "a100_80g.json").read_text())
    d[record] = {key: bad}
    with pytest.raises(SpecError) as e:
        load_system(d)
    assert e.value.field == f"{record}.{key}"
    assert e.value.message == f"must be in {said}, got {json.dumps(bad)}"
