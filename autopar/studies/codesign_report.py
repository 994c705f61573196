"""Co-design outputs: tables, front exports, plots and a summary.

Everything is computed first and each file written atomically
(``autopar.io.writers``), so an error leaves no half-written result.

Files (in the output folder):

``trials.csv`` (a sampler run) or ``systems.csv`` (every system)
    one row per trial / system: the hardware values, ``num_procs``, ``cost``,
    ``sample_rate`` (best layout), ``reason`` when pruned, the winner's
    breakdown and its ``execution`` (JSON).
``front.csv``, ``front/NN/system.json``, ``front/NN/execution.json``
    the Pareto front (the best point with one objective), cheapest first,
    with a system and an execution file per point that ``autopar estimate``
    re-evaluates to the reported figures.
``front.png``
    sample rate against cost (or processors): every evaluated system, the
    front, and with a comparison the true front and each sampler's.
``curves.csv``, ``regret.csv``, ``runs.csv``, ``regret.png`` (comparison)
    regret per trial, the per-sampler summary (``autopar.studies.regret``), one row
    per run, and the regret plot.
``summary.json``
    the figures above in one place.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from autopar.io.writers import atomic_path, json_value, write_atomic_csv, write_json


def regret_name(st) -> str:
    """What the comparison's regret is: of the hypervolume with two
    objectives (``autopar.studies.codesign``: ``hypervolume_curve``), else
    of the best sample rate."""
    return "hypervolume regret" if len(st.objectives) == 2 else "regret"


def regret_formula(st) -> str:
    """The regret as the axis writes it (``regret_note`` says what is what)."""
    return "1 - HV / HV*" if len(st.objectives) == 2 else "1 - best / optimum"


def regret_note(st, systems: int) -> str:
    if len(st.objectives) == 2:
        return (f"{regret_name(st)} = 1 - HV / HV*; HV: hypervolume of the front found so far, "
                f"HV*: of the true front ({systems} systems)")
    return (f"regret = 1 - best / optimum; best: the highest sample rate found so far, "
            f"optimum: the ground truth's ({systems} systems)")


def front_files(res, front) -> list[tuple[str, dict, dict, dict]]:
    """(folder name, system JSON, execution JSON, summary entry) per front point."""
    from autopar.io.specs import system_to_json
    st = res.study
    hw = st.hardware
    out = []
    width = max(2, len(str(len(front) - 1)))
    for k, (_, row) in enumerate(front.iterrows()):
        values = {n: json_value(row[n]) for n in hw.names if n in row and n != "num_procs"
                  and row[n] == row[n]}
        values = hw.canonical(values)
        if "num_procs" in hw.names:
            values = {"num_procs": int(row["num_procs"]), **values}
        system = hw.system(values)
        sj = system_to_json(system)
        label = ", ".join(f"{n}={v:g}" for n, v in values.items()) or "base system"
        sj["name"] = f"{st.name}-front-{k:0{width}d}"
        sj["description"] = (f"co-design study {st.name}, front point {k}: {label} "
                             f"(from {hw.base.get('name') or 'the base system'})")
        ex = json.loads(row["execution"])
        folder = f"front/{k:0{width}d}"
        entry = {"point": k, **{n: json_value(v) for n, v in values.items()},
                 "num_procs": int(row["num_procs"]), "cost": json_value(row["cost"]),
                 "sample_rate": json_value(row["sample_rate"]),
                 "sample_rate_per_proc": json_value(row["sample_rate_per_proc"]),
                 "total_time": json_value(row["total_time"]),
                 "system": f"{folder}/system.json", "execution": f"{folder}/execution.json"}
        out.append((folder, sj, ex, entry))
    return out


def write_outputs(res, out_dir) -> tuple[Path, ...]:
    out = Path(out_dir)
    st = res.study
    files = front_files(res, res.front)
    front = res.front.copy()
    front.insert(0, "point", range(len(front)))
    front["system_file"] = [f[0] + "/system.json" for f in files]
    front["execution_file"] = [f[0] + "/execution.json" for f in files]
    written = []
    table_name = "systems.csv" if "system" in res.table.columns else "trials.csv"
    summary = summary_dict(res, [f[3] for f in files])
    from autopar.io.writers import file_ref
    for k in ("model", "system"):      # the files, from the summary's folder
        summary[f"{k}_file"] = file_ref(getattr(st.case, f"{k}_file"), out)
    # Plots first: the slowest part, and nothing is on disk if they fail.
    pngs = {"front.png": lambda p: plot_front(res, p)}
    if res.curves is not None:
        from autopar.studies.regret import plot
        note = regret_note(st, len(res.truth))
        pngs["regret.png"] = lambda p: plot(res.curves, [s.name for s in st.compare.samplers], p,
                                            title=f"{st.name}: outer samplers", note=note,
                                            ylabel=f"{regret_name(st)} = {regret_formula(st)}")
    for name, fn in pngs.items():
        fn(out / name)
        written.append(out / name)
    write_atomic_csv(res.table, out / table_name)
    written.append(out / table_name)
    write_atomic_csv(front, out / "front.csv")
    written.append(out / "front.csv")
    for folder, sj, ex, _ in files:
        write_json(sj, out / folder / "system.json")
        write_json(ex, out / folder / "execution.json")
        written += [out / folder / "system.json", out / folder / "execution.json"]
    if res.curves is not None:
        import pandas as pd
        curves = res.curves
        if len(st.objectives) == 2:
            curves = curves.rename(columns={"sample_rate": "hypervolume",
                                            "best_sample_rate": "best_hypervolume"})
        write_atomic_csv(curves, out / "curves.csv")
        write_atomic_csv(res.regret, out / "regret.csv")
        write_atomic_csv(pd.DataFrame(res.runs), out / "runs.csv")
        written += [out / "curves.csv", out / "regret.csv", out / "runs.csv"]
    write_json(summary, out / "summary.json")
    written.append(out / "summary.json")
    return tuple(written)


def summary_dict(res, points) -> dict:
    st = res.study
    t = res.table
    done = t["state"] == "COMPLETE"
    d = {"study": st.name, "source": st.source, "objectives": list(st.objectives),
         "search": "compare" if st.compare else st.search.sampler,
         "inner": st.inner.to_dict(), "space": st.case.space.name,
         "hardware": {n: ({"values": list(d.values)} if d.discrete else
                          {"min": d.low, "max": d.high, "log": d.log}) | {"cost": d.cost}
                      for n, d in zip(st.hardware.names, st.hardware.dims)},
         "cost": {"processor": st.hardware.processor_cost, "fixed": st.hardware.fixed_cost},
         "evaluated": int(len(t)), "feasible": int(done.sum()), "pruned": int((~done).sum()),
         "seconds": round(res.seconds, 3), "parallel": st.parallel, "workers": st.workers,
         "front": points}
    if res.hypervolume is not None:
        d["hypervolume"] = res.hypervolume
        d["hypervolume_reference"] = {st.objectives[0]: 0.0 - res.reference[0],
                                      st.objectives[1]: res.reference[1]}
    if done.any():
        best = t[done].loc[t[done]["sample_rate"].idxmax()]
        d["best_sample_rate"] = float(best["sample_rate"])
    if res.base is not None:
        b = res.base
        d["base_system"] = {**{n: json_value(b[n]) for n in st.hardware.names if n in b},
                            "cost": json_value(b["cost"]), "sample_rate": json_value(b["sample_rate"]),
                            "state": b["state"], "reason": b["reason"]}
    if res.curves is not None:
        d["systems"] = int(len(res.truth))
        d["ground_truth_seconds"] = round(res.truth_seconds, 3)
        d["runs"] = res.runs
        d["regret"] = json.loads(res.regret.to_json(orient="records"))
    return d


def summary_text(res) -> str:
    st = res.study
    t = res.table
    done = int((t["state"] == "COMPLETE").sum())
    lines = [f"study {st.name}: {len(t)} systems evaluated, {done} feasible, "
             f"{len(t) - done} pruned, {res.seconds:.1f} s"]
    if res.hypervolume is not None:
        lines.append(f"hypervolume {res.hypervolume:.6g}")
    second = st.objectives[1] if len(st.objectives) == 2 else "cost"
    lines.append(f"front ({len(res.front)} points): {second}, sample rate, system")
    for k, (_, r) in enumerate(res.front.iterrows()):
        vals = ", ".join(f"{n}={r[n]:g}" for n in st.hardware.names
                         if n in r and r[n] == r[n])
        lines.append(f"  {k:2d}  {r[second]:.6g}  {r['sample_rate']:.4f}/s  {vals}")
    if res.base is not None and res.base["state"] == "COMPLETE":
        lines.append(f"base system: {res.base[second]:.6g}  {res.base['sample_rate']:.4f}/s")
    if res.regret is not None:
        what = regret_name(st)
        b = max(st.compare.budgets)
        lines.append(f"{what}: median after {b} trials; trials to within 1%: median")
        for _, r in res.regret.iterrows():
            if r["sampler"] == "exhaustive":      # the ground truth: no regret curve
                lines.append(f"  {'exhaustive':>12}: the ground truth, every one of "
                             f"{int(r['trials']):,} systems in {r['seconds_per_run']:.1f} s "
                             f"(regret 0 once all are evaluated)")
                continue
            lines.append(f"  {r['sampler']:>12}: regret@{b} median "
                         f"{r.get(f'regret_median@{b}', math.nan):.4f}, trials to 1%: "
                         f"{r['trials_to_1pct']}")
    return "\n".join(lines)


def front_key(res, scale: float = 1.0, x_name: str = "cost") -> list[str]:
    """The front's points as the lines of a fixed-width table: the number a
    point has on the plot (and in front.csv), its cost (or second
    objective), sample rate and hardware values, one column per dimension."""
    st = res.study
    names = [n for n in st.hardware.names if n in res.front.columns]
    xl = "cost (M)" if scale == 1e6 else x_name.replace("_", " ")
    head = ["#", xl, "samples/s", *names]
    rows = []
    for k, (_, r) in enumerate(res.front.iterrows()):
        x = r[x_name] / scale
        rows.append([str(k), f"{x:.4g}" if scale != 1 or abs(x) < 1e3 else f"{x:,.0f}",
                     f"{r['sample_rate']:.2f}",
                     *("-" if r[n] != r[n] else f"{r[n]:g}" for n in names)])
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    return ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [head, *rows]]


def plot_front(res, path) -> None:
    """Sample rate against cost: every evaluated system, the front (with a
    comparison, the true front and each sampler's); the front's points are
    numbered, and a key beside the plot gives each number's hardware, so
    that the picture reads without front.csv."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    st = res.study
    x_name = st.objectives[1] if len(st.objectives) == 2 else "cost"
    t = res.table
    ok = t["state"] == "COMPLETE"
    scale = 1e6 if x_name == "cost" and t.loc[ok, "cost"].max() > 1e7 else 1.0
    xl = "cost (millions)" if scale == 1e6 else x_name.replace("_", " ")
    key = front_key(res, scale, x_name)
    key_font = 6.5 if len(key) <= 30 else 6.0
    # in inches: title, plot, axis labels, then the key of the front's points
    key_height = (len(key) + 1) * key_font * 1.25 / 72 + 0.1
    width = max(7.5, max(len(line) for line in key) * key_font * 0.62 / 72 + 0.6)
    h = 0.35 + 3.8 + 0.65 + key_height
    fig = Figure(figsize=(width, h), dpi=120)
    ax = fig.add_axes((0.8 / width, (key_height + 0.65) / h, (width - 1.0) / width, 3.8 / h))
    ax.scatter(t.loc[ok, x_name] / scale, t.loc[ok, "sample_rate"], s=6, color="0.75",
               label=f"evaluated systems ({int(ok.sum())})", zorder=1)
    colors = matplotlib.colormaps["tab10"]

    def stairs(front, **kw):
        if len(front):
            x = front[x_name].to_numpy() / scale
            y = front["sample_rate"].to_numpy()
            ax.step(x, y, where="post", **kw)
    if res.curves is not None:
        for i, (label, fr) in enumerate(res.sampler_fronts.items()):
            stairs(fr, color=colors(i), linewidth=1.1, marker="x", markersize=4, alpha=0.85,
                   label=f"{label} front, seed {st.compare.seeds[0]} ({len(fr)} points)",
                   zorder=2)
        stairs(res.front, color="k", linewidth=1.4, linestyle="--", marker="o",
               markersize=3, label=f"true front ({len(res.front)} points, numbered)", zorder=3)
        mark = "k"
    else:
        stairs(res.front, color=colors(0), linewidth=1.6, marker="o", markersize=4,
               label=f"front ({len(res.front)} points, numbered)", zorder=3)
        mark = colors(0)
    ax.get_xlim(), ax.get_ylim()           # (the limits set, data -> pixels is final)
    placed: list = []
    for k, (_, r) in enumerate(res.front.iterrows()):
        xy = (r[x_name] / scale, r["sample_rate"])
        px = ax.transData.transform(xy)
        # numbers that would overprint a neighbour's are left out (the key
        # below lists every point); alternate sides for the rest
        if k != len(res.front) - 1 and any(abs(px[0] - q[0]) < 11 and abs(px[1] - q[1]) < 9
                                           for q in placed):
            continue
        placed.append(px)
        ax.annotate(str(k), xy, xytext=(4, -9) if len(placed) % 2 else (-10, 4),
                    textcoords="offset points", fontsize=6.5, color=mark, zorder=5)
    b = res.base
    if b is not None and b["state"] == "COMPLETE":
        ax.scatter([b[x_name] / scale], [b["sample_rate"]], marker="*", s=110, color="tab:red",
                   zorder=4, label=f"base system {st.hardware.base.get('name', '')}".rstrip())
    ax.set_xlabel(xl)
    ax.set_ylabel("best sample rate (samples/s)")
    ax.grid(True, color="0.9", linewidth=0.6)
    ax.set_title(f"{st.name}: sample rate against {x_name.replace('_', ' ')}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    fig.text(0.25 / width, key_height / h, "front points, as in front.csv (the plot "
             "numbers those it has room for)\n" + "\n".join(key), family="monospace", fontsize=key_font,
             va="top", ha="left")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
