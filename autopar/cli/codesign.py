"""``autopar codesign STUDY.yaml`` and ``autopar cliffs``.

``codesign`` runs a co-design study (``kind: codesign``: hardware dimensions,
cost, objectives, outer and inner search; see ``docs/codesign.md``) or a
sweep file (``kind: cliffs``).  ``cliffs`` sweeps the processor count for
one model and system, from a ``kind: cliffs`` file or from arguments::

    autopar cliffs --model models/megatron-1T.json --system systems/a100_80g.json \\
        --max-batch-size 3072 --datatype float16 --space small \\
        --num-procs 1024:4096:8 --parallel ray --output-dir results/cliffs
"""
from __future__ import annotations

import argparse

PARALLEL = ("serial", "processes", "ray")
OUTER = ("exhaustive", "nsga2", "tpe", "motpe", "random")


def _common(p) -> None:
    p.add_argument("--output-dir", default=None, help="folder for the results "
                   "(default: the file's output_dir; none: print only)")
    p.add_argument("--parallel", choices=PARALLEL, default=None,
                   help="evaluate systems serially, in a process pool or as Ray tasks")
    p.add_argument("--workers", type=int, default=None, help="processes or Ray CPUs (default 2)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (implies --parallel ray; default: a local Ray)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "codesign", help="co-design: search systems (and processor counts) at their best layouts",
        description="Run a co-design study file (kind: codesign) or a processor-count sweep "
                    "file (kind: cliffs).  Exit 0, or 1 when no system runs any layout.")
    p.add_argument("study", help="study file (YAML)")
    p.add_argument("--sampler", choices=OUTER, default=None, help="outer search (overrides the file)")
    p.add_argument("--trials", type=int, default=None, help="outer trials (overrides the file)")
    p.add_argument("--seed", type=int, default=None, help="outer sampler seed (overrides the file)")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="each system's best layout must leave this much of tier 1 free "
                        "(overrides the file's inner.memory_headroom; default: each system's "
                        "memory_headroom, else 0); rows also give the rate without it")
    p.add_argument("--inner", default=None,
                   help="inner layout search: exhaustive or a sampler of autopar tune, e.g. "
                        "skeleton-tpe (overrides the file)")
    p.add_argument("--inner-trials", type=int, default=None,
                   help="trials of an inner sampler (overrides the file)")
    _common(p)
    # issue 25: inference from the command line
    from autopar.cli import inference_option
    inference_option(p)
    p.set_defaults(func=run)

    c = subparsers.add_parser(
        "cliffs", help="best sample rate per processor at every processor count of a range",
        description="Sweep the processor count: the best layout at each count, as Ray tasks "
                    "or serially; plots samples/s per processor against the count.")
    c.add_argument("sweep", nargs="?", help="sweep file (kind: cliffs); or give the case below")
    c.add_argument("--model", help="model file")
    c.add_argument("--system", help="system file")
    c.add_argument("--max-batch-size", type=int)
    c.add_argument("--datatype")
    c.add_argument("--space", default=None, help="layout space (default: calculon)")
    c.add_argument("--batch-policy", choices=("max", "fixed"), default=None)
    c.add_argument("--num-procs", help="MIN:MAX:STEP (e.g. 1024:4096:8) or a comma list")
    c.add_argument("--inner", default=None,
                   help="how each count's best layout is found: exhaustive (default) or a "
                        "sampler of autopar tune")
    c.add_argument("--inner-trials", type=int, default=None, help="trials of an inner sampler")
    _common(c)
    inference_option(c)
    c.set_defaults(func=run_cliffs)


def _check_counts(args) -> None:
    from autopar.cli import positive, seed_arg
    positive("--workers", getattr(args, "workers", None))
    positive("--trials", getattr(args, "trials", None))
    seed_arg("--seed", getattr(args, "seed", None))


def run(args) -> int:
    from autopar.io.experiment import read
    _check_counts(args)
    data = read(args.study)
    if data.get("kind") == "cliffs":
        for opt in ("sampler", "trials", "seed", "inner", "inner_trials"):
            if getattr(args, opt, None) is not None:
                from autopar.io.specs import SpecError
                raise SpecError("command line", f"--{opt.replace('_', '-')}",
                                "not for a sweep (kind: cliffs)")
        return _sweep(args.study, args, inference_overrides(data, args))
    return _study(args.study, args, {**study_overrides(data, args),
                                     **(inference_overrides(data, args) or {})} or None)


def inference_overrides(data, args) -> dict | None:
    """``--inference``: the file's case with ``training: false``."""
    from collections.abc import Mapping
    from autopar.cli import training_of
    if training_of(args) or not isinstance(data.get("case"), Mapping):
        return None
    return {"case": {**data["case"], "training": False}}


def study_overrides(data, args) -> dict:
    """The command line's --sampler/--trials/--seed/--inner/--inner-trials as
    overrides of a co-design file.  A study with a ``compare:`` section runs
    its comparison, so there they replace the compared samplers (one), the
    trials per run (budgets above it dropped) and the seeds (one)."""
    from collections.abc import Mapping
    out: dict = {}
    search = {k: getattr(args, k) for k in ("sampler", "trials", "seed")
              if getattr(args, k, None) is not None}
    cmp = data.get("compare")
    if search and isinstance(cmp, Mapping):
        cmp = dict(cmp)
        if "sampler" in search:
            cmp["samplers"] = [search["sampler"]]
        if "trials" in search:
            cmp["trials"] = search["trials"]
            if isinstance(cmp.get("budgets"), list):
                fit = [b for b in cmp["budgets"] if not isinstance(b, int) or b <= search["trials"]]
                cmp["budgets"] = fit or [search["trials"]]
        if "seed" in search:
            cmp["seeds"] = [search["seed"]]
        out["compare"] = cmp
    elif search:
        out["search"] = search
    inner = getattr(args, "inner", None)
    inner_trials = getattr(args, "inner_trials", None)
    if inner is not None or inner_trials is not None:
        had = data.get("inner")
        had = {"search": had} if isinstance(had, str) else dict(had or {})
        if inner is not None:
            had["search"] = inner
            if inner == "exhaustive":
                had.pop("trials", None)
        if inner_trials is not None:
            had["trials"] = inner_trials
        out["inner"] = had
    return out


def _study(path, args, overrides) -> int:
    from autopar.studies.codesign import codesign
    from autopar.studies.codesign_report import summary_text
    res = codesign(path, args.output_dir, address=args.address, parallel=args.parallel,
                   workers=args.workers, progress=args.progress, overrides=overrides,
                   memory_headroom=getattr(args, "memory_headroom", None))
    print(summary_text(res))
    if res.outputs:
        print(f"wrote {len(res.outputs)} files to {res.outputs[-1].parent}")
    return 0 if len(res.front) else 1


def _sweep(spec, args, overrides=None) -> int:
    from autopar.studies.cliffs import summary_text, sweep
    res = sweep(spec, args.output_dir, address=args.address, parallel=args.parallel,
                workers=args.workers, progress=args.progress, overrides=overrides)
    print(summary_text(res))
    if res.outputs:
        print(f"wrote {len(res.outputs)} files to {res.outputs[0].parent}")
    return 0 if (res.table["state"] == "COMPLETE").any() else 1


def run_cliffs(args) -> int:
    from autopar.io.specs import SpecError
    _check_counts(args)
    direct = ("model", "system", "max_batch_size", "datatype", "num_procs")
    given = [k for k in direct + ("space", "batch_policy", "inner", "inner_trials")
             if getattr(args, k) is not None]
    if args.sweep:
        if given:
            raise SpecError("command line", f"--{given[0].replace('_', '-')}",
                            "give a sweep file or the case arguments, not both")
        from autopar.io.experiment import read
        return _sweep(args.sweep, args, inference_overrides(read(args.sweep), args))
    for k in direct:
        if getattr(args, k) is None:
            raise SpecError("command line", f"--{k.replace('_', '-')}",
                            "missing (or give a sweep file)")
    counts = args.num_procs
    if "," in counts:
        try:
            counts = [int(x) for x in counts.split(",") if x.strip()]
        except ValueError:
            raise SpecError("command line", "--num-procs",
                            f"expected integers separated by commas, got {args.num_procs!r}") from None
    case = {"model": args.model, "system": args.system, "max_batch_size": args.max_batch_size,
            "datatype": args.datatype}
    if args.space:
        case["space"] = args.space
    if args.batch_policy:
        case["batch_policy"] = args.batch_policy
    from autopar.cli import training_of
    if not training_of(args):
        case["training"] = False
    spec = {"kind": "cliffs", "name": "cliffs", "case": case, "num_procs": counts}
    if args.inner or args.inner_trials:
        spec["inner"] = {"search": args.inner or "tpe",
                         **({"trials": args.inner_trials} if args.inner_trials else {})}
    from autopar.studies.cliffs import load_sweep
    sw = load_sweep(spec, source="command line")
    return _sweep(sw, args)


def run_experiment(path, output_dir=None, address=None, progress=None, data=None) -> int:
    """``autopar run`` of a ``kind: codesign`` or ``kind: cliffs`` file."""
    ns = argparse.Namespace(study=str(path), output_dir=output_dir, address=address,
                            parallel=None, workers=None, progress=progress,
                            sampler=None, trials=None, seed=None, inner=None,
                            inner_trials=None)
    kind = (data or {}).get("kind")
    if kind == "cliffs":
        return _sweep(str(path), ns)
    return _study(str(path), ns, None)
