"""Skeleton search against the exhaustive search, wall time, in process.

For one case (default: compare-quick's, GPT-3 13B on 64 A100, batch 512,
float16, the ``small`` space: 6,240 layouts, 48 skeletons), runs
``autopar.exhaustive`` and ``autopar.tune(sampler="skeleton-tpe",
trials=T)`` alternately ``--repeat`` times (a warm-up pair first) and prints
each one's median and range of wall time and CPU time, the best sample rate
each found, and the skeleton runs' trials.  With ``T`` at least the space's
skeletons the budget covers every skeleton: the search evaluates them all in
one pass (see ``autopar.search.skeleton``); below it, the sampler proposes.

    python benchmarks/skeleton_vs_exhaustive.py [--trials 100] [--repeat 9]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> None:
    import autopar
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/gpt3-13B.json"))
    p.add_argument("--system", default=str(ROOT / "systems/a100_80g.json"))
    p.add_argument("--num-procs", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--datatype", default="float16")
    p.add_argument("--space", default="small")
    p.add_argument("--sampler", default="skeleton-tpe")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--repeat", type=int, default=9)
    a = p.parse_args(argv)
    case = (a.model, a.system, a.num_procs, a.batch, a.datatype)
    times = {"exhaustive": [], a.sampler: []}
    best = {}
    trials = []
    for k in range(a.repeat + 1):
        (table, summary), wall, cpu = timed(lambda: autopar.exhaustive(
            *case, space=a.space, progress=False))
        if k:
            times["exhaustive"].append((wall, cpu))
        best["exhaustive"] = summary["best"]["sample_rate"] if summary["best"] else None
        got, wall, cpu = timed(lambda: autopar.tune(*case, space=a.space, sampler=a.sampler,
                                                    trials=a.trials, seed=k, progress=False))
        if k:
            times[a.sampler].append((wall, cpu))
            trials.append(len(got))
        done = got[got["state"] == "COMPLETE"]
        best[a.sampler] = float(done["sample_rate"].max()) if len(done) else None
    print(f"case: {Path(a.model).stem} on {a.num_procs} x {Path(a.system).stem}, batch {a.batch}, "
          f"{a.datatype}, space {a.space}; {a.repeat} runs each, alternating")
    for name, ts in times.items():
        w = [t[0] for t in ts]
        c = [t[1] for t in ts]
        extra = (f", trials {min(trials)}-{max(trials)} (asked {a.trials})"
                 if name != "exhaustive" else "")
        print(f"{name:>14}: wall median {statistics.median(w):.4f} s "
              f"[{min(w):.4f}-{max(w):.4f}], CPU median {statistics.median(c):.4f} s; "
              f"best {best[name]:.6g} samples/s{extra}")


if __name__ == "__main__":
    main()
