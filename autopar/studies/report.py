"""Run outputs -> what ``autopar report`` shows: layouts with their time
breakdown and memory per stage, regret curves, Pareto fronts.

``read_run(path, context)`` recognises any output autopar writes by its
content, not its name:

* a JSON file: ``exhaustive --top`` (``{"0": {"execution", "stats"}, ...}``),
  ``exhaustive --summary`` (``layouts``, ``best``...), ``advise --output``
  (``"kind": "advise"``), or one execution (``exhaustive``/``tune --output``);
* a CSV file: ``tune --trials-out`` (``trial, state, sample_rate``, the
  layout), or a comparison's ``curves.csv``;
* a folder: ``compare``'s (``optimum.json``, ``curves.csv``, ``summary.csv``),
  ``codesign``'s (``summary.json`` with a ``front``, ``front.csv``, and when
  comparing ``curves.csv``/``regret.csv``) or ``cliffs``' (``cliffs.csv``).

Memory per stage is the model's own split (``autopar.model.memory.
stage_needs``): the first stage (the fuller of the first two with an uneven
split) and the last, each as static state, transient tensors and the
overheads (the loss's fp32 logits, fragmentation, the reserved amount); one
stage without pipelining.  Outputs carry no such split (an advise file's
``memory_stages_gib`` excepted, drawn as given), so the layouts are evaluated
again with the model and system (and framework) of the run: those the run
names (a summary's ``model_file``/``system_file``, a comparison's
``optimum.json``, an advise file's model and system names, looked up among
the shipped files), or ``--model``/``--system``/``--framework``, which take
precedence.  A run whose layouts carry no statistics (one execution, tune's
trials) needs them; without them its statistics are what the file holds and
the memory chart shows the peak only.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from autopar.io.errors import SpecError

GIB = 1024 ** 3
TOP_LAYOUTS = 5          # layouts drawn per run (the table lists up to 10)
TABLE_LAYOUTS = 10

# The parts each stage's bar is stacked from.
STAGE_PARTS = ("static: weights, gradients, optimizer state",
               "transient: activations, checkpoints, activation gradients",
               "overheads: loss fp32 logits, fragmentation, reserved",
               "need as the run reported it")


@dataclasses.dataclass
class Context:
    """The model and system (under a framework) a run's layouts are evaluated with."""
    model: object = None
    system: object = None
    where: str = ""                 # where they came from, for the page

    @property
    def complete(self) -> bool:
        return self.model is not None and self.system is not None


@dataclasses.dataclass
class Layout:
    label: str
    execution: dict
    stats: dict
    p_fits: float | None = None
    stages: list[tuple[str, list[float]]] | None = None   # (stage, GiB per STAGE_PARTS)
    reason: str | None = None       # why the model says it cannot run


@dataclasses.dataclass
class Run:
    source: str
    kind: str                       # what the input is, in words
    title: str
    facts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    layouts: list[Layout] = dataclasses.field(default_factory=list)
    capacity_gib: float | None = None
    headroom_gib: float = 0.0
    user: Layout | None = None      # advise: the user's config
    near: list[Layout] = dataclasses.field(default_factory=list)
    changes: list[dict] = dataclasses.field(default_factory=list)
    gain: float | None = None
    curves: list[dict] = dataclasses.field(default_factory=list)   # regret curves
    curves_by_budget: bool = False  # from a summary's budgets, not every trial
    sampler_rows: list[dict] = dataclasses.field(default_factory=list)
    front: dict | None = None       # {"x_label", "sets", "rows"}
    progress: list[dict] = dataclasses.field(default_factory=list)  # best so far per trial
    progress_label: tuple[str, str] = ("trial", "best sample rate (samples/s)")
    notes: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------
# Model and system

def load_context(model=None, system=None, framework=None, where: str = "") -> Context:
    """A context from paths (or shipped names); None parts stay unknown."""
    from autopar.io.specs import load_model, load_system
    m = load_model(model) if model is not None else None
    s = None
    if system is not None:
        from autopar.io.frameworks import system_under
        s = system_under(load_system(system), framework)
    return Context(m, s, where)


def _merge(given: Context, own: Context) -> Context:
    """The command line's model/system/framework over the run's own."""
    m = given.model if given.model is not None else own.model
    s = given.system if given.system is not None else own.system
    where = "the command line" if (given.model is not None or given.system is not None) \
        else own.where
    return Context(m, s, where)


def _context_from_files(run: "Run", folder: Path, model_ref, system_ref, framework_ref,
                        source: str) -> Context:
    """The run's own model and system, named relative to its folder; an empty
    context (and a note) where they cannot be read (a folder moved away from
    them): the run's own figures are shown, not evaluated again."""
    def path(ref):
        if ref is None or isinstance(ref, dict) or not isinstance(ref, str):
            return ref
        p = folder / ref
        return str(p) if p.exists() else ref        # else a shipped name, or absent
    try:
        if model_ref is None or system_ref is None:
            raise SpecError(source, "model", "names no model or system")
        return load_context(path(model_ref), path(system_ref), path(framework_ref),
                            where=source)
    except SpecError as e:
        run.notes.append(f"{source} names a model and system that cannot be read here "
                         f"({e.source}: {e.field}: {e.message}): the run's own figures are "
                         "shown; give --model and --system to evaluate its layouts.")
        return Context()


def evaluate(ctx: Context, layouts: list[Layout], source: str, fill_stats: bool) -> list[str]:
    """Memory per stage for every layout (and, with ``fill_stats``, every
    statistic) from the model: one call of ``evaluate_columns`` for all.
    Returns the labels of the layouts whose peak, as the file records it,
    differs from this evaluation's (another model, system or framework)."""
    if not ctx.complete or not layouts:
        return []
    from autopar.io.layouts import to_columns
    from autopar.io.specs import load_execution
    from autopar.model import STATS, evaluate_columns
    from autopar.model.memory import MEMORY_PARTS, stage_needs
    from autopar.io.writers import json_value

    execs = [load_execution(lay.execution, system=ctx.system, model=ctx.model,
                            source=f"{source} ({lay.label})") for lay in layouts]
    out = evaluate_columns(ctx.model, ctx.system, to_columns(execs),
                           stats=tuple(STATS) + tuple(MEMORY_PARTS))
    first, last = stage_needs(out, ctx.system.memory_overhead)
    from autopar.model import REASONS
    differ = []
    for i, lay in enumerate(layouts):
        recorded = lay.stats.get("proc_mem_tier1_cap_req") if lay.stats else None
        now = out["proc_mem_tier1_cap_req"][i]
        if isinstance(recorded, (int, float)) and math.isfinite(now) \
                and abs(recorded - now) > 1e-9 * max(abs(now), 1.0):
            differ.append(lay.label)
        if fill_stats or not lay.stats:
            lay.stats = {k: json_value(out[k][i]) for k in STATS}
        if not out["feasible"][i]:
            lay.reason = REASONS[int(out["reason_code"][i])]
        for k in ("proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req"):
            if lay.stats.get(k) is None:        # a layout out of memory keeps its need
                lay.stats[k] = json_value(out[k][i])
        parts = [float(out[p][i]) for p in MEMORY_PARTS]
        if not all(math.isfinite(v) for v in parts):
            continue
        s1, t1, s2, t2 = parts[:4]
        f, la = float(first[i]), float(last[i])
        pp = int(execs[i]["pipeline_par"])
        uneven = any(execs[i].get(k) for k in ("first_stage_blocks", "last_stage_blocks")) \
            or execs[i].get("pipeline_layout", "even") != "even"
        split = [("stage 1" + (" or 2 (the fuller)" if uneven and pp > 2 else ""),
                  [s1, t1, f - s1 - t1]), (f"stage {pp}", [s2, t2, la - s2 - t2])]
        if pp == 1:
            split = [("the only stage", split[0][1] if f >= la else split[1][1])]
        if lay.stages is not None:          # carried by the file (advise): drawn as given
            continue
        lay.stages = [(name, [v / GIB for v in vals] + [0.0]) for name, vals in split]
    return differ


def _p_fits(v, source: str, field: str):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise SpecError(source, field, f"expected a probability or null, got {v!r}")
    return float(v)


def _layout(entry, label: str, source: str, field: str) -> Layout:
    """An ``{"execution", "stats", "p_fits"?, "memory_stages_gib"?}`` entry."""
    if not isinstance(entry, dict):
        raise SpecError(source, field, f"expected an object, got {type(entry).__name__}")
    ex = entry.get("execution")
    if not isinstance(ex, dict):
        raise SpecError(source, f"{field}.execution", "missing or not an object")
    stats = entry.get("stats", {})
    if stats is None:
        stats = {}
    if not isinstance(stats, dict):
        raise SpecError(source, f"{field}.stats", "not an object")
    for k, v in stats.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise SpecError(source, f"{field}.stats.{k}", f"expected a number or null, got {v!r}")
    lay = Layout(label, ex, dict(stats), _p_fits(entry.get("p_fits"), source, f"{field}.p_fits"))
    carried = entry.get("memory_stages_gib")
    if carried is not None:
        if not isinstance(carried, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in carried):
            raise SpecError(source, f"{field}.memory_stages_gib",
                            "expected a list of numbers (GiB per stage) or null")
        lay.stages = [(f"stage {k + 1}", [0.0, 0.0, 0.0, float(v)])
                      for k, v in enumerate(carried)]
    return lay


def _capacity(run: Run, ctx: Context) -> None:
    if ctx.system is not None:
        from autopar.search.headroom import headroom_gib
        run.capacity_gib = float(ctx.system.mem1.GiB)
        run.headroom_gib = float(headroom_gib(ctx.system))


def _needs_context(run: Run, ctx: Context, what: str) -> None:
    if not ctx.complete and not any("--model" in n for n in run.notes):
        run.notes.append(f"{what}: give --model and --system (and --framework if the run "
                         "used one) to evaluate the layouts' time breakdown and memory "
                         "per stage.")


# --------------------------------------------------------------------------
# Readers, one per kind of output

def read_run(path, given: Context | None = None) -> Run:
    """One run's output (a file or a folder) -> Run; SpecError when it is none
    that autopar writes or is malformed."""
    run = _read(path, given or Context())
    run.title = run.title or Path(path).resolve().name or str(path)
    return run


def _read(path, given: Context) -> Run:
    p = Path(path)
    src = str(path)
    if p.is_dir():
        if (p / "optimum.json").is_file():
            return _compare(p, src, given)
        if (p / "cliffs.csv").is_file():
            return _cliffs(p, src)
        if (p / "summary.json").is_file() and (p / "front.csv").is_file():
            return _codesign(p, src, given)
        raise SpecError(src, "(folder)", "is not an output folder autopar report reads: no "
                        "optimum.json (compare), summary.json with front.csv (codesign) or "
                        "cliffs.csv (cliffs)")
    from autopar.io.specs import read_json, regular_input
    regular_input(p)
    if p.suffix.lower() == ".csv":
        frame = _csv(p, src)
        if {"sampler", "seed", "trial", "regret"} <= set(frame.columns):
            run = Run(src, "regret curves", p.name)
            run.curves = _curves(frame, src)
            return run
        if {"trial", "state", "sample_rate"} <= set(frame.columns):
            return _trials(frame, src, given)
        raise SpecError(src, "(columns)", "neither tune --trials-out (trial, state, "
                        "sample_rate, ...) nor regret curves (sampler, seed, trial, regret)")
    data = read_json(p)
    if isinstance(data, dict) and data.get("kind") == "advise":
        return _advise(data, src, given)
    if isinstance(data, dict) and data and all(isinstance(k, str) and k.isdigit() for k in data):
        return _top(data, src, given)
    if isinstance(data, dict) and "layouts" in data and "best" in data:
        return _summary(data, p, src, given)
    if isinstance(data, dict) and "tensor_par" in data:
        run = Run(src, "best execution", p.name or src)
        run.layouts = [Layout("best", data, {})]
        _evaluated(run, given, src, fill_stats=True, need="this file holds one execution")
        return run
    raise SpecError(src, "(root)", "not an output autopar report reads: expected exhaustive "
                    "--top/--summary/--output, tune --output or advise --output JSON")


def _evaluated(run: Run, ctx: Context, src: str, fill_stats: bool, need: str) -> None:
    if fill_stats and not ctx.complete:
        raise SpecError("command line", "--model" if ctx.model is None else "--system",
                        f"{src}: {need} without statistics; give --model and --system to "
                        "evaluate it")
    differ = evaluate(ctx, run.layouts + ([run.user] if run.user else []) + run.near, src,
                      fill_stats)
    if differ:
        run.notes.append(f"the peak memory {src} records for {', '.join(differ[:3])}"
                         f"{' and others' if len(differ) > 3 else ''} differs from this "
                         f"evaluation's with {ctx.model.name} on {ctx.system.name}: the run "
                         "used another model, system or framework (give the run's own "
                         "--model, --system and --framework); memory per stage is this "
                         "evaluation's.")
    _capacity(run, ctx)
    if not fill_stats:
        _needs_context(run, ctx, "memory per stage")
    if ctx.complete:
        run.facts.append(("evaluated with", f"{ctx.model.name} on {ctx.system.name} "
                                            f"(from {ctx.where})"))


def _own_figures(run: Run, ctx: Context, picks: dict) -> None:
    """Without a model and system: the sample rate (and peak) the run itself
    recorded for each layout."""
    if ctx.complete:
        return
    for lay in run.layouts:
        b = picks.get(lay.label)
        if isinstance(b, dict):
            for key, stat in (("sample_rate", "sample_rate"),
                              ("peak_bytes", "proc_mem_tier1_cap_req")):
                v = b.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    lay.stats[stat] = float(v)


def _top(data: dict, src: str, given: Context) -> Run:
    run = Run(src, "exhaustive --top", Path(src).name)
    keys = sorted(data, key=int)
    run.layouts = [_layout(data[k], f"#{int(k) + 1}", src, k) for k in keys]
    if run.layouts:
        ex = run.layouts[0].execution
        run.facts += [("layouts listed", str(len(keys))),
                      ("processors", str(ex.get("num_procs", "-"))),
                      ("batch", str(ex.get("batch_size", "-")))]
    _evaluated(run, given, src, fill_stats=False, need="")
    return run


def _summary(data: dict, p: Path, src: str, given: Context) -> Run:
    run = Run(src, "exhaustive --summary", p.name)
    for key in ("model", "system", "space", "num_procs", "max_batch_size", "datatype",
                "layouts", "feasible", "seconds"):
        if key in data:
            v = data[key]
            run.facts.append((key.replace("_", " "),
                              f"{v:,}" if isinstance(v, int) and not isinstance(v, bool)
                              else str(v)))
    bad = data.get("infeasible")
    if isinstance(bad, dict) and bad:
        run.facts.append(("commonest reasons a layout cannot run",
                          "; ".join(f"{r} ({n:,})" for r, n in list(bad.items())[:3]
                                    if isinstance(n, int))))
    for key, label in (("best", "best"), ("best_without_headroom", "fastest without headroom"),
                       ("fast_pick", "fast pick")):
        b = data.get(key)
        if b is None:
            continue
        if not isinstance(b, dict) or not isinstance(b.get("execution"), dict):
            raise SpecError(src, f"{key}.execution", "missing or not an object")
        if key != "best" and b["execution"] == data["best"]["execution"]:
            continue
        run.layouts.append(Layout(label, b["execution"], {},
                                  _p_fits(b.get("p_fits"), src, f"{key}.p_fits")))
    own = Context()
    if not given.complete and ("model_file" in data or "system_file" in data):
        own = _context_from_files(run, p.parent, data.get("model_file"),
                                  data.get("system_file"), None, src)
    ctx = _merge(given, own)
    if not run.layouts:
        run.notes.append("no layout of the space can run (see the reasons above).")
    _own_figures(run, ctx, {"best": data.get("best"),
                            "fastest without headroom": data.get("best_without_headroom"),
                            "fast pick": data.get("fast_pick")})
    _evaluated(run, ctx, src, fill_stats=ctx.complete, need="")
    return run


def _advise(data: dict, src: str, given: Context) -> Run:
    for key in ("user", "near", "overall", "changes"):
        if key not in data:
            raise SpecError(src, key, "missing (advise --output has it)")
    run = Run(src, "advise", Path(src).name)
    run.user = _layout(data["user"], "your config", src, "user")
    for key in ("near", "overall"):
        if not isinstance(data[key], list):
            raise SpecError(src, key, "expected a list of layouts")
    run.near = [_layout(e, f"near #{k + 1}", src, f"near[{k}]")
                for k, e in enumerate(data["near"])]
    run.layouts = [_layout(e, f"best #{k + 1}", src, f"overall[{k}]")
                   for k, e in enumerate(data["overall"])]
    rec = data.get("recommended")
    if rec is not None:
        # advise's pick (the fewest changes among the layouts within 0.1% of
        # the best): first, unless it is the overall best itself
        if not isinstance(rec, dict):
            raise SpecError(src, "recommended", "expected a layout object or null")
        if not data["overall"] or rec.get("execution") != data["overall"][0].get("execution"):
            run.layouts.insert(0, _layout(rec, "recommended", src, "recommended"))
        else:
            run.layouts[0] = _layout(rec, "recommended (best #1)", src, "recommended")
    if not isinstance(data["changes"], list):
        raise SpecError(src, "changes", "expected a list of {field, from, to}")
    for k, c in enumerate(data["changes"]):
        if not isinstance(c, dict) or "field" not in c:
            raise SpecError(src, f"changes[{k}]", "expected an object with field, from, to")
    run.changes = data["changes"]
    gain = data.get("gain")
    if gain is not None and (isinstance(gain, bool) or not isinstance(gain, (int, float))):
        raise SpecError(src, "gain", f"expected a number, got {gain!r}")
    run.gain = gain
    for key in ("model", "system", "format"):
        if data.get(key) is not None:
            run.facts.append((key, str(data[key])))
    own = Context()
    names = {k: data.get(k) for k in ("model", "system")}
    if not given.complete and all(isinstance(v, str) and v for v in names.values()):
        from autopar.io.shipped import resolve
        try:
            own = load_context(resolve(names["model"], "models"),
                               resolve(names["system"], "systems"), None,
                               where=f"the shipped files {src} names")
        except SpecError:
            run.notes.append(f"the model {names['model']!r} or system {names['system']!r} is "
                             "not a shipped file: memory per stage is drawn as the file "
                             "reports it (give --model and --system to split it).")
    ctx = _merge(given, own)
    _evaluated(run, ctx, src, fill_stats=False, need="")
    return run


def _csv(p: Path, src: str):
    import pandas as pd
    try:
        return pd.read_csv(p)
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise SpecError(src, "(file)", f"not a readable CSV table: "
                        f"{' '.join(str(e).split())[:120]}") from None


def _numbers(frame, col: str, src: str):
    import pandas as pd
    v = pd.to_numeric(frame[col], errors="coerce")
    bad = frame[col].notna() & v.isna()
    if bad.any():
        raise SpecError(src, col, f"row {int(bad.idxmax()) + 2}: not a number: "
                        f"{frame[col][bad].iloc[0]!r}")
    return v


def _trials(frame, src: str, given: Context) -> Run:
    from autopar.io.layouts import execution_from_row
    run = Run(src, "tune --trials-out", Path(src).name)
    rate = _numbers(frame, "sample_rate", src)
    trial = _numbers(frame, "trial", src)
    if trial.isna().any():
        raise SpecError(src, "trial", "empty cell")
    frame = frame.assign(sample_rate=rate, trial=trial)
    ok = frame[rate.notna() & (rate > 0)]
    run.facts += [("trials", f"{len(frame):,}"), ("feasible", f"{len(ok):,}")]
    order = frame.sort_values("trial", kind="stable")
    best, xs, ys = -math.inf, [], []
    for t, r in zip(order["trial"], order["sample_rate"]):
        if r == r and r > best:
            best = r
        if best > 0:
            xs.append(float(t) + 1)
            ys.append(float(best))
    if xs:
        run.progress = [{"name": "best so far", "x": xs, "y": ys}]
        run.progress_label = ("trial (counted from 1)", "best sample rate (samples/s)")
    top = ok.sort_values("sample_rate", ascending=False, kind="stable").head(TABLE_LAYOUTS)
    stat_cols = [c for c in frame.columns if c in _stat_names()]
    for _, row in top.iterrows():
        try:
            ex = execution_from_row(row)
        except (KeyError, ValueError) as e:
            raise SpecError(src, "(columns)", f"a trial's layout cannot be read: {e}") from None
        stats = {c: (None if row[c] != row[c] else float(row[c])) for c in stat_cols}
        run.layouts.append(Layout(f"trial {int(row['trial'])}", ex, stats))
    evaluate(given, run.layouts, src, fill_stats=True)    # trials: the file's peaks replaced
    _capacity(run, given)
    _needs_context(run, given, "tune's trials hold the totals only")
    if given.complete:
        run.facts.append(("evaluated with", f"{given.model.name} on {given.system.name}"))
    return run


def _stat_names():
    from autopar.model import STATS
    return set(STATS)


def _curves(frame, src: str) -> list[dict]:
    """Median regret and interquartile band per sampler and trial (over seeds)."""
    import numpy as np
    from autopar.studies.regret import regret_matrix
    for c in ("trial", "regret"):
        frame = frame.assign(**{c: _numbers(frame, c, src)})
    out = []
    for name, sub in frame.groupby("sampler", sort=False):
        sub = sub.dropna(subset=["trial", "regret"])
        if sub.empty:
            continue
        length = int(sub["trial"].max())
        mat = regret_matrix(sub, length)
        q1, med, q3 = np.percentile(mat, [25, 50, 75], axis=0)
        x = list(range(1, length + 1))
        out.append({"name": f"{name} ({mat.shape[0]} seeds)", "x": x, "y": med.tolist(),
                    "lo": q1.tolist(), "hi": q3.tolist()})
    return out


def _budget_curves(frame, src: str) -> list[dict]:
    """Regret at each budget from a summary table (``regret_median@B``...)."""
    budgets = sorted(int(c.split("@")[1]) for c in frame.columns
                     if c.startswith("regret_median@") and c.split("@")[1].isdigit())
    out = []
    for _, row in frame.iterrows():
        if str(row["sampler"]) == "exhaustive" or not budgets:
            continue
        get = [[_cell(row, f"regret_{k}@{b}", src) for b in budgets]
               for k in ("median", "q1", "q3")]
        out.append({"name": str(row["sampler"]), "x": budgets, "y": get[0], "lo": get[1],
                    "hi": get[2], "marks": True})
    return out


def _cell(row, col: str, src: str):
    v = row.get(col)
    try:
        return float(v)
    except (TypeError, ValueError):
        raise SpecError(src, col, f"not a number: {v!r}") from None


def _sampler_rows(frame) -> list[dict]:
    keep = ("sampler", "runs", "trials", "trials_to_5pct", "trials_to_1pct", "pruned_fraction",
            "ms_per_trial")
    return [{k: row[k] for k in keep if k in frame.columns} for _, row in frame.iterrows()]


def _compare(p: Path, src: str, given: Context) -> Run:
    from autopar.io.specs import read_json
    opt_src = str(p / "optimum.json")
    opt = read_json(p / "optimum.json")
    if not isinstance(opt, dict) or not isinstance(opt.get("execution"), dict):
        raise SpecError(opt_src, "execution", "missing or not an object")
    run = Run(src, "compare", opt.get("name") or p.name)
    for key in ("model_name", "system_name", "num_procs", "max_batch_size", "datatype",
                "space", "space_size", "feasible_layouts", "sample_rate"):
        if key in opt:
            v = opt[key]
            run.facts.append((key.replace("_", " ").replace(" name", ""),
                              f"{v:,}" if isinstance(v, int) and not isinstance(v, bool)
                              else (f"{v:.4g}" if isinstance(v, float) else str(v))))
    run.layouts = [Layout("optimum", opt["execution"], {})]
    if (p / "curves.csv").is_file():
        run.curves = _curves(_csv(p / "curves.csv", str(p / "curves.csv")),
                             str(p / "curves.csv"))
    if (p / "summary.csv").is_file():
        frame = _csv(p / "summary.csv", str(p / "summary.csv"))
        if "sampler" not in frame.columns:
            raise SpecError(str(p / "summary.csv"), "sampler", "missing column")
        run.sampler_rows = _sampler_rows(frame)
    own = Context() if given.complete else _context_from_files(
        run, p, opt.get("model"), opt.get("system"), opt.get("framework"), opt_src)
    ctx = _merge(given, own)
    _own_figures(run, ctx, {"optimum": {"sample_rate": opt.get("sample_rate")}})
    _evaluated(run, ctx, opt_src, fill_stats=ctx.complete, need="")
    return run


def _codesign(p: Path, src: str, given: Context) -> Run:
    from autopar.io.specs import read_json
    s_src = str(p / "summary.json")
    summ = read_json(p / "summary.json")
    if not isinstance(summ, dict):
        raise SpecError(s_src, "(root)", "expected a JSON object")
    run = Run(src, "codesign", str(summ.get("study") or p.name))
    objectives = summ.get("objectives") or ["sample_rate"]
    if not isinstance(objectives, list) or not all(isinstance(o, str) for o in objectives):
        raise SpecError(s_src, "objectives", "expected a list of names")
    for key in ("search", "evaluated", "feasible", "pruned", "seconds", "best_sample_rate",
                "hypervolume"):
        if key in summ and not isinstance(summ[key], (dict, list)):
            v = summ[key]
            run.facts.append((key.replace("_", " "), f"{v:.4g}" if isinstance(v, float)
                              else str(v)))
    f_src = str(p / "front.csv")
    front = _csv(p / "front.csv", f_src)
    x_name = objectives[1] if len(objectives) > 1 else "num_procs"
    for col in ("sample_rate", x_name):
        if col not in front.columns:
            raise SpecError(f_src, col, "missing column")
    xs, ys = _numbers(front, x_name, f_src), _numbers(front, "sample_rate", f_src)
    hw = [c for c in front.columns if "." in c or c.startswith("networks[")]
    labels = [", ".join(f"{c} {row[c]}" for c in hw if row[c] == row[c])
              for _, row in front.iterrows()]
    sets = []
    table = p / ("systems.csv" if (p / "systems.csv").is_file() else "trials.csv")
    if table.is_file():
        every = _csv(table, str(table))
        if x_name in every.columns and "sample_rate" in every.columns:
            sets.append({"name": "every system evaluated", "x": _numbers(every, x_name, str(table))
                         .tolist(), "y": _numbers(every, "sample_rate", str(table)).tolist(),
                         "colour": "#bbbbbb", "size": 2})
    sets.append({"name": "Pareto front", "x": xs.tolist(), "y": ys.tolist(), "labels": labels,
                 "steps": len(objectives) > 1, "colour": "#D55E00", "size": 4.5})
    rows = []
    for k, (_, row) in enumerate(front.iterrows()):
        rows.append({"point": k, x_name: row[x_name], "sample_rate": row["sample_rate"],
                     "hardware": labels[k], "execution": _json_cell(row.get("execution"))})
    run.front = {"x_label": x_name.replace("_", " "), "sets": sets, "rows": rows,
                 "x_name": x_name}
    if (p / "curves.csv").is_file():
        run.curves = _curves(_csv(p / "curves.csv", str(p / "curves.csv")),
                             str(p / "curves.csv"))
    elif (p / "regret.csv").is_file():
        frame = _csv(p / "regret.csv", str(p / "regret.csv"))
        if "sampler" not in frame.columns:
            raise SpecError(str(p / "regret.csv"), "sampler", "missing column")
        run.curves = _budget_curves(frame, str(p / "regret.csv"))
        run.curves_by_budget = True
        run.sampler_rows = _sampler_rows(frame)
    return run


def _json_cell(v):
    import json
    if not isinstance(v, str):
        return None
    try:
        d = json.loads(v)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _cliffs(p: Path, src: str) -> Run:
    c_src = str(p / "cliffs.csv")
    frame = _csv(p / "cliffs.csv", c_src)
    for col in ("num_procs", "sample_rate_per_proc"):
        if col not in frame.columns:
            raise SpecError(c_src, col, "missing column")
    run = Run(src, "cliffs", p.name)
    x = _numbers(frame, "num_procs", c_src)
    y = _numbers(frame, "sample_rate_per_proc", c_src)
    run.progress = [{"name": "best layout at each count", "x": x.tolist(), "y": y.tolist()}]
    run.progress_label = ("processors", "samples/s per processor")
    run.facts += [("processor counts", f"{len(frame):,}"),
                  ("best per processor", f"{y.max():.4g} at {int(x[y.idxmax()]):,}"
                   if y.notna().any() else "-")]
    return run
