"""Charts as inline SVG text, for pages that must work with no network.

Four kinds, each a function that returns one ``<svg>`` element as a string:
``stacked_bars`` (vertical, with an optional capacity line: memory per
stage), ``stacked_hbars`` (horizontal: a time breakdown), ``lines`` (curves
with optional bands, linear or logarithmic axes: regret curves) and
``points`` (scatter plots with optional step lines: Pareto fronts).  Every
text is escaped; every mark carries a ``<title>``, which a browser shows on
hover.  No script, no external font: the page's own CSS sets the font.
"""
from __future__ import annotations

import math
from html import escape

# Colour-blind-safe palette (Okabe-Ito, then Tol's muted), cycled.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00",
           "#F0E442", "#332288", "#88CCEE", "#44AA99", "#999933", "#AA4499", "#777777")

WIDTH = 720
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 16, 46
LEGEND_ROW = 18


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def fmt(v: float) -> str:
    """A number as a tick or tooltip shows it: 4 significant digits."""
    if v is None or not math.isfinite(v):
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(v) >= scale:
            return f"{v / scale:.4g}{suffix}"
    if v != 0 and abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:.4g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t < hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(t, 12))
        t += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten covering [lo, hi] (with 2 and 5 between when few)."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if b == a:
        b = a + 1
    mult = (1, 2, 5) if b - a <= 2 else (1,)
    return [m * 10.0 ** e for e in range(a, b + 1) for m in mult
            if lo / 1.0001 <= m * 10.0 ** e <= hi * 1.0001] or [10.0 ** a, 10.0 ** b]


class _Axis:
    """A linear or logarithmic mapping from data to pixels."""

    def __init__(self, lo: float, hi: float, p0: float, p1: float, log: bool = False,
                 ticks: list[float] | None = None):
        self.log = log
        if log:
            lo, hi = max(lo, 1e-300), max(hi, lo * 10)
            self.ticks = ticks or log_ticks(lo, hi)
            lo, hi = min(lo, self.ticks[0]), max(hi, self.ticks[-1])
        else:
            self.ticks = ticks or nice_ticks(lo, hi)
            lo, hi = min(lo, self.ticks[0]), max(hi, self.ticks[-1])
        self.lo, self.hi, self.p0, self.p1 = lo, hi, p0, p1

    def __call__(self, v: float) -> float:
        if self.log:
            v = max(v, self.lo)
            f = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            f = (v - self.lo) / (self.hi - self.lo) if self.hi > self.lo else 0.0
        return self.p0 + f * (self.p1 - self.p0)


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
            f'aria-label="{escape(label)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">' + "".join(body) + "</svg>")


def _legend(items: list[tuple[str, str, str]], y: float, width: int) -> tuple[list[str], float]:
    """Legend entries (name, colour, kind: box|line|dash) in rows from ``y``;
    returns the marks and the height used."""
    out, x, row = [], LEFT, 0
    for name, col, kind in items:
        w = 26 + 7 * len(name)
        if x + w > width - RIGHT and x > LEFT:
            x, row = LEFT, row + 1
        yy = y + row * LEGEND_ROW
        if kind == "box":
            out.append(f'<rect x="{x}" y="{yy - 9}" width="12" height="10" fill="{col}"/>')
        else:
            dash = ' stroke-dasharray="5 3"' if kind == "dash" else ""
            out.append(f'<line x1="{x}" y1="{yy - 4}" x2="{x + 14}" y2="{yy - 4}" '
                       f'stroke="{col}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 18}" y="{yy}" class="legend">{escape(name)}</text>')
        x += w
    return out, (row + 1) * LEGEND_ROW if items else 0


def _y_axis(ax: _Axis, x0: float, x1: float, label: str) -> list[str]:
    out = []
    for t in ax.ticks:
        y = ax(t)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                   f'{escape(fmt(t))}</text>')
    mid = (ax.p0 + ax.p1) / 2
    out.append(f'<text x="14" y="{mid:.1f}" transform="rotate(-90 14 {mid:.1f})" '
               f'text-anchor="middle" class="axis-label">{escape(label)}</text>')
    return out


def _x_axis(ax: _Axis, y0: float, y1: float, label: str, width: int) -> list[str]:
    out = []
    for t in ax.ticks:
        x = ax(t)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}" class="grid"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle" class="tick">'
                   f'{escape(fmt(t))}</text>')
    out.append(f'<text x="{(LEFT + width - RIGHT) / 2:.1f}" y="{y0 + 34}" text-anchor="middle" '
               f'class="axis-label">{escape(label)}</text>')
    return out


def stacked_bars(bars: list[tuple[str, list[float]]], series: list[str], y_label: str,
                 lines: list[tuple[str, float, str]] = (), title: str = "",
                 height: int = 300, width: int = WIDTH) -> str:
    """Vertical stacked bars: ``bars`` are (label, one value per series);
    ``lines`` horizontal reference lines (name, value, colour), e.g. a
    memory capacity."""
    legend_items = [(s, colour(i), "box") for i, s in enumerate(series)] + \
        [(name, col, "dash") for name, _, col in lines]
    leg, leg_h = _legend(legend_items, 0, width)
    plot_bottom = height - BOTTOM - leg_h
    totals = [sum(v for v in vals if v and math.isfinite(v)) for _, vals in bars] or [0.0]
    top = max(totals + [v for _, v, _ in lines] + [1e-9])
    ay = _Axis(0.0, top * 1.05, plot_bottom, TOP)
    body = _y_axis(ay, LEFT, width - RIGHT, y_label)
    n = max(len(bars), 1)
    slot = (width - LEFT - RIGHT) / n
    bw = min(slot * 0.7, 80)
    for k, (label, vals) in enumerate(bars):
        x = LEFT + slot * k + (slot - bw) / 2
        base = 0.0
        for i, v in enumerate(vals):
            if not v or not math.isfinite(v) or v <= 0:
                continue
            y0, y1 = ay(base), ay(base + v)
            body.append(f'<rect class="bar" x="{x:.1f}" y="{y1:.1f}" width="{bw:.1f}" '
                        f'height="{max(y0 - y1, 0.5):.1f}" fill="{colour(i)}">'
                        f'<title>{escape(label)}: {escape(series[i])} {escape(fmt(v))}</title>'
                        f'</rect>')
            base += v
        body.append(f'<text x="{x + bw / 2:.1f}" y="{ay(base) - 4:.1f}" text-anchor="middle" '
                    f'class="value">{escape(fmt(base))}</text>')
        # a label "layout: stage" on two lines
        for j, part in enumerate(label.split(": ", 1)):
            body.append(f'<text x="{x + bw / 2:.1f}" y="{plot_bottom + 15 + 13 * j}" '
                        f'text-anchor="middle" class="tick">{escape(part)}</text>')
    for name, v, col in lines:
        y = ay(v)
        body.append(f'<line class="ref" x1="{LEFT}" y1="{y:.1f}" x2="{width - RIGHT}" '
                    f'y2="{y:.1f}" stroke="{col}" stroke-width="2" stroke-dasharray="6 3">'
                    f'<title>{escape(name)}: {escape(fmt(v))}</title></line>')
    body.append(f'<line x1="{LEFT}" y1="{plot_bottom}" x2="{width - RIGHT}" y2="{plot_bottom}" '
                f'class="axis"/>')
    body.append(f'<g transform="translate(0 {plot_bottom + 50})">{"".join(leg)}</g>')
    return _svg(width, height + 12, body, title or y_label)


def stacked_hbars(bars: list[tuple[str, list[float]]], series: list[str], x_label: str,
                  title: str = "", width: int = WIDTH) -> str:
    """Horizontal stacked bars, one per row of ``bars`` (label, one value per
    series); the label left of the bar, the total right of it."""
    left = max(LEFT, 8 + 7 * max((len(lab) for lab, _ in bars), default=0))
    row_h = 26
    legend_items = [(s, colour(i), "box") for i, s in enumerate(series)]
    leg, leg_h = _legend(legend_items, 0, width)
    plot_h = row_h * max(len(bars), 1)
    height = TOP + plot_h + BOTTOM + leg_h
    totals = [sum(v for v in vals if v and math.isfinite(v)) for _, vals in bars] or [0.0]
    ax = _Axis(0.0, max(totals + [1e-9]) * 1.08, left, width - RIGHT - 40)
    y_end = TOP + plot_h
    body = []
    for t in ax.ticks:
        x = ax(t)
        body.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{y_end}" class="grid"/>')
        body.append(f'<text x="{x:.1f}" y="{y_end + 16}" text-anchor="middle" class="tick">'
                    f'{escape(fmt(t))}</text>')
    body.append(f'<text x="{(left + width - RIGHT) / 2:.1f}" y="{y_end + 34}" '
                f'text-anchor="middle" class="axis-label">{escape(x_label)}</text>')
    for k, (label, vals) in enumerate(bars):
        y = TOP + row_h * k + 4
        base = 0.0
        for i, v in enumerate(vals):
            if not v or not math.isfinite(v) or v <= 0:
                continue
            x0, x1 = ax(base), ax(base + v)
            body.append(f'<rect class="bar" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 0.5):.1f}" '
                        f'height="{row_h - 8}" fill="{colour(i)}"><title>{escape(label)}: '
                        f'{escape(series[i])} {escape(fmt(v))}</title></rect>')
            base += v
        body.append(f'<text x="{left - 6}" y="{y + row_h / 2}" text-anchor="end" '
                    f'class="tick">{escape(label)}</text>')
        body.append(f'<text x="{ax(base) + 4:.1f}" y="{y + row_h / 2}" class="value">'
                    f'{escape(fmt(base))}</text>')
    body.append(f'<g transform="translate(0 {y_end + 52})">{"".join(leg)}</g>')
    return _svg(width, height, body, title or x_label)


def _bounds(values, log: bool) -> tuple[float, float]:
    vals = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if not vals:
        return (1.0, 10.0) if log else (0.0, 1.0)
    return min(vals), max(vals)


def lines(curves: list[dict], x_label: str, y_label: str, log_x: bool = False,
          log_y: bool = False, title: str = "", height: int = 320, width: int = WIDTH) -> str:
    """Curves: each a dict with ``name``, ``x``, ``y`` and optional ``lo``/
    ``hi`` (a band drawn under the line, e.g. the interquartile range) and
    ``marks`` (dots at the points)."""
    items = [(c["name"], colour(i), "line") for i, c in enumerate(curves)]
    leg, leg_h = _legend(items, 0, width)
    plot_bottom = height - BOTTOM - leg_h
    xs = [v for c in curves for v in c["x"]]
    ys = [v for c in curves for k in ("y", "lo", "hi") for v in c.get(k) or ()]
    ax = _Axis(*_bounds(xs, log_x), LEFT, width - RIGHT, log=log_x)
    ylo, yhi = _bounds(ys, log_y)
    ay = _Axis(ylo if log_y else min(0.0, ylo), yhi, plot_bottom, TOP, log=log_y)
    body = _y_axis(ay, LEFT, width - RIGHT, y_label)
    body += _x_axis(ax, plot_bottom, TOP, x_label, width)

    def ok(x, y):
        return (x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
                and (x > 0 or not log_x) and (y > 0 or not log_y))

    for i, c in enumerate(curves):
        col = colour(i)
        if c.get("lo") is not None and c.get("hi") is not None:
            pts = [(x, lo, hi) for x, lo, hi in zip(c["x"], c["lo"], c["hi"])
                   if ok(x, lo) and ok(x, hi)]
            if pts:
                poly = [f"{ax(x):.1f},{ay(hi):.1f}" for x, _, hi in pts] + \
                       [f"{ax(x):.1f},{ay(lo):.1f}" for x, lo, _ in reversed(pts)]
                body.append(f'<polygon class="band" points="{" ".join(poly)}" fill="{col}" '
                            f'fill-opacity="0.18" stroke="none"/>')
        pts = [(x, y) for x, y in zip(c["x"], c["y"]) if ok(x, y)]
        if pts:
            d = " ".join(f"{ax(x):.1f},{ay(y):.1f}" for x, y in pts)
            body.append(f'<polyline class="curve" points="{d}" fill="none" stroke="{col}" '
                        f'stroke-width="2"><title>{escape(c["name"])}</title></polyline>')
            if c.get("marks"):
                for x, y in pts:
                    body.append(f'<circle cx="{ax(x):.1f}" cy="{ay(y):.1f}" r="3" fill="{col}">'
                                f'<title>{escape(c["name"])}: {escape(fmt(x))}, '
                                f'{escape(fmt(y))}</title></circle>')
    body.append(f'<g transform="translate(0 {plot_bottom + 52})">{"".join(leg)}</g>')
    return _svg(width, height + 12, body, title or y_label)


def points(sets: list[dict], x_label: str, y_label: str, title: str = "",
           height: int = 340, width: int = WIDTH) -> str:
    """Scatter sets: each a dict with ``name``, ``x``, ``y``, optional
    ``labels`` (one tooltip per point), ``steps`` (join the points by a
    staircase, as a Pareto front of a cost to minimise and a rate to
    maximise) and ``size`` (dot radius)."""
    items = [(s["name"], s.get("colour") or colour(i), "box") for i, s in enumerate(sets)]
    leg, leg_h = _legend(items, 0, width)
    plot_bottom = height - BOTTOM - leg_h
    ax = _Axis(*_bounds([v for s in sets for v in s["x"]], False), LEFT, width - RIGHT)
    ay = _Axis(*_bounds([v for s in sets for v in s["y"]], False), plot_bottom, TOP)
    body = _y_axis(ay, LEFT, width - RIGHT, y_label)
    body += _x_axis(ax, plot_bottom, TOP, x_label, width)
    for i, s in enumerate(sets):
        col = s.get("colour") or colour(i)
        pts = sorted((x, y, k) for k, (x, y) in enumerate(zip(s["x"], s["y"]))
                     if x is not None and y is not None and math.isfinite(x) and math.isfinite(y))
        if s.get("steps") and pts:
            d = [f"{ax(pts[0][0]):.1f},{ay(pts[0][1]):.1f}"]
            for (_, y0, _), (x1, y1, _) in zip(pts, pts[1:]):
                d += [f"{ax(x1):.1f},{ay(y0):.1f}", f"{ax(x1):.1f},{ay(y1):.1f}"]
            body.append(f'<polyline class="front" points="{" ".join(d)}" fill="none" '
                        f'stroke="{col}" stroke-width="1.5"/>')
        labels = s.get("labels")
        r = s.get("size", 3.5)
        for x, y, k in pts:
            tip = labels[k] if labels else f"{fmt(x)}, {fmt(y)}"
            body.append(f'<circle class="point" cx="{ax(x):.1f}" cy="{ay(y):.1f}" r="{r}" '
                        f'fill="{col}"><title>{escape(s["name"])}: {escape(tip)}</title></circle>')
    body.append(f'<g transform="translate(0 {plot_bottom + 52})">{"".join(leg)}</g>')
    return _svg(width, height + 12, body, title or y_label)
