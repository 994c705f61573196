"""``autopar.search.tune`` on the optuna backend: real Optuna studies, real storage.

The case is GPT-3 175B on 1024 A100 80G, batch 1536, float16 (the project's
own model and system files).  Every trial is checked against the model itself
(``autopar.evaluate``): a trial is pruned exactly when its layout cannot run.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

import autopar
from autopar.io.layouts import FIELDS
from autopar.io.specs import SpecError
from autopar.search.tune import TRIAL_COLUMNS, best_execution, best_trial
from autopar.search.tune import tune_arguments as tune

MODEL = "models/gpt3-175B.json"
SYSTEM = "systems/a100_80g.json"
CASE = dict(num_procs=1024, max_batch_size=1536, datatype="float16")


@pytest.fixture(autouse=True)
def _in_repo(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)


def check_trials(table: pd.DataFrame, trials: int, space="calculon", in_order=True) -> None:
    """The invariants of a trials table, checked against the model.

    ``in_order``: trials end in trial order (one at a time, or batches).
    """
    from autopar.search.space import Case, load_space
    assert list(table.columns) == list(TRIAL_COLUMNS)
    assert len(table) == trials
    assert table["trial"].is_unique and table["trial"].is_monotonic_increasing
    assert set(table["state"]) <= {"COMPLETE", "PRUNED"}
    pruned = table["state"] == "PRUNED"
    # every infeasible trial is pruned and every pruned trial infeasible
    assert (pruned == ~table["feasible"]).all()
    assert table.loc[pruned, "sample_rate"].isna().all()
    assert table.loc[pruned, "reason"].str.match(r"^(invalid|infeasible): ").all()
    assert (table.loc[~pruned, "reason"] == "").all()
    assert (table.loc[~pruned, "sample_rate"] > 0).all()
    assert (table["elapsed_s"] >= 0).all()
    if in_order:
        assert table["elapsed_s"].is_monotonic_increasing
    # the model agrees, layout by layout
    execs = [{f: (v.item() if hasattr(v, "item") else v) for f, v in row.items()}
             for row in table[list(FIELDS)].to_dict("records")]
    sp = load_space(space)
    m, s = autopar.load_model(MODEL), autopar.load_system(SYSTEM)
    case = Case(model=m, system=s, **CASE)
    in_space = np.array([sp.check(case, ex) == "" for ex in execs])
    ev = autopar.evaluate(m, s, execs)
    feasible = ev["feasible"].to_numpy() & in_space
    assert (feasible == table["feasible"].to_numpy()).all()
    ok = table["feasible"].to_numpy()
    np.testing.assert_allclose(table.loc[ok, "sample_rate"], ev.loc[ok, "sample_rate"], rtol=1e-12)
    np.testing.assert_allclose(table.loc[ok, "total_time"], ev.loc[ok, "total_time"], rtol=1e-12)


@pytest.mark.parametrize("sampler", ["tpe", "cmaes", "random", "grid", "bohb"])
def test_samplers_prune_exactly_the_infeasible(sampler):
    if sampler == "bohb":
        pytest.importorskip("hpbandster")
    table = tune(MODEL, SYSTEM, sampler=sampler, trials=30, seed=3, progress=False, **CASE)
    check_trials(table, 30)
    assert (table["state"] == "PRUNED").any()        # this case has infeasible layouts
    assert (table["node_id"] == "").all()
    # define-by-run encodings sample valid layouts only
    assert not table["reason"].str.startswith("invalid:").any()


def test_flat_encoding_prunes_invalid_combinations_with_the_space_reason():
    table = tune(MODEL, SYSTEM, sampler="random", trials=40, seed=0, encoding="flat",
                 progress=False, **CASE)
    check_trials(table, 40)
    invalid = table["reason"].str.startswith("invalid:")
    assert invalid.sum() > 10                        # flat samples break the rules often


def test_named_encoding_samples_valid_layouts():
    table = tune(MODEL, SYSTEM, sampler="tpe", trials=30, seed=0, encoding="named",
                 progress=False, **CASE)
    check_trials(table, 30)
    assert not table["reason"].str.startswith("invalid:").any()


def test_same_seed_same_trials_and_other_seed_other_trials():
    runs = [tune(MODEL, SYSTEM, sampler="tpe", trials=25, seed=s, progress=False, **CASE)
            for s in (7, 7, 8)]
    drop = ["elapsed_s"]
    pd.testing.assert_frame_equal(runs[0].drop(columns=drop), runs[1].drop(columns=drop))
    assert not runs[0].drop(columns=drop).equals(runs[2].drop(columns=drop))


def test_bohb_same_seed_same_trials():
    pytest.importorskip("hpbandster")
    a, b = (tune(MODEL, SYSTEM, sampler="bohb", trials=25, seed=1, progress=False, **CASE)
            for _ in range(2))
    pd.testing.assert_frame_equal(a.drop(columns=["elapsed_s"]), b.drop(columns=["elapsed_s"]))


def test_concurrency_batches_are_deterministic_too():
    a, b = (tune(MODEL, SYSTEM, sampler="tpe", trials=24, seed=2, concurrency=4,
                 progress=False, **CASE) for _ in range(2))
    check_trials(a, 24)
    pd.testing.assert_frame_equal(a.drop(columns=["elapsed_s"]), b.drop(columns=["elapsed_s"]))


def test_storage_holds_the_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    table = tune(MODEL, SYSTEM, sampler="random", trials=12, seed=5, storage=url,
                 study_name="s", progress=False, **CASE)
    study = optuna.load_study(study_name="s", storage=url)
    states = [t.state for t in study.trials]
    assert len(states) == 12 and TrialState.COMPLETE in states and TrialState.PRUNED in states
    assert [s.name for s in states] == list(table["state"])
    for t, (_, row) in zip(study.trials, table.iterrows()):
        if t.state == TrialState.PRUNED:
            assert t.user_attrs["reason"] == row["reason"]
            assert t.value is None
        else:
            assert t.value == pytest.approx(row["sample_rate"], rel=1e-12)
    best = best_trial(table)
    assert study.best_trial.number == best["trial"]
    assert study.best_value == pytest.approx(best["sample_rate"], rel=1e-12)


def test_rerun_on_storage_resumes_without_new_trials(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    a = tune(MODEL, SYSTEM, sampler="random", trials=12, seed=0, storage=url,
             progress=False, **CASE)
    b = tune(MODEL, SYSTEM, sampler="random", trials=12, seed=0, storage=url,
             progress=False, **CASE)
    pd.testing.assert_frame_equal(a.drop(columns=["elapsed_s"]), b.drop(columns=["elapsed_s"]))
    c = tune(MODEL, SYSTEM, sampler="random", trials=18, seed=0, storage=url,
             progress=False, **CASE)
    check_trials(c, 18)
    pd.testing.assert_frame_equal(a.drop(columns=["elapsed_s"]),
                                  c.iloc[:12].drop(columns=["elapsed_s"]))


def test_resuming_another_search_under_the_same_study_name_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    tune(MODEL, SYSTEM, sampler="random", trials=3, seed=0, storage=url, study_name="x",
         progress=False, **CASE)
    with pytest.raises(SpecError) as e:
        tune(MODEL, SYSTEM, sampler="tpe", trials=3, seed=0, storage=url, study_name="x",
             progress=False, **CASE)
    assert e.value.field == "storage" and "sampler" in e.value.message


def _finished(url: str, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except KeyError:
        return 0
    return len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)))


def test_killed_run_resumes_to_exactly_t_trials(tmp_path, repo_root):
    """A run killed mid-way (SIGKILL: trials left RUNNING) and run again ends with T."""
    db = tmp_path / "study.db"
    url = f"sqlite:///{db}"
    # (enough trials that the run cannot finish them all between two polls
    # of a loaded machine: the kill must land mid-way)
    trials = 300
    cmd = [sys.executable, "-m", "autopar.cli", "tune", MODEL, SYSTEM, "--num-procs", "1024",
           "--max-batch-size", "1536", "--datatype", "float16", "--sampler", "random",
           "--trials", str(trials), "--seed", "5", "--storage", url, "--study-name", "k",
           "--trials-out", str(tmp_path / "trials.csv"), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while _finished(url, "k") < 8:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done = _finished(url, "k")
    assert 8 <= done < trials
    assert not (tmp_path / "trials.csv").exists()         # nothing written half-way
    rerun = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    table = pd.read_csv(tmp_path / "trials.csv", keep_default_na=False, na_values=[""])
    assert len(table) == trials
    assert set(table["state"]) <= {"COMPLETE", "PRUNED"}
    study = optuna.load_study(study_name="k", storage=url)
    assert _finished(url, "k") == trials
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    # a finished trial is never evaluated twice: the first `done` are unchanged
    assert list(table["trial"][:done]) == [t.number for t in study.trials
                                           if t.state in (TrialState.COMPLETE, TrialState.PRUNED)][:done]


def test_interrupted_in_process_leaves_no_running_trial(tmp_path, monkeypatch):
    """Ctrl-C inside the loop: asked trials are failed, a rerun completes T."""
    from autopar.search import trainable
    url = f"sqlite:///{tmp_path / 'study.db'}"
    real = trainable.evaluate_params
    calls = {"n": 0}

    def flaky(prob, params):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(prob, params)

    monkeypatch.setattr(trainable, "evaluate_params", flaky)
    with pytest.raises(KeyboardInterrupt):
        tune(MODEL, SYSTEM, sampler="random", trials=16, seed=0, storage=url, study_name="i",
             concurrency=2, progress=False, **CASE)
    study = optuna.load_study(study_name="i", storage=url)
    assert [t.state.name for t in study.trials].count("RUNNING") == 0
    assert _finished(url, "i") == 10                # 5 batches of 2 before the interrupt
    assert [t.state.name for t in study.trials].count("FAIL") == 2
    monkeypatch.setattr(trainable, "evaluate_params", real)
    table = tune(MODEL, SYSTEM, sampler="random", trials=16, seed=0, storage=url, study_name="i",
                 concurrency=2, progress=False, **CASE)
    check_trials(table, 16)


def test_grid_covers_distinct_layouts_and_caps_at_the_space_size():
    space = {"name": "tiny", "params": {"tensor_par": [4, 8], "pipeline_par": [8, 16],
                                        "microbatch_size": [1, 2]},
             "fixed": {"pipeline_interleaving": 1, "activation_recompute": "full",
                       "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
                       "seq_par_ag_redo": False, "data_par_overlap": True,
                       "tensor_par_overlap": "none", "weight_offload": False,
                       "activations_offload": False, "optimizer_offload": False,
                       "fused_activation": True, "attention_type": "multihead",
                       "tensor_par_net": 0, "pipeline_par_net": 1, "data_par_net": 1}}
    table = tune(MODEL, SYSTEM, sampler="grid", trials=50, seed=0, space=space,
                 progress=False, **CASE)
    check_trials(table, 8, space=space)
    combos = table[["tensor_par", "pipeline_par", "microbatch_size"]].drop_duplicates()
    assert len(combos) == 8


def test_best_export_is_the_best_trial(tmp_path, cli):
    out, csv = tmp_path / "best.json", tmp_path / "trials.csv"
    # --risk fast: the export is the fastest trial that fits (with the
    # default safe risk it is the fastest whose P(fits) reaches 0.95, which
    # depends on errors.json's memory spread: none of these 25 trials does
    # under the Megatron family's sigma 0.104; tests/test_risk.py covers it).
    r = cli("tune", MODEL, SYSTEM, "--num-procs", 1024, "--max-batch-size", 1536,
            "--datatype", "float16", "--sampler", "tpe", "--trials", 25, "--seed", 4,
            "--output", out, "--trials-out", csv, "--risk", "fast")
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    # the command adds each trial's chance to fit (autopar.search.risk)
    assert list(table.columns) == list(TRIAL_COLUMNS) + ["p_fits"]
    assert len(table) == 25
    best = json.loads(out.read_text())
    row = table.loc[table["sample_rate"].idxmax()]
    assert best == {f: (row[f].item() if hasattr(row[f], "item") else row[f]) for f in FIELDS}
    assert best == best_execution(table)
    again = autopar.evaluate(MODEL, SYSTEM, [best])
    assert bool(again["feasible"][0])
    assert again["sample_rate"][0] == pytest.approx(row["sample_rate"], rel=1e-9)
    assert f"{row['sample_rate']:.4g}" in r.stdout
    # the same search from Python gives the same table
    api = tune(MODEL, SYSTEM, sampler="tpe", trials=25, seed=4, progress=False, **CASE)
    np.testing.assert_allclose(api["sample_rate"], table["sample_rate"], rtol=1e-12)
    assert list(api["state"]) == list(table["state"])


def test_autopar_tune_is_callable_after_importing_the_module():
    import autopar.search.tune  # noqa: F401  (the module no longer shadows the function)
    assert callable(autopar.tune)
    assert autopar.tune(MODEL, SYSTEM, sampler="random", trials=3, seed=0,
                        progress=False, **CASE).shape[0] == 3


@pytest.mark.parametrize("kw, field", [
    ({"sampler": "annealing"}, "sampler"),
    ({"trials": 0}, "trials"),
    ({"backend": "spark"}, "backend"),
    ({"encoding": "onehot"}, "encoding"),
    ({"sampler": "bohb", "encoding": "named"}, "encoding"),
    ({"backend": "ray", "storage": "sqlite:///x.db"}, "storage"),
    ({"address": "127.0.0.1:6379"}, "address"),
    ({"concurrency": 0}, "concurrency"),
    ({"seed": -1}, "seed"),
    ({"storage": "nosuchdb://x"}, "storage"),
])
def test_bad_arguments_raise_spec_errors(kw, field):
    args = {"sampler": "random", "trials": 5, **kw}
    with pytest.raises(SpecError) as e:
        tune(MODEL, SYSTEM, progress=False, **CASE, **args)
    assert e.value.field == field


def test_datatype_the_system_lacks_is_a_spec_error():
    with pytest.raises(SpecError) as e:
        tune(MODEL, SYSTEM, 1024, 1536, "float8", sampler="random", trials=2, progress=False)
    assert e.value.field == "datatype"


@pytest.mark.parametrize("args, needle", [
    (["--trials", "0"], "--trials"),
    (["--storage", "sqlite:///x.db", "--backend", "ray"], "--storage"),
    (["--output", "/nonexistent/dir/best.json"], "--output"),
    (["--storage", "nosuchdb://x"], "storage"),
])
def test_cli_bad_input_is_one_line_exit_2(cli, tmp_path, args, needle):
    r = cli("tune", MODEL, SYSTEM, "--num-procs", 1024, "--max-batch-size", 1536,
            "--datatype", "float16", "--sampler", "random", "--trials", 3,
            "--trials-out", tmp_path / "t.csv", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: ") and needle in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "t.csv").exists()


def test_cli_missing_model_file_names_it(cli, tmp_path):
    r = cli("tune", tmp_path / "nope.json", SYSTEM, "--num-procs", 1024, "--max-batch-size",
            1536, "--datatype", "float16", "--trials", 3)
    assert r.returncode == 2
    assert "nope.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_no_feasible_layout_exits_1_and_still_writes_trials(cli, tmp_path):
    # 8 GPUs cannot hold GPT-3 175B: every trial is pruned
    out, csv = tmp_path / "best.json", tmp_path / "trials.csv"
    r = cli("tune", MODEL, SYSTEM, "--num-procs", 8, "--max-batch-size", 8,
            "--datatype", "float16", "--sampler", "random", "--trials", 10, "--seed", 0,
            "--output", out, "--trials-out", csv)
    assert r.returncode == 1, r.stderr
    assert "no feasible layout" in r.stderr
    assert not out.exists()
    table = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    assert len(table) == 10 and (table["state"] == "PRUNED").all()


def test_cli_sampler_names_match_the_library():
    from autopar.cli import tune as cli_tune
    from autopar.search.samplers import SAMPLERS
    assert cli_tune.SAMPLERS == SAMPLERS


def test_optuna_returns_its_study_and_says_when_nothing_was_left(tmp_path, cli):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    table, study = tune(MODEL, SYSTEM, sampler="random", trials=6, seed=0, storage=storage,
                        study_name="mine", progress=False, return_study=True, **CASE)
    assert study.study_name == "mine" and len(study.trials) == 6
    assert table.attrs["study_name"] == "mine" and table.attrs["new_trials"] == 6
    args = [MODEL, SYSTEM, *sum(([f"--{k.replace('_', '-')}", v] for k, v in CASE.items()), []),
            "--sampler", "random", "--trials", 6, "--seed", 0, "--storage", storage,
            "--study-name", "mine"]
    r = cli("tune", *args)
    assert r.returncode in (0, 1), r.stderr
    assert f"study mine in {storage}" in r.stdout
    assert "nothing to do: the study already has 6 finished trials (asked for 6)" in r.stdout
    r = cli("tune", *args[:-4], "--trials", 8, "--storage", storage, "--study-name", "mine")
    assert "study mine" in r.stdout and "nothing to do" not in r.stdout
