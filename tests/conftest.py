"""Shared fixtures: the repo root, the shared reference data, the CLI runner."""
from __future__ import annotations

import gzip
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

# Ray 2.60 keeps token authentication on for the clusters it starts, and a
# process keeps the auth mode of its first Ray for good.  So the whole test
# session (this process, the clusters the tests start with `ray start`, the
# drivers they run) uses one token, set before anything imports Ray.  A
# user's own ~/.ray/auth_token is neither read nor written.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.pop("RAY_ADDRESS", None)
# `autopar tune --backend ray` keeps its experiments here unless told otherwise.
os.environ.setdefault("AUTOPAR_RESULTS", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"autopar-test-results-{os.getpid()}"))

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE = REPO_ROOT.parent / "shared" / "reference"


def one_proc_execution(**kw) -> dict:
    """A training execution on one processor (batch 4, micro-batch 2, float16,
    nothing fused, shared, overlapped or offloaded), with ``kw`` replacing fields."""
    e = {"num_procs": 1, "tensor_par": 1, "pipeline_par": 1, "data_par": 1,
         "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
         "batch_size": 4, "microbatch_size": 2, "datatype": "float16",
         "fused_activation": False, "attention_type": "multihead",
         "activation_recompute": "none", "pipeline_interleaving": 1,
         "optimizer_sharding": False, "tensor_par_comm_type": "ar",
         "tensor_par_overlap": "none", "seq_par_ag_redo": False,
         "data_par_overlap": False, "weight_offload": False,
         "activations_offload": False, "optimizer_offload": False, "training": True}
    e.update(kw)
    return e


def bf16_one_proc_execution(**kw) -> dict:
    """``one_proc_execution`` of one bfloat16 sample (batch 1, micro-batch 1,
    the activation fused): the small blocks of the MoE, hybrid, Gated DeltaNet
    and MTP tests, with ``kw`` replacing fields."""
    return one_proc_execution(**{"batch_size": 1, "microbatch_size": 1, "datatype": "bfloat16",
                                 "fused_activation": True, **kw})


def launch_round_trip(fmt: str, model, ex: dict):
    """Write ``ex`` for ``model`` in launch format ``fmt`` (which must refuse
    neither) and read the text back: (text, the format's parsed launch)."""
    from autopar.io.launch import get
    F = get(fmt)
    assert F.refuse_model(model) is None, F.refuse_model(model)
    assert F.refuse_layout(model, ex) is None, F.refuse_layout(model, ex)
    text = F.write(model, ex)
    return text, F.read(text, f"run.{fmt}")


class DeepSpeedMPU:
    """A stand-in for the model-parallel unit DeepSpeed's own
    ``DeepSpeedConfig(..., mpu=...)`` asks for its data-parallel size when no
    process group runs: the sizes of the exported execution ``ex``."""

    def __init__(self, ex: dict):
        self.ex = ex

    def get_data_parallel_world_size(self):
        return self.ex["data_par"]

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return self.ex["tensor_par"] * self.ex["pipeline_par"]


DELETE = object()


def set_key(*path_and_value):
    """A mutation of a loaded JSON document: set the key at ``path`` (keys and
    indices) to ``value``, or remove it when ``value`` is ``DELETE``."""
    *path, value = path_and_value

    def apply(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        if value is DELETE:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
        return d
    return apply


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def reference() -> Path:
    """``../shared/reference`` (test oracles); skips where it is absent."""
    if not REFERENCE.is_dir():
        pytest.skip(f"reference data not found at {REFERENCE} "
                    "(only present in the development checkout)")
    return REFERENCE


@pytest.fixture(scope="session")
def golden(reference) -> list[dict]:
    """The reference model's cases, one dict per line of golden.jsonl.gz."""
    path = reference / "calculon-golden" / "golden.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def run_autopar(*args, cwd: Path | None = None, timeout: float = 300
                ) -> subprocess.CompletedProcess:
    """Run the real command line (``python -m autopar.cli ARGS``)."""
    return subprocess.run([sys.executable, "-m", "autopar.cli", *map(str, args)],
                          cwd=cwd or REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def cli():
    """``cli(*args)`` runs the autopar command and returns the CompletedProcess."""
    return run_autopar


@pytest.fixture(scope="session")
def h100():
    """The H100 SXM 80GB system file (NVLink 8)."""
    from autopar.io.specs import load_system
    return load_system(REPO_ROOT / "systems" / "h100_80g_nvl8.json")


@pytest.fixture(scope="session")
def roomy(h100):
    """The H100 system with memory too large to fill (to read requirements)."""
    from autopar.studies.validate import unbounded
    return unbounded(h100)


@pytest.fixture
def execution() -> dict:
    """A well-formed training execution of GPT-3 175B on 1024 processors."""
    return {
        "num_procs": 1024, "tensor_par": 8, "pipeline_par": 8, "data_par": 16,
        "tensor_par_net": 0, "pipeline_par_net": 1, "data_par_net": 1,
        "batch_size": 1536, "microbatch_size": 1, "datatype": "float16",
        "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": "attn_only", "pipeline_interleaving": 2,
        "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False,
        "data_par_overlap": True, "weight_offload": False,
        "activations_offload": False, "optimizer_offload": False,
        "training": True,
    }
