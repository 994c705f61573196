"""Issue 27's classes of bad input and faults, and the defects found beside
them: each ends with one line naming the file and field (or the option), the
promised exit code, no traceback, and nothing written or left behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO_ROOT, REFERENCE
from test_probes import MODEL, SMALL, SYSTEM, one_line


def _shell(command: str, cwd) -> subprocess.CompletedProcess:
    """``command`` through bash, ``autopar`` being this interpreter's CLI."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = f"autopar() {{ '{sys.executable}' -m autopar.cli \"$@\"; }}; {command}"
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, word", [
    (["tune", *SMALL, "--sampler", "sgd"], "--sampler"),
    (["exhaustive", *SMALL, "--format", "onnx"], "--format"),
    (["exhaustive", MODEL, SYSTEM, "--num-procs", "6x4", "--max-batch-size", "64",
      "--datatype", "float16"], "--num-procs"),
    (["estimate", MODEL], "required"),
    (["no-such-command"], "invalid choice"),
])
def test_argparse_errors_are_one_line(cli, args, word):
    one_line(cli(*args), word)


def test_help_still_prints_the_usage(cli):
    r = cli("exhaustive", "--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "--num-procs" in r.stdout


@pytest.mark.parametrize("redirect", [">&-", "| true"])
def test_closed_stdout_writes_nothing(tmp_path, redirect):
    # `| true`: the reader exits at once; the run refuses before any work or output
    r = _shell(f"sleep 0; autopar exhaustive {REPO_ROOT / MODEL} {REPO_ROOT / SYSTEM} "
               f"--num-procs 64 --max-batch-size 64 --datatype float16 --space small "
               f"--output best.json --summary s.json {redirect}; echo rc=${{PIPESTATUS[0]}}",
               tmp_path)
    assert "rc=2" in r.stdout, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "stdout: closed" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_estimate_with_closed_stdout(tmp_path, execution):
    import json
    (tmp_path / "e.json").write_text(json.dumps(execution))
    r = _shell(f"autopar estimate {REPO_ROOT / MODEL} {REPO_ROOT / SYSTEM} e.json >&-; "
               "echo rc=$?", tmp_path)
    assert "rc=2" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_output_through_a_symlink_loop(cli, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    r = cli("exhaustive", *SMALL, "--space", "small", "--output", tmp_path / "a")
    one_line(r, "--output", "symlink loop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("which", ["model", "system", "execution"])
def test_a_fifo_as_input_does_not_hang(cli, tmp_path, execution, which):
    import json
    fifo = tmp_path / "in.json"
    os.mkfifo(fifo)
    (tmp_path / "e.json").write_text(json.dumps(execution))
    files = {"model": REPO_ROOT / MODEL, "system": REPO_ROOT / SYSTEM,
             "execution": tmp_path / "e.json"}
    files[which] = fifo
    r = cli("estimate", files["model"], files["system"], files["execution"], timeout=60)
    one_line(r, "in.json", "not a regular file")


def test_a_fifo_as_experiment_file(cli, tmp_path):
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)
    one_line(cli("run", fifo, timeout=60), "x.yaml", "(file)", "not a")


def _sweep(tmp_path, **changes):
    path = REFERENCE / "measured" / "llama-sweeps" / "llama_13B_65B_a100.csv"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    frame = pd.read_csv(path).head(6)
    for col, value in changes.items():
        frame[col] = frame[col].astype(object)
        frame.loc[frame.index[2], col] = value
    out = tmp_path / "sweep.csv"
    frame.to_csv(out, index=False)
    return out


@pytest.mark.parametrize("col, value", [("step_time_s", "fast"), ("mfu", "high"),
                                        ("step_time_s", -3.0)])
def test_non_numbers_in_a_sweep(cli, tmp_path, col, value):
    sweep = _sweep(tmp_path, **{col: value})
    one_line(cli("validate", sweep, "--system", SYSTEM), "sweep.csv", col, "row 4")
    out = tmp_path / "k.json"
    one_line(cli("calibrate", sweep, "--system", SYSTEM, "--output", out), "sweep.csv", col)
    assert not out.exists()


def test_a_run_without_a_seed_names_its_study_unseeded(cli):
    r = cli("tune", *SMALL, "--space", "small", "--sampler", "random", "--trials", 3)
    assert r.returncode in (0, 1), r.stderr      # 1: no feasible layout among 3 random ones
    assert "seedNone" not in r.stdout + r.stderr
    assert "unseeded" in r.stdout


def test_skeleton_trials_keep_integer_fields(cli, tmp_path):
    out = tmp_path / "t.csv"
    r = cli("tune", *SMALL, "--space", "small", "--sampler", "skeleton-tpe", "--trials", 10,
            "--seed", 1, "--trials-out", out)
    assert r.returncode == 0, r.stderr
    best = [line for line in r.stdout.splitlines() if line.startswith("best:")][0]
    assert ".0 " not in best + " " and "dp=" in best, best
    rows = out.read_text().splitlines()
    header = rows[0].split(",")
    at = header.index("num_procs")
    done = [line.split(",") for line in rows[1:] if ",COMPLETE," in line]
    assert done and all(cells[at] == "64" for cells in done), done[:2]


def test_stdout_on_a_full_disk_writes_no_output(tmp_path):
    # /dev/full: every write fails with ENOSPC, as `> log` on a full disk does
    r = _shell(f"autopar exhaustive {REPO_ROOT / MODEL} {REPO_ROOT / SYSTEM} --num-procs 64 "
               f"--max-batch-size 64 --datatype float16 --space small --output best.json "
               f"--summary s.json --top top.json > /dev/full; echo rc=$? >&2", tmp_path)
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "rc=2" and len(lines) == 2, lines
    assert "stdout" in lines[0] and "No space left on device" in lines[0]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------
# counts beyond sane limits inside files

def _experiment(tmp_path, name, doc):
    """``doc`` (a shipped experiment, changed) written to ``tmp_path``, its
    model and system files named absolutely."""
    import yaml
    for k in ("model", "system"):
        if isinstance(doc["case"].get(k), str):
            doc["case"][k] = str((REPO_ROOT / "experiments" / doc["case"][k]).resolve())
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p


def test_compare_case_batch_beyond_the_limit(cli, tmp_path):
    import yaml
    doc = yaml.safe_load((REPO_ROOT / "experiments/compare-quick.yaml").read_text())
    doc["case"]["max_batch_size"] = 2 ** 62
    p = _experiment(tmp_path, "c.yaml", doc)
    r = cli("compare", p, "--output-dir", tmp_path / "out", timeout=60)
    one_line(r, "c.yaml", "case.max_batch_size", "at most")
    assert not (tmp_path / "out").exists()


def test_codesign_processor_count_beyond_the_limit(cli, tmp_path):
    import yaml
    doc = yaml.safe_load((REPO_ROOT / "experiments/codesign-small.yaml").read_text())
    doc["hardware"]["num_procs"] = [64, 2 ** 40]
    doc.get("case", {}).pop("num_procs", None)
    p = _experiment(tmp_path, "d.yaml", doc)
    one_line(cli("codesign", p, "--output-dir", tmp_path / "out", timeout=60),
             "d.yaml", "num_procs", "at most")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, field", [
    ({"min": 1, "max": 10 ** 12, "step": 1}, "step"),
    ({"min": 1.0, "max": 2.0, "num": 10 ** 9}, "num"),
])
def test_codesign_range_beyond_the_limit(cli, tmp_path, spec, field):
    import yaml
    doc = yaml.safe_load((REPO_ROOT / "experiments/codesign-small.yaml").read_text())
    doc["hardware"]["mem1.GiB"] = spec
    p = _experiment(tmp_path, "g.yaml", doc)
    one_line(cli("codesign", p, "--output-dir", tmp_path / "out", timeout=60),
             "g.yaml", f"hardware.mem1.GiB.{field}", "at most")


def test_codesign_headroom_nan(cli):
    one_line(cli("codesign", REPO_ROOT / "experiments/codesign-small.yaml",
                 "--memory-headroom", "nan", "--output-dir", "none", timeout=60),
             "--memory-headroom")


def test_a_failed_run_leaves_no_folder_and_no_file(monkeypatch, tmp_path, capsys):
    # compare writes four files into a folder it makes; the disk fills at the
    # second: the first is not put in place and the folder is removed again
    import errno
    from autopar.cli import main
    from autopar.io import writers

    made = []
    real = writers.tempfile.mkstemp

    def fills_up(*a, **k):
        made.append(k.get("prefix"))
        if len(made) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "curves.csv")
        return real(*a, **k)
    monkeypatch.setattr(writers.tempfile, "mkstemp", fills_up)
    monkeypatch.chdir(REPO_ROOT)
    out = tmp_path / "deep" / "out"
    code = main(["compare", "experiments/compare-quick.yaml", "--samplers", "random",
                 "--seeds", "1", "--trials", "4", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert len(made) == 2
    assert list(tmp_path.iterdir()) == []


def test_all_or_nothing_puts_every_output_in_place_together(tmp_path):
    from autopar.io import writers
    with pytest.raises(RuntimeError):
        with writers.all_or_nothing():
            writers.write_json({"a": 1}, tmp_path / "x" / "a.json")
            assert not (tmp_path / "x" / "a.json").exists()      # held back
            raise RuntimeError("the run failed")
    assert list(tmp_path.iterdir()) == []
    with writers.all_or_nothing():
        writers.write_json({"a": 1}, tmp_path / "x" / "a.json")
        writers.write_json({"b": 2}, tmp_path / "x" / "b.json")
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["a.json", "b.json"]


# --------------------------------------------------------------------------
# errors that name the right place

def test_a_sweep_naming_an_unknown_model_names_the_csv_row(cli, tmp_path):
    sweep = _sweep(tmp_path, model="llama-99B")
    one_line(cli("validate", sweep, "--system", SYSTEM), "sweep.csv", "model", "row 4",
             "llama-99B")


def test_an_experiment_storage_error_names_the_file(cli, tmp_path):
    doc = {"kind": "tune", "sampler": "random", "trials": 2, "storage": "mysql://nowhere/db",
           "case": {"model": "../models/gpt3-175B.json", "system": "../systems/a100_80g.json",
                    "num_procs": 64, "max_batch_size": 64, "datatype": "float16",
                    "space": "small"}}
    p = _experiment(tmp_path, "t.yaml", doc)
    line = one_line(cli("run", p), "t.yaml", "storage")
    assert "arguments" not in line


# --------------------------------------------------------------------------
# Ray addresses

@pytest.mark.parametrize("command", ["exhaustive", "tune"])
def test_a_port_that_is_not_ray(cli, command):
    # a live TCP port of another service (it accepts and says nothing): one
    # line within seconds, not Ray's minutes of retries
    import socket
    import threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass
        for c in held:
            c.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    address = "127.0.0.1:%d" % server.getsockname()[1]
    extra = ["--backend", "ray", "--sampler", "random", "--trials", 2] if command == "tune" else []
    try:
        r = cli(command, *SMALL, "--space", "small", *extra, "--address", address, timeout=60)
    finally:
        stop.set()
        t.join()
        server.close()
    one_line(r, "address", "not a Ray cluster")


# --------------------------------------------------------------------------
# signals

@pytest.mark.parametrize("gap_ms", [0, 50, 100, 200, 400])
def test_two_quick_interrupts_exit_130(tmp_path, gap_ms):
    import signal
    import time
    from test_probes import _popen
    args = ["tune", *[str(REPO_ROOT / a) if a.endswith(".json") else a for a in SMALL],
            "--sampler", "random", "--trials", 1_000_000, "--seed", 0]
    p = _popen(args, tmp_path)
    time.sleep(4)                      # imported and in the run loop
    p.send_signal(signal.SIGINT)
    time.sleep(gap_ms / 1000)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-1500:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "autopar: interrupted"


def test_resume_of_a_relative_path_that_does_not_exist(cli, tmp_path):
    one_line(cli("tune", "--resume", "nothere/exp", cwd=tmp_path), "resume", "not a folder")
