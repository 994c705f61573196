"""autopar report: one self-contained HTML page from run outputs.

The outputs are made here by the real commands on a small case (GPT-3 13B on
64 A100, the small space: 6,240 layouts), an advise file of the shape
``autopar advise --output`` writes is built from them, and the shipped
docs/ folders of a comparison and a co-design study are read as they are.
The page is checked as text (every chart, no network), its figures against
the model, its bad inputs for one line and nothing written, and in a real
headless Chromium (skipped, with the reason, where Chromium or Playwright is
missing: the ``browser`` extra, and Debian's chromium package).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import pytest

from autopar.cli import main
from conftest import REPO_ROOT

MODEL = str(REPO_ROOT / "models" / "gpt3-13B.json")
SYSTEM = str(REPO_ROOT / "systems" / "a100_80g.json")
CASE = [MODEL, SYSTEM, "--num-procs", "64",
        "--max-batch-size", "512", "--datatype", "float16", "--space", "small"]
MODEL_SYSTEM = ["--model", MODEL, "--system", SYSTEM]
COMPARE = REPO_ROOT / "docs" / "compare" / "compare-quick"
CODESIGN = REPO_ROOT / "docs" / "codesign" / "small"
CLIFFS = REPO_ROOT / "docs" / "codesign" / "cliffs-megatron-1t"
GIB = 1024 ** 3
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]


def _advise(top: dict, model="gpt3-13B", system="a100_80g", stages=None) -> dict:
    """An advise --output document (its documented shape) from exhaustive --top
    entries: the fifth best as the user's config."""
    def row(e, carried=None):
        return {"execution": e["execution"], "stats": e["stats"], "p_fits": e.get("p_fits"),
                "memory_stages_gib": carried}
    user, best = top["4"], top["0"]
    changes = [{"field": k, "from": user["execution"].get(k), "to": v}
               for k, v in best["execution"].items() if user["execution"].get(k) != v]
    return {"kind": "advise", "model": model, "system": system, "format": "megatron",
            "user": row(user, stages), "near": [row(top["2"])],
            "overall": [row(best), row(top["1"])], "changes": changes,
            "gain": best["stats"]["sample_rate"] / user["stats"]["sample_rate"] - 1}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Real outputs of exhaustive (--top, --summary, --output) and tune
    (--trials-out, --output), and an advise file built from them."""
    d = tmp_path_factory.mktemp("runs")
    assert main(["exhaustive", *CASE, "--top-n", "5", "--top", str(d / "top.json"),
                 "--summary", str(d / "summary.json"), "--output", str(d / "best.json")]) == 0
    assert main(["tune", *CASE, "--sampler", "random", "--trials", "30", "--seed", "0",
                 "--trials-out", str(d / "trials.csv"), "--output", str(d / "tbest.json")]) == 0
    top = json.loads((d / "top.json").read_text())
    (d / "advise.json").write_text(json.dumps(_advise(top)))
    return d


def _report(*args) -> int:
    return main(["report", *map(str, args)])


def _sections(html: str) -> int:
    return html.count("<section")


# --------------------------------------------------------------------------
# The page

def test_every_kind_of_output_in_one_page(outputs, tmp_path, capsys):
    page = tmp_path / "page.html"
    ins = [outputs / f for f in ("top.json", "summary.json", "best.json", "trials.csv",
                                 "tbest.json", "advise.json")] + [COMPARE, CODESIGN, CLIFFS]
    assert _report(*ins, "--output", page, "--title", "All <kinds>", *MODEL_SYSTEM) == 0
    html = page.read_text()
    assert "wrote" in capsys.readouterr().out
    assert _sections(html) == len(ins)
    assert "<title>All &lt;kinds&gt;</title>" in html        # escaped
    # charts: top, summary, best, trials, tbest: memory + time (trials: + progress);
    # advise: memory + time; compare: memory + time + regret; codesign: regret +
    # front; cliffs: one
    assert html.count("<svg") == 5 * 2 + 1 + 2 + 3 + 2 + 1
    for kind in ("Best layouts", "Memory per stage", "Time per batch", "Regret curves",
                 "Pareto front", "Your config beside the best"):
        assert kind in html
    # self-contained: no script, no external resource of any kind
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", html)
    assert "url(" not in html and "@import" not in html and "<link" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_memory_per_stage_is_the_models_split(outputs):
    """The stages' bars add up to the model's need per stage, and the fuller
    stage is the peak the run reported (proc_mem_tier1_cap_req)."""
    from autopar.studies.report import load_context, read_run
    run = read_run(outputs / "top.json", load_context(MODEL, SYSTEM))
    assert run.capacity_gib == 80.0
    checked = 0
    for lay in run.layouts:
        pp = lay.execution["pipeline_par"]
        assert len(lay.stages) == (1 if pp == 1 else 2)
        totals = [sum(v) for _, v in lay.stages]
        assert all(all(x >= -1e-9 for x in v) for _, v in lay.stages)
        peak = lay.stats["proc_mem_tier1_cap_req"] / GIB
        assert max(totals) == pytest.approx(peak, rel=1e-12)
        if pp > 1:
            assert lay.stages[0][0] == "stage 1" and lay.stages[1][0] == f"stage {pp}"
            assert totals[0] != pytest.approx(totals[1])   # the stages differ
            checked += 1
    assert checked >= 2


def test_time_breakdown_adds_up_to_the_batch_time(outputs):
    from autopar.model.breakdown import TIME_ROWS
    from autopar.studies.report import load_context, read_run
    run = read_run(outputs / "best.json", load_context(MODEL, SYSTEM))
    stats = run.layouts[0].stats
    parts = sum(stats[k] or 0.0 for _, keys in TIME_ROWS for k in keys)
    assert parts == pytest.approx(stats["total_time"], rel=1e-9)
    best = json.loads((outputs / "best.json").read_text())
    top = json.loads((outputs / "top.json").read_text())
    assert best == top["0"]["execution"]
    assert stats["sample_rate"] == pytest.approx(top["0"]["stats"]["sample_rate"], rel=1e-12)


def test_summary_finds_its_own_model_and_system(outputs, tmp_path):
    """A summary names its model and system files: no --model/--system needed."""
    from autopar.studies.report import read_run
    run = read_run(outputs / "summary.json")
    summary = json.loads((outputs / "summary.json").read_text())
    assert run.layouts[0].stats["sample_rate"] == pytest.approx(
        summary["best"]["sample_rate"], rel=1e-12)
    assert run.layouts[0].stages and run.capacity_gib == 80.0
    assert _report(outputs / "summary.json", "--output", tmp_path / "p.html") == 0


def test_advise_user_beside_the_best(outputs, tmp_path):
    from autopar.studies.report import read_run
    run = read_run(outputs / "advise.json")    # shipped names: evaluated by name
    doc = json.loads((outputs / "advise.json").read_text())
    assert run.user.label == "your config" and run.user.stages
    assert [c["field"] for c in run.changes] == [c["field"] for c in doc["changes"]]
    assert run.changes, "the fifth best differs from the best"
    page = tmp_path / "a.html"
    assert _report(outputs / "advise.json", "--output", page) == 0
    html = page.read_text()
    assert f"{doc['gain'] * 100:+.1f}%" in html
    for c in doc["changes"]:
        assert f'<td class="l">{c["field"]}</td>' in html
    assert html.count("<svg") == 2


def test_advise_memory_stages_drawn_as_carried(outputs, tmp_path):
    """An advise file whose model is no shipped file: its memory_stages_gib
    are drawn as it gives them, against no capacity line."""
    from autopar.studies.report import read_run
    top = json.loads((outputs / "top.json").read_text())
    p = tmp_path / "adv.json"
    p.write_text(json.dumps(_advise(top, model="my-own-model", stages=[61.25, 37.5])))
    run = read_run(p)
    assert [sum(v) for _, v in run.user.stages] == [61.25, 37.5]
    assert run.capacity_gib is None and any("not a shipped file" in n for n in run.notes)
    assert _report(p, "--output", tmp_path / "a.html") == 0
    html = (tmp_path / "a.html").read_text()
    assert "61.25" in html and "capacity" not in html.split("Memory per stage")[1][:3000]


def test_regret_curves_are_the_median_over_seeds(tmp_path):
    import numpy as np
    import pandas as pd
    from autopar.studies.report import read_run
    run = read_run(COMPARE)
    curves = pd.read_csv(COMPARE / "curves.csv")
    assert [c["name"].split(" (")[0] for c in run.curves] == list(curves["sampler"].unique())
    for c in run.curves:
        name = c["name"].split(" (")[0]
        sub = curves[curves["sampler"] == name]
        for t in (1, 10, int(sub["trial"].max())):
            at = sub[sub["trial"] == t]["regret"].to_numpy()
            if len(at) == sub["seed"].nunique():
                assert c["y"][t - 1] == pytest.approx(float(np.median(at)))
                assert c["lo"][t - 1] <= c["y"][t - 1] <= c["hi"][t - 1]
    opt = json.loads((COMPARE / "optimum.json").read_text())
    assert run.layouts[0].stats["sample_rate"] == pytest.approx(opt["sample_rate"], rel=1e-9)


def test_pareto_front_has_every_point(tmp_path):
    import pandas as pd
    from autopar.studies.report import read_run
    run = read_run(CODESIGN)
    front = pd.read_csv(CODESIGN / "front.csv")
    pts = [s for s in run.front["sets"] if s["name"] == "Pareto front"][0]
    assert pts["y"] == front["sample_rate"].tolist() and pts["x"] == front["cost"].tolist()
    assert run.curves and run.curves_by_budget      # regret.csv's budgets
    assert _report(CODESIGN, "--output", tmp_path / "c.html") == 0
    html = (tmp_path / "c.html").read_text()
    assert html.count('class="point"') == len(front)


# --------------------------------------------------------------------------
# Bad input: one line naming the file and the field, exit 2, nothing written

def _bad(tmp_path, capsys, *inputs, extra=()):
    page = tmp_path / "page.html"
    page.write_text("before")
    code = _report(*inputs, "--output", page, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert page.read_text() == "before"              # untouched
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".page.html")]
    return err


def test_missing_input(tmp_path, capsys):
    err = _bad(tmp_path, capsys, tmp_path / "nope.json")
    assert "nope.json: (file): no such file" in err


@pytest.mark.parametrize("content, field", [
    ("{not json", "(file)"),
    ('{"hello": 1}', "(root)"),
    ('[1, 2]', "(root)"),
    ('{"0": {"stats": {}}}', "0.execution"),
    ('{"0": {"execution": {}, "stats": {"sample_rate": "fast"}}}', "0.stats.sample_rate"),
    ('{"0": {"execution": {}, "stats": {}, "p_fits": 2}}', "0.p_fits"),
    ('{"kind": "advise", "near": [], "overall": [], "changes": []}', "user"),
])
def test_malformed_json(tmp_path, capsys, content, field):
    p = tmp_path / "in.json"
    p.write_text(content)
    err = _bad(tmp_path, capsys, p)
    assert f"{p}: {field}:" in err


def test_malformed_advise_entries(outputs, tmp_path, capsys):
    doc = json.loads((outputs / "advise.json").read_text())
    doc["user"]["memory_stages_gib"] = ["a lot"]
    p = tmp_path / "adv.json"
    p.write_text(json.dumps(doc))
    assert f"{p}: user.memory_stages_gib:" in _bad(tmp_path, capsys, p)
    doc = json.loads((outputs / "advise.json").read_text())
    doc["changes"] = [{"from": 1}]
    p.write_text(json.dumps(doc))
    assert f"{p}: changes[0]:" in _bad(tmp_path, capsys, p)


def test_execution_without_model_names_the_option(outputs, tmp_path, capsys):
    err = _bad(tmp_path, capsys, outputs / "best.json")
    assert "command line: --model:" in err and "best.json" in err


def test_bad_execution_field_names_it(outputs, tmp_path, capsys):
    ex = json.loads((outputs / "best.json").read_text())
    ex["tensor_par"] = "eight"
    p = tmp_path / "ex.json"
    p.write_text(json.dumps(ex))
    err = _bad(tmp_path, capsys, p, extra=MODEL_SYSTEM)
    assert "tensor_par" in err and "ex.json" in err


def test_bad_csv(tmp_path, capsys, outputs):
    p = tmp_path / "t.csv"
    p.write_text("a,b\n1,2\n")
    assert f"{p}: (columns):" in _bad(tmp_path, capsys, p)
    text = (outputs / "trials.csv").read_text().splitlines()
    head = text[0].split(",")
    row = text[1].split(",")
    row[head.index("sample_rate")] = "fast"
    p.write_text("\n".join([text[0], ",".join(row)] + text[2:]) + "\n")
    assert f"{p}: sample_rate: row 2: not a number" in _bad(tmp_path, capsys, p)


def test_folder_that_is_no_run(tmp_path, capsys):
    d = tmp_path / "empty"
    d.mkdir()
    assert f"{d}: (folder):" in _bad(tmp_path, capsys, d)


def test_output_folder_missing(outputs, tmp_path, capsys):
    code = _report(outputs / "top.json", "--output", tmp_path / "no" / "page.html")
    assert code == 2 and "--output" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_second_input_bad_writes_nothing(outputs, tmp_path, capsys):
    err = _bad(tmp_path, capsys, outputs / "top.json", tmp_path / "missing.csv")
    assert "missing.csv" in err


# --------------------------------------------------------------------------
# A real browser

def _browser():
    if not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)):
        pytest.skip(f"{CHROMIUM} not installed (Debian's chromium package; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed (the 'browser' extra: pip install -e '.[browser]')")
    return sync_playwright


def test_page_renders_in_headless_chromium(outputs, tmp_path):
    """The page in Debian's Chromium: it loads with no console message of
    level error or warning and no page error, asks for nothing over the
    network, and every chart is an SVG drawn at a visible size with its marks."""
    sync_playwright = _browser()
    page_file = tmp_path / "page.html"
    ins = [outputs / "top.json", outputs / "advise.json", outputs / "trials.csv",
           COMPARE, CODESIGN]
    assert _report(*ins, "--output", page_file, *MODEL_SYSTEM) == 0
    html = page_file.read_text()
    messages, errors, requests = [], [], []
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            tempfile.mkdtemp(dir=tmp_path), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1200, "height": 900})
        try:
            page = ctx.new_page()
            page.on("console", lambda m: messages.append((m.type, m.text)))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri(), wait_until="load")
            assert page.title() == "autopar report"
            assert page.locator("section").count() == len(ins)
            charts = page.locator("svg.chart")
            assert charts.count() == html.count("<svg") == 2 + 2 + 3 + 3 + 2
            for i in range(charts.count()):
                box = charts.nth(i).bounding_box()
                assert box and box["width"] > 300 and box["height"] > 100
            # the marks: bars, curves, front points, the capacity line
            assert page.locator("svg rect.bar").count() > 20
            assert page.locator("svg polyline.curve").count() >= 7
            assert page.locator("svg circle.point").count() == \
                len(open(CODESIGN / "front.csv").read().splitlines()) - 1
            assert page.locator("svg line.ref").count() >= 3
            headings = page.locator("h3").all_inner_texts()
            assert "Pareto front" in headings and "Regret curves" in headings
            # a bar's tooltip names the layout, the part and the GiB
            tip = page.locator("svg rect.bar title").first.text_content()
            assert re.match(r".+: static: .+ \d", tip)
            shot = tmp_path / "shot.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 50_000
        finally:
            ctx.close()
    assert errors == []
    assert [m for m in messages if m[0] in ("error", "warning")] == []
    assert requests and all(u.startswith("file://") for u in requests), requests


def test_folder_moved_from_its_model_still_reports(tmp_path):
    """A compare folder copied away from the model and system it names: its
    curves and the optimum's own rate are shown, with a note, and no memory
    or time chart is made up."""
    moved = tmp_path / "moved"
    shutil.copytree(COMPARE, moved)
    page = tmp_path / "m.html"
    assert _report(moved, "--output", page) == 0
    html = page.read_text()
    assert "cannot be read here" in html and "Regret curves" in html
    assert html.count("<svg") == 1
    opt = json.loads((COMPARE / "optimum.json").read_text())
    assert f"{opt['sample_rate']:.4g}" in html


def test_config_that_cannot_run_says_why(outputs, tmp_path):
    """The user's config out of memory: its need per stage (above the
    capacity line) and the model's reason, not a blank row."""
    doc = json.loads((outputs / "advise.json").read_text())
    doc["user"]["execution"].update(tensor_par=1, pipeline_par=1, data_par=64,
                                    microbatch_size=8, activation_recompute="none",
                                    pipeline_interleaving=1)
    doc["user"]["stats"] = {k: None for k in doc["user"]["stats"]}
    p = tmp_path / "adv.json"
    p.write_text(json.dumps(doc))
    from autopar.studies.report import read_run
    run = read_run(p)
    assert run.user.reason and "mem" in run.user.reason
    assert max(sum(v) for _, v in run.user.stages) > run.capacity_gib
    assert _report(p, "--output", tmp_path / "a.html") == 0
    html = (tmp_path / "a.html").read_text()
    assert "your config cannot run" in html and ">cannot run</span>" in html


def test_command_line_bad_input_one_line(cli, tmp_path):
    """The real command: exit 2, one line on stderr, no traceback, no page."""
    r = cli("report", tmp_path / "none.csv", "--output", tmp_path / "p.html")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"autopar: error: {tmp_path / 'none.csv'}: (file): no such file"]
    assert not (tmp_path / "p.html").exists()


def test_peak_that_differs_from_the_evaluation_is_said(outputs, tmp_path):
    """A top file evaluated under a framework it was not searched under (one
    with a reserved amount and fragmentation): the page says that the
    recorded peak and this evaluation differ, and draws the framework's
    headroom line."""
    from autopar.studies.report import load_context, read_run
    same = read_run(outputs / "top.json", load_context(MODEL, SYSTEM))
    assert not any("differs" in n for n in same.notes)
    other = read_run(outputs / "top.json",
                     load_context(MODEL, SYSTEM, "megatron-llama-sweeps-fitted"))
    assert any("differs from this evaluation" in n for n in other.notes)
    assert other.headroom_gib == 5.0
    over = [v[2] for lay in other.layouts for _, v in lay.stages]
    assert min(over) >= 3.0       # overheads: at least the reserved 3 GiB per stage
    page = tmp_path / "f.html"
    assert _report(outputs / "top.json", "--output", page, *MODEL_SYSTEM,
                   "--framework", "megatron-llama-sweeps-fitted") == 0
    html = page.read_text()
    assert "capacity less headroom 5 GiB" in html and "overheads: " in html
