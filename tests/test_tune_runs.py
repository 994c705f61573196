"""Runs of ``autopar tune`` (backend optuna) on one storage, and what a failed
run leaves (issue #27): each run's ``--trials-out`` holds its own trials, two
runs with one seed do not evaluate the same layouts, and a failed run leaves
no database it created."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from autopar.io.layouts import ALL_FIELDS
from autopar.search.tune import tune_arguments as tune
from test_tune import CASE, MODEL, SYSTEM

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(db: Path, out: Path, seed: int, trials: int):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    args = [MODEL, SYSTEM, *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in CASE.items()), [])]
    return subprocess.Popen(
        [sys.executable, "-m", "autopar.cli", "tune", *args, "--sampler", "random",
         "--trials", str(trials), "--seed", str(seed), "--storage", f"sqlite:///{db}",
         "--study-name", "shared", "--trials-out", str(out), "--no-progress"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_runs_on_one_study_each_report_their_own_distinct_trials(tmp_path):
    import optuna
    db, trials = tmp_path / "s.db", 300
    outs = [tmp_path / "a.csv", tmp_path / "b.csv"]
    runs = [_run(db, out, seed=0, trials=trials) for out in outs]
    for p in runs:
        _, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1) and "Traceback" not in err, err
    a, b = (pd.read_csv(o, keep_default_na=False, na_values=[""]) for o in outs)
    assert len(a) > 0 and len(b) > 0, "the runs did not overlap; nothing is tested"
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{db}")
    finished = {t.number for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")}
    # each run's table: its own trials; together every finished trial, once
    assert set(a["trial"]).isdisjoint(b["trial"])
    assert set(a["trial"]) | set(b["trial"]) == finished
    assert len(a) + len(b) == len(finished)
    # one seed, two runs: not the same proposals (one seed's sequence twice
    # would repeat nearly every layout of the shorter run)
    fields = [f for f in ALL_FIELDS if f in a.columns]
    layouts = [set(map(tuple, t[fields].astype(str).values)) for t in (a, b)]
    shared = len(layouts[0] & layouts[1])
    assert shared <= 0.1 * min(map(len, layouts)), (shared, [len(x) for x in layouts])


def test_a_failed_run_leaves_no_database_it_created(tmp_path, monkeypatch):
    from autopar.search import trainable
    real = trainable.evaluate_params
    calls = {"n": 0}

    def failing(prob, params):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(prob, params)

    monkeypatch.setattr(trainable, "evaluate_params", failing)
    db = tmp_path / "new.db"
    with pytest.raises(OSError):
        tune(MODEL, SYSTEM, sampler="random", trials=10, seed=0, storage=f"sqlite:///{db}",
             progress=False, **CASE)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a database that was there before is kept (it holds other studies' trials)
    monkeypatch.setattr(trainable, "evaluate_params", real)
    tune(MODEL, SYSTEM, sampler="random", trials=2, seed=0, storage=f"sqlite:///{db}",
         study_name="kept", progress=False, **CASE)
    calls["n"] = 0
    monkeypatch.setattr(trainable, "evaluate_params", failing)
    with pytest.raises(OSError):
        tune(MODEL, SYSTEM, sampler="random", trials=10, seed=0, storage=f"sqlite:///{db}",
             progress=False, **CASE)
    assert db.exists()


def test_a_run_beside_a_live_run_with_the_same_seed_draws_other_layouts(tmp_path):
    """Two runs starting together on a new study both find no trial done:
    the run's rank among the live runs (``RUN_MARK``) gives it its own seed."""
    import socket

    import optuna
    from autopar.search.backends.shared_study import RUN_MARK
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        url = f"sqlite:///{tmp_path / 's.db'}"
        study = optuna.create_study(storage=url, study_name="s", direction="maximize")
        study.set_user_attr(RUN_MARK + f"{socket.gethostname()}:{sleeper.pid}", 0.0)
        beside = tune(MODEL, SYSTEM, sampler="random", trials=20, seed=0, storage=url,
                      study_name="s", progress=False, **CASE)
    finally:
        sleeper.kill()
        sleeper.wait()
    alone = tune(MODEL, SYSTEM, sampler="random", trials=20, seed=0, progress=False, **CASE)
    again = tune(MODEL, SYSTEM, sampler="random", trials=20, seed=0, progress=False, **CASE)
    fields = [f for f in ALL_FIELDS if f in alone.columns]

    def layouts(t):
        return [tuple(map(str, r)) for r in t[fields].values]
    assert layouts(alone) == layouts(again)               # one run alone: the seed's trials
    assert len(set(layouts(beside)) & set(layouts(alone))) <= 2
