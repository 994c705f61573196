"""What a trial costs: the ray backend against a no-op, and the optuna backend.

    python benchmarks/tune_overhead.py [--ray-trials 300] [--optuna-trials 1000]
                                       [--cpus 2] [--skip-ray] [--skip-optuna]

Ray part: a local Ray with ``--cpus`` CPUs; the same Tune settings
(``autopar.search.backends.ray_tune.run``: reused actors, no per-trial loggers, no
checkpoints, one report per trial, random search) run once with a no-op
trainable (reports a constant, does nothing else) and once with the real one
(decode a layout, evaluate it with the model).  Prints trials/s of each and
their ratio (goal: ours >= 0.8x the no-op and >= 30 trials/s on two cores);
the two alternate ``--repeats`` times and the best of each is compared, since
a shared machine's load moves both.

Optuna part: trials/s of the in-process backend for each sampler at
``--optuna-trials`` trials (in-memory storage, one trial at a time).

The case is GPT-3 175B on 1024 A100 80G, batch 1536, float16, space
``calculon``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = os.path.join(ROOT, "models", "gpt3-175B.json")
SYSTEM = os.path.join(ROOT, "systems", "a100_80g.json")
CASE = dict(num_procs=1024, max_batch_size=1536, datatype="float16")


def noop_trainable(config: dict, problem=None) -> None:
    """Reports a constant once: what Tune costs with no work in the trial."""
    from ray import tune
    tune.report({"sample_rate": 1.0, "state": "COMPLETE", "feasible": True, "reason": "",
                 "done": True})


def bench_ray(trials: int, cpus: int, repeats: int) -> None:
    import ray
    from autopar.search.backends import ray_tune as tune_ray
    from autopar.search.cluster import start_local_ray
    from autopar.search.samplers import parse
    from autopar.search.space import load_space
    from autopar.search.trainable import make_problem
    from autopar.search.tune import make_case

    case = make_case(MODEL, SYSTEM, **CASE)
    prob = make_problem(case, load_space("calculon"), "index")
    start_local_ray(num_cpus=cpus)
    try:
        # warm-up: worker processes started, imports done
        tune_ray.run(prob, parse("random"), 2 * cpus, 0, None, None, None, trainable=noop_trainable)
        tune_ray.run(prob, parse("random"), 2 * cpus, 0, None, None, None)
        rates: dict[str, list[float]] = {"no-op": [], "autopar": []}
        for rep in range(repeats):          # alternated, so both see the same machine load
            for name, trainable in (("no-op", noop_trainable),
                                    ("autopar", tune_ray.layout_trainable)):
                t0 = time.perf_counter()
                rows = tune_ray.run(prob, parse("random"), trials, rep, None, None, None,
                                    trainable=trainable)
                dt = time.perf_counter() - t0
                assert len(rows) == trials
                rates[name].append(trials / dt)
                print(f"ray {name:8s} random  {trials:5d} trials  {dt:7.2f} s  "
                      f"{trials / dt:7.1f} trials/s  (load {os.getloadavg()[0]:.1f})", flush=True)
        best = {k: max(v) for k, v in rates.items()}
        print(f"ray best of {repeats}: no-op {best['no-op']:.1f}, autopar {best['autopar']:.1f} "
              f"trials/s; autopar / no-op = {best['autopar'] / best['no-op']:.2f}x", flush=True)
    finally:
        ray.shutdown()


def bench_optuna(trials: int, samplers) -> None:
    from autopar.search.tune import tune_arguments as tune
    for s in samplers:
        t0 = time.perf_counter()
        table = tune(MODEL, SYSTEM, sampler=s, trials=trials, seed=0, backend="optuna",
                     progress=False, **CASE)
        dt = time.perf_counter() - t0
        pruned = (table["state"] == "PRUNED").mean()
        print(f"optuna {s:7s} {len(table):5d} trials  {dt:7.2f} s  {len(table) / dt:8.1f} trials/s"
              f"  pruned {pruned:.0%}  best {table['sample_rate'].max():.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ray-trials", type=int, default=300)
    ap.add_argument("--optuna-trials", type=int, default=1000)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="ray runs of each trainable")
    ap.add_argument("--samplers", default="random,tpe,cmaes,grid,bohb")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--skip-optuna", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_ray:
        bench_ray(args.ray_trials, args.cpus, args.repeats)
    if not args.skip_optuna:
        bench_optuna(args.optuna_trials, args.samplers.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
