"""``autopar.search.tune`` on the ray backend: a real local Ray (2 CPUs), real Tune runs.

Ray is started once for the module (``autopar.search.cluster.start_local_ray``:
loopback only, no dashboard) and shut down at the end.  Each sampler runs
once; the TPE and BOHB runs also expose their search algorithm, to check what
Ray's OptunaSearch told its study and what BOHB learnt.
"""
from __future__ import annotations

import math

import pytest
from optuna.trial import TrialState

from autopar.search.backends import ray_tune as tune_ray
from autopar.search.cluster import start_local_ray
from autopar.search.samplers import parse
from autopar.io.layouts import FIELDS
from autopar.search.space import load_space
from autopar.search.trainable import make_problem
from autopar.search.tune import best_execution, best_trial, make_case, trials_table
from autopar.search.tune import tune_arguments as tune
from test_tune import CASE, MODEL, SYSTEM, check_trials

ray = pytest.importorskip("ray")
TRIALS = 10


@pytest.fixture(scope="module")
def local_ray(repo_root):
    import os
    cwd = os.getcwd()
    os.chdir(repo_root)
    assert not ray.is_initialized()
    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _in_repo(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)


def _problem(encoding: str):
    return make_problem(make_case(MODEL, SYSTEM, **CASE), load_space("calculon"), encoding)


def _check_ray(table) -> None:
    check_trials(table, TRIALS, in_order=False)
    assert list(table["trial"]) == list(range(TRIALS))
    node = ray.get_runtime_context().get_node_id()
    assert (table["node_id"] == node).all()        # the one local node ran every trial


@pytest.mark.parametrize("sampler", ["random", "grid", "cmaes"])
def test_ray_trials_prune_exactly_the_infeasible(local_ray, sampler):
    table = tune(MODEL, SYSTEM, sampler=sampler, trials=TRIALS, seed=1, backend="ray",
                 progress=False, **CASE)
    _check_ray(table)
    best = best_trial(table)
    if best is not None:
        assert best["sample_rate"] == table["sample_rate"].max()
        assert best_execution(table) == {
            f: (best[f].item() if hasattr(best[f], "item") else best[f]) for f in FIELDS}


def test_ray_optuna_study_marks_infeasible_trials_pruned(local_ray):
    """Ray's OptunaSearch sees a trial reported without a value and tells PRUNED."""
    keep: dict = {}
    rows = tune_ray.run(_problem("named"), parse("tpe"), TRIALS, 2, None, 2, None, keep=keep)
    _check_ray(trials_table(rows))
    study = keep["search_alg"]._ot_study          # OptunaSearch's study (no public accessor)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == len(rows)
    for t, row in zip(trials, rows):
        if row["feasible"]:
            assert t.state == TrialState.COMPLETE
            assert t.value == pytest.approx(row["sample_rate"], rel=1e-12)
        else:
            assert t.state == TrialState.PRUNED and math.isnan(row["sample_rate"])
    assert {t.state for t in trials} == {TrialState.COMPLETE, TrialState.PRUNED}


def test_ray_bohb_learns_from_every_trial(local_ray):
    """TuneBOHBAll feeds BOHB each finished trial, infeasible ones with loss +inf."""
    pytest.importorskip("hpbandster")
    keep: dict = {}
    rows = tune_ray.run(_problem("index"), parse("bohb"), TRIALS, 0, None, 2, None, keep=keep)
    _check_ray(trials_table(rows))
    bohber = keep["search_alg"].bohber
    assert len(bohber.configs[1.0]) == len(rows)
    losses = bohber.losses[1.0]
    assert sum(math.isinf(x) for x in losses) == sum(not r["feasible"] for r in rows)


def test_local_ray_listens_on_loopback_only(local_ray):
    """Every socket our Ray processes listen on is bound to 127.0.0.1; no dashboard."""
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    kids = me.children(recursive=True)
    pids = {p.pid for p in kids} | {me.pid}
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening, "no Ray server found among this process's children"
    for c in listening:
        assert c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1"), c
    cmds = []
    for p in kids:          # a short-lived worker may exit (or be a zombie) meanwhile
        try:
            cmds.append(" ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    assert any("gcs_server" in c for c in cmds)
    # include_dashboard=False leaves only Ray's minimal head process: no web frontend
    for c in cmds:
        if "dashboard/dashboard.py" in c:
            assert "--minimal" in c and "--disable-frontend" in c, c


def test_mend_experiment_state_puts_back_what_a_killed_driver_cut_off(tmp_path):
    # A driver killed while Tune copied its state to storage leaves an empty
    # experiment_state file; the staging copy in the Ray session folder is whole.
    from autopar.io.specs import SpecError
    exp = tmp_path / "results" / "killed"
    exp.mkdir(parents=True)
    cut, whole = "2026-01-01_00-00-01", "2026-01-01_00-00-09"
    (exp / f"experiment_state-{cut}.json").write_text("")
    (exp / f"basic-variant-state-{cut}.json").write_text('{"old": 1}')
    (exp / f"experiment_state-{whole}.json").write_text('{"later": 1}')
    stage = tmp_path / "ray" / "session_x" / "artifacts" / "t0" / "killed" / "driver_artifacts"
    stage.mkdir(parents=True)
    (stage / f"experiment_state-{cut}.json").write_text('{"trial_data": []}')
    (stage / f"basic-variant-state-{cut}.json").write_text('{"new": 1}')
    (stage / f"experiment_state-{whole}.json").write_text('{"staged": 1}')
    tune_ray.mend_experiment_state(str(exp), [tmp_path / "ray"])
    assert (exp / f"experiment_state-{cut}.json").read_text() == '{"trial_data": []}'
    assert (exp / f"basic-variant-state-{cut}.json").read_text() == '{"new": 1}'
    assert (exp / f"experiment_state-{whole}.json").read_text() == '{"later": 1}'   # untouched

    (exp / f"experiment_state-{cut}.json").write_text('{"trial_da')
    with pytest.raises(SpecError) as e:
        tune_ray.mend_experiment_state(str(exp), [tmp_path / "elsewhere"])
    assert e.value.field == f"experiment_state-{cut}.json"
    assert "cannot be resumed" in e.value.message


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_kept_experiment_restores_the_ray_way(local_ray, tmp_path, sampler):
    """Tuner.restore(...).get_results(): a ResultGrid with the metrics, and
    configs of the searched parameters only (no problem JSON, no encoding names)."""
    table = tune(MODEL, SYSTEM, sampler=sampler, trials=6, seed=3, backend="ray",
                 progress=False, storage_path=str(tmp_path), name="kept", **CASE)
    path = str(tmp_path / "kept")
    grid = tune_ray.restore(path).get_results()
    assert len(grid) == 6 and not grid.errors
    frame = grid.get_dataframe()
    assert frame.shape[0] == 6 and {"sample_rate", "state", "tensor_par"} <= set(frame.columns)
    done = sorted(frame.loc[frame["state"] == "COMPLETE", "sample_rate"])
    assert done == sorted(table.loc[table["state"] == "COMPLETE", "sample_rate"])
    for res in grid:
        keys = set(res.config) | set(res.config.get("params", {}))
        assert tune_ray.PAYLOAD_KEY not in keys and not any("|" in k for k in keys), keys
        assert len(str(res.config)) < 1000
    # Ray's own call, with the trainable autopar names for the folder
    plain = ray.tune.Tuner.restore(path, trainable=tune_ray.restore_trainable(path))
    assert len(plain.get_results().get_dataframe()) == 6


def test_resumed_experiment_numbers_trials_as_the_run_did(local_ray, tmp_path):
    """Tune puts restored trials back newest result first; the resumed table
    still numbers each trial as the run did (the summary's "trial 46", not
    its place in the restored list), in trial order (#27)."""
    from autopar.search.tune import resume
    table = tune(MODEL, SYSTEM, sampler="random", trials=8, seed=4, backend="ray",
                 concurrency=1, progress=False, storage_path=str(tmp_path), name="kept", **CASE)
    again = resume(str(tmp_path / "kept"))
    assert list(again["trial"]) == list(table["trial"]) == list(range(8))
    fields = ["tensor_par", "pipeline_par", "data_par", "microbatch_size", "batch_size"]
    assert again[fields].astype(str).values.tolist() == table[fields].astype(str).values.tolist()
    assert list(again["sample_rate"].fillna(-1)) == list(table["sample_rate"].fillna(-1))


def test_actors_are_reused_on_one_node_only(local_ray, monkeypatch):
    """Tune hands a cached actor to any pending trial, one whose actor is
    starting on another node too: on more than one node, no reuse (#27)."""
    assert tune_ray.reuse_actors_here()          # the local Ray: one node
    node = {"Alive": True, "Resources": {"CPU": 1.0}}
    monkeypatch.setattr(ray, "nodes", lambda: [node, dict(node)])
    assert not tune_ray.reuse_actors_here()
    monkeypatch.setattr(ray, "nodes", lambda: [node, {"Alive": False, "Resources": {"CPU": 1.0}},
                                               {"Alive": True, "Resources": {"GPU": 1.0}}])
    assert tune_ray.reuse_actors_here()
