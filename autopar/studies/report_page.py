"""One self-contained HTML page from the runs ``autopar.studies.report``
read: inline CSS, charts as inline SVG (``autopar.studies.svg``), no script,
no external font, image or link, so it opens the same with no network.

Per run: what it is and its figures, the user's config beside the best (an
advise file), the best layouts (table), memory per stage against the
processor's capacity (stacked bars, a capacity line and, where the system
sets one, the headroom line), the time breakdown per batch (stacked bars),
regret curves and Pareto fronts where the run has them.
"""
from __future__ import annotations

import math
from html import escape

from autopar.studies import svg
from autopar.studies.report import STAGE_PARTS, TABLE_LAYOUTS, TOP_LAYOUTS, GIB, Layout, Run

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
margin:0 auto;max-width:1100px;padding:16px 28px 40px;color:#222;background:#fff}
h1{font-size:1.6em;margin:.4em 0 .1em}h2{font-size:1.3em;margin:1.6em 0 .3em;
border-bottom:2px solid #0072B2;padding-bottom:3px}h3{font-size:1.05em;margin:1.2em 0 .4em}
.meta{color:#555;font-size:.9em}.note{background:#fff7e0;border-left:4px solid #E69F00;
padding:6px 10px;margin:8px 0;font-size:.9em}
table{border-collapse:collapse;font-size:.85em;margin:6px 0 10px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f2f5f9}td.l,th.l{text-align:left}td.wrap{white-space:normal;min-width:12em;max-width:20em}
.scroll{overflow-x:auto}tr.user td{background:#fff3f0}
tr.best td{background:#eef7ee}dl.facts{display:grid;grid-template-columns:max-content auto;
gap:2px 14px;font-size:.9em;margin:6px 0}dl.facts dt{color:#555}dl.facts dd{margin:0}
svg.chart{display:block;max-width:100%;height:auto;margin:4px 0 12px}
svg .grid{stroke:#e6e6e6;stroke-width:1}svg .axis{stroke:#555;stroke-width:1}
svg text{font-size:11px;fill:#333}svg .axis-label{font-size:12px;fill:#222}
svg .value{font-size:10px;fill:#444;paint-order:stroke;stroke:#fff;stroke-width:3px}.gain{font-size:1.15em;font-weight:600;color:#007050}
code{background:#f4f4f4;padding:0 3px}nav a{margin-right:12px}
"""

# Layout fields shown as table columns; the others are summarised in "other".
COLUMNS = (("TP", "tensor_par"), ("PP", "pipeline_par"), ("DP", "data_par"),
           ("CP", "context_par"), ("EP", "expert_par"), ("mbs", "microbatch_size"),
           ("batch", "batch_size"), ("VP", "pipeline_interleaving"),
           ("recompute", "activation_recompute"), ("TP comm", "tensor_par_comm_type"))
# true/false fields, by a short name
FLAGS = {"optimizer_sharding": "optimizer sharded", "weight_sharding": "weights sharded",
         "data_par_overlap": "DP overlap", "seq_par_ag_redo": "SP all-gather redo",
         "weight_offload": "weights offloaded", "activations_offload": "activations offloaded",
         "optimizer_offload": "optimizer offloaded", "fused_activation": "fused activation"}
SHOWN = {f for _, f in COLUMNS} | set(FLAGS) | {
    "num_procs", "datatype", "training", "tensor_par_net", "pipeline_par_net", "data_par_net",
    "attention_type"}


def _num(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return escape(str(v))


def _stat(lay: Layout, key: str):
    v = lay.stats.get(key) if lay.stats else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _other(ex: dict) -> str:
    on = [name for f, name in FLAGS.items() if ex.get(f) is True]
    rest = [f"{k}={v}" for k, v in ex.items() if k not in SHOWN and v not in (None, False)]
    if ex.get("tensor_par_overlap") not in (None, "none"):
        rest = [r for r in rest if not r.startswith("tensor_par_overlap")] + \
               [f"tp overlap {ex['tensor_par_overlap']}"]
    else:
        rest = [r for r in rest if not r.startswith("tensor_par_overlap")]
    return ", ".join(on + rest)


def layout_table(layouts: list[Layout], classes: dict | None = None) -> str:
    # context and expert parallelism only where some layout uses them
    columns = [(c, f) for c, f in COLUMNS if f not in ("context_par", "expert_par")
               or any(lay.execution.get(f, 1) not in (1, None) for lay in layouts)]
    head = ["", "samples/s", "batch time (s)", "tier-1 peak (GiB)", "P(fits)"] + \
        [c for c, _ in columns] + ["other settings"]
    rows = ["<tr>" + "".join(f'<th class="{"l" if i in (0, len(head) - 1) else ""}">'
                             f'{escape(h)}</th>' for i, h in enumerate(head)) + "</tr>"]
    for lay in layouts[:TABLE_LAYOUTS]:
        ex = lay.execution
        peak = _stat(lay, "proc_mem_tier1_cap_req")
        rate = _num(_stat(lay, "sample_rate"))
        if lay.reason is not None:
            rate = f'<span title="{escape(lay.reason)}">cannot run</span>'
        cells = [rate, _num(_stat(lay, "total_time")),
                 _num(peak / GIB if peak is not None else None),
                 _num(lay.p_fits, 3)] + [_num(ex.get(f, 1 if f in ("context_par", "expert_par")
                                                 else None)) for _, f in columns]
        cls = (classes or {}).get(lay.label, "")
        rows.append(f'<tr class="{cls}"><td class="l">{escape(lay.label)}</td>'
                    + "".join(f"<td>{c}</td>" for c in cells)
                    + f'<td class="l wrap">{escape(_other(ex))}</td></tr>')
    why = "".join(f'<p class="note">{escape(lay.label)} cannot run: {escape(lay.reason)}</p>'
                  for lay in layouts[:TABLE_LAYOUTS] if lay.reason is not None)
    return '<div class="scroll"><table class="layouts">' + "".join(rows) + "</table></div>" + why


def memory_chart(run: Run, layouts: list[Layout]) -> str:
    """Memory per stage of each layout, stacked by kind, against capacity."""
    bars = []
    for lay in layouts:
        if lay.stages:
            for stage, vals in lay.stages:
                bars.append((f"{lay.label}: {stage}", vals))
        else:
            peak = _stat(lay, "proc_mem_tier1_cap_req")
            if peak is not None:
                bars.append((f"{lay.label}: peak stage", [0.0, 0.0, 0.0, peak / GIB]))
    if not bars:
        return ""
    used = [i for i in range(len(STAGE_PARTS)) if any(v[i] > 0 for _, v in bars)]
    bars = [(label, [vals[i] for i in used]) for label, vals in bars]
    lines = []
    if run.capacity_gib is not None:
        lines.append((f"capacity {run.capacity_gib:g} GiB", run.capacity_gib, "#C00000"))
        if run.headroom_gib > 0:
            lines.append((f"capacity less headroom {run.headroom_gib:g} GiB",
                          run.capacity_gib - run.headroom_gib, "#E69F00"))
    width = max(svg.WIDTH, 110 * len(bars) + svg.LEFT + svg.RIGHT)
    return svg.stacked_bars(bars, [STAGE_PARTS[i] for i in used], "GiB per processor (tier 1)",
                            lines=lines, title="memory per stage", width=width)


def time_chart(layouts: list[Layout]) -> str:
    from autopar.model.breakdown import EXTRA_TIME_ROWS, TIME_ROWS
    have = [lay for lay in layouts if _stat(lay, "total_time") is not None]
    if not have:
        return ""
    rows = TIME_ROWS + tuple(r for r in EXTRA_TIME_ROWS
                             if any((_stat(lay, k) or 0) > 0 for lay in have for k in r[1]))
    known = [r for r in rows if any(_stat(lay, k) is not None for lay in have for k in r[1])]
    if not known:
        return ""
    bars = [(lay.label, [sum(_stat(lay, k) or 0.0 for k in keys) for _, keys in known])
            for lay in have]
    return svg.stacked_hbars(bars, [label for label, _ in known], "seconds per batch",
                             title="time per batch")


def _facts(run: Run) -> str:
    if not run.facts:
        return ""
    return '<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                                          for k, v in run.facts) + "</dl>"


def _advise(run: Run) -> str:
    out = ["<h3>Your config beside the best</h3>"]
    if run.gain is not None:
        out.append(f'<p class="gain">predicted gain: {run.gain * 100:+.1f}% samples/s'
                   f' ({run.gain + 1:.3g}x)</p>' if abs(run.gain) < 100 else
                   f'<p class="gain">predicted gain: {run.gain:.4g}</p>')
    if run.changes:
        out.append("<table><tr><th class=l>field</th><th class=l>yours</th>"
                   "<th class=l>the better config</th></tr>" + "".join(
                       f'<tr><td class="l">{escape(str(c.get("field")))}</td>'
                       f'<td class="l">{escape(str(c.get("from")))}</td>'
                       f'<td class="l">{escape(str(c.get("to")))}</td></tr>'
                       for c in run.changes) + "</table>")
    else:
        out.append("<p>No change: your config is the best found.</p>")
    best = run.layouts[:1] + run.near[:1]
    classes = {run.user.label: "user", **{b.label: "best" for b in best[:1]}}
    out.append(layout_table([run.user] + run.layouts[:3] + run.near[:3], classes))
    mem = memory_chart(run, [run.user] + best)
    if mem:
        out.append("<h3>Memory per stage: yours, the best, the best near yours</h3>" + mem)
    t = time_chart([run.user] + run.layouts[:3] + run.near[:3])
    if t:
        out.append("<h3>Time per batch</h3>" + t)
    return "".join(out)


def _front(run: Run) -> str:
    f = run.front
    out = ["<h3>Pareto front</h3>",
           svg.points(f["sets"], f["x_label"], "sample rate (samples/s)", title="Pareto front")]
    head = ["point", f["x_label"], "samples/s", "hardware", "TP", "PP", "DP", "mbs"]
    rows = ["<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for r in f["rows"]:
        ex = r["execution"] or {}
        rows.append(f"<tr><td>{r['point']}</td><td>{_num(_float(r[f['x_name']]))}</td>"
                    f"<td>{_num(_float(r['sample_rate']))}</td>"
                    f'<td class="l wrap">{escape(r["hardware"])}</td>'
                    + "".join(f"<td>{_num(ex.get(k))}</td>" for k in
                              ("tensor_par", "pipeline_par", "data_par", "microbatch_size"))
                    + "</tr>")
    out.append("<table>" + "".join(rows) + "</table>")
    return "".join(out)


def _float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _samplers(run: Run) -> str:
    if not run.sampler_rows:
        return ""
    keys = list(run.sampler_rows[0])
    rows = ["<tr>" + "".join(f"<th>{escape(k.replace('_', ' '))}</th>" for k in keys) + "</tr>"]
    for r in run.sampler_rows:
        rows.append("<tr>" + "".join(
            f'<td class="{"l" if k == "sampler" else ""}">{_num(_cell(r[k]))}</td>'
            for k in keys) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _cell(v):
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return int(v)
    return v


def section(run: Run, k: int) -> str:
    out = [f'<section id="run{k}"><h2>{escape(run.title)}</h2>',
           f'<p class="meta">{escape(run.kind)}: <code>{escape(run.source)}</code></p>',
           _facts(run)]
    out += [f'<p class="note">{escape(n)}</p>' for n in run.notes]
    if run.user is not None:
        out.append(_advise(run))
    elif run.layouts:
        out.append("<h3>Best layouts</h3>" + layout_table(run.layouts))
        shown = run.layouts[:TOP_LAYOUTS]
        mem = memory_chart(run, shown[:3])
        if mem:
            out.append("<h3>Memory per stage</h3>" + mem)
        t = time_chart(shown)
        if t:
            out.append("<h3>Time per batch</h3>" + t)
    if run.progress:
        x_label, y_label = run.progress_label
        out.append(f"<h3>{escape(y_label[0].upper() + y_label[1:])}</h3>"
                   + svg.lines(run.progress, x_label, y_label, title=y_label))
    if run.curves:
        how = ("median and interquartile range over seeds at each budget"
               if run.curves_by_budget else "median and interquartile range over seeds")
        out.append(f"<h3>Regret curves</h3><p class=meta>regret = 1 - best found / optimum; "
                   f"{how}</p>" + svg.lines(run.curves, "trials", "regret", log_x=True,
                                            title="regret curves"))
    out.append(_samplers(run))
    if run.front:
        out.append(_front(run))
    out.append("</section>")
    return "".join(out)


def page(runs: list[Run], title: str) -> str:
    nav = "".join(f'<a href="#run{k}">{escape(r.title)}</a>' for k, r in enumerate(runs)) \
        if len(runs) > 1 else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1><p class=\"meta\">autopar report of "
            f"{len(runs)} run output{'s' if len(runs) != 1 else ''}; predictions of autopar's "
            "analytical model</p>"
            + (f"<nav>{nav}</nav>" if nav else "")
            + "".join(section(r, k) for k, r in enumerate(runs)) + "</body></html>\n")
