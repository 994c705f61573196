"""Layouts per second of the analytical model on one process.

GPT-3 175B on 4,096 A100 (the project's models/ and systems/ files): N random
layouts (tensor/pipeline/data parallelism, micro-batch, interleaving, recompute,
TP communication and overlap, networks, sharding, offloads) drawn with a fixed
seed, evaluated by ``autopar.evaluate`` (a DataFrame with every statistic) and
by ``autopar.model.evaluate_columns`` (raw columns).  Prints layouts/s and the
peak resident memory.

    python benchmarks/model_throughput.py [--layouts 1000000]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np
import pandas as pd

import autopar
from autopar import model as M
from autopar.io.layouts import CHOICES, FIELDS

ROOT = Path(__file__).resolve().parent.parent


def divisors(x: int) -> np.ndarray:
    return np.array([d for d in range(1, x + 1) if x % d == 0])


def random_layouts(model, num_procs: int, batch: int, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tps = [t for t in divisors(num_procs) if model.hidden % t == 0 and model.attn_heads % t == 0]
    tp = rng.choice(tps, n)
    pp = np.empty(n, dtype=np.int64)
    for t in tps:
        m = tp == t
        cands = [p for p in divisors(min(num_procs // t, model.num_blocks))
                 if (num_procs // t) % p == 0 and model.num_blocks % p == 0]
        pp[m] = rng.choice(cands, m.sum())
    dp = num_procs // (tp * pp)
    gb = np.maximum(batch // dp, 1) * dp
    local = gb // dp
    mbs = np.ones(n, dtype=np.int64)
    for lb in np.unique(local):
        m = local == lb
        mbs[m] = rng.choice(divisors(int(lb)), m.sum())
    ppint = np.ones(n, dtype=np.int64)
    for p in np.unique(pp):
        m = pp == p
        if p > 1:
            ppint[m] = rng.choice(divisors(model.num_blocks // int(p)), m.sum())
    coin = lambda: rng.random(n) < 0.5
    code = lambda f: rng.integers(0, len(CHOICES[f]), n).astype(np.int8)
    cols = dict(
        num_procs=np.full(n, num_procs), tensor_par=tp, pipeline_par=pp, data_par=dp,
        tensor_par_net=rng.integers(0, 2, n) * (tp > 1),
        pipeline_par_net=rng.integers(0, 2, n) * (pp > 1),
        data_par_net=rng.integers(0, 2, n) * (dp > 1),
        batch_size=gb, microbatch_size=mbs,
        datatype=np.full(n, CHOICES["datatype"].index("float16"), np.int8),
        fused_activation=coin(), attention_type=np.zeros(n, np.int8),
        activation_recompute=code("activation_recompute"), pipeline_interleaving=ppint,
        optimizer_sharding=coin() & (dp > 1), tensor_par_comm_type=code("tensor_par_comm_type"),
        tensor_par_overlap=(code("tensor_par_overlap") * (tp > 1)).astype(np.int8),
        seq_par_ag_redo=np.zeros(n, bool), data_par_overlap=coin() & (dp > 1),
        weight_offload=coin(), activations_offload=coin(), optimizer_offload=coin(),
        training=np.ones(n, bool))
    rs = cols["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("rs_ag")
    cols["seq_par_ag_redo"] = coin() & rs & (cols["activation_recompute"] != 0)
    return {f: cols[f] for f in FIELDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = autopar.load_model(ROOT / "models" / "gpt3-175B.json")
    system = autopar.load_system(ROOT / "systems" / "a100_80g.json")
    cols = random_layouts(model, 4096, 1536, args.layouts)
    frame = pd.DataFrame({f: cols[f] for f in FIELDS})
    for f in CHOICES:
        if f not in frame:
            continue
        frame[f] = pd.Categorical.from_codes(frame[f], CHOICES[f]).astype(str)

    best_cols = best_eval = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = M.evaluate_columns(model, system, cols)
        best_cols = min(best_cols, time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        table = autopar.evaluate(model, system, frame)
        best_eval = min(best_eval, time.perf_counter() - t0)
    n = args.layouts
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"case: GPT-3 175B on 4096 A100, {n:,} random layouts, "
          f"{int(table.feasible.sum()):,} feasible")
    print(f"evaluate_columns: {best_cols:.2f} s  {n / best_cols:,.0f} layouts/s")
    print(f"autopar.evaluate (DataFrame, {len(table.columns)} columns): "
          f"{best_eval:.2f} s  {n / best_eval:,.0f} layouts/s")
    print(f"peak memory (max RSS): {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
