"""``autopar calibrate SWEEP.csv --system BASE.json --output CALIBRATED.json``
(or ``--framework BASE_FRAMEWORK --output FRAMEWORK.json [--system-output SYSTEM.json]``).

With ``--framework`` the output is a framework file: the framework's free
constants fitted (pipeline fraction, memory headroom, and the loss buffers
where the framework lists them as free), the counted ones kept; the system's
efficiency constants are fitted too and written to ``--system-output`` when
given (hardware only).

Fits the system's free constants (16-bit matrix efficiency level, network
efficiencies, pipeline overhead, memory overheads, and from the out-of-memory
labels the uncertainty band of a predicted peak and the default memory
headroom) to a measured sweep (``autopar validate``'s column format), prints
validate's four figures in sample and under leave-one-sweep-out and
leave-one-model-out cross-validation, for the base and the calibrated
constants, and writes the calibrated system.  It refuses (exit 1, nothing
written) when a cross-validation scores the calibrated constants worse than
the base system.
"""
from __future__ import annotations

from autopar.cli import framework_option

FIGURES = ("oom_agreement", "spearman", "median_abs_error", "top1_regret")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit a system's free constants to a measured sweep",
        description="Fit efficiency levels, network efficiencies, pipeline and memory "
                    "overheads and the memory headroom of a system to a measured sweep "
                    "(the CSV format of 'autopar validate'); cross-validate by leaving "
                    "one sweep and one model out; write the calibrated system unless "
                    "its cross-validated scores are worse than the base's.")
    p.add_argument("sweep", help="measured sweep CSV")
    p.add_argument("--system", required=True, help="base system JSON")
    p.add_argument("--output", required=True,
                   help="calibrated system JSON to write (with --framework: the calibrated "
                        "framework JSON)")
    p.add_argument("--system-output", default=None,
                   help="with --framework: also write the calibrated system (hardware only)")
    p.add_argument("--models", default=None,
                   help="folder of model JSON files the sweep names (default: the shipped "
                        "models/)")
    p.add_argument("--name", default=None,
                   help="name of the calibrated system (default: the output file's stem)")
    p.add_argument("--fit-overheads", action="store_true",
                   help="fit memory_overhead reserved_GiB and fraction too (default: kept "
                        "from the base system as counted, only the loss buffers fitted)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    framework_option(p)
    p.set_defaults(func=run)


def _line(label: str, report) -> str:
    r = report.loc["overall"]
    return (f"  {label:<34} oom_agreement {r.oom_agreement:.3f}  spearman {r.spearman:.3f}  "
            f"median_abs_error {r.median_abs_error:.3f}  top1_regret {r.top1_regret:.3f}")


def run(args) -> int:
    import sys
    import time
    from pathlib import Path

    from autopar.cli import output_path
    from autopar.io.specs import load_system, system_to_json
    from autopar.io.writers import write_json
    from autopar.studies.calibrate import apply, calibrate, describe

    from autopar.io.shipped import resolve, shipped_dir

    out = output_path("--output", args.output)
    sys_out = output_path("--system-output", args.system_output)
    from autopar.io.frameworks import framework_to_json, load_framework, with_framework
    framework = load_framework(args.framework) if args.framework else None
    if sys_out is not None and framework is None:
        from autopar.io.specs import SpecError
        raise SpecError("command line", "--system-output", "needs --framework")
    base = with_framework(load_system(args.system), framework)
    copies = framework is None or "memory_overhead.logits_fp32_copies" in framework.free
    models_dir = resolve(args.models) if args.models else shipped_dir("models")
    t0 = time.time()
    cal = calibrate(args.sweep, base, models_dir=models_dir, progress=not args.no_progress,
                    overheads=args.fit_overheads, copies=copies,
                    defaults=framework.defaults if framework is not None else None)
    k = cal.constants
    print(f"calibrated on {Path(args.sweep).name} in {time.time() - t0:.0f} s "
          f"({cal.evaluations} model evaluations of the sweep)")
    print(f"  matrix efficiency x{k.matrix_scale:.3f}; network efficiency "
          + ", ".join(f"{e:.3f}" for e in k.net_efficiency)
          + f"; pipeline_fraction {k.pipeline_fraction:.3f}")
    how = "fitted" if args.fit_overheads else "counted, from the base"
    print(f"  memory_overhead: reserved {k.reserved_GiB:g} GiB, fraction {k.fraction:.2f} "
          f"({how}); logits_fp32_copies {k.logits_fp32_copies:g} "
          f"({'fitted' if copies else 'counted, the framework'}); "
          f"peak band +-{k.band_GiB:.2f} GiB; default headroom {k.headroom_GiB:g} GiB")
    print("in sample:")
    print(_line("base", cal.base_in_sample))
    print(_line("calibrated", cal.in_sample))
    for kind, rep in cal.cv.items():
        print(f"{kind} (each left-out part predicted by constants fitted without it):")
        print(_line("base", cal.base_cv[kind]))
        print(_line("calibrated", rep))
        for left, kk in cal.folds[kind].items():
            print(f"    left out {left}:")
            print("  " + _line("predicted", cal.fold_reports[kind][left]))
            print(f"      fitted without it: matrix x{kk.matrix_scale:.3f}, networks "
                  + ", ".join(f"{e:.3f}" for e in kk.net_efficiency)
                  + f", pipeline {kk.pipeline_fraction:.3f}, reserved {kk.reserved_GiB:g} GiB,"
                  f" fraction {kk.fraction:.2f}, logits copies {kk.logits_fp32_copies:g},"
                  f" band +-{kk.band_GiB:.2f} GiB")
    worse = cal.worse()
    if worse:
        print(f"autopar calibrate: refusing to write {out}: {', '.join(worse)} scores the "
              f"calibrated constants worse than the base system", file=sys.stderr)
        return 1
    name = args.name or out.stem
    system = apply(base, k, name=name, description=describe(k, base, Path(args.sweep).name,
                                                       args.fit_overheads))
    if framework is None:
        write_json(system_to_json(system), out)
        print(f"wrote {out}")
        return 0
    import dataclasses

    from autopar.studies.calibrate import framework_result
    write_json(framework_to_json(framework_result(framework, system, name,
                                                  Path(args.sweep).name)), out)
    print(f"wrote {out}")
    if sys_out is not None:
        hardware = dataclasses.replace(system, name=sys_out.stem, memory_overhead=None,
                                       time_overhead=None, memory_headroom=None)
        write_json(system_to_json(hardware), sys_out)
        print(f"wrote {sys_out}")
    return 0
