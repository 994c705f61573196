"""`autopar calibrate` end to end on the shipped LLaMA 13B/65B sweeps.

Prints the wall and CPU seconds, the number of distinct model evaluations of
the sweep, the fitted constants, and the in-sample and cross-validated
figures (leave-one-sweep-out, leave-one-model-out, and each left-out model).
The target is a few minutes on two cores.  Needs ../shared/reference.

    python benchmarks/calibrate.py [--system systems/a100_80g_dgx_hdr200_base.json]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.io.specs import load_system  # noqa: E402
from autopar.studies.calibrate import calibrate  # noqa: E402
from llama_sweep import SWEEP, arguments  # noqa: E402


def line(label, rep) -> str:
    r = rep.loc["overall"]
    return (f"{label:<40} OOM {r.oom_agreement:.3f}  Spearman {r.spearman:.3f}  "
            f"median |err| {100 * r.median_abs_error:.1f}%  regret {r.top1_regret:.3f}")


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    if args is None:
        return 1
    sweep = SWEEP
    t0, c0 = time.perf_counter(), time.process_time()
    from autopar.io.frameworks import load_framework, with_framework
    fw = load_framework(args.framework)
    cal = calibrate(sweep, with_framework(load_system(args.system), fw), models_dir=ROOT / "models",
                    progress=False, copies="memory_overhead.logits_fp32_copies" in fw.free)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    k = cal.constants
    print(f"calibrate: {wall:.0f} s wall, {cpu:.0f} s CPU, {cal.evaluations} model evaluations")
    print(f"constants: matrix x{k.matrix_scale:.3f}, networks {k.net_efficiency}, pipeline "
          f"{k.pipeline_fraction}, reserved {k.reserved_GiB} GiB, fraction {k.fraction}, "
          f"logits copies {k.logits_fp32_copies}, band +-{k.band_GiB:.2f} GiB, "
          f"headroom {k.headroom_GiB} GiB")
    print(line("base, in sample", cal.base_in_sample))
    print(line("calibrated, in sample", cal.in_sample))
    for kind, rep in cal.cv.items():
        print(line(kind, rep))
        for left, r in cal.fold_reports[kind].items():
            if kind == "leave-one-model-out":
                print(line(f"  fitted without {left}, scored on it", r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
