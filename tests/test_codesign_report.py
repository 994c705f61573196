"""The co-design report a newcomer reads (issue 27): the summary has no
``nan`` regret, the regret plot's axis and footnote name the regret that is
computed (of the hypervolume with two objectives), and front.png carries a
key of its numbered points."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from test_codesign import study_dict


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The tiny study of test_codesign, enumerated and compared, with the
    arguments regret.png and front.png were drawn with."""
    import autopar.studies.regret as regret
    from autopar.studies import codesign_report
    from autopar.studies.codesign import codesign
    seen = {}
    plot, key = regret.plot, codesign_report.front_key

    def spy_plot(*a, **kw):
        seen["regret"] = kw
        return plot(*a, **kw)

    def spy_key(*a, **kw):
        seen["key"] = key(*a, **kw)
        return seen["key"]
    mp = pytest.MonkeyPatch()
    mp.setattr(regret, "plot", spy_plot)
    mp.setattr(codesign_report, "front_key", spy_key)
    try:
        out = tmp_path_factory.mktemp("codesign") / "out"
        res = codesign(study_dict(compare={"samplers": [{"sampler": "nsga2", "population": 6},
                                                        "motpe"],
                                           "seeds": 1, "trials": 12, "budgets": [6, 12]}),
                       out, progress=False)
    finally:
        mp.undo()
    return res, out, seen


def test_summary_text_has_no_nan_and_says_what_exhaustive_is(compared):
    from autopar.studies.codesign_report import summary_text
    res, _, _ = compared
    text = summary_text(res)
    assert "nan" not in text.lower()
    ex = [line for line in text.splitlines() if line.strip().startswith("exhaustive:")]
    assert len(ex) == 1 and "ground truth" in ex[0] and "36 systems" in ex[0]
    assert "hypervolume regret" in text
    for label in ("nsga2", "motpe"):
        line = next(x for x in text.splitlines() if x.strip().startswith(label + ":"))
        med = float(line.split("median ")[1].split(",")[0])
        assert 0 <= med <= 1


def test_regret_plot_axis_and_note_name_the_regret_computed(compared):
    res, out, seen = compared
    kw = seen["regret"]
    assert kw["ylabel"].startswith("hypervolume regret = 1 - HV / HV*")
    assert kw["note"].startswith("hypervolume regret = 1 - HV / HV*")
    assert "HV*: of the true front" in kw["note"]
    # and that is what curves.csv holds: 1 - best hypervolume / the true front's
    curves = pd.read_csv(out / "curves.csv")
    hv = json.loads((out / "summary.json").read_text())["hypervolume"]
    done = curves["best_hypervolume"].notna()
    assert done.any()
    assert np.allclose(curves.loc[done, "regret"], 1 - curves.loc[done, "best_hypervolume"] / hv)


def test_front_png_has_a_key_of_its_numbered_points(compared):
    res, out, seen = compared
    key = seen["key"]
    front = pd.read_csv(out / "front.csv")
    assert len(key) == len(front) + 1                       # a header, then one per point
    head = key[0].split()
    assert head[:3] == ["#", "cost", "samples/s"] and "mem1.GiB" in head
    for line, (_, row) in zip(key[1:], front.iterrows()):
        cells = line.split()
        assert int(cells[0]) == row["point"]
        assert float(cells[2]) == pytest.approx(row["sample_rate"], abs=0.006)
        assert float(cells[head.index("mem1.GiB")]) == row["mem1.GiB"]
        gbps = cells[head.index("mem2.GBps")]
        assert (gbps == "-") == (isinstance(row["mem2.GBps"], float) and
                                 math.isnan(row["mem2.GBps"]))
    assert (out / "front.png").stat().st_size > 10_000
