"""The recommendation among near ties (autopar.search.ranking) and the memory
``exhaustive`` prints for its best layout (issue 25, item 6)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from autopar.cli import main
from autopar.search import ranking
from autopar.search.exhaustive import exhaustive
from autopar.search.tune import best_trial

from conftest import REPO_ROOT

# GPT-3 13B on 64 A100s in Calculon's space: the fastest layout, enumerated
# first among its exact ties, offloads the optimizer state for no gain.
CASE = (REPO_ROOT / "models/gpt3-13B.json", REPO_ROOT / "systems/a100_80g.json", 64, 64,
        "float16")
OFFLOADS = ranking.OFFLOADS


def _rows(**cols):
    n = len(cols["sample_rate"])
    base = {"weight_offload": [False] * n, "activations_offload": [False] * n,
            "optimizer_offload": [False] * n, "pipeline_par": [1] * n,
            "pipeline_interleaving": [1] * n, "activation_recompute": ["none"] * n,
            "proc_mem_tier1_cap_req": [1.0] * n}
    base.update(cols)
    return pd.DataFrame(base)


def test_the_order_inside_the_tie_group_and_by_rate_outside():
    t = _rows(sample_rate=[100.0, 99.95, 99.95, 99.95, 99.95, 99.5],
              optimizer_offload=[True, False, False, False, False, False],
              proc_mem_tier1_cap_req=[1.0, 5.0, 5.0, 4.0, 5.0, 0.5],
              pipeline_par=[1, 2, 1, 8, 1, 1],
              activation_recompute=["none", "none", "full", "none", "attn_only", "none"])
    # in the group (>= 99.9): no offload first; then less memory (row 3); then
    # fewer stages (rows 2, 4 before 1); then less recompute (attn_only before full);
    # row 5 is 0.5% slower: after the group, although it needs the least memory
    assert list(ranking.order(t)) == [3, 4, 2, 1, 0, 5]
    assert ranking.fastest(t) == 0


def test_just_outside_the_tolerance_is_ranked_by_rate():
    t = _rows(sample_rate=[100.0, 100.0 * (1 - 1.01e-3)], weight_offload=[True, False])
    assert list(ranking.order(t)) == [0, 1]
    t = _rows(sample_rate=[100.0, 100.0 * (1 - 0.99e-3)], weight_offload=[True, False])
    assert list(ranking.order(t)) == [1, 0]


def test_exact_ties_of_equal_simplicity_keep_enumeration_order():
    t = _rows(sample_rate=[5.0, 5.0, 5.0], index=[7, 3, 5])
    assert list(ranking.order(t)) == [1, 2, 0]


@pytest.mark.parametrize("n", [1, 3, 10])
def test_chunk_candidates_and_merges_give_the_order_of_all_rows(n):
    rng = np.random.default_rng(n)
    m = 5000
    rate = np.round(rng.uniform(90, 100, m), 1)         # many near and exact ties
    rows = {"index": np.arange(m), "sample_rate": rate,
            "weight_offload": rng.integers(0, 2, m).astype(bool),
            "activations_offload": rng.integers(0, 2, m).astype(bool),
            "optimizer_offload": np.zeros(m, bool),
            "pipeline_par": rng.choice([1, 2, 4], m), "pipeline_interleaving": np.ones(m, int),
            "activation_recompute": rng.integers(0, 3, m),
            "proc_mem_tier1_cap_req": np.round(rng.uniform(1, 4, m), 0)}
    ok = rng.uniform(size=m) < 0.7
    want = np.flatnonzero(ok)[ranking.order({k: v[ok] for k, v in rows.items()})][:n]
    top = None
    for a in range(0, m, 337):
        sel = a + ranking.candidates(rate[a:a + 337], ok[a:a + 337], n)
        part = {k: v[sel] for k, v in rows.items()}
        both = part if top is None else {k: np.concatenate([top[k], part[k]]) for k in part}
        top = {k: v[ranking.reduce(both, n)] for k, v in both.items()}
    assert list(top["index"][:n]) == list(want)


def test_exhaustive_recommends_the_simpler_of_equally_fast_layouts():
    table, s = exhaustive(*CASE, top_n=5, progress=False)
    opt, best = s["optimum"]["execution"], s["best"]["execution"]
    assert any(opt[k] for k in OFFLOADS)                 # the enumeration order's pick
    assert not any(best[k] for k in OFFLOADS)
    assert s["best"]["sample_rate"] >= s["optimum"]["sample_rate"] * (1 - ranking.TOLERANCE)
    # the optimum's rate is the highest: the ranking changes the pick, not the rate
    assert s["optimum"]["sample_rate"] == table["sample_rate"].max()
    # chunks change nothing
    table2, s2 = exhaustive(*CASE, top_n=5, progress=False, chunk_size=10_007)
    assert list(table2.index) == list(table.index) and s2["optimum"] == s["optimum"]


def test_tune_best_trial_follows_the_ranking():
    t = _rows(sample_rate=[10.0, 9.995, 12.0, 9.0], optimizer_offload=[True, False, True, False],
              state=["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"], trial=[0, 1, 2, 3])
    assert int(best_trial(t)["trial"]) == 1


def test_exhaustive_cli_prints_the_best_layouts_memory(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["exhaustive", str(CASE[0]), str(CASE[1]), "--num-procs", "64",
                 "--max-batch-size", "64", "--datatype", "float16", "--space", "small",
                 "--summary", str(out), "--output", str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.strip().startswith("memory tier 1"))
    m = json.loads(out.read_text())["best"]["memory_GiB"]
    assert f"tier 1 {m['tier1']:.2f} of 80 GiB" in line and "tier 2" in line
    assert m["tier1"] == pytest.approx(max(m["first_stage"], m["last_stage"]))
    assert m[m["peak_stage"] + "_stage"] == pytest.approx(m["tier1"])
    assert 0 < m["tier1"] <= m["tier1_capacity"] == 80
    best = json.loads((tmp_path / "b.json").read_text())
    assert m["stages"] == best["pipeline_par"]
    from autopar.io.specs import load_model, load_system
    from autopar.model import evaluate_one
    stats = evaluate_one(load_model(CASE[0]), load_system(CASE[1]), best)
    assert m["tier1"] * 1024 ** 3 == pytest.approx(stats["proc_mem_tier1_cap_req"])
    if best["pipeline_par"] > 1:
        assert f"of {best['pipeline_par']} stages" in line


def test_skeleton_trials_take_the_simplest_of_equally_fast_completions():
    """A skeleton trial is its fastest completion; among completions of
    exactly that rate the simplest, so the trial's rate stays the optimum's
    and tune's recommendation offloads nothing for no gain."""
    from autopar.search.tune import best_execution, tune_arguments
    _, s = exhaustive(*CASE, progress=False)
    table = tune_arguments(*CASE[:2], num_procs=CASE[2], max_batch_size=CASE[3], datatype=CASE[4],
                           sampler="skeleton-tpe", trials=400, seed=0, space="calculon",
                           progress=False)
    done = table[table["state"] == "COMPLETE"]
    assert done["sample_rate"].max() == pytest.approx(s["optimum"]["sample_rate"], rel=1e-12)
    best = best_execution(table)
    assert not any(best[k] for k in OFFLOADS)
    assert any(s["optimum"]["execution"][k] for k in OFFLOADS)
