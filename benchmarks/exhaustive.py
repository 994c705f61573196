"""Exhaustive search end to end: GPT-3 175B on 4,096 A100, batch 1,536.

Prints the number of layouts, seconds, layouts per second, peak memory (RSS)
and the best sample rate.  The target is <= 30 s on two cores (ideally
<= 10 s) and well under 2 GiB.  Uses the reference system file when
../shared/reference is present (the figures are then comparable with
Calculon's), else the project's systems/a100_80g.json.

    python benchmarks/exhaustive.py [--space calculon] [--chunk-size N]
        [--num-procs 4096] [--batch 1536] [--model models/gpt3-175B.json]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.search.exhaustive import DEFAULT_CHUNK, exhaustive  # noqa: E402


def main() -> int:
    ref_system = ROOT.parent / "shared/reference/calculon-golden/systems/a100_80g.json"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/gpt3-175B.json"))
    p.add_argument("--system", default=str(ref_system if ref_system.exists()
                                           else ROOT / "systems/a100_80g.json"))
    p.add_argument("--num-procs", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1536)
    p.add_argument("--datatype", default="float16")
    p.add_argument("--space", default="calculon")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    p.add_argument("--address", default=None, help="Ray address (default: local)")
    a = p.parse_args()
    t0 = time.perf_counter()
    _, s = exhaustive(a.model, a.system, a.num_procs, a.batch, a.datatype,
                      space=a.space, chunk_size=a.chunk_size, address=a.address,
                      progress=False)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    best = s["best"]["sample_rate"] if s["best"] else float("nan")
    print(f"system       {a.system}")
    print(f"space        {s['space']}  chunk {a.chunk_size}")
    print(f"layouts      {s['layouts']:,}")
    print(f"feasible     {s['feasible']:,}")
    print(f"seconds      {secs:.2f}")
    print(f"layouts/s    {s['layouts'] / secs:,.0f}")
    print(f"peak RSS     {peak:,.0f} MiB")
    print(f"best rate    {best:.4f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
