"""``autopar tune MODEL SYSTEM --num-procs N --max-batch-size B --datatype DT ...``

Samples layouts with a sampler (``--sampler tpe|cmaes|random|grid|bohb``) for
``--trials`` trials and reports the best (``autopar.search.tune``).  Infeasible
layouts end as pruned trials.  Files are written only when the search has
run, each atomically:

* ``--output``: the best execution (``--format autopar``, the default: every
  field; ``--format calculon``: Calculon's 23 fields, refused in one line for
  what Calculon cannot represent; ``--format megatron|bridge|torchtitan|
  deepspeed``: the framework's launch config, refused in one line before the
  search for what it cannot express; see ``autopar.io.export``);
* ``--trials-out``: one CSV row per trial (``trial, state, feasible, reason,
  sample_rate``, the breakdown, the layout, ``node_id``, ``elapsed_s``).

Backend ray: ``--storage-path DIR`` keeps the experiment at ``DIR/NAME``
(``--name``; default ``autopar-tune-SAMPLER-TIMESTAMP``; any path Ray Tune
accepts) and prints that path; ``autopar tune --resume DIR/NAME`` finishes a
killed run (no model or system arguments), with the same output options.
Failed trials are retried ``--max-failures`` times (default 3).

Exit 0 with a feasible layout, 1 when every trial was pruned (the commonest
reasons on one line; ``--trials-out`` is still written), 2 on bad input.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.io.experiment import DEFAULT_SAMPLER
from autopar.io.export import DEFAULT_FORMAT, FORMATS, HELP as FORMAT_HELP
from autopar.io.layouts import CHOICES
from autopar.cli import framework_option, SOURCE, distinct_outputs, output_path, positive, seed_arg
from autopar.cli import inference_option, training_of
from autopar.io.specs import SpecError

from autopar.search.samplers import user_names

# the registry's names (autopar.search.samplers; no optuna import here)
SAMPLERS = user_names()


def register(subparsers) -> None:
    from autopar.search.encodings import ENCODINGS
    p = subparsers.add_parser(
        "tune", help="search layouts with a sampler (Optuna or Ray Tune)",
        description="Search layouts with a sampler; infeasible layouts are pruned "
                    "trials. Exit 0 found, 1 no feasible layout, 2 bad input.")
    p.add_argument("model", nargs="?", help="model (application) JSON file")
    p.add_argument("system", nargs="?", help="system JSON file")
    p.add_argument("--num-procs", type=int, help="processors (GPUs); required")
    p.add_argument("--max-batch-size", type=int,
                   help="global batch: the largest multiple of data_par up to this "
                        "(batch policy max) or exactly this (fixed)")
    p.add_argument("--datatype", choices=CHOICES["datatype"], help="required")
    p.add_argument("--sampler", default=DEFAULT_SAMPLER, choices=SAMPLERS,
                   help="default: skeleton-tpe (docs/compare.md); skeleton-SAMPLER proposes skeletons (the space's "
                        "skeleton: parameters) and evaluates every completion of each at once "
                        "(autopar.search.skeleton); --trials then counts distinct skeletons")
    p.add_argument("--trials", type=int, default=100, help="trials to run (default 100)")
    p.add_argument("--space", default=None,
                   help="search space YAML file or name under search_spaces/ (default: calculon)")
    p.add_argument("--batch-policy", choices=("max", "fixed"), default=None,
                   help="default: the space's (max)")
    p.add_argument("--backend", choices=("optuna", "ray"), default="optuna",
                   help="optuna: a study in this process (default); ray: a Ray Tune Tuner")
    from autopar.search.encodings import DEFAULT_ENCODING
    from autopar.search.samplers import default_encodings
    encodings = default_encodings()
    by = ", ".join(f"{e} for {', '.join(s for s, x in encodings.items() if x == e)}"
                   for e in dict.fromkeys(encodings.values()))
    p.add_argument("--encoding", choices=ENCODINGS, default=None,
                   help=f"how samplers see the space (default by sampler: {by}; otherwise "
                        f"{DEFAULT_ENCODING}; see autopar.search.encodings)")
    p.add_argument("--seed", type=int, default=None, help="sampler seed")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="the recommended layout is the fastest trial that leaves this much of "
                        "tier 1 free (default: the system's memory_headroom, else 0); the "
                        "fastest trial without it is named too")
    from autopar.search.risk import add_arguments
    add_arguments(p)
    p.add_argument("--address", default=None,
                   help="Ray cluster address (backend ray; default: $RAY_ADDRESS, else "
                        "a local Ray on loopback)")
    p.add_argument("--storage-path", default=None,
                   help="backend ray: keep the experiment in this folder or URI "
                        "(resumable; default: $AUTOPAR_RESULTS, else ~/autopar_results)")
    p.add_argument("--name", default=None,
                   help="backend ray: experiment name under --storage-path")
    p.add_argument("--resume", metavar="PATH", default=None,
                   help="finish the ray experiment at PATH (STORAGE_PATH/NAME)")
    p.add_argument("--max-failures", type=int, default=3,
                   help="backend ray: retries of a failed trial (default 3)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL, e.g. sqlite:///tune.db (backend optuna): "
                        "the study is kept there and a rerun resumes it")
    p.add_argument("--study-name", default=None,
                   help="study name in --storage (default: derived from the case, "
                        "space, sampler, encoding and seed)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="trials at once (optuna: asked and evaluated together; ray: "
                        "concurrent trials, default all CPUs)")
    p.add_argument("--output",
                   help="write the best execution (JSON, or the launch config --format names)")
    p.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT, help=FORMAT_HELP)
    p.add_argument("--trials-out", help="write every trial (CSV)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    framework_option(p)
    # issue 25: inference from the command line
    inference_option(p)
    p.set_defaults(func=run)


def write_results(table, output: Path | None, trials_out: Path | None,
                  fmt: str = DEFAULT_FORMAT, recommend=None, model=None) -> dict | None:
    """Write the best execution (in ``fmt``; a launch format needs the
    ``model``) and the trials, both or neither; returns the best (of the
    trials in ``recommend``, a subset of ``table``, when given)."""
    import contextlib

    from autopar.io.export import written
    from autopar.search.tune import best_execution
    from autopar.io.writers import atomic_path

    best = best_execution(table if recommend is None else recommend)
    text = None
    if best is not None and output is not None:
        text = written(best, fmt, model)[0]
    with contextlib.ExitStack() as stack:
        if trials_out is not None:
            tmp = stack.enter_context(atomic_path(trials_out))
            table.to_csv(tmp, index=False)
        if output is not None and best is not None:
            tmp = stack.enter_context(atomic_path(output))
            with open(tmp, "w") as f:
                f.write(text)
    return best


def _layout_line(row) -> str:
    return (f"{row['sample_rate']:.4g} samples/s (trial {int(row['trial'])})  "
            f"tp={row['tensor_par']} pp={row['pipeline_par']} dp={row['data_par']} "
            f"batch={row['batch_size']} mbs={row['microbatch_size']} "
            f"ppint={row['pipeline_interleaving']} recompute={row['activation_recompute']} "
            f"comm={row['tensor_par_comm_type']}"
            + "".join(f" {k}={row[k]}" for k in ("context_par", "weight_sharding",
                                                 "sharding_group", "fp8_recipe", "expert_par",
                                                 "expert_tensor_par", "pipeline_layout",
                                                 "embedding_in_split", "loss_in_split",
                                                 "first_stage_blocks", "last_stage_blocks",
                                                 "bf16_first_blocks", "bf16_last_blocks")
                      if k in row and row[k] == row[k]
                      and str(row[k]) not in ("1", "False", "0", "none", "even")))


def fitting_trials(table, system, headroom: float):
    """The trials but the complete ones that do not fit with ``headroom`` GiB."""
    from autopar.search.headroom import PEAK, fits
    if headroom <= 0 or PEAK not in table:
        return table
    return table[(table["state"] != "COMPLETE") | fits(table[PEAK], system, headroom)]


def headroom_lines(table, system, headroom: float) -> list[str]:
    """The recommendation's predicted peak and the fastest trial without headroom."""
    from autopar.search.headroom import PEAK, difference_text, peak_text
    from autopar.search.tune import best_trial
    if headroom <= 0 or PEAK not in table:
        return []
    rec, fastest = best_trial(fitting_trials(table, system, headroom)), best_trial(table)
    lines = []
    if rec is not None:
        lines.append(f"      peak {peak_text(rec[PEAK], system, headroom)}")
    if fastest is not None and (rec is None or fastest["trial"] != rec["trial"]):
        lines.append(f"fastest without headroom: {_layout_line(fastest)}")
        lines.append(f"      peak {peak_text(fastest[PEAK], system, headroom)}; "
                     + difference_text(rec["sample_rate"] if rec is not None else 0.0,
                                       fastest["sample_rate"]))
    return lines


def risk_recommend(table, system, headroom: float, risk, errors):
    """The trials the recommendation is the best of, under ``risk``: fast,
    those that fit with ``headroom``; safe, those with P(fits) >= the
    threshold (as a headroom); expected, the one trial of the highest rate x
    P(fits).  Adds the ``p_fits`` column to ``table``."""
    import math

    from autopar.search.headroom import PEAK
    from autopar.search.risk import p_fits, risk_headroom_gib
    if PEAK not in table:
        return fitting_trials(table, system, headroom)
    table["p_fits"] = p_fits(table[PEAK], system.mem1.GiB, errors)
    if risk.choice == "safe":
        h = math.ceil(100 * risk_headroom_gib(system, errors, risk.min_p_fits)) / 100
        return fitting_trials(table, system, max(headroom, h))
    fit = fitting_trials(table, system, headroom)
    if risk.choice == "expected":
        done = fit[fit["state"] == "COMPLETE"]
        if len(done):
            return done.loc[[(done["sample_rate"] * done["p_fits"]).idxmax()]]
    return fit


def risk_lines(table, recommend, system, headroom: float, risk) -> list[str]:
    """The recommendation's P(fits) and, when it differs, the fast pick."""
    from autopar.search.headroom import difference_text
    from autopar.search.risk import fits_text
    from autopar.search.tune import best_trial
    rec = best_trial(recommend)
    if rec is None or "p_fits" not in table:
        return []
    how = {"fast": "--risk fast: ranked by rate",
           "safe": f"the safe pick: the fastest with P(fits) >= {risk.min_p_fits:g}",
           "expected": "ranked by rate x P(fits)"}[risk.choice]
    lines = [f"      {fits_text(rec['p_fits'])}; {how}"]
    fast = best_trial(fitting_trials(table, system, headroom))
    if risk.choice != "fast" and fast is not None and fast["trial"] != rec["trial"]:
        lines.append(f"fast pick: {_layout_line(fast)}")
        lines.append(f"      {fits_text(fast['p_fits'])}; "
                     + difference_text(rec["sample_rate"], fast["sample_rate"])
                     .replace("without the headroom", f"than the {risk.choice} pick"))
    return lines


def summary_lines(table, label: str, system=None, headroom: float = 0.0,
                  recommend=None, risk=None) -> list[str]:
    """What a run printed: counts and the best layout (with ``headroom`` GiB
    of memory to spare, and then the fastest without it); with ``risk``, the
    best of ``recommend``, its P(fits) and the fast pick."""
    from autopar.search.tune import best_trial
    n = len(table)
    pruned = int((table["state"] == "PRUNED").sum())
    lines = [f"{label}: {n} trials, {n - pruned} complete, {pruned} pruned "
             f"({table['elapsed_s'].max():.1f} s)" if n else f"{label}: no trials"]
    if recommend is None:
        recommend = table if system is None else fitting_trials(table, system, headroom)
    row = best_trial(recommend)
    if row is not None:
        lines.append(f"best: {_layout_line(row)}"
                     + (f" (fits with {headroom:g} GiB headroom)" if headroom > 0 else ""))
    if risk is not None:
        lines += risk_lines(table, recommend, system, headroom, risk)
    if system is not None:
        lines += headroom_lines(table, system, headroom)
    return lines


def no_feasible_line(table) -> str:
    reasons = table["reason"].value_counts().head(3)
    why = "; ".join(f"{r} ({n})" for r, n in reasons.items()) or "no trial ran"
    return f"autopar: no feasible layout in {len(table)} trials: {why}"


def _resume(args) -> int:
    from autopar.search.tune import resume
    for flag, v in (("model", args.model), ("system", args.system),
                    ("--num-procs", args.num_procs), ("--storage-path", args.storage_path),
                    ("--storage", args.storage)):
        if v is not None:
            raise SpecError(SOURCE, flag, "not with --resume (the experiment keeps its case)")
    output = output_path("--output", args.output)
    trials_out = output_path("--trials-out", args.trials_out)
    from autopar.io.export import JSON_FORMATS
    if getattr(args, "format", DEFAULT_FORMAT) not in JSON_FORMATS:
        raise SpecError(SOURCE, "--format", f"{args.format}: a launch config needs the model "
                        "file, which --resume does not take; write --format autopar and "
                        "convert it with autopar estimate --format")
    table = resume(args.resume, address=args.address)
    best = write_results(table, output, trials_out, getattr(args, "format", DEFAULT_FORMAT))
    for line in summary_lines(table, "tune (ray, resumed)"):
        print(line)
    if best is None:
        print(no_feasible_line(table), file=sys.stderr)
        return 1
    return 0


def default_storage_path() -> str:
    """Where ``autopar tune --backend ray`` keeps experiments by default."""
    import os
    return os.environ.get("AUTOPAR_RESULTS") or os.path.join(os.path.expanduser("~"),
                                                             "autopar_results")


def _ray_options(args) -> dict:
    if args.backend != "ray":
        return {}

    def started(path):
        print(f"experiment: {path} (resume with: autopar tune --resume {path})",
              file=sys.stderr, flush=True)
    storage = getattr(args, "storage_path", None) or default_storage_path()
    return {"storage_path": storage,
            "name": getattr(args, "name", None),
            "max_failures": getattr(args, "max_failures", 3), "on_start": started}


def run(args) -> int:
    from autopar.search.space import load_space
    from autopar.search.tune import DEFAULT_SPACE, make_case, tune, tune_options

    if getattr(args, "resume", None) is not None:
        return _resume(args)
    for flag, v in (("model", args.model), ("system", args.system),
                    ("--num-procs", args.num_procs),
                    ("--max-batch-size", args.max_batch_size),
                    ("--datatype", args.datatype)):
        if v is None:
            raise SpecError(SOURCE, flag, "required (unless --resume)")
    max_failures = getattr(args, "max_failures", 3)
    if max_failures < 0:
        raise SpecError(SOURCE, "--max-failures", f"must be >= 0, got {max_failures}")
    storage_path, name = getattr(args, "storage_path", None), getattr(args, "name", None)
    if args.backend == "optuna" and (storage_path or name):
        raise SpecError(SOURCE, "--storage-path" if storage_path else "--name",
                        "needs --backend ray (backend optuna uses --storage)")
    positive("--num-procs", args.num_procs)
    positive("--max-batch-size", args.max_batch_size)
    positive("--trials", args.trials)
    positive("--concurrency", args.concurrency)
    seed_arg("--seed", args.seed)
    if args.backend == "optuna" and args.address:
        raise SpecError(SOURCE, "--address", "a Ray address needs --backend ray")
    if args.backend == "ray" and args.storage:
        raise SpecError(SOURCE, "--storage", "an Optuna storage needs --backend optuna")
    output = output_path("--output", args.output)
    trials_out = output_path("--trials-out", args.trials_out)
    distinct_outputs({"--output": output, "--trials-out": trials_out})
    fmt = getattr(args, "format", DEFAULT_FORMAT)
    if fmt != "autopar":
        from autopar.io.export import check_run
        from autopar.io.specs import load_model
        check_run(fmt, load_model(args.model),
                  load_space(args.space if args.space is not None else DEFAULT_SPACE),
                  args.datatype)
    from autopar.io.specs import load_system
    from autopar.search.headroom import headroom_gib
    from autopar.io.frameworks import system_under
    system = system_under(load_system(args.system), getattr(args, "framework", None))
    headroom = headroom_gib(system, getattr(args, "memory_headroom", None))
    from autopar.io.specs import load_model
    from autopar.search.risk import family_of, load_errors, risk_of
    risk = risk_of(args)
    # --framework: only what the framework can run (its spec's options)
    from autopar.search.space import framework_space
    space = framework_space(args.space if args.space is not None else DEFAULT_SPACE,
                            getattr(args, "framework", None))
    errors = load_errors(family_of(load_model(args.model), space.spec.fixed))
    from autopar.io.export import format_space
    space = format_space(fmt, space)
    options = tune_options(args.sampler, args.trials, backend=args.backend, seed=args.seed,
                           storage=args.storage, address=args.address,
                           concurrency=args.concurrency, encoding=args.encoding,
                           progress=args.progress, study_name=args.study_name,
                           **_ray_options(args))
    case = make_case(args.model, system, args.num_procs, args.max_batch_size, args.datatype,
                     args.batch_policy, training=training_of(args))
    table = tune(case, space, options)
    recommend = risk_recommend(table, system, headroom, risk, errors)
    best = write_results(table, output, trials_out, fmt, recommend, load_model(args.model))
    if "study_name" in table.attrs:
        where = f" in {args.storage}" if args.storage else " (in memory)"
        print(f"study {table.attrs['study_name']}{where}")
        if table.attrs.get("new_trials") == 0:
            print(f"nothing to do: the study already has {len(table)} finished trials "
                  f"(asked for {args.trials})")
    if table.attrs.get("skeleton_space_covered") and args.trials > len(table):
        print(f"all {table.attrs['skeletons']:,} skeletons of the space evaluated "
              f"(asked for {args.trials} trials, which covers them all: "
              f"no sampler needed, no new trial possible)")
    for line in summary_lines(table, f"tune {args.sampler} ({args.backend})", system, headroom,
                              recommend, risk):
        print(line)
    if best is None:
        print(no_feasible_line(table), file=sys.stderr)
        return 1
    return 0
