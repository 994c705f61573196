"""Compare samplers against the exhaustive optimum: ``compare(experiment)``.

An experiment (YAML file or dict, ``kind: compare``) names one case, the
samplers, the seeds and the trial budget.  ``compare`` finds the case's
optimum by exhaustive search, runs every sampler with every seed (each run an
independent ``autopar.search.tune`` search), and measures each run's regret
(``autopar.studies.regret``).  With an output folder it writes ``optimum.json``,
``curves.csv``, ``summary.csv`` and ``regret.png`` there, each atomically and
only once everything has run.

The experiment file::

    kind: compare                   # optional here; `autopar run` dispatches on it
    name: quick                     # default: the file's stem
    description: ...
    case:
      model: ../models/gpt3-13B.json      # paths: relative to this file's folder
      system: ../systems/a100_80g.json
      num_procs: 64
      max_batch_size: 512
      datatype: float16
      space: small                  # a name under search_spaces/ or a path (default: calculon)
      batch_policy: max             # optional (default: the space's)
    samplers:                       # names, or mappings with options for autopar.search.tune
      - random
      - tpe
      - {name: tpe, label: tpe-flat, encoding: flat}
    seeds: 3                        # 0, 1, 2; or a list of seeds
    trials: 100                     # per run
    budgets: [10, 25, 50, 100]      # where the summary reads regret (default 25..1000 up to trials)
    parallel: serial                # serial | processes | ray (default: ray with an address, else serial)
    workers: 2                      # processes (default: 2)
    output_dir: results/quick       # optional, from the current folder; --output-dir overrides

Runs are independent: ``serial`` runs them one after another in this process,
``processes`` in a local pool of ``workers`` processes, ``ray`` as Ray tasks
(on the cluster at ``address``, else a local Ray).  A sampler with option
``backend: ray`` is a Ray Tune experiment per run, started from here one after
another.  Every run is seeded, so the same experiment gives the same curves
whichever way it is spread.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from autopar.io.experiment import (Experiment, is_compare,  # noqa: F401
                                   load_experiment)
from autopar.io.specs import SpecError
from autopar.search.runner import Runner

OUTPUT_FILES = ("optimum.json", "curves.csv", "summary.csv", "regret.png")


@dataclass
class CompareResult:
    experiment: Experiment
    optimum: dict                    # what optimum.json holds
    curves: Any                      # pandas DataFrame (curves.csv)
    summary: Any                     # pandas DataFrame (summary.csv)
    runs: list                       # per run: sampler, seed, trials, pruned, wall_s, ...
    output_dir: Path | None = None
    files: tuple[Path, ...] = ()
    launch: tuple[str, str] | None = None   # a launch format's (text, suffix): optimum<suffix>


# --------------------------------------------------------------------------
# One run (a top-level function: it runs in pool processes and Ray tasks)

def _job_base(exp: Experiment) -> dict:
    """What every run needs, as plain data (no files needed where it runs)."""
    from autopar.io.specs import model_to_json, system_to_json
    return {"source": exp.source,
            "model": model_to_json(exp.case.model), "system": system_to_json(exp.case.system),
            "num_procs": exp.case.num_procs, "max_batch_size": exp.case.max_batch_size,
            "datatype": exp.case.datatype, "space": exp.case.space.to_dict(),
            "batch_policy": exp.case.batch_policy, "trials": exp.trials,
            "training": exp.case.training}


def run_one(base: Mapping, sampler: str, label: str, options: Mapping, seed: int,
            address: str | None = None) -> dict:
    """One sampler with one seed: an ``autopar.search.tune`` search -> its run record."""
    from autopar.search.space import load_space
    from autopar.search.tune import make_case, tune, tune_options
    t0 = time.perf_counter()
    # the run's options: the sampler's needs are checked here (the file's
    # values were checked when it was read)
    opts = tune_options(sampler, base["trials"], seed=seed, progress=False, **options,
                        **({"address": address} if address and options.get("backend") == "ray"
                           else {}))
    case = make_case(base["model"], base["system"], base["num_procs"], base["max_batch_size"],
                     base["datatype"], base["batch_policy"],
                     training=base.get("training", True))
    table = tune(case, load_space(base["space"]), opts)
    wall = time.perf_counter() - t0
    rate = table["sample_rate"].to_numpy(dtype=float).copy()
    rate[~table["feasible"].to_numpy(dtype=bool)] = math.nan
    best = None
    if (table["state"] == "COMPLETE").any():
        from autopar.search.tune import best_execution
        best = best_execution(table)
    return {"sampler": label, "seed": int(seed), "trials": int(len(table)),
            "pruned": int((table["state"] == "PRUNED").sum()),
            "sample_rate": rate.tolist(),
            "elapsed_s": table["elapsed_s"].to_numpy(dtype=float).tolist(),
            "wall_s": wall, "best_execution": best}


def _run_job(base: Mapping, job: tuple) -> dict:
    """One run where the runner puts it (``autopar.search.runner``); tune's
    complaints about an option name the experiment's field."""
    i, sampler, label, options, seed, address = job
    try:
        return run_one(base, sampler, label, options, seed, address)
    except SpecError as err:
        if err.source == "tune":
            raise SpecError(base["source"], f"samplers[{i}].{err.field}", err.message) from None
        raise


# --------------------------------------------------------------------------
# Spreading the runs

def _jobs(exp: Experiment, address: str | None) -> list[tuple]:
    """Every (sampler, seed) run as a runner item, sampler by sampler."""
    return [(i, e.name, e.label, dict(e.options), s, address)
            for i, e in enumerate(exp.samplers) for s in exp.seeds]


def _run_all(runner, base: Mapping, jobs: list, done) -> list:
    """Every run's record; ``done`` sees each as it is taken.  On Ray, Tune
    experiments (``backend: ray``) are driven from here, one at a time, while
    the other runs go on as tasks."""
    def took(records):
        for rec in records:
            done(rec)
        return records
    if runner.backend != "ray":
        return runner.map(_run_job, jobs, shared=base, per_task=1, on_done=took)
    here = [j for j in jobs if j[3].get("backend") == "ray"]
    tasks = runner.imap(_run_job, [j for j in jobs if j[3].get("backend") != "ray"],
                        shared=base, per_task=1)         # submitted now
    out = [took([_run_job(base, j)])[0] for j in here]
    for records in tasks:
        out.extend(took(records))
    return out


# --------------------------------------------------------------------------
# The comparison

class _Progress:
    def __init__(self, total: int, show: bool):
        self.bar = None
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="trial", desc="compare", file=sys.stderr,
                            dynamic_ncols=True)

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)

    def run_done(self, rec: Mapping, optimum: float) -> None:
        if self.bar is None:
            return
        rates = [r for r in rec["sample_rate"] if r == r]
        best = max(rates) if rates else None
        gap = "no feasible trial" if best is None else f"regret {1 - best / optimum:.4f}"
        self.bar.set_postfix_str(f"{rec['sampler']} seed {rec['seed']}: {gap}", refresh=False)
        self.bar.update(rec["trials"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def compare(experiment, output_dir=None, *, address: str | None = None,
            progress: bool | None = None, execution_format: str = "autopar",
            memory_headroom: float | None = None, risk=None,
            **overrides) -> CompareResult:
    """Run a comparison experiment; returns a ``CompareResult``.

    ``experiment``: a YAML path, a mapping or an ``Experiment``; keyword
    ``overrides`` replace its top-level keys (e.g. ``seeds=2, trials=50``).
    ``output_dir`` (else the experiment's ``output_dir``): where the four
    files are written; None writes nothing.  ``address``: a Ray cluster; the
    runs become Ray tasks there (as ``parallel: ray``).  ``progress``: a bar
    on stderr (None: when stderr is a terminal).  ``execution_format``: how
    optimum.json's execution is written (``autopar.io.export``: autopar, or
    calculon, refused before any work for what Calculon cannot represent; a
    launch format (megatron, bridge, torchtitan, deepspeed) keeps autopar's
    execution in optimum.json and writes the framework's config beside it as
    ``optimum<suffix>``, refused before any work for what it cannot express).
    ``risk`` (``autopar.search.risk.Risk``; default safe): with safe, the
    optimum is the fastest layout with P(fits) >= its threshold (a headroom).
    """
    from autopar.io.export import JSON_FORMATS, check_run, json_execution, written
    from autopar.studies import regret
    from autopar.search.exhaustive import exhaustive

    exp = load_experiment(experiment, overrides=overrides or None)
    check_run(execution_format, exp.case.model, exp.case.space, exp.case.datatype,
              source="compare", field="execution_format")
    from autopar.io.writers import NO_OUTPUT, file_ref
    if output_dir == NO_OUTPUT:
        out_dir = None
    else:
        out_dir = Path(output_dir) if output_dir is not None else exp.output_dir
    if out_dir is not None:
        _check_output_dir(out_dir)
    address = address or os.environ.get("RAY_ADDRESS") or None
    parallel = exp.parallel or ("ray" if address else "serial")
    show = sys.stderr.isatty() if progress is None else bool(progress)

    if parallel == "ray":
        runner = Runner("ray", workers=None, address=address, retries=1)
    elif parallel == "processes" and len(exp.samplers) * len(exp.seeds) > 1 and exp.workers > 1:
        runner = Runner("processes", workers=exp.workers)
    else:
        runner = Runner("serial")
    # the optimum's searches: on the cluster when there is one, else here
    on_ray = runner if parallel == "ray" and address else None
    with runner:
        t0 = time.perf_counter()
        exp, plain = _headroom_case(exp, memory_headroom, on_ray, risk)
        case = exp.case
        _, summ = exhaustive(case.model, case.system, case.num_procs, case.max_batch_size,
                             case.datatype, space=case.space, batch_policy=case.batch_policy,
                             runner=on_ray, progress=show, training=case.training)
        if summ["best"] is None:
            why = "; ".join(f"{r} ({n:,})" for r, n in list(summ["infeasible"].items())[:3])
            raise SpecError(exp.source, "case", f"no feasible layout among {summ['layouts']:,} "
                            f"layouts of space {summ['space']}: {why or 'the space is empty'}")
        # the regret's reference is the fastest layout (the optimum, as Calculon
        # picks it), not the simpler one the ranking recommends among ties
        # (autopar.search.ranking): its rate and layout, as before that rule
        opt = float(summ["optimum"]["sample_rate"])
        optimum = {
            # model and system: paths from optimum.json's folder (or the inline mappings)
            "name": exp.name,
            "model": file_ref(exp.case.model_file, out_dir or Path.cwd()),
            "system": file_ref(exp.case.system_file, out_dir or Path.cwd()),
            "model_name": exp.case.model.name, "system_name": exp.case.system.name,
            "num_procs": exp.case.num_procs, "max_batch_size": exp.case.max_batch_size,
            "datatype": exp.case.datatype, "batch_policy": summ["batch_policy"],
            "space": summ["space"], "space_size": summ["layouts"],
            "feasible_layouts": summ["feasible"],
            "training": exp.case.training,
            "execution": json_execution(summ["optimum"]["execution"], execution_format,
                                        "compare", "execution_format"),
            "sample_rate": opt,
            "exhaustive_seconds": summ["seconds"],
            "exhaustive_runner": summ["runner"],
        }
        fw = exp.case.framework_file
        if fw is not None:        # a shipped name or a mapping as given; a path from here
            optimum["framework"] = file_ref(fw, out_dir or Path.cwd()) \
                if isinstance(fw, str) and ("/" in fw or fw.endswith(".json")) else fw
        if plain is not None:
            optimum.update(_headroom_record(plain, summ["optimum"]))
        # a launch config of the optimum: refused (one line) before the samplers run
        launch = None if execution_format in JSON_FORMATS else written(
            summ["optimum"]["execution"], execution_format, case.model, "compare",
            "execution_format")
        if launch is not None:
            optimum["launch_file"] = "optimum" + launch[1]
        jobs = _jobs(exp, None if parallel == "processes" else address)
        bar = _Progress(len(jobs) * exp.trials, show)
        bar.say(f"exhaustive: {summ['layouts']:,} layouts ({summ['feasible']:,} feasible) in "
                f"{summ['seconds']:.1f} s; optimum {opt:.6g} samples/s")
        base = _job_base(exp)
        done = lambda rec: bar.run_done(rec, opt)     # noqa: E731
        try:
            runs = _run_all(runner, base, jobs, done)
        finally:
            bar.close()
    order = {(exp.samplers[j[0]].label, j[4]): i for i, j in enumerate(jobs)}
    runs.sort(key=lambda r: order[(r["sampler"], r["seed"])])
    labels = [e.label for e in exp.samplers]
    curves = regret.curves(runs, opt)
    # every run's best trial, evaluated again on its own, scores what it reported
    optimum["best_rechecked"] = regret.recheck_best(runs, case.model, case.system)
    summary = regret.summarize(curves, runs, labels, exp.budgets,
                               exhaustive={"layouts": summ["layouts"], "feasible": summ["feasible"],
                                           "seconds": summ["seconds"]})
    optimum["compare_seconds"] = round(time.perf_counter() - t0, 3)
    optimum["runner"] = parallel if parallel != "ray" else f"ray:{address or 'local'}"
    result = CompareResult(experiment=exp, optimum=optimum, curves=curves,
                           summary=summary, runs=runs, launch=launch)
    if out_dir is not None:
        result.files = write_outputs(result, out_dir)
        result.output_dir = out_dir
    return result


def _check_output_dir(out_dir: Path) -> None:
    """Fail before any work if the results could not be written there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecError(str(out_dir), "output_dir", "exists and is not a folder")
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(str(out_dir), "output_dir", f"cannot write into {probe}")


def write_outputs(result: CompareResult, out_dir) -> tuple[Path, ...]:
    """optimum.json, curves.csv, summary.csv and regret.png, each atomically."""
    from autopar.studies import regret
    from autopar.io.writers import write_atomic_csv, write_json
    from autopar.io.writers import make_folder
    out_dir = make_folder(out_dir)
    exp, opt = result.experiment, result.optimum
    paths = tuple(out_dir / f for f in OUTPUT_FILES)
    write_json(opt, paths[0])
    write_atomic_csv(result.curves, paths[1])
    write_atomic_csv(result.summary, paths[2])
    title = (f"{exp.case.model.name or 'model'} on {exp.case.num_procs:,} x {exp.case.system.name or 'system'}, "
             f"{exp.case.datatype}, space {opt['space']} ({opt['space_size']:,} layouts)")
    note = (f"optimum {opt['sample_rate']:.4g} samples/s; exhaustive search: "
            f"{opt['exhaustive_seconds']:.3g} s")
    regret.plot(result.curves, [e.label for e in exp.samplers], paths[3], title=title, note=note)
    if result.launch is not None:
        from autopar.io.writers import write_text
        paths += (out_dir / opt["launch_file"],)
        write_text(result.launch[0], paths[-1])
    return paths


# --------------------------------------------------------------------------
# The summary as text

def _headroom_case(exp, memory_headroom, runner=None, risk=None):
    """With a memory headroom (asked, else the system's default; with the
    safe risk, at least the one its P(fits) threshold sets): the experiment on
    the system whose first tier is that much smaller (samplers and optimum
    then fit with headroom), and what is needed to name the fastest layout
    without it; else ``(exp, None)``."""
    import math
    from dataclasses import replace

    from autopar.search.exhaustive import exhaustive
    from autopar.search.headroom import headroom_gib, with_headroom
    from autopar.search.risk import Risk, family_of, load_errors, risk_headroom_gib
    case = exp.case
    h = headroom_gib(case.system, memory_headroom)
    risk = risk or Risk()
    errors = load_errors(family_of(case.model))
    if risk.choice == "safe":
        h = max(h, math.ceil(100 * risk_headroom_gib(case.system, errors,
                                                     risk.min_p_fits)) / 100)
    if h <= 0:
        return exp, None
    _, summ = exhaustive(case.model, case.system, case.num_procs, case.max_batch_size,
                         case.datatype, space=case.space, batch_policy=case.batch_policy,
                         runner=runner, training=case.training)
    plain = {"headroom": h, "system": case.system, "model": case.model, "best": summ["optimum"],
             "errors": errors, "risk": risk}
    return replace(exp, case=replace(case, system=with_headroom(case.system, h))), plain


def _headroom_record(plain: dict, best) -> dict:
    """optimum.json's headroom fields: the headroom, the optimum's predicted
    peak with its band, the fastest layout without headroom and the gap."""
    from autopar.model import evaluate_one
    from autopar.search.headroom import band_gib
    from autopar.search.risk import p_fits
    system, model = plain["system"], plain["model"]

    def peak(ex):
        return evaluate_one(model, system, ex)["proc_mem_tier1_cap_req"] / 1024 ** 3

    def fits(gib):
        return float(p_fits(gib * 1024 ** 3, system.mem1.GiB, plain["errors"]))

    rec = {"memory_headroom_GiB": plain["headroom"], "memory_band_GiB": band_gib(system),
           "peak_GiB": peak(best["execution"]),
           "risk": {"choice": plain["risk"].choice, "min_p_fits": plain["risk"].min_p_fits}}
    rec["p_fits"] = fits(rec["peak_GiB"])
    fast = plain["best"]
    if fast is not None:
        rec["fastest_without_headroom"] = {"execution": fast["execution"],
                                           "sample_rate": fast["sample_rate"],
                                           "peak_GiB": peak(fast["execution"])}
        rec["fastest_without_headroom"]["p_fits"] = fits(rec["fastest_without_headroom"]
                                                         ["peak_GiB"])
    return rec


def summary_text(result: CompareResult) -> str:
    """The summary as an aligned text table (what the terminal ends with)."""
    s, exp, opt = result.summary, result.experiment, result.optimum
    budgets = [b for b in exp.budgets]
    head = ["sampler", "runs"] + [f"regret@{b}" for b in budgets] + \
        ["trials to 5%", "trials to 1%", "s to 1%", "pruned", "ms/trial"]
    rows = []
    for _, r in s.iterrows():
        ex = r["sampler"] == "exhaustive"
        cells = [str(r["sampler"]), str(int(r["runs"]))]
        for b in budgets:
            med = r[f"regret_median@{b}"]
            cells.append("" if ex or med != med else
                         f"{med:.3f} [{r[f'regret_q1@{b}']:.3f}-{r[f'regret_q3@{b}']:.3f}]")
        for tag in ("5pct", "1pct"):
            v = r[f"trials_to_{tag}"]
            cells.append(_count(v) + ("" if ex else f" ({int(r[f'reached_{tag}'])}/{int(r['runs'])})"))
        cells.append(_secs(r["seconds_to_1pct"]))
        cells.append(f"{r['pruned_fraction']:.0%}")
        cells.append(f"{r['ms_per_trial']:.3g}")
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)   # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [f"{exp.name}: {opt['model_name']} on {exp.case.num_procs:,} x {opt['system_name']}, "
             f"{exp.case.datatype}, space {opt['space']} ({opt['space_size']:,} layouts); "
             f"optimum {opt['sample_rate']:.6g} samples/s",
             "regret: median [IQR] after N trials; trials to X%: median (runs that got there)",
             fmt(head), fmt(["-" * w for w in widths])]
    if "memory_headroom_GiB" in opt:
        from autopar.search.headroom import difference_text
        band = f" +-{opt['memory_band_GiB']:.2f}" if opt["memory_band_GiB"] else ""
        safe = opt.get("risk", {}).get("choice") == "safe"
        lines.insert(1, f"memory headroom {opt['memory_headroom_GiB']:g} GiB"
                        + (f" (safe pick: P(fits) >= {opt['risk']['min_p_fits']:g})"
                           if safe else "")
                        + f": the optimum's predicted peak {opt['peak_GiB']:.2f} GiB{band}"
                        + (f", P(fits) {opt['p_fits']:.3f}" if "p_fits" in opt else ""))
        fast = opt.get("fastest_without_headroom")
        if fast is not None and fast["execution"] != opt["execution"]:
            lines.insert(2, ("fast pick" if safe else "fastest without headroom")
                            + f": {fast['sample_rate']:.6g} samples/s, "
                            f"peak {fast['peak_GiB']:.2f} GiB"
                            + (f", P(fits) {fast['p_fits']:.3f}" if "p_fits" in fast else "")
                            + "; " + difference_text(opt["sample_rate"], fast["sample_rate"])
                            .replace("without the headroom",
                                     "than the safe pick" if safe else "without the headroom"))
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def _count(v) -> str:
    if isinstance(v, str):
        return v
    return f"{v:,.0f}" if v == v else ""


def _secs(v) -> str:
    if isinstance(v, str):
        return v
    return f"{v:.3g}" if v == v else ""
