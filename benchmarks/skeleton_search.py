"""Skeleton search on Ray: one loopback node against two.

Starts a Ray head node (``ray start --head --block``, 1 CPU, token
authentication on) and runs a skeleton search (``autopar.tune(...,
sampler="skeleton-random", backend="ray", address=...)``: each Ray trial is
one skeleton whose completions the model evaluates at once); then adds a
second node (1 CPU) and runs the same search again.  Prints, for each, the
trials (distinct skeletons) per second and the layouts evaluated per second,
and the ratio; and for reference the same search in process
(``backend="optuna"``, skeletons batched 8 per model call).  Every process
it starts is killed at the end by its process group.

    python benchmarks/skeleton_search.py [--trials 60] [--sampler skeleton-random]
"""
from __future__ import annotations

import argparse
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
    from autopar.search.tune import tune
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/gpt3-175B.json"))
    p.add_argument("--system", default=str(ROOT / "systems/a100_80g.json"))
    p.add_argument("--num-procs", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1536)
    p.add_argument("--datatype", default="float16")
    p.add_argument("--space", default="calculon")
    p.add_argument("--sampler", default="skeleton-random")
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    def search(address, backend="ray"):
        t0 = time.perf_counter()
        table = tune(a.model, a.system, a.num_procs, a.batch, a.datatype, sampler=a.sampler,
                     trials=a.trials, space=a.space, seed=a.seed, backend=backend,
                     address=address, progress=False)
        dt = time.perf_counter() - t0
        return dt, len(table), int(table["layouts"].sum()), table["node_id"].nunique(), \
            float(table["sample_rate"].max())

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
    print(f"{a.sampler}, {a.trials} skeletons, GPT-3 175B-style case "
          f"({Path(a.model).name}, {a.num_procs} procs, batch {a.batch}, space {a.space})")
    for label, (dt, n, lay, nodes, best) in (("1 node", one), ("2 nodes", two),
                                             ("in process", local)):
        print(f"{label:11s} {dt:7.2f} s  {n / dt:6.2f} trials/s  {lay / dt:12,.0f} layouts/s  "
              f"({n} trials, {lay:,} layouts, {nodes} node(s) ran trials, best {best:.4g})")
    print(f"ratio       {one[0] / two[0]:.2f}x trials/s (2 nodes / 1 node)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
