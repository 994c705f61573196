"""``autopar estimate``: the real command line, good and bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DELETE, set_key

MODEL = "models/gpt3-175B.json"
SYSTEM = "systems/a100_80g.json"


def _strict_json(text: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=reject)


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return path


# ------------------------------------------------------------ bad input: exit 2


# (id, which file, mutation or raw text or None for a missing file, field named)
BAD = [
    ("missing-file", "model", None, "(file)"),
    ("invalid-json", "system", '{\n  "matrix": {\n    "float16": [1,,2]\n}', "(file)"),
    ("not-an-object", "execution", "[1, 2, 3]", "(root)"),
    ("nan", "system", '{"matrix": NaN}', "(file)"),
    ("duplicate-key", "execution", '{"num_procs": 8, "num_procs": 16}', "(file)"),
    ("model-missing-key", "model", set_key("num_blocks", DELETE), "num_blocks"),
    ("model-unknown-key", "model", set_key("layers", 96), "layers"),
    ("model-wrong-type", "model", set_key("hidden", "12288"), "hidden"),
    ("model-bool-int", "model", set_key("attn_heads", True), "attn_heads"),
    ("model-float-int", "model", set_key("hidden", 12288.0), "hidden"),
    ("model-zero", "model", set_key("seq_size", 0), "seq_size"),
    ("model-negative", "model", set_key("feedforward", -1), "feedforward"),
    ("model-block", "model", set_key("block", "bert"), "block"),
    ("model-kv-heads", "model", set_key("kv_heads", 5), "kv_heads"),
    ("model-vocab", "model", set_key("vocab_size", -5), "vocab_size"),
    ("system-unknown-key", "system", set_key("gpus", 8), "gpus"),
    ("efficiency-above-1", "system",
     set_key("matrix", "float16", "gflops_efficiency", 2, 1, 1.2),
     "matrix.float16.gflops_efficiency[2]"),
    ("efficiency-zero", "system", set_key("mem1", "MB_efficiency", 1, 1, 0.0),
     "mem1.MB_efficiency[1]"),
    ("table-not-descending", "system",
     set_key("vector", "bfloat16", "gflops_efficiency", 2, 0, 1),
     "vector.bfloat16.gflops_efficiency[2]"),
    ("table-not-ending-at-0", "system", set_key("mem2", "MB_efficiency", 3, 0, 1),
     "mem2.MB_efficiency[3]"),
    ("processing-mode", "system", set_key("processing_mode", "overlap"), "processing_mode"),
    ("processor-usage", "system", set_key("networks", 1, "processor_usage", 1),
     "networks[1].processor_usage"),
    ("ops-missing", "system", set_key("networks", 1, "ops", "all_reduce", DELETE),
     "networks[1].ops.all_reduce"),
    ("ops-unknown", "system", set_key("networks", 0, "ops", "broadcast", [1, 0]),
     "networks[0].ops.broadcast"),
    ("p2p-offset", "system", set_key("networks", 0, "ops", "p2p", [1.0, 0]),
     "networks[0].ops.p2p"),
    ("collective-offset-null", "system",
     set_key("networks", 0, "ops", "all_gather", [1.0, None]), "networks[0].ops.all_gather"),
    ("unknown-datatype-in-system", "system",
     set_key("vector", "int4", {"tflops": 1, "gflops_efficiency": [[0, 1]]}), "vector.int4"),
    ("network-size-zero", "system", set_key("networks", 1, "size", 0), "networks[1].size"),
    ("negative-bandwidth", "system", set_key("networks", 0, "bandwidth", -1),
     "networks[0].bandwidth"),
    ("memory-zero", "system", set_key("mem1", "GiB", 0), "mem1.GiB"),
    ("second-tier-negative", "system", set_key("mem2", "GiB", -1), "mem2.GiB"),
    ("network-missing-key", "system", set_key("networks", 0, "latency", DELETE),
     "networks[0].latency"),
    ("execution-missing-key", "execution", set_key("data_par", DELETE), "data_par"),
    ("execution-unknown-key", "execution", set_key("sequence_parallel", True),
     "sequence_parallel"),
    ("execution-enum", "execution", set_key("tensor_par_comm_type", "allreduce"),
     "tensor_par_comm_type"),
    ("execution-unknown-datatype", "execution", set_key("datatype", "int8"), "datatype"),
    ("execution-datatype-not-on-system", "execution", set_key("datatype", "float8"),
     "datatype"),
    ("execution-tier-out-of-range", "execution", set_key("data_par_net", 2), "data_par_net"),
    ("execution-bool-int", "execution", set_key("pipeline_par", False), "pipeline_par"),
    ("execution-float-int", "execution", set_key("batch_size", 1536.0), "batch_size"),
    ("execution-zero", "execution", set_key("num_procs", 0), "num_procs"),
    ("execution-string-bool", "execution", set_key("training", "true"), "training"),
    # Megatron-FSDP's outer optimizer sharding without hybrid weight sharding
    ("execution-outer-sharding-alone", "execution",
     set_key("optimizer_outer_sharding", True), "optimizer_outer_sharding"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_line(cli, repo_root, tmp_path, execution, case):
    _, which, change, field = case
    files = {"model": repo_root / MODEL, "system": repo_root / SYSTEM,
             "execution": _write(tmp_path / "execution.json", execution)}
    target = tmp_path / f"bad_{which}.json"
    if change is None:
        pass                                   # target never written: missing
    elif isinstance(change, str):
        _write(target, change)
    else:
        _write(target, change(json.loads(files[which].read_text())))
    files[which] = target

    r = cli("estimate", files["model"], files["system"], files["execution"])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"autopar: error: {target}: {field}: "), lines[0]


def test_usage_errors_exit_2(cli):
    for args in ((), ("estimate",), ("no-such-command",)):
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        # one line naming the command and where its usage is (issue 27)
        assert len(r.stderr.strip().splitlines()) == 1 and "autopar" in r.stderr
        assert "-h)" in r.stderr


# ------------------------------------------------------------ real estimates

def test_feasible_estimate_on_project_files(cli, repo_root, tmp_path, execution):
    exe = _write(tmp_path / "e.json", execution)
    r = cli("estimate", MODEL, SYSTEM, exe)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for words in ("TP 8 (net 0) x PP 8 (net 1) x DP 16 (net 1)", "memory per processor",
                  "requirement", "capacity", "pipeline bubble", "DP comm exposed",
                  "sample rate", "compute"):
        assert words in out, words

    j = cli("estimate", MODEL, SYSTEM, exe, "--json")
    assert j.returncode == 0
    stats = _strict_json(j.stdout)
    assert stats["feasible"] is True and stats["reason"] == ""
    assert stats["proc_mem_tier1_cap_req"] <= 80 * 1024 ** 3
    assert stats["sample_rate"] == pytest.approx(1536 / stats["total_time"])
    parts = ("fw_time", "bw_time", "recompute_time", "recomm_exposed_time",
             "optim_step_time", "bubble_time", "tp_comm_exposed_time",
             "pp_comm_exposed_time", "dp_comm_exposed_time",
             "fw_offload_exposed_time", "bw_offload_exposed_time")
    assert sum(stats[p] for p in parts) == pytest.approx(stats["total_time"], rel=1e-9)
    # The sample rate in the report is the one in the JSON.
    assert f"sample rate  {stats['sample_rate']:.4g} samples/s" in out


def test_infeasible_and_invalid_exit_1(cli, tmp_path, execution):
    # GPT-3 175B unsharded on 8 GPUs without offload cannot fit in 80 GiB.
    tight = dict(execution, num_procs=8, tensor_par=8, pipeline_par=1, data_par=1,
                 pipeline_interleaving=1, batch_size=8, optimizer_sharding=False,
                 data_par_overlap=False)
    r = cli("estimate", MODEL, SYSTEM, _write(tmp_path / "tight.json", tight))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.strip().splitlines() == [r.stdout.strip()]
    assert r.stdout.startswith("infeasible: ") and "mem tier1" in r.stdout
    j = cli("estimate", MODEL, SYSTEM, _write(tmp_path / "tight.json", tight), "--json")
    assert j.returncode == 1
    stats = _strict_json(j.stdout)
    assert stats["feasible"] is False and stats["reason"] == r.stdout.strip()

    wrong = dict(execution, num_procs=1000)        # well formed, breaks TP*PP*DP
    r = cli("estimate", MODEL, SYSTEM, _write(tmp_path / "wrong.json", wrong))
    assert r.returncode == 1 and r.stdout.startswith("invalid: ")
    assert "num_procs" in r.stdout and "Traceback" not in r.stderr


def _golden_case(golden, want_ok):
    for g in golden:
        if (g["ok"] == want_ok and g["system"] == "a100_80g"
                and g["execution"]["tensor_par"] > 1
                and (want_ok or "Mem tier1" in g["error"])):
            return g
    pytest.fail("no such golden case")


@pytest.mark.parametrize("want_ok", [True, False], ids=["feasible", "infeasible"])
def test_estimate_matches_reference(cli, golden, reference, tmp_path, want_ok):
    g = _golden_case(golden, want_ok)
    system = reference / "calculon-golden" / "systems" / f"{g['system']}.json"
    model = _write(tmp_path / "model.json", g["application"])
    exe = _write(tmp_path / "exe.json", g["execution"])
    r = cli("estimate", model, system, exe, "--json")
    assert r.returncode == (0 if want_ok else 1), r.stderr
    stats = _strict_json(r.stdout)
    assert stats["feasible"] is want_ok
    if want_ok:
        for k in ("sample_rate", "total_time", "proc_mem_tier1_cap_req",
                  "proc_mem_tier2_cap_req", "bubble_time"):
            assert stats[k] == pytest.approx(g["stats"][k], rel=1e-6), k
    else:
        assert stats["reason"] == "infeasible: mem tier1 capacity exceeded"
        assert stats["sample_rate"] in (None, 0)


def test_console_script(repo_root, tmp_path, execution):
    script = Path(sys.executable).parent / ("autopar.exe" if os.name == "nt" else "autopar")
    if not script.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    exe = _write(tmp_path / "e.json", execution)
    r = subprocess.run([str(script), "estimate", MODEL, SYSTEM, str(exe), "--json"],
                       cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _strict_json(r.stdout)["feasible"] is True


def test_memory_rows_add_up_to_the_tier_requirements(golden):
    """The report's per-kind tier split matches the reference's requirements."""
    from autopar.cli.estimate import memory_rows
    from autopar.io.specs import load_model

    seen = set()
    for g in golden:
        if not g["ok"]:
            continue
        e = g["execution"]
        seen.add((e["weight_offload"], e["activations_offload"], e["optimizer_offload"],
                  e["activation_recompute"] == "full"))
        rows = memory_rows(load_model(g["application"]), e, g["stats"])
        assert sum(r[1] for r in rows) == pytest.approx(g["stats"]["proc_mem_tier1_cap_req"])
        assert sum(r[2] for r in rows) == pytest.approx(
            g["stats"]["proc_mem_tier2_cap_req"], abs=1.0)
    assert len(seen) >= 8      # offload flags and full recompute in many combinations
