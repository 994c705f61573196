"""Which encoding of the space serves the samplers best: index, named or flat.

    python benchmarks/tune_encodings.py [--trials 200] [--seeds 3]
        [--samplers tpe,cmaes,random,bohb] [--space calculon] [--optimum RATE]

For each sampler x encoding x seed, one in-process search (optuna backend) of
GPT-3 175B on 1024 A100 80G, batch 1536, float16.  Prints, per sampler and
encoding (medians over seeds): the fraction of trials pruned, of those the
fraction pruned as *invalid* (sampled outside the space's rules), and the best
sample rate found after 25/50/100/.../trials trials as a fraction of the
exhaustive optimum (``--optimum``, else found by ``autopar.search.exhaustive``).
The encoding with the fewest pruned trials and the best early results is
``autopar.search.encodings.DEFAULT_ENCODING``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = os.path.join(ROOT, "models", "gpt3-175B.json")
SYSTEM = os.path.join(ROOT, "systems", "a100_80g.json")
CASE = dict(num_procs=1024, max_batch_size=1536, datatype="float16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--samplers", default="tpe,cmaes,random,bohb")
    ap.add_argument("--encodings", default="index,named,flat")
    ap.add_argument("--space", default="calculon")
    ap.add_argument("--optimum", type=float, default=None,
                    help="the exhaustive optimum (samples/s); found if not given")
    args = ap.parse_args(argv)

    import numpy as np
    from autopar.search.tune import tune_arguments as tune

    opt = args.optimum
    if opt is None:
        from autopar.search.exhaustive import exhaustive
        t0 = time.perf_counter()
        _, summ = exhaustive(MODEL, SYSTEM, space=args.space, progress=False, **CASE)
        opt = float(summ["best"]["sample_rate"])
        print(f"optimum {opt:.4f} samples/s ({summ['layouts']:,} layouts, "
              f"{summ['feasible']:,} feasible, {time.perf_counter() - t0:.0f} s)", flush=True)
    budgets = [b for b in (25, 50, 100, 200, 500, 1000) if b <= args.trials]
    if args.trials not in budgets:
        budgets.append(args.trials)
    head = "".join(f"  @{b:<5d}" for b in budgets)
    print(f"{'sampler':8s}{'encoding':9s}{'pruned':>8s}{'invalid':>9s}{head}   s/run", flush=True)
    for s in args.samplers.split(","):
        for enc in args.encodings.split(","):
            if s == "bohb" and enc == "named":
                continue
            pruned, invalid, at, secs = [], [], {b: [] for b in budgets}, []
            for seed in range(args.seeds):
                t0 = time.perf_counter()
                t = tune(MODEL, SYSTEM, sampler=s, trials=args.trials, seed=seed,
                         encoding=enc, space=args.space, progress=False, **CASE)
                secs.append(time.perf_counter() - t0)
                p = t["state"] == "PRUNED"
                pruned.append(p.mean())
                invalid.append(t["reason"].str.startswith("invalid:").mean())
                rate = np.fmax.accumulate(np.nan_to_num(t["sample_rate"].to_numpy(), nan=0.0))
                for b in budgets:
                    at[b].append(rate[b - 1] / opt)
            med = statistics.median
            cells = "".join(f"  {med(at[b]):6.3f}" for b in budgets)
            print(f"{s:8s}{enc:9s}{med(pruned):8.2f}{med(invalid):9.2f}{cells}   {med(secs):5.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
