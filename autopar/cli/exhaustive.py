"""``autopar exhaustive MODEL SYSTEM --num-procs N --max-batch-size B --datatype DT``

Evaluates every layout of a search space (``--space``, Calculon's own search
by default) and reports the best.  Files are written only when the search
succeeds, each atomically:

* ``--output``: the best execution (``--format autopar``, the default: every
  field, extensions included, read back by ``autopar estimate``; ``--format
  calculon``: Calculon's 23 fields for its ``llm`` command, refused in one line
  for a model or space Calculon cannot represent; ``--format megatron``,
  ``bridge``, ``torchtitan`` or ``deepspeed``: the framework's launch config,
  refused in one line before the search for what it cannot express; see
  ``autopar.io.export`` and docs/launch.md);
* ``--top``: the best ``--top-n`` with their statistics, in Calculon's
  optimal-execution layout ``{"0": {"execution": ..., "stats": ...}, ...}``
  (executions as ``--format`` says for autopar/calculon, autopar's beside a
  launch format);
* ``--all``: every layout with its statistics (Parquet; CSV for ``*.csv``);
* ``--summary``: layouts, feasible, infeasible counts by reason, seconds, best.

Exit 0 with a best layout, 1 when no layout is feasible (the commonest
reasons on one line), 2 on bad input.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from autopar.io.export import DEFAULT_FORMAT, FORMATS, HELP as FORMAT_HELP
from autopar.io.layouts import CHOICES
from autopar.cli import framework_option, distinct_outputs, output_path, positive
from autopar.cli import inference_option, training_of



def register(subparsers) -> None:
    p = subparsers.add_parser(
        "exhaustive", help="evaluate every layout of a search space",
        description="Evaluate every layout of a search space and report the "
                    "best. Exit 0 found, 1 no feasible layout, 2 bad input.")
    p.add_argument("model", help="model (application) JSON file")
    p.add_argument("system", help="system JSON file")
    p.add_argument("--num-procs", type=int, required=True, help="processors (GPUs)")
    p.add_argument("--max-batch-size", type=int, required=True,
                   help="global batch: the largest multiple of data_par up to this "
                        "(batch policy max) or exactly this (fixed)")
    p.add_argument("--datatype", required=True, choices=CHOICES["datatype"])
    p.add_argument("--space", default=None,
                   help="search space YAML file or name under search_spaces/ "
                        "(default: calculon, the reference search)")
    p.add_argument("--batch-policy", choices=("max", "fixed"), default=None,
                   help="default: the space's (max)")
    p.add_argument("--top-n", type=int, default=1, help="best layouts kept (default 1)")
    p.add_argument("--output", metavar="FILE",
                   help="write the best execution (JSON, or the launch config --format names)")
    p.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT, help=FORMAT_HELP)
    p.add_argument("--top", metavar="FILE", help="write the top N with statistics (JSON)")
    p.add_argument("--all", dest="all_rows", metavar="FILE",
                   help="write every layout with statistics (Parquet, or CSV for .csv)")
    p.add_argument("--summary", metavar="FILE", help="write the summary (JSON)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address: run chunks as Ray tasks "
                        "(default: $RAY_ADDRESS, else local)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="layouts evaluated at once (memory vs. overhead)")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="the best layout must leave this much of tier 1 free (default: the "
                        "system's memory_headroom, else 0); the fastest layout without the "
                        "headroom is named too")
    from autopar.search.risk import add_arguments
    add_arguments(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    framework_option(p)
    # issue 25: inference from the command line
    inference_option(p)
    p.set_defaults(func=run)


def _remove_stale_partials(p: Path) -> None:
    """Partial --all files a killed run (SIGKILL: no cleanup) left beside ``p``:
    ``.STEM.PID.partialSUFFIX`` whose process is gone are removed."""
    for old in p.parent.glob(f".{p.stem}.*.partial{p.suffix}"):
        pid = old.name[len(p.stem) + 2:].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            old.unlink(missing_ok=True)
        except PermissionError:
            pass


def run(args) -> int:
    from autopar.search.exhaustive import DEFAULT_CHUNK, DEFAULT_SPACE, exhaustive, top_json
    from autopar.search.space import load_space
    from autopar.io.export import check_run, json_execution, written
    from autopar.io.specs import load_model, load_system

    positive("--num-procs", args.num_procs)
    positive("--max-batch-size", args.max_batch_size)
    positive("--top-n", args.top_n)
    positive("--chunk-size", args.chunk_size)
    outs = {"--output": output_path("--output", args.output),
            "--top": output_path("--top", args.top),
            "--all": output_path("--all", args.all_rows),
            "--summary": output_path("--summary", args.summary)}
    distinct_outputs(outs)
    from autopar.search.headroom import headroom_gib, with_headroom
    model = load_model(args.model)
    from autopar.io.frameworks import system_under
    system = system_under(load_system(args.system), getattr(args, "framework", None))
    headroom = headroom_gib(system, getattr(args, "memory_headroom", None))
    from autopar.search.risk import family_of, load_errors, risk_headroom_gib, risk_of
    risk = risk_of(args)
    # --framework: only what the framework can run (its spec's options)
    from autopar.search.space import framework_space
    space = framework_space(load_space(args.space if args.space is not None else DEFAULT_SPACE),
                            getattr(args, "framework", None))
    errors = load_errors(family_of(model, space.spec.fixed))
    # safe: the fastest layout with P(fits) >= min_p_fits, a search with the
    # headroom that probability sets (or the one asked for, if larger); the
    # fast pick (today's ranking) is searched too when they differ.
    user_headroom = headroom
    if risk.choice == "safe":
        headroom = max(headroom, math.ceil(100 * risk_headroom_gib(system, errors, risk.min_p_fits)) / 100)
    fmt = getattr(args, "format", DEFAULT_FORMAT)
    from autopar.io.export import format_space
    space = format_space(fmt, space)
    check_run(fmt, model, space, args.datatype)
    all_tmp = None
    if outs["--all"] is not None:
        p = outs["--all"]
        # held back under a temporary name until the search has succeeded
        all_tmp = p.with_name(f".{p.stem}.{os.getpid()}.partial{p.suffix}")
        _remove_stale_partials(p)
    from autopar.io.writers import put_in_place, write_json
    try:
        from functools import partial
        search, searched = exhaustive, headroom
        if risk.choice == "expected":
            from autopar.search.risk import expected_search
            search = partial(expected_search, err=errors, capacity_gib=system.mem1.GiB)
        elif headroom > user_headroom:
            from autopar.search.risk import safe_search
            search = partial(safe_search, base=system, safe_headroom=headroom)
            searched = user_headroom
        table, summary = search(
            model, with_headroom(system, searched), args.num_procs, args.max_batch_size, args.datatype,
            space=space, batch_policy=args.batch_policy, top_n=args.top_n,
            address=args.address, progress=args.progress,
            chunk_size=args.chunk_size or DEFAULT_CHUNK, all_path=all_tmp,
            training=training_of(args))
        best = summary["best"]
        if summary["layouts"] == 0:        # as tune says it: bad input, exit 2
            from autopar.io.specs import SpecError
            raise SpecError(getattr(space, "source", "space"), "space",
                            f"has no layout for this case ({args.num_procs} procs, "
                            f"batch {args.max_batch_size})")
        if risk.choice == "expected" or headroom > user_headroom:
            unhedged = summary["fast_pick"]
            summary["memory_headroom_GiB"] = headroom
        else:
            unhedged = _without_headroom(model, system, space, args, headroom, summary)
        _add_risk(model, system, summary, errors, risk, headroom)
        if best is None:
            reasons = list(summary["infeasible"].items())[:3]
            why = "; ".join(f"{r} ({n:,})" for r, n in reasons) or "the space is empty"
            if headroom > 0:
                why += f" (with {headroom:g} GiB memory headroom)"
            if risk.choice == "safe":
                why += f"; no layout has P(fits) >= {risk.min_p_fits:g}"
                if unhedged is not None:
                    why += f"; fast pick: {layout_text(unhedged)}"
            print(f"autopar: no feasible layout among {summary['layouts']:,} layouts of "
                  f"space {summary['space']}: {why}", file=sys.stderr)
            return 1
        best["memory_GiB"] = best_memory(model, system, best["execution"])
        top = top_json(table, args.top_n)
        from autopar.search.headroom import PEAK
        from autopar.search.risk import p_fits
        for entry in top.values():
            entry["execution"] = json_execution(entry["execution"], fmt)
            peak = entry["stats"].get(PEAK)
            entry["p_fits"] = float(p_fits(peak, system.mem1.GiB, errors)) if peak else None
        # every output is put in place with the run's others when the command
        # has succeeded, its answer printed (autopar.io.writers.all_or_nothing)
        if outs["--output"] is not None:
            from autopar.io.writers import write_text
            write_text(written(best["execution"], fmt, model)[0], outs["--output"])
        if outs["--top"] is not None:
            write_json(top, outs["--top"])
        if outs["--summary"] is not None:
            from autopar.io.writers import file_ref
            where = outs["--summary"].parent
            summary = {**summary, "model_file": file_ref(model.source, where),
                       "system_file": file_ref(system.source, where)}
            write_json(summary, outs["--summary"])
        if all_tmp is not None:
            put_in_place(all_tmp, outs["--all"])
            all_tmp = None
        try:
            _print_answer(summary, best, headroom, unhedged, system, risk, errors,
                          user_headroom)
            sys.stdout.flush()    # a full disk under `> log` shows here
        except OSError as err:
            err.filename = err.filename or "stdout"
            raise
    finally:
        if all_tmp is not None and all_tmp.exists():
            all_tmp.unlink()
    return 0


def _print_answer(summary: dict, best: dict, headroom: float, unhedged, system, risk, errors,
                  user_headroom: float) -> None:
    counted = summary.get("searched_headroom_GiB", headroom)
    print(f"space {summary['space']}: {summary['layouts']:,} layouts, "
          f"{summary['feasible']:,} feasible"
          + (f" with {counted:g} GiB memory headroom" if counted > 0 else "")
          + ("" if summary.get("training", True) else ", inference")
          + f", {summary['seconds']:.1f} s")
    from autopar.search.risk import fits_text
    pick = {"safe": "safe pick", "expected": "expected pick"}.get(risk.choice, "best")
    how = {"safe": f"the safe pick: the fastest with P(fits) >= {risk.min_p_fits:g}",
           "expected": "the expected pick: the highest rate x P(fits)",
           "fast": "--risk fast: ranked by rate"}[risk.choice]
    print(f"best: {layout_text(best)}")
    if "memory_GiB" in best:
        print(f"      memory {memory_text(best['memory_GiB'])}")
    print(f"      {fits_text(best['p_fits'])} ({errors.family} errors); {how}")
    other = ("fast pick" if headroom > user_headroom or risk.choice == "expected"
             else "fastest without headroom")
    if headroom > 0 or risk.choice == "expected":
        from autopar.search.headroom import difference_text, peak_text
        print(f"      peak {peak_text(best['peak_bytes'], system, headroom)}")
        if unhedged is not None and unhedged["execution"] != best["execution"]:
            print(f"{other}: {layout_text(unhedged)}")
            print(f"      peak {peak_text(unhedged['peak_bytes'], system, headroom)}; "
                  f"{fits_text(unhedged['p_fits'])}; "
                  f"{difference_text(best['sample_rate'], unhedged['sample_rate'])}"
                  .replace("without the headroom", f"than the {pick}"
                           if other == "fast pick" else "without the headroom")
                  .replace("no layout fits with the headroom", f"the {pick} has rate 0"))
        elif unhedged is not None:
            print(f"{other}: the same layout")


def best_memory(model, system, execution: dict) -> dict:
    """The memory a layout needs, in GiB: on each tier against its capacity,
    and on tier 1 that of its first and last pipeline stage (the model's
    ``stage_needs``; the peak is the fuller one, with the reserved amount)."""
    from autopar.io.layouts import to_columns
    from autopar.model import evaluate_columns
    from autopar.model.memory import MEMORY_PARTS, stage_needs
    from autopar.search.headroom import GIB
    out = evaluate_columns(model, system, to_columns([execution]),
                           stats=("proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req",
                                  *MEMORY_PARTS))
    stats = {k: v[0] for k, v in out.items()}
    first, last = stage_needs(stats, system.memory_overhead)
    return {"tier1": float(stats["proc_mem_tier1_cap_req"]) / GIB,
            "tier1_capacity": float(system.mem1.GiB),
            "tier2": float(stats["proc_mem_tier2_cap_req"]) / GIB,
            "tier2_capacity": float(system.mem2.GiB),
            "first_stage": float(first) / GIB, "last_stage": float(last) / GIB,
            "stages": int(execution["pipeline_par"]),
            "peak_stage": "first" if float(first) >= float(last) else "last"}


def memory_text(m: dict) -> str:
    """'tier 1 61.3 of 80 GiB (peak: the first of 8 stages, 61.3; the last 44.0),
    tier 2 0.0 of 512 GiB'."""
    if m["stages"] > 1:
        other = "last" if m["peak_stage"] == "first" else "first"
        stages = (f" (peak: the {m['peak_stage']} of {m['stages']} stages, "
                  f"{m[m['peak_stage'] + '_stage']:.2f}; the {other} {m[other + '_stage']:.2f})")
    else:
        stages = " (one stage)"
    free = m["tier1_capacity"] - m["tier1"]
    return (f"tier 1 {m['tier1']:.2f} of {m['tier1_capacity']:g} GiB{stages}, "
            f"{free:.2f} GiB free; tier 2 {m['tier2']:.2f} of {m['tier2_capacity']:g} GiB")


def layout_text(best: dict) -> str:
    ex = best["execution"]
    return (f"{best['sample_rate']:.4g} samples/s  tp={ex['tensor_par']} "
            f"pp={ex['pipeline_par']} dp={ex['data_par']} batch={ex['batch_size']} "
            f"mbs={ex['microbatch_size']} ppint={ex['pipeline_interleaving']} "
            f"recompute={ex['activation_recompute']} comm={ex['tensor_par_comm_type']}"
            + "".join(f" {k}={ex[k]}" for k in ("context_par", "weight_sharding", "sharding_group",
                                                 "fp8_recipe", "expert_par", "expert_tensor_par",
                                                 "pipeline_layout", "embedding_in_split",
                                                 "loss_in_split", "first_stage_blocks",
                                                 "last_stage_blocks", "bf16_first_blocks",
                                                 "bf16_last_blocks")
                      if k in ex))


def _add_risk(model, system, summary: dict, errors, risk, headroom: float) -> None:
    """P(fits) of the picks, and the risk asked for, in the summary."""
    from autopar.model import evaluate_one
    from autopar.search.risk import p_fits

    picks = [summary.get("best"), summary.get("best_without_headroom"),
             summary.get("fast_pick")]
    for b in picks:
        if b is not None and "p_fits" not in b:
            if "peak_bytes" not in b:
                b["peak_bytes"] = float(evaluate_one(model, system, b["execution"])
                                        ["proc_mem_tier1_cap_req"])
            b["p_fits"] = float(p_fits(b["peak_bytes"], system.mem1.GiB, errors))
    summary["risk"] = {"choice": risk.choice, "min_p_fits": risk.min_p_fits,
                       "family": errors.family, "headroom_GiB": round(headroom, 3),
                       "memory_error": {"mu": errors.memory_mu, "sigma": errors.memory_sigma}}
    if risk.choice == "safe":
        summary["safe_pick"] = summary.get("best")


def _without_headroom(model, system, space, args, headroom: float, summary: dict):
    """With a headroom: the fastest layout without it (a second search of the
    space, keeping the best only), recorded in the summary with both peaks."""
    from autopar.search.exhaustive import DEFAULT_CHUNK, exhaustive
    from autopar.model import evaluate_one

    if headroom <= 0:
        return None
    _, plain = exhaustive(model, system, args.num_procs,
                          args.max_batch_size, args.datatype,
                          space=space, batch_policy=args.batch_policy, top_n=1,
                          address=args.address, progress=args.progress,
                          chunk_size=args.chunk_size or DEFAULT_CHUNK,
                          training=training_of(args))
    found = [b for b in (summary["best"], plain["best"]) if b is not None]
    for b in found:
        b["peak_bytes"] = float(evaluate_one(model, system, b["execution"])
                                ["proc_mem_tier1_cap_req"])
    summary["memory_headroom_GiB"] = headroom
    summary["best_without_headroom"] = plain["best"]
    return plain["best"]
