"""Probes: bad input and faults a user meets, one class per test.

Each ends with one line on stderr and exit 2 (130 when interrupted), no
traceback, and nothing half-written or replaced."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

MODEL, SYSTEM = "models/gpt3-175B.json", "systems/a100_80g.json"
SMALL = [MODEL, SYSTEM, "--num-procs", "64", "--max-batch-size", "64", "--datatype", "float16"]


def one_line(r, *words, code=2):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _user_signals():
    # A shell's background job starts with SIGINT ignored, and Python then keeps
    # it ignored; a user's Ctrl-C reaches a process whose SIGINT is the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _popen(args, cwd, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **kw.pop("env", {})}
    return subprocess.Popen([sys.executable, "-m", "autopar.cli", *map(str, args)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_user_signals, **kw)


# --------------------------------------------------------------------------
# numbers

@pytest.mark.parametrize("seed", [2 ** 32, 10 ** 30])
def test_seed_beyond_32_bits(cli, seed):
    one_line(cli("tune", *SMALL, "--trials", 2, "--seed", seed), "--seed", "2**32-1")


def test_seed_beyond_32_bits_in_python():
    from autopar.io.errors import SpecError
    from autopar.search.tune import tune_arguments as tune
    with pytest.raises(SpecError, match="2\\*\\*32-1"):
        tune(MODEL, SYSTEM, 64, 64, "float16", trials=2, seed=2 ** 32, progress=False)


@pytest.mark.parametrize("flag", ["--num-procs", "--max-batch-size", "--top-n", "--chunk-size"])
def test_integers_beyond_64_bits_and_huge_counts(cli, flag):
    args = [a if a != flag else a for a in SMALL]
    r = cli("exhaustive", *args, "--space", "small", flag, 2 ** 70, timeout=60)
    one_line(r, flag, "at most")


def test_model_field_beyond_64_bits(cli, tmp_path):
    m = json.loads((REPO_ROOT / MODEL).read_text())
    m["hidden"] = 2 ** 70
    (tmp_path / "m.json").write_text(json.dumps(m))
    one_line(cli("estimate", tmp_path / "m.json", SYSTEM, tmp_path / "m.json"), "m.json", "hidden")


@pytest.mark.parametrize("workers", [0, -1])
def test_workers_must_be_positive(cli, workers):
    r = cli("codesign", REPO_ROOT / "experiments/codesign-small.yaml", "--workers", workers)
    one_line(r, "--workers")


# --------------------------------------------------------------------------
# outputs

def test_same_path_for_two_outputs(cli, tmp_path):
    r = cli("exhaustive", *SMALL, "--space", "small", "--output", tmp_path / "x.json",
            "--summary", tmp_path / "x.json")
    one_line(r, "--summary", "--output")
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_file_that_is_not_a_folder(cli, tmp_path):
    (tmp_path / "f").write_text("x")
    one_line(cli("exhaustive", *SMALL, "--space", "small", "--output", tmp_path / "f" / "b.json"),
             "--output")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_unwritable_folder_before_the_search(cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    one_line(cli("exhaustive", *SMALL, "--output", ro / "b.json"), "--output", "cannot write")


def test_device_is_not_replaced(cli):
    before = os.stat("/dev/full")
    one_line(cli("exhaustive", *SMALL, "--space", "small", "--output", "/dev/full"),
             "/dev/full", "not a regular file")
    after = os.stat("/dev/full")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_fifo_is_not_replaced(cli, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line(cli("tune", *SMALL, "--trials", 2, "--trials-out", fifo), "--trials-out")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_symlink_is_kept_and_its_target_written(cli, tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to("real.json")
    r = cli("exhaustive", *SMALL, "--space", "small", "--output", tmp_path / "link.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "real.json").read_text())["num_procs"] == 64


def test_full_disk_is_one_line(monkeypatch, tmp_path, capsys):
    import errno
    from autopar.cli import main
    from autopar.io import writers

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "b.json"))
    monkeypatch.setattr(writers.tempfile, "mkstemp", full)
    monkeypatch.chdir(REPO_ROOT)
    code = main(["tune", *SMALL, "--trials", "2", "--seed", "0", "--trials-out",
                 str(tmp_path / "b.csv"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_closed_pipe(tmp_path):
    p = _popen(["validate", "megatron"], tmp_path)
    p.stdout.close()              # the reader goes away before anything is read
    err = p.stderr.read()
    p.wait(timeout=120)
    assert p.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines() == ["autopar: error: stdout: closed by its reader"]


def test_stale_partial_all_file_is_removed(cli, tmp_path):
    dead = subprocess.run(["true"]).args and 2 ** 22 + 12345      # no such pid on Linux
    stale = tmp_path / f".all.{dead}.partial.parquet"
    stale.write_bytes(b"cut off by SIGKILL")
    r = cli("exhaustive", *SMALL, "--space", "small", "--all", tmp_path / "all.parquet")
    assert r.returncode == 0, r.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["all.parquet"]


# --------------------------------------------------------------------------
# spaces and experiment files

def _space(tmp_path, **params) -> Path:
    """search_spaces/small.yaml with ``params`` replaced."""
    data = yaml.safe_load((REPO_ROOT / "search_spaces/small.yaml").read_text())
    data["params"].update(params)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("command", ["exhaustive", "tune"])
def test_network_tier_beyond_the_system(cli, tmp_path, command):
    space = _space(tmp_path, tensor_par_net=[0, 5])
    extra = ["--trials", 2] if command == "tune" else []
    one_line(cli(command, *SMALL, "--space", space, *extra), "s.yaml", "params.tensor_par_net",
             "network tier 5")


@pytest.mark.parametrize("command", ["exhaustive", "tune"])
def test_empty_space_exits_2(cli, tmp_path, command):
    p = _space(tmp_path, tensor_par=[128])          # more than the 64 processors
    extra = ["--trials", 2] if command == "tune" else []
    one_line(cli(command, *SMALL, "--space", p, *extra), "s.yaml", "no layout")


def test_experiment_errors_name_the_file(cli, tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"kind": "tune", "trials": 0, "output": "out/b.json",
                                    "case": {"model": str(REPO_ROOT / MODEL),
                                             "system": str(REPO_ROOT / SYSTEM), "num_procs": 64,
                                             "max_batch_size": 64, "datatype": "float16"}}))
    line = one_line(cli("run", path, cwd=tmp_path), str(path), ": trials:")
    assert "--trials" not in line and "command line" not in line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------
# signals and concurrent runs

def _study_states(db: Path) -> dict:
    with sqlite3.connect(db) as con:
        return dict(con.execute("select state, count(*) from trials group by state").fetchall())


def _completed_any(db: Path) -> bool:
    """Whether the study has a finished trial yet (Optuna may be creating the
    database's tables while we look)."""
    try:
        return db.exists() and bool(_study_states(db).get("COMPLETE"))
    except sqlite3.OperationalError:
        return False


def test_sigterm_leaves_no_running_trial(tmp_path):
    db = tmp_path / "s.db"
    p = _popen(["tune", *[str(REPO_ROOT / a) if a.endswith(".json") else a for a in SMALL],
                "--sampler", "random", "--trials", 200000, "--storage", f"sqlite:///{db}",
                "--trials-out", tmp_path / "t.csv"], tmp_path)
    end = time.monotonic() + 120
    while time.monotonic() < end and not _completed_any(db):
        time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert "RUNNING" not in _study_states(db)
    assert not (tmp_path / "t.csv").exists()


def test_a_run_notes_the_first_interrupt_and_raises_on_the_second():
    """The optuna run loop's signals: the first is noted for the loop to end
    at its next step (a KeyboardInterrupt raised inside a library callback
    is dropped by Python, with a traceback), the second raises at once; the
    handlers are put back after."""
    from autopar.search.backends.signals import interrupts_noted as _interrupts_noted
    # (as in a terminal; a suite started in the background has SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _interrupts_noted() as noted:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert noted == [signal.SIGINT]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_two_runs_on_one_study_make_the_trials_asked(tmp_path):
    db = tmp_path / "s.db"
    args = ["tune", *[str(REPO_ROOT / a) if a.endswith(".json") else a for a in SMALL],
            "--sampler", "random", "--trials", 300, "--storage", f"sqlite:///{db}",
            "--study-name", "shared"]
    runs = [_popen(args + ["--seed", s], tmp_path) for s in (1, 2)]
    for p in runs:
        _, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1) and "Traceback" not in err, err
    states = _study_states(db)
    done = states.get("COMPLETE", 0) + states.get("PRUNED", 0)
    assert 300 <= done <= 302, states          # at most one trial each over, while racing


@pytest.mark.cluster
def test_ray_sigint_exits_130(tmp_path):
    pytest.importorskip("ray")
    p = _popen(["tune", *[str(REPO_ROOT / a) if a.endswith(".json") else a for a in SMALL],
                "--backend", "ray", "--sampler", "random", "--trials", 400, "--concurrency", 1,
                "--storage-path", tmp_path / "r", "--name", "x"], tmp_path,
               env={"AUTOPAR_TRIAL_DELAY": "0.2"})
    end = time.monotonic() + 180
    while time.monotonic() < end and len(list((tmp_path / "r" / "x").glob("t*"))) < 2:
        time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "interrupted" in err.strip().splitlines()[-1]
