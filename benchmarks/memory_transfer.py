"""Does the memory fit on one LLaMA model carry over to the other?

For counted reserves and fragmentations around the shipped ones, fits the
loss buffers (``autopar.studies.calibrate.fit_memory``, the calibrate code
path) on 65B and scores out-of-memory agreement on 13B, the other way round,
and in sample; then the same with the loss buffers divided over the tensor
ranks (Megatron's vocab-parallel cross entropy) instead of gathered, and with
the reserve and fragmentation fitted as well (the previous calibration).
Memory only: no step times are predicted.  Needs ../shared/reference.

    python benchmarks/memory_transfer.py [--system systems/a100_80g_dgx_hdr200_base.json]
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.studies import calibrate as C  # noqa: E402
from llama_sweep import SWEEP, load  # noqa: E402


def agreement(sweep, k, rows) -> float:
    fits = sweep.structural & (sweep.need_gib(k) <= sweep.capacity)
    return float((fits == sweep.ran)[rows].mean())


def transfer(sweep, k) -> tuple:
    """(65B -> 13B, 13B -> 65B, in sample) OOM agreement and fitted copies."""
    model = sweep.frame["model"].to_numpy()
    out = []
    for train, test in (("llama-65B", "llama-13B"), ("llama-13B", "llama-65B"), (None, None)):
        fit_rows = np.ones(len(model), bool) if train is None else model == train
        score_rows = np.ones(len(model), bool) if test is None else model == test
        f = C.fit_memory(sweep, fit_rows, k)
        out.append((agreement(sweep, f, score_rows), f.logits_fp32_copies))
    return out


def fmt(res) -> str:
    return "  ".join(f"{a:.3f} ({c:g})" for a, c in res)


def main() -> int:
    got = load(__doc__.splitlines()[0])
    if got is None:
        return 1
    system, sweep = got
    k0 = C.base_constants(system)
    print("OOM agreement (fitted loss copies): 65B -> 13B, 13B -> 65B, in sample")
    print(f"shipped base: reserved {k0.reserved_GiB:g} GiB, fraction {k0.fraction:g}: "
          f"{fmt(transfer(sweep, k0))}")
    print("counted reserve / fragmentation around it:")
    for frac in (0.05, 0.10, 0.15, 0.20):
        for res in (2.0, 3.0, 4.0, 5.0):
            k = dataclasses.replace(k0, reserved_GiB=res, fraction=frac)
            print(f"  reserved {res:3g} GiB, fraction {frac:.2f}: {fmt(transfer(sweep, k))}")
    model = sweep.frame["model"].to_numpy()
    print("reserve, fragmentation and copies all fitted (the previous calibration):")
    for train, test in (("llama-65B", "llama-13B"), ("llama-13B", "llama-65B")):
        f = C.fit_memory(sweep, model == train, k0, overheads=True)
        print(f"  fitted on {train}: reserved {f.reserved_GiB:g}, fraction {f.fraction:.2f}, "
              f"copies {f.logits_fp32_copies:g}; on {test}: "
              f"{agreement(sweep, f, model == test):.3f}")
    om = system.memory_overhead
    split = dataclasses.replace(system, memory_overhead=dataclasses.replace(
        om, logits_gathered=False))
    sweep_split = C.Sweep(SWEEP, split, ROOT / "models")
    print("loss buffers divided over the tensor ranks (Megatron's vocab-parallel loss): "
          f"{fmt(transfer(sweep_split, k0))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
