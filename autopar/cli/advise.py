"""``autopar advise MODEL SYSTEM --from CONFIG``: how far a user's config is
from the best, and what to change.

Reads the user's config (an autopar / Calculon execution JSON here; the
frameworks' launch formats through ``autopar.io.launch.read_config``),
fills the fields it leaves unstated as ``estimate --partial`` does (the
framework's recipe defaults; unknown fields by their best completion over
the framework's options) and says which it filled, evaluates the layout
(memory per stage with its band, time breakdown, P(fits)), searches the
best layouts near it and over the whole space for the same case
(``autopar.search.advise``), and prints what to change field by field, the
predicted gain and the better config in the user's own format
(``--config-out`` writes it).  ``--output`` writes the whole answer as JSON
(``{"kind": "advise", "model", "system", "format", "user", "near",
"overall", "changes", "gain", ...}``, which ``autopar report`` reads).

Exit 0 with advice, 1 when neither the user's layout nor any layout found
can run, 2 on bad input.
"""
from __future__ import annotations

import json
from pathlib import Path

from autopar.cli import (distinct_outputs, framework_option, inference_option, output_path,
                         positive, training_of)
from autopar.io.errors import SpecError

JSON_FORMATS = ("autopar", "calculon")
LAUNCH = ("megatron", "bridge", "torchtitan", "deepspeed")   # autopar.io.launch.LAUNCH_FORMATS
FORMAT_CHOICES = JSON_FORMATS + LAUNCH
SOURCE = "command line"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "advise", help="how far a config is from the best layout, and what to change",
        description="Evaluate the layout of a config (autopar/Calculon execution JSON, or a "
                    "framework's launch config), find the best layouts near it (its parallel "
                    "sizes kept, or one or two fields changed) and over the whole space for the same processors and global "
                    "batch, and print what to change, the predicted gain and the better config "
                    "in the same format. Exit 0 advice, 1 nothing can run, 2 bad input.",
        epilog="example: autopar advise models/gpt3-13B.json systems/a100_80g.json "
               "--from my-run.json --space small --output advise.json --config-out better.json")
    p.add_argument("model", help="model (application) JSON file")
    p.add_argument("system", help="system JSON file")
    # --- advise's own options
    p.add_argument("--from", dest="config", required=True, metavar="CONFIG",
                   help="the config to advise on: an execution JSON (autopar's or Calculon's "
                        "fields; a field null, \"?\" or left out is filled and reported) or a "
                        "framework launch config (--format)")
    p.add_argument("--format", dest="config_format", choices=FORMAT_CHOICES, default=None,
                   help="the config's format (default: an execution JSON is read as autopar's; "
                        "other files by autopar.io.launch.read_config)")
    p.add_argument("--num-procs", type=int, default=None,
                   help="processors, where the config does not state them")
    p.add_argument("--space", default=None,
                   help="search space YAML file or name under search_spaces/ (default: "
                        "calculon)")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="memory margin a recommended layout must leave below tier 1's "
                        "capacity (default: the system's memory_headroom, else 0)")
    from autopar.search.risk import add_arguments
    add_arguments(p)
    inference_option(p)
    p.add_argument("--top-n", type=int, default=5,
                   help="layouts listed near and overall (default 5)")
    p.add_argument("--output", metavar="FILE", help="write the advice (JSON)")
    p.add_argument("--config-out", metavar="FILE",
                   help="write the better config, in the config's format")
    framework_option(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------
# Reading the user's config

def _execution_json(path: Path):
    """The execution JSON object in ``path``, or None when the file is not one
    (no JSON object, or keys that are not execution fields)."""
    from autopar.io.layouts import ALL_FIELDS
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not data:
        return None
    if not all(k in ALL_FIELDS or k == "structure_type" for k in data):
        return None
    return data


def read_user_config(path: str, fmt: str | None):
    """(format, ``Imported``) of the user's config: an execution JSON read
    here, any other format by ``autopar.io.launch.read_config``."""
    from autopar.io.launch.base import Imported
    from autopar.io.specs import regular_input
    p = regular_input(path, path)
    if fmt in JSON_FORMATS or fmt is None:
        data = _execution_json(p)
        if data is not None:
            if fmt is None:
                fmt = "autopar"
            return fmt, Imported(execution=data)
        if fmt in JSON_FORMATS:
            # the usual one-line error of an execution file
            from autopar.io.specs import load_partial_execution
            load_partial_execution(str(p))
            raise SpecError(path, "(root)", "expected an execution JSON object")
    try:
        from autopar.io.launch import read_config
    except ImportError:
        raise SpecError(path, "--format", f"reading {fmt or 'this'} config needs "
                        "autopar.io.launch.read_config, which this build lacks; give an "
                        "execution JSON") from None
    got, imported = read_config(path, fmt)
    return got, imported


def _fill(model, system, framework, execution: dict, source: str):
    """The user's whole layout and the fields filled: framework defaults for
    fields the config leaves out, and unknown fields by their best
    completion (``estimate --partial``'s way).  Returns (execution, {field:
    (value, how)})."""
    from autopar.io.specs import load_execution, load_partial_execution
    defaults = framework.defaults if framework is not None else {}
    stated, unknown = load_partial_execution(execution, system=system, model=model,
                                             source=source, missing_unknown=True,
                                             defaults=defaults)
    filled = {f: (v, f"{framework.name} default") for f, v in defaults.items()
              if f not in execution and f not in unknown}
    if not unknown:
        return load_execution(execution, system=system, model=model, source=source,
                              defaults=defaults), filled
    from autopar.search.partial import complete, default_options, defaults_first
    options = default_options(unknown)
    if framework is not None:
        options.update({f: framework.options[f] for f in unknown if f in framework.options})
        options = defaults_first(options, framework.defaults)
    res = complete(model, system, stated, unknown, options, source=source)
    pick = res.best if res.best is not None else res.lowest_memory
    if pick is None:
        raise SpecError(source, ", ".join(unknown), f"cannot be filled: {res.reason}")
    how = "best completion" if res.best is not None else "memory-lowest completion (none fits)"
    filled.update({f: (pick.chosen[f], how) for f in unknown})
    return pick.execution, filled


# --------------------------------------------------------------------------
# The command

def run(args) -> int:
    from autopar.io.frameworks import check_options, load_framework, with_framework
    from autopar.io.specs import load_model, load_system
    from autopar.search.headroom import band_gib, headroom_gib
    from autopar.search.risk import risk_of

    positive("--num-procs", args.num_procs)
    positive("--top-n", args.top_n)
    outs = {"--output": output_path("--output", args.output),
            "--config-out": output_path("--config-out", args.config_out)}
    distinct_outputs(outs)
    model = load_model(args.model)
    fmt, imported = read_user_config(args.config, args.config_format)
    launch = None
    if fmt not in JSON_FORMATS:
        from autopar.io.launch import get
        launch = get(fmt)
        why = launch.refuse_model(model)
        if why:
            raise SpecError(args.model, "(model)", f"{fmt}: {why}")
    elif fmt == "calculon":
        from autopar.io.export import check_calculon_run
        check_calculon_run(fmt, model)      # a model Calculon cannot represent
    # the framework whose recipe fills what the config leaves unstated: the
    # one asked for, else the one the config names, else its format's
    fw_name = args.framework or imported.framework or (launch.framework if launch else None)
    framework = load_framework(fw_name) if fw_name else None
    system = with_framework(load_system(args.system), framework)
    headroom = headroom_gib(system, args.memory_headroom)
    risk = risk_of(args)
    execution = dict(imported.execution)
    if args.num_procs is not None:
        given = execution.get("num_procs")
        if given not in (None, "?") and given != args.num_procs:
            raise SpecError(SOURCE, "--num-procs", f"{args.num_procs} differs from the "
                            f"config's num_procs {given}")
        execution["num_procs"] = args.num_procs
    execution.setdefault("training", True)
    if execution.get("num_procs") in (None, "?"):
        raise SpecError(args.config, "num_procs", "not stated; give --num-procs")
    user, filled = _fill(model, system, framework, execution, args.config)
    if not training_of(args):
        # --inference: the config's layout for inference, its training-only
        # fields at the values the search's rules give them when not training
        from autopar.search.advise import for_inference, full_execution
        before = full_execution(user)
        user = for_inference(model, system, user)
        filled.update({f: (v, "for inference") for f, v in user.items() if before[f] != v})
    check_options(framework, user, args.config)

    def accept(e) -> bool:
        """Whether a found layout can be written in the user's format and run
        by the framework."""
        if framework is not None:
            try:
                check_options(framework, e, "found layout")
            except SpecError:
                return False
        if launch is not None:
            return launch.refuse_layout(model, e) is None
        if fmt == "calculon":
            from autopar.io.export import export_execution
            try:
                export_execution(e, "calculon")
            except SpecError:
                return False
        return True

    from autopar.search.advise import advise
    from autopar.search.exhaustive import DEFAULT_SPACE
    from autopar.search.space import load_space
    space = load_space(args.space if args.space is not None else DEFAULT_SPACE)
    advice = advise(model, system, user, space, risk, headroom, args.top_n, accept)
    text = None
    if advice.best is not None and advice.changes:
        text = config_text(fmt, launch, model, advice.best.execution)
    out = {"kind": "advise", "model": model.name, "system": system.name, "format": fmt,
           **advice.to_json(),
           "config": str(args.config), "space": space.name,
           "filled": {f: v for f, (v, _) in filled.items()},
           "risk": {"choice": risk.choice, "min_p_fits": risk.min_p_fits},
           "memory_headroom_GiB": advice.headroom_gib, "memory_band_GiB": band_gib(system),
           "capacity_GiB": system.mem1.GiB}
    if outs["--output"] is not None:
        from autopar.io.writers import write_json
        write_json(out, outs["--output"])
    if outs["--config-out"] is not None and advice.best is not None:
        from autopar.io.writers import atomic_path
        with atomic_path(outs["--config-out"]) as tmp:
            Path(tmp).write_text(text if text is not None
                                 else config_text(fmt, launch, model, advice.user.execution))
    notes = tuple(getattr(imported, "notes", ()) or ()) + model_notes(model, imported)
    print(report(model, system, fmt, advice, filled, headroom, risk, text, notes))
    ok = advice.best is not None or advice.user.feasible
    return 0 if ok else 1


def config_text(fmt: str, launch, model, execution: dict) -> str:
    """``execution`` as a file of the user's format."""
    if launch is not None:
        return launch.write(model, execution)
    from autopar.io.export import export_execution
    from autopar.io.specs import load_execution
    return json.dumps(export_execution(load_execution(execution), fmt), indent=2) + "\n"


def _line(row) -> str:
    from autopar.cli.exhaustive import layout_text
    from autopar.search.risk import fits_text
    p = row.p_fits if row.p_fits is not None else float("nan")
    from autopar.search.advise import compact
    return (layout_text({"execution": compact(row.execution), "sample_rate": row.rate})
            + f"  {fits_text(p)}")


def _versus(row, user) -> str:
    """'12.3 samples/s (+45.1%) P(fits) 0.998: tensor_par=4, ...': a found
    layout by its rate and the fields it changes."""
    from autopar.search.advise import changes
    from autopar.search.risk import fits_text
    p = row.p_fits if row.p_fits is not None else float("nan")
    gain = f" ({100 * (row.rate / user.rate - 1):+.1f}%)" if user.feasible and user.rate else ""
    diff = ", ".join(f"{c['field']}={c['to']}" for c in changes(user.execution, row.execution))
    return f"{row.rate:.4g} samples/s{gain} {fits_text(p)}: {diff or 'your layout'}"


def _stages(row, system) -> str:
    from autopar.search.headroom import band_gib
    if row.memory_stages_gib is None:
        return "-"
    band = band_gib(system)
    b = f" +-{band:.2f}" if band > 0 else ""
    names = ("first", "last") if len(row.memory_stages_gib) == 2 else ("the stage",)
    return ", ".join(f"{n} {g:.2f} GiB{b}" for n, g in zip(names, row.memory_stages_gib)) \
        + f" of {system.mem1.GiB:g}"


def model_notes(model, imported) -> tuple[str, ...]:
    """Where the config's model fields differ from the model file's (the
    model file is the one predicted)."""
    from autopar.io.specs import model_to_json
    have = model_to_json(model)
    return tuple(f"the config's {k} is {v}, the model file's {have.get(k)} (the model file "
                 f"is used)" for k, v in (getattr(imported, "model", None) or {}).items()
                 if k in have and have[k] != v)


def report(model, system, fmt, advice, filled, headroom, risk, text, notes=()) -> str:
    from autopar.cli.estimate import report as layout_report
    from autopar.search.headroom import PEAK
    from autopar.search.risk import layout_risk
    user = advice.user
    lines = [f"your layout ({fmt}):"]
    for note in notes:
        lines.append(f"  note: {note}")
    if filled:
        lines.append("  filled (the config leaves them unstated): " + ", ".join(
            f"{f}={v} ({how})" for f, (v, how) in filled.items()))
    if user.feasible:
        stats = dict(user.stats)
        stats.update(layout_risk(model, system, user.execution, stats.get(PEAK),
                                 user.rate, risk))
        from autopar.search.advise import compact
        lines.append(layout_report(model, system, compact(user.execution), stats, headroom))
    else:
        lines.append(f"  cannot run: {user.reason}")
    lines.append(f"memory per stage   {_stages(user, system)}")
    lines.append("")
    how = {"safe": f"P(fits) >= {risk.min_p_fits:g}", "fast": "predicted rate",
           "expected": "rate x P(fits)"}[risk.choice]
    lines.append(f"ranked by {how}"
                 + (f", {advice.headroom_gib:g} GiB memory headroom" if advice.headroom_gib
                    else ""))
    lines.append("near (your parallel sizes, or one or two fields changed), as changes to "
                 "yours:")
    lines += [f"  {_versus(r, user)}" for r in advice.near] or ["  none fits"]
    lines.append("overall, as changes to yours:")
    lines += [f"  {_versus(r, user)}" for r in advice.overall] or ["  none fits"]
    lines.append("")
    if advice.best is None:
        lines.append("no layout found fits")
        return "\n".join(lines)
    if not advice.changes:
        lines.append("your layout is within 0.1% of the best found: nothing to change")
        return "\n".join(lines)
    gain = (f"{100 * advice.gain:+.1f}%" if advice.gain is not None
            else "yours cannot run")
    lines.append(f"recommended (of the layouts within 0.1% of the best found, the one with "
                 f"the fewest changes): {_line(advice.best)}")
    lines.append(f"predicted gain {gain} ({user.rate:.4g} -> {advice.best.rate:.4g} "
                 f"samples/s); memory per stage {_stages(advice.best, system)}")
    lines.append("change:")
    lines += [f"  {c['field']}: {c['from']} -> {c['to']}" for c in advice.changes]
    lines.append("")
    lines.append(f"better config ({fmt}):")
    lines.append(text.rstrip("\n"))
    return "\n".join(lines)
