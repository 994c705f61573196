"""Co-design: which way of running outer trials is fastest on this machine.

``--study small`` (default) enumerates a reduced version of
``experiments/codesign-small.yaml`` (one processor count, fewer HBM sizes:
270 systems, ~70 ms each); ``--study 1t`` runs ``--trials`` NSGA-II trials of
``experiments/codesign-megatron-1t.yaml`` (~0.3 s each, 4 asked at once).
Each runs serially, in a pool of processes and as Ray tasks (a local Ray,
loopback only); the script checks that all give the same table and prints
the seconds of each (Ray's and the pool's start-up included, as a user sees
it).

    .venv/bin/python benchmarks/codesign_parallel.py [--study small|1t] [--workers 2]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--procs", type=int, default=256)
    ap.add_argument("--modes", default="serial,processes,ray")
    ap.add_argument("--study", choices=("small", "1t"), default="small")
    ap.add_argument("--trials", type=int, default=32)
    args = ap.parse_args()
    from autopar.studies.codesign import codesign
    from autopar.studies.compare import read_experiment
    if args.study == "small":
        data = read_experiment(ROOT / "experiments" / "codesign-small.yaml")
        data.pop("compare")
        data["hardware"]["num_procs"] = [args.procs]
        data["hardware"]["mem1.GiB"]["values"] = [24, 80]
        data["search"] = {"sampler": "exhaustive"}
    else:
        data = read_experiment(ROOT / "experiments" / "codesign-megatron-1t.yaml")
        data["search"].update({"trials": args.trials, "batch": 4})
    data.pop("output_dir")
    import os
    os.chdir(ROOT / "experiments")          # the file's relative paths
    tables = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        res = codesign(data, parallel=mode, workers=args.workers, progress=False,
                       overrides=None) if mode else None
        secs = time.perf_counter() - t0
        tables[mode] = res.table
        per = res.table["eval_s"].mean() * 1e3
        print(f"{mode:>9}: {len(res.table)} systems in {secs:6.2f} s "
              f"({secs / len(res.table) * 1e3:.1f} ms/system wall; {per:.1f} ms/system "
              f"inside a worker); front {len(res.front)} points")
    first = next(iter(tables.values()))
    cols = [c for c in first.columns if c not in ("eval_s", "elapsed_s")]
    for mode, t in tables.items():
        same = t[cols].equals(first[cols])
        print(f"{mode:>9}: same table as {next(iter(tables))}: {same}")


if __name__ == "__main__":
    main()
