"""autopar on a real two-node Ray cluster (two raylets on this machine).

The cluster is started once for the module with ``ray start --head --block``
and ``ray start --address ... --block``, each in its own process group, with
one CPU, a small object store and a private ``--temp-dir``.  Token
authentication stays on (Ray 2.60's default for ``ray start``): the nodes and
the drivers share the session token (``RAY_AUTH_TOKEN``, conftest.py).  Trials sleep
``AUTOPAR_TRIAL_DELAY`` seconds (set in the raylets' environment, inherited by
their workers) so that a node or a driver can be killed mid-run.  Every
process started here is killed at the end by its process group and, for
anything left, by the pids whose command line names the cluster's temp dir.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.cluster
ray = pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
MODEL, SYSTEM = "models/gpt3-175B.json", "systems/a100_80g.json"
CASE = ["--num-procs", "1024", "--max-batch-size", "1536", "--datatype", "float16"]
NODE_ENV = {
    "RAY_AUTH_MODE": "token",      # nodes and drivers: the session's token (conftest.py)
    "AUTOPAR_TRIAL_DELAY": "0.25",
    # a killed node is declared dead within about two seconds
    "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass


def _pids_naming(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


class Cluster:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="apc-"))
        self.temp_dir = str(self.tmp / "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **NODE_ENV}
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.head = self._start(["--head", "--port", str(self.port),
                                 "--include-dashboard", "false"], "head")
        self._wait_nodes(1)
        self.worker = self.add_worker()

    def _start(self, args, tag) -> subprocess.Popen:
        log = open(self.tmp / f"{tag}.log", "w")
        p = subprocess.Popen(
            [RAY, "start", "--block", "--num-cpus", "1", "--object-store-memory", "200000000",
             "--temp-dir", self.temp_dir, "--disable-usage-stats", *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def add_worker(self) -> subprocess.Popen:
        n = len(self.alive_nodes())
        w = self._start(["--address", self.address], f"worker{len(self.procs)}")
        self._wait_nodes(n + 1)
        return w

    def alive_nodes(self) -> list[str]:
        code = ("import ray,logging; ray.init(address=%r, logging_level=logging.ERROR); "
                "print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive']))" % self.address)
        r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True,
                           text=True, timeout=60)
        self.last_error = r.stderr[-2000:]
        return r.stdout.split() if r.returncode == 0 else []

    def _wait_nodes(self, n: int, timeout: float = 40) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if len(self.alive_nodes()) >= n:
                return
            time.sleep(1)
        raise RuntimeError(f"cluster did not reach {n} nodes; logs in {self.tmp}; "
                           f"last error: {self.last_error}")

    def close(self) -> None:
        for p in reversed(self.procs):
            _kill_group(p)
        for pid in _pids_naming(self.temp_dir):     # anything that left the groups
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.close()


def _driver(cluster, *args, env=None) -> subprocess.Popen:
    """``autopar tune`` as its own process (group), joined to the cluster."""
    e = {**cluster.env, "TUNE_GLOBAL_CHECKPOINT_S": "0.5", **(env or {})}
    p = subprocess.Popen([sys.executable, "-m", "autopar.cli", "tune", *map(str, args)],
                         cwd=REPO_ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    cluster.procs.append(p)
    return p


def _finish(p: subprocess.Popen, timeout: float = 150) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        raise
    return p.returncode, out, err


def _trial_dirs(path: Path) -> int:
    return len(list(path.glob("t*"))) if path.is_dir() else 0


def _nodes_done(path: Path) -> set:
    """Nodes of the finished trials of a kept experiment (their result.json)."""
    import json
    nodes = set()
    for f in path.glob("t*/result.json"):
        try:
            for line in f.read_text().splitlines():
                nodes.add(json.loads(line)["node_id"])
        except (OSError, ValueError, KeyError):
            pass                          # being written
    return nodes


def _check_trials(csv: Path, n: int) -> pd.DataFrame:
    table = pd.read_csv(csv)
    assert len(table) == n
    assert sorted(table["trial"]) == list(range(n))
    assert set(table["state"]) <= {"COMPLETE", "PRUNED"}
    assert (table["node_id"].str.len() > 0).all()
    return table


def test_tune_by_address_runs_trials_on_both_nodes(cluster, tmp_path):
    out = tmp_path / "trials.csv"
    # By placement, not timing: each node has one CPU and each trial holds one,
    # so two trials at once sit on different nodes; on a multi-node cluster
    # actors are not reused, so a trial placed on the second node (whose first
    # actor is slow to start: it unpacks the shipped package) waits for it
    # there instead of being handed to the warm first node.
    p = _driver(cluster, MODEL, SYSTEM, *CASE, "--backend", "ray", "--sampler", "random",
                "--trials", 12, "--seed", 0, "--concurrency", 2, "--address",
                cluster.address, "--trials-out", out)
    rc, stdout, err = _finish(p)
    assert rc == 0, err
    table = _check_trials(out, 12)
    nodes = set(cluster.alive_nodes())
    assert set(table["node_id"]) == nodes and len(nodes) == 2


def test_tune_honours_ray_address(cluster, tmp_path):
    out = tmp_path / "trials.csv"
    p = _driver(cluster, MODEL, SYSTEM, *CASE, "--backend", "ray", "--sampler", "random",
                "--trials", 4, "--seed", 1, "--trials-out", out,
                env={"RAY_ADDRESS": cluster.address})
    rc, _, err = _finish(p)
    assert rc in (0, 1), err         # 1: none of the 4 layouts was feasible
    table = _check_trials(out, 4)
    assert set(table["node_id"]) <= set(cluster.alive_nodes())


def test_driver_without_the_token_gets_one_line(cluster, tmp_path):
    p = _driver(cluster, MODEL, SYSTEM, *CASE, "--backend", "ray", "--sampler", "random",
                "--trials", 2, "--address", cluster.address,
                env={"RAY_AUTH_MODE": "disabled"})
    rc, _, err = _finish(p)
    assert rc == 2 and "Traceback" not in err
    # one line: Ray's own connection retries (gcs_client) are not shown
    assert len(err.strip().splitlines()) == 1, err
    assert "requires token authentication" in err.strip().splitlines()[-1]


def test_exhaustive_by_address_matches_local(cluster, tmp_path):
    import json
    args = [MODEL, SYSTEM, *CASE, "--space", "search_spaces/small.yaml", "--top-n", 3,
            "--chunk-size", 64]
    e = {**cluster.env}
    local = subprocess.run([sys.executable, "-m", "autopar.cli", "exhaustive", *map(str, args),
                            "--summary", tmp_path / "local.json", "--top", tmp_path / "lt.json"],
                           cwd=REPO_ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr
    remote = subprocess.run([sys.executable, "-m", "autopar.cli", "exhaustive",
                             *map(str, args), "--address", cluster.address,
                             "--summary", tmp_path / "remote.json", "--top", tmp_path / "rt.json"],
                            cwd=REPO_ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert remote.returncode == 0, remote.stderr
    s_local = json.loads((tmp_path / "local.json").read_text())
    s_remote = json.loads((tmp_path / "remote.json").read_text())
    assert s_local["runner"] == "local"
    assert s_remote["runner"] == f"ray:{cluster.address}" and s_remote["chunks"] > 2
    assert s_remote["best"] == s_local["best"] and s_local["best"] is not None
    for k in ("layouts", "feasible", "infeasible"):
        assert s_remote[k] == s_local[k]
    assert (tmp_path / "rt.json").read_text() == (tmp_path / "lt.json").read_text()


@pytest.mark.parametrize("cut_state", [False, True], ids=["whole", "state-cut-off"])
def test_killed_driver_resumes_to_exactly_the_trials_asked(cluster, tmp_path, cut_state):
    trials, storage = 30, tmp_path / "results"
    exp = storage / "killed"
    spawned = time.time()
    p = _driver(cluster, MODEL, SYSTEM, *CASE, "--backend", "ray", "--sampler", "random",
                "--trials", trials, "--seed", 2, "--concurrency", 2, "--address",
                cluster.address, "--storage-path", storage, "--name", "killed")
    end = time.monotonic() + 120
    while _trial_dirs(exp) < 8 and p.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    assert p.poll() is None, "the driver ended before it could be killed"
    time.sleep(1.0)                       # let an experiment checkpoint land
    killed = time.time()
    _kill_group(p)
    assert p.returncode == -signal.SIGKILL
    assert _trial_dirs(exp) < trials      # killed mid-run
    if cut_state:       # as if killed while Tune copied its state to storage
        (state,) = exp.glob("experiment_state-*.json")
        state.write_text("")
    out = tmp_path / "trials.csv"
    rc, stdout, err = _finish(_driver(cluster, "--resume", exp, "--address", cluster.address,
                                      "--trials-out", out))
    assert rc == 0, err
    table = _check_trials(out, trials)
    assert _trial_dirs(exp) >= trials
    assert "resumed" in stdout
    # trials finished before the kill were kept, not run again
    assert (table["elapsed_s"] < killed - spawned).sum() >= 4


def test_resume_rejects_a_folder_without_experiment(cluster, tmp_path):
    rc, _, err = _finish(_driver(cluster, "--resume", tmp_path))
    assert rc == 2 and "holds no Ray Tune experiment" in err and "Traceback" not in err


def test_run_experiment_file_by_address(cluster, tmp_path):
    (tmp_path / "tune.yaml").write_text(
        "kind: tune\n"
        "case:\n"
        f"  model: {REPO_ROOT / MODEL}\n"
        f"  system: {REPO_ROOT / SYSTEM}\n"
        "  num_procs: 1024\n  max_batch_size: 1536\n  datatype: float16\n"
        "sampler: random\ntrials: 6\nseed: 4\nbackend: ray\nconcurrency: 2\n"
        "storage_path: results\ntrials_out: out/trials.csv\n")
    p = subprocess.Popen([sys.executable, "-m", "autopar.cli", "run", tmp_path / "tune.yaml",
                          "--address", cluster.address], cwd=tmp_path, env=cluster.env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    cluster.procs.append(p)
    rc, _, err = _finish(p)
    assert rc in (0, 1), err
    _check_trials(tmp_path / "out" / "trials.csv", 6)
    kept = list((tmp_path / "results").iterdir())       # the experiment, kept
    assert len(kept) == 1 and kept[0].name.startswith("autopar-tune-random-")
    assert f"--resume {kept[0]}" in err


def test_lost_worker_node_loses_no_trial(cluster, tmp_path):
    trials, storage = 24, tmp_path / "results"
    exp = storage / "lost"
    out = tmp_path / "trials.csv"
    p = _driver(cluster, MODEL, SYSTEM, *CASE, "--backend", "ray", "--sampler", "random",
                "--trials", trials, "--seed", 3, "--concurrency", 2, "--address",
                cluster.address, "--storage-path", storage, "--name", "lost",
                "--max-failures", 3, "--trials-out", out)
    # kill the worker node once it has finished a trial (each kept trial's
    # result.json names its node), not after some time
    end = time.monotonic() + 120
    while len(_nodes_done(exp)) < 2 and p.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    assert p.poll() is None, "the driver ended before the node could be killed"
    _kill_group(cluster.worker)           # the worker raylet and its workers, at once
    rc, _, err = _finish(p)
    assert rc == 0, err
    table = _check_trials(out, trials)
    alive = cluster.alive_nodes()
    assert len(alive) == 1
    # trials ran on both nodes, the lost one included; every trial ended
    assert table["node_id"].nunique() == 2 and set(alive) < set(table["node_id"])


def _both_nodes(ctx, item):
    """A task that marks its node in a shared folder and waits (at most a
    minute) until a task has started on two nodes: with one CPU per node,
    two such tasks at once can only run on different nodes."""
    node = ray.get_runtime_context().get_node_id()
    folder = Path(ctx["folder"])
    (folder / f"{node}-{item}").touch()
    end = time.monotonic() + 60
    while len({p.name.split("-")[0] for p in folder.iterdir()}) < 2 \
            and time.monotonic() < end:
        time.sleep(0.05)
    return node


def test_runner_works_on_both_nodes_with_one_payload(cluster, tmp_path):
    from ray import cloudpickle
    from autopar.search.exhaustive import exhaustive
    from autopar.search.runner import TASKS_PER_SLOT, Runner
    cloudpickle.register_pickle_by_value(sys.modules[__name__])    # tests/ is no package
    if len(cluster.alive_nodes()) < 2:       # a test before killed the worker node
        cluster.worker = cluster.add_worker()
    shared = {"folder": str(tmp_path)}
    case = (REPO_ROOT / MODEL, REPO_ROOT / SYSTEM, 1024, 1536, "float16")
    kw = dict(space=REPO_ROOT / "search_spaces/small.yaml", top_n=3, chunk_size=64,
              progress=False)
    with Runner("ray", address=cluster.address) as r:
        nodes = r.map(_both_nodes, range(4), shared=shared, per_task=1)
        assert r.slots == 2 and r.stats.puts == 1
        assert len(set(nodes)) == 2 and set(nodes) == set(cluster.alive_nodes())
        assert set(r.stats.by_node()) == set(nodes)
        # the search on the same session: sent once more (its own payload), in
        # few tasks, each folding several chunks
        before = len(r.stats.tasks)
        table, s = exhaustive(*case, runner=r, **kw)
        tasks = r.stats.tasks[before:]
        assert r.stats.puts == 2 and 1 < len(tasks) <= 2 * TASKS_PER_SLOT < s["chunks"]
    assert not ray.is_initialized()
    local, s0 = exhaustive(*case, **kw)
    assert table.equals(local) and s["best"] == s0["best"] is not None
    for k in ("layouts", "feasible", "infeasible"):
        assert s[k] == s0[k]
