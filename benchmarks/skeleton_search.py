"""Skeleton search on Ray: one loopback node against two.

Starts a Ray head node (``ray start --head --block``, ``--num-cpus 1``, token
authentication on) and runs a skeleton search on it (``autopar.tune(...,
sampler="skeleton-random", backend="ray", address=...)``: each Ray trial is
one skeleton whose completions the model evaluates in one call, and holds one
CPU, Tune's default for a function trainable); then adds a second node
(another raylet, ``--num-cpus 1``) and runs the same search again, so two
nodes have twice the trial slots of one.  Prints, for each, the trials
(distinct skeletons) per second, the layouts evaluated per second, and which
nodes ran how many trials (the ``node_id`` of every trial); the ratio of the
two; and for reference the same search in process (``backend="optuna"``,
skeletons batched 8 per model call).  Every process it starts is killed at
the end by its process group.

A trial has to be worth shipping to a node: Tune's own work per trial on the
driver (starting it, collecting its result) is a good fraction of a second
here, so the default skeleton is (tensor_par, pipeline_par), whose
completions are tens of thousands of layouts each, rather than the space's
default three parameters.

    python benchmarks/skeleton_search.py [--trials 24] [--skeleton tensor_par,pipeline_par]
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")   # before Ray is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster_exhaustive import _free_port, _start, _wait  # noqa: E402


def main() -> int:
    from autopar.search.space import load_space
    from autopar.search.tune import tune_arguments as tune
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/gpt3-175B.json"))
    p.add_argument("--system", default=str(ROOT / "systems/a100_80g.json"))
    p.add_argument("--num-procs", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1536)
    p.add_argument("--datatype", default="float16")
    p.add_argument("--space", default="calculon")
    p.add_argument("--skeleton", default="tensor_par,pipeline_par",
                   help="the skeleton parameters (comma-separated; '' for the space's own)")
    p.add_argument("--sampler", default="skeleton-random")
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    space = load_space(a.space).to_dict()
    if a.skeleton:
        space["skeleton"] = [s.strip() for s in a.skeleton.split(",") if s.strip()]

    def search(address, backend="ray"):
        t0 = time.perf_counter()
        table = tune(a.model, a.system, a.num_procs, a.batch, a.datatype, sampler=a.sampler,
                     trials=a.trials, space=space, seed=a.seed, backend=backend,
                     address=address, progress=False)
        dt = time.perf_counter() - t0
        nodes = collections.Counter(str(n)[:8] for n in table["node_id"] if n)
        return dt, len(table), int(table["layouts"].sum()), nodes, float(table["sample_rate"].max())

    tmp = Path(tempfile.mkdtemp(prefix="apb-"))
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    try:
        with open(tmp / "nodes.log", "w") as log:
            procs.append(_start(["--head", "--port", address.rpartition(":")[2],
                                 "--include-dashboard", "false"], str(tmp / "ray"), log))
            _wait(address, 1)
            search(address)                     # warm-up: runtime_env upload, workers
            one = search(address)
            procs.append(_start(["--address", address], str(tmp / "ray"), log))
            _wait(address, 2)
            search(address)
            two = search(address)
        local = search(None, backend="optuna")
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{a.sampler}, {a.trials} skeletons of ({', '.join(space.get('skeleton') or ['the space default'])}), "
          f"{Path(a.model).name} on {a.num_procs} x {Path(a.system).stem}, batch {a.batch}, "
          f"space {a.space}; each node --num-cpus 1, each trial 1 CPU")
    for label, (dt, n, lay, nodes, best) in (("1 node", one), ("2 nodes", two),
                                             ("in process", local)):
        ran = ", ".join(f"{k}: {v}" for k, v in sorted(nodes.items())) or "-"
        print(f"{label:11s} {dt:7.2f} s  {n / dt:6.2f} trials/s  {lay / dt:12,.0f} layouts/s  "
              f"({n} trials, {lay:,} layouts, best {best:.4g}; trials per node {ran})")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores "
          "at the end (other jobs on the machine count too)")
    print(f"ratio       {one[0] / two[0]:.2f}x trials/s (2 nodes / 1 node); "
          f"nodes that ran trials: {len(one[3])} with one node, {len(two[3])} with two")
    return 0


if __name__ == "__main__":
    sys.exit(main())
