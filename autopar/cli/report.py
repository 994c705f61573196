"""``autopar report INPUT... --output page.html [--title T]``: one
self-contained HTML page from any run's outputs.

Inputs (any number, any mix; each recognised by its content, see
``autopar.studies.report``): ``exhaustive --top``/``--summary``/``--output``
JSON, ``tune --trials-out`` CSV and ``--output`` JSON, a ``compare`` or
``codesign``/``cliffs`` output folder, an ``advise --output`` JSON.  The
page (``autopar.studies.report_page``) needs no network: inline CSS and SVG,
no script.  ``--model``/``--system``/``--framework`` evaluate layouts that
carry no statistics and split memory per stage; they take precedence over
the model and system a run names itself.

Exit 0 written; 2 bad input (one line naming the file and the field, and no
page written).
"""
from __future__ import annotations

from autopar.cli import framework_option, output_path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="one self-contained HTML page from run outputs",
        description="Write one self-contained HTML page (no network: inline SVG charts) "
                    "from run outputs: the best layouts, memory per stage against capacity, "
                    "the time breakdown, the user's config beside the best (advise), regret "
                    "curves (compare) and Pareto fronts (codesign). Exit 0 written, 2 bad "
                    "input.",
        epilog="example: autopar report top.json summary.json results/compare-quick "
               "--output report.html --model models/gpt3-13B.json "
               "--system systems/a100_80g.json")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a run output: exhaustive --top/--summary/--output JSON, tune "
                        "--trials-out CSV or --output JSON, advise --output JSON, or a "
                        "compare/codesign/cliffs output folder")
    p.add_argument("--output", required=True, metavar="FILE", help="the HTML page to write")
    p.add_argument("--title", default="autopar report", help="the page's title")
    p.add_argument("--model", default=None, metavar="FILE",
                   help="model to evaluate the layouts with (default: the one the run names, "
                        "where it names one)")
    p.add_argument("--system", default=None, metavar="FILE",
                   help="system to evaluate the layouts with, and whose capacity the memory "
                        "chart draws (default: the one the run names)")
    framework_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from autopar.io.writers import atomic_path
    from autopar.studies.report import load_context, read_run
    from autopar.studies.report_page import page

    out = output_path("--output", args.output)
    given = load_context(args.model, args.system, args.framework, where="the command line")
    if args.framework is not None and args.system is None:
        from autopar.io.specs import SpecError
        raise SpecError("command line", "--framework", "applies to a system: give --system too")
    runs = [read_run(path, given) for path in args.inputs]
    html = page(runs, args.title)
    with atomic_path(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(html)
    print(f"wrote {out}: {len(runs)} run{'s' if len(runs) != 1 else ''}, "
          f"{html.count('<svg')} charts, {len(html.encode()) / 1024:.0f} KiB")
    return 0
