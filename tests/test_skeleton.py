"""Skeleton search (``autopar.search.skeleton``): real Optuna studies on real
storage, a real local Ray, every result checked against the model itself.

The case is GPT-3 13B on 64 A100, batch 512, space ``small`` (6,240 layouts,
48 skeletons), so every skeleton's completions can be enumerated here and
compared with what the search reports.
"""
from __future__ import annotations

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

import autopar
from autopar.io.layouts import FIELDS, to_records
from autopar.io.specs import SpecError
from autopar.search.space import load_space
from autopar.search.tune import TRIAL_COLUMNS, best_execution, make_case
from autopar.search.tune import tune_arguments as tune

MODEL = "models/gpt3-13B.json"
SYSTEM = "systems/a100_80g.json"
CASE = dict(num_procs=64, max_batch_size=512, datatype="float16")
SKELETON = ("tensor_par", "pipeline_par", "microbatch_size")


@pytest.fixture(autouse=True)
def _in_repo(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)


@pytest.fixture(scope="module")
def truth(repo_root):
    """Every layout of the space with its sample rate, and the best per skeleton."""
    import os
    cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        case = make_case(MODEL, SYSTEM, **CASE)
        sp = load_space("small")
        cols = sp.layouts(case, 0, sp.size(case))
        ev = autopar.evaluate(case.model, case.system, to_records(cols))
    finally:
        os.chdir(cwd)
    rate = np.where(ev["feasible"], ev["sample_rate"], -np.inf)
    best: dict = {}
    for i in range(len(rate)):
        k = tuple(int(cols[p][i]) for p in SKELETON)
        best[k] = max(best.get(k, -np.inf), rate[i])
    return {"case": case, "space": sp, "best": best, "optimum": float(rate.max())}


def _check(table, truth, trials):
    assert list(table.columns) == list(TRIAL_COLUMNS)
    assert len(table) == trials
    keys = list(zip(*(table[p].astype(int) for p in SKELETON)))
    assert len(set(keys)) == len(keys), "a skeleton was counted twice"
    for k, (_, row) in zip(keys, table.iterrows()):
        want = truth["best"][k]
        if np.isfinite(want):
            assert row["state"] == "COMPLETE"
            assert row["sample_rate"] == pytest.approx(want, rel=1e-12)
            assert row["layouts"] > 1
        else:
            assert row["state"] == "PRUNED" and row["reason"].startswith("infeasible: ")
    # every COMPLETE row's execution re-evaluates to its reported figures
    done = table[table["state"] == "COMPLETE"]
    execs = [best_execution(done.loc[[i]]) for i in done.index]
    ev = autopar.evaluate(truth["case"].model, truth["case"].system, execs)
    assert ev["feasible"].all()
    np.testing.assert_allclose(ev["sample_rate"], done["sample_rate"], rtol=1e-12)
    np.testing.assert_allclose(ev["total_time"], done["total_time"], rtol=1e-12)


def test_skeletons_partition_the_space(truth):
    sp, case = truth["space"], truth["case"]
    sk = sp.skeletons(case)
    assert sp.skeleton == SKELETON
    assert len(sk) == len(set(sk)) == len(truth["best"]) == 48
    sizes = [sp.restrict(dict(zip(SKELETON, s))).size(case) for s in sk]
    assert sum(sizes) == sp.size(case)
    assert min(sizes) > 0


def test_space_file_declares_the_skeleton(truth):
    d = truth["space"].to_dict()
    d["skeleton"] = ["microbatch_size", "tensor_par"]
    sp = load_space(d)
    assert sp.skeleton == ("tensor_par", "microbatch_size")      # define-by-run order
    assert load_space(sp.to_dict()).skeleton == sp.skeleton
    sk = sp.skeletons(truth["case"])
    assert len(sk) == len({(a, c) for a, _, c in truth["best"]})


@pytest.mark.parametrize("value, field", [
    (["tensor_par", "nonsense"], "skeleton[1]"),
    (["tensor_par", "fused_activation"], "skeleton[1]"),     # fixed in small, not searched
    ("tensor_par", "skeleton"),
    (["tensor_par", "tensor_par"], "skeleton"),
    (["data_par"], "skeleton[0]"),
])
def test_bad_skeleton_is_a_spec_error_naming_the_field(truth, value, field):
    d = truth["space"].to_dict()
    d["skeleton"] = value
    with pytest.raises(SpecError) as e:
        load_space(d, source="x.yaml")
    assert e.value.field == field and e.value.source == "x.yaml"


@pytest.mark.parametrize("sampler", ["skeleton-tpe", "skeleton-random", "skeleton-cmaes"])
def test_skeleton_trials_are_the_best_completions(truth, sampler):
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler=sampler, trials=20, seed=1)
    _check(table, truth, 20)


def test_trials_cap_at_the_skeletons_and_find_the_optimum(truth):
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe", trials=500, seed=0)
    _check(table, truth, 48)            # every skeleton once, however often proposed
    assert table["sample_rate"].max() == pytest.approx(truth["optimum"], rel=1e-12)
    assert table["layouts"].sum() == truth["space"].size(truth["case"])


def test_storage_keeps_repeats_out_of_the_count_and_resumes(truth, tmp_path):
    url = f"sqlite:///{tmp_path / 'sk.db'}"
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe", trials=40,
                 seed=3, storage=url, study_name="sk", concurrency=4)
    _check(table, truth, 40)
    study = optuna.load_study(study_name="sk", storage=url)
    trials = study.get_trials(deepcopy=False)
    repeats = [t for t in trials if "repeat_of" in t.user_attrs]
    assert len(trials) == 40 + len(repeats)
    assert repeats, "40 of 48 skeletons with TPE: some proposals repeat"
    by_number = {t.number: t for t in trials}
    for t in repeats:               # told the known result of the first proposal
        first = by_number[t.user_attrs["repeat_of"]]
        assert t.state == first.state and t.value == first.value
    again = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe", trials=40,
                 seed=3, storage=url, study_name="sk", concurrency=4)
    assert len(optuna.load_study(study_name="sk", storage=url).trials) == len(trials)
    assert list(again["sample_rate"].fillna(-1)) == list(table["sample_rate"].fillna(-1))


def test_infeasible_skeletons_are_pruned_with_the_commonest_reason():
    # GPT-3 175B on 64 A100: most skeletons cannot hold the model
    table = tune("models/gpt3-175B.json", SYSTEM, num_procs=64, max_batch_size=512,
                 datatype="float16", space="small", sampler="skeleton-random", trials=15, seed=0)
    pruned = table[table["state"] == "PRUNED"]
    assert len(pruned) > 0
    assert pruned["reason"].str.match(r"^infeasible: .* \(all \d+ completions").all()
    assert pruned["sample_rate"].isna().all()


def test_skeleton_on_ray_runs_distinct_skeletons(truth):
    ray = pytest.importorskip("ray")
    from autopar.search.backends import ray_tune as tune_ray
    from autopar.search.cluster import start_local_ray
    assert not ray.is_initialized()
    start_local_ray(num_cpus=2)
    try:
        keep: dict = {}
        from autopar.search.samplers import parse
        from autopar.search.trainable import make_problem
        prob = make_problem(truth["case"], truth["space"], "skeleton-index")
        rows = tune_ray.run(prob, parse("skeleton-tpe"), 24, 0, None, 2, None, keep=keep)
    finally:
        ray.shutdown()
    from autopar.search.tune import trials_table
    table = trials_table(rows)
    _check(table, truth, 24)
    alg = keep["search_alg"]
    study = alg.searcher._ot_study
    assert len(study.trials) >= 24     # every Tune trial, plus proposals answered from the cache


def test_cli_tune_skeleton_writes_the_best_execution(cli, tmp_path, truth):
    out, csv = tmp_path / "best.json", tmp_path / "t.csv"
    r = cli("tune", MODEL, SYSTEM, "--num-procs", "64", "--max-batch-size", "512",
            "--datatype", "float16", "--space", "small", "--sampler", "skeleton-tpe",
            "--trials", "10", "--seed", "0", "--output", str(out), "--trials-out", str(csv))
    assert r.returncode == 0, r.stderr
    import json
    ex = json.loads(out.read_text())
    ev = autopar.evaluate(truth["case"].model, truth["case"].system, [ex])
    import pandas as pd
    t = pd.read_csv(csv)
    assert len(t) == 10
    assert ev["sample_rate"][0] == pytest.approx(t["sample_rate"].max(), rel=1e-12)
    assert set(FIELDS) <= set(ex)


def test_completions_enumerated_once_are_each_skeletons_completions(truth):
    """The one-off enumeration of a small space, split by skeleton, gives each
    skeleton exactly the table its restricted space enumerates, in order."""
    from autopar.io.layouts import ALL_FIELDS
    from autopar.search.skeleton import Completions, completions
    sp, case = truth["space"], truth["case"]
    got = Completions(sp, case, sp.skeleton)
    assert got.small
    total = 0
    for sk in sp.skeletons(case):
        params = dict(zip(sp.skeleton, sk))
        a, b = got(params), completions(sp, case, params)
        for f in ALL_FIELDS:
            assert np.array_equal(np.asarray(a[f]), np.asarray(b[f])), (sk, f)
        total += len(a["tensor_par"])
    assert total == sp.size(case)
    assert len(got({"tensor_par": 3, "pipeline_par": 1, "microbatch_size": 1})["tensor_par"]) == 0


def test_a_run_that_covers_every_skeleton_stops_and_says_so(truth):
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-random",
                 trials=100, seed=3, progress=False)
    assert len(table) == len(truth["best"]) == 48
    assert table.attrs["skeletons"] == 48 and table.attrs["skeleton_space_covered"] is True
    assert table["sample_rate"].max() == pytest.approx(truth["optimum"], rel=1e-12)
    short = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-random",
                 trials=10, seed=3, progress=False)
    assert len(short) == 10 and short.attrs["skeleton_space_covered"] is False


def test_a_budget_covering_the_skeletons_evaluates_them_at_once_in_order(truth, tmp_path):
    """The sampler proposes while it has a choice; a budget that covers the
    rest of the skeletons evaluates them together, each once, in the space's
    enumeration order, recorded in the study (and resumed from it)."""
    url = f"sqlite:///{tmp_path / 'whole.db'}"
    first = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe", trials=12,
                 seed=5, storage=url, study_name="w", concurrency=4, progress=False)
    _check(first, truth, 12)
    study = optuna.load_study(study_name="w", storage=url)
    assert not any("whole_space" in t.user_attrs for t in study.trials)
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe", trials=60,
                 seed=5, storage=url, study_name="w", concurrency=4, progress=False)
    _check(table, truth, 48)
    assert table["sample_rate"].max() == pytest.approx(truth["optimum"], rel=1e-12)
    trials = optuna.load_study(study_name="w", storage=url).get_trials(deepcopy=False)
    whole = [t for t in trials if "whole_space" in t.user_attrs]
    assert len(whole) == 48 - 12 and len(trials) == 48 + sum(
        "repeat_of" in t.user_attrs for t in trials)
    done = {k for k in zip(*(first[p].astype(int) for p in SKELETON))}
    order = [k for k in sorted(truth["best"], key=_enumeration_rank(truth)) if k not in done]
    got = [tuple(int(v) for v in k) for k in
           zip(*(table[p].to_numpy()[12:] for p in SKELETON))]
    assert got == order
    for t in whole:            # each trial holds its skeleton's best completion
        k = tuple(int(table.loc[table.trial == t.number, p].iloc[0]) for p in SKELETON)
        want = truth["best"][k]
        assert (t.state == TrialState.PRUNED) == (not np.isfinite(want))
        if np.isfinite(want):
            assert t.value == pytest.approx(want, rel=1e-12)


def test_a_study_that_ends_with_the_run_gives_the_same_whole_space_trials(truth):
    """In memory and not returned, the whole-space pass does not record its
    trials in the study (nobody can read it): the table is the one a
    returned study's run gives, trial numbers and elapsed times included."""
    args = dict(space="small", sampler="skeleton-tpe", trials=100, seed=3, progress=False)
    alone = tune(MODEL, SYSTEM, **CASE, **args)
    kept, study = tune(MODEL, SYSTEM, **CASE, **args, return_study=True)
    assert len(study.trials) == len(alone) == 48
    assert all("whole_space" in t.user_attrs for t in study.trials)
    cols = [c for c in alone.columns if c != "elapsed_s"]
    pd.testing.assert_frame_equal(alone[cols], kept[cols])
    assert alone["elapsed_s"].notna().all() and (alone["elapsed_s"] >= 0).all()


def _enumeration_rank(truth):
    """Skeleton -> where its first completion comes in the space's enumeration."""
    sp, case = truth["space"], truth["case"]
    cols = sp.layouts(case, 0, sp.size(case))
    first: dict = {}
    for i, k in enumerate(zip(*(np.asarray(cols[p]).tolist() for p in SKELETON))):
        first.setdefault(k, i)
    return first.__getitem__


def test_compare_rechecks_each_runs_best_trial(truth):
    """``regret.recheck_best`` evaluates a run's best execution again: the
    rate it reported passes, any other rate stops the comparison."""
    from autopar.studies.regret import BestMismatch, recheck_best
    table = tune(MODEL, SYSTEM, **CASE, space="small", sampler="skeleton-tpe",
                 trials=12, seed=0, progress=False)
    run = {"sampler": "skeleton-tpe", "seed": 0, "best_execution": best_execution(table),
           "sample_rate": table["sample_rate"].tolist()}
    case = truth["case"]
    assert recheck_best([run], case.model, case.system) == {"runs": 1,
                                                            "max_relative_difference": 0.0}
    wrong = dict(run, sample_rate=[r * 1.001 for r in run["sample_rate"]])
    with pytest.raises(BestMismatch, match="evaluated again gives"):
        recheck_best([wrong], case.model, case.system)
    assert recheck_best([dict(run, best_execution=None)], case.model, case.system)["runs"] == 0


def test_the_ray_repeat_cache_state_round_trips(truth):
    """SkeletonCache keeps its repeat cache (backends.repeats, shared with the
    optuna backend) in Tune's searcher state: a restored one places the same
    skeleton in place of a repeat."""
    pytest.importorskip("ray")
    import pickle

    from autopar.search.backends.ray_tune import SkeletonCache
    from autopar.search.skeleton import SkeletonEncoder
    enc = SkeletonEncoder(truth["space"], truth["case"], "index")
    a = SkeletonCache(searcher=None, encoder=enc, seed=5)
    for i, sk in enumerate(enc.all[:3]):
        a.repeats.claim(sk, f"t{i}")
    b = SkeletonCache(searcher=None, encoder=enc, seed=99)
    b.set_state(pickle.loads(pickle.dumps(a.get_state())))     # as Tune saves it
    assert b.repeats.owner == a.repeats.owner
    assert b.repeats.instead(enc.all[0], "t9") == a.repeats.instead(enc.all[0], "t9")
    assert enc.all[0] in b.repeats and b.repeats.unseen() == a.repeats.unseen()
