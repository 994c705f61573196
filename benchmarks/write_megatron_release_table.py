"""Write ``autopar/data/published/megatron_release.csv`` from Megatron-LM's
own release (convergence) tests, read from a bare git mirror of
NVIDIA/Megatron-LM.

Each release case is ``tests/functional_tests/test_cases/<family>/<case>/``:
``model_config.yaml`` (``MODEL_ARGS``: the exact ``pretrain_gpt.py``
arguments) beside ``golden_values_<env>_<machine>.json`` (per logged step
``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ``iteration-time``,
...).  One CSV row per (case, machine file):

* ``megatron_args``: the case's ``MODEL_ARGS`` as one command line (an
  argument whose value is a shell variable -- data, checkpoint, logging
  paths -- is left out; a ``true`` flag is written bare);
* ``gbs``: ``--global-batch-size``, or the first batch size of
  ``--step-batch-size-schedule`` when its next threshold lies beyond the
  logged steps (thresholds are tokens or samples,
  megatron/core/num_microbatches_calculator.py; both are beyond);
* ``n_gpus`` / ``n_gpus_source``: the GPU count and where it is stated.  The
  release tests' recipes (nodes, GPUs) are not in the public tree: the CI
  adds them from the private ``megatron-lm-convergence-tests`` submodule as
  ``tests/test_utils/local_recipes`` (.gitlab/stages/04.functional-tests.yml,
  ``before_script``), and no ``tests/test_utils/recipes/*.yaml`` names a
  release case, so ``n_gpus`` is blank and the source says so;
* ``tokenizer``: the file name of ``--tokenizer-model`` (its path is a
  shell variable), which states the vocabulary the arguments leave out;
* ``copy_of``: the case file whose golden values are byte-identical to
  this one's (the same git blob; a copy, not a run of this case's
  arguments), blank otherwise;
* measured peak memory: ``mem-max-allocated-bytes`` is
  ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]``, written by
  ``training_log`` (megatron/training/training.py) through the TensorBoard
  writer, which only rank ``world_size - 1`` holds
  (megatron/training/global_vars.py ``_set_tensorboard_writer``): the last
  pipeline stage's last tensor/data rank.  The peak is never reset in
  training.py, so the steady-state value is the largest over the steady
  steps;
* measured step time: the median of the finite ``iteration-time`` values
  over the steady steps (seconds per iteration, training.py
  ``elapsed_time_per_iteration``).

Steady steps: the logged steps after step ``WARMUP_STEPS`` (100), or after
the first half of the log where it ends sooner.  NaN entries (steps not
logged at the log interval) are skipped.

Usage: python benchmarks/write_megatron_release_table.py [--mirror GIT_DIR]
[--commit REV] [--output CSV]
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
OUTPUT = ROOT / "autopar" / "data" / "published" / "megatron_release.csv"
CASES_DIR = "tests/functional_tests/test_cases"
FAMILIES = ("gpt", "mixtral", "moe", "nemotron", "hybrid")     # GPT-style pretrain cases
WARMUP_STEPS = 100
N_GPUS_SOURCE = ("not stated: release recipes are in the private megatron-lm-convergence-tests "
                 "submodule (.gitlab/stages/04.functional-tests.yml)")
MEM_RANK = "world_size-1 (global_vars.py _set_tensorboard_writer)"
COLUMNS = ("case", "family", "environment", "machine", "gbs", "n_gpus", "n_gpus_source",
           "mem_rank", "steady_after_step", "peak_mem_bytes", "resting_mem_bytes",
           "iteration_time_s", "time_steps", "tokenizer", "copy_of", "megatron_args", "source")


def git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={mirror}", *args], check=True,
                          capture_output=True, text=True).stdout


def release_files(mirror: Path, commit: str) -> dict[str, list[str]]:
    """case folder -> its files, for every ``*release*`` case folder of
    the GPT-style families that has a model_config.yaml."""
    out: dict[str, list[str]] = {}
    for path in git(mirror, "ls-tree", "-r", "--name-only", commit, CASES_DIR).splitlines():
        rel = path[len(CASES_DIR) + 1:]
        parts = rel.split("/")
        if len(parts) != 3 or parts[0] not in FAMILIES or "release" not in parts[1]:
            continue
        out.setdefault(f"{parts[0]}/{parts[1]}", []).append(parts[2])
    return {k: sorted(v) for k, v in sorted(out.items()) if "model_config.yaml" in v}


def command_line(model_args: dict) -> str:
    """``MODEL_ARGS`` as one argument list: ``--flag`` for true, left out for
    false, ``--key value`` otherwise; arguments naming a shell variable left
    out."""
    out = []
    for k, v in model_args.items():
        if isinstance(v, bool):
            if v:
                out.append(k)
            continue
        s = str(v)
        if "$" in s:
            continue
        out.append(f"{k} {s}" if " " not in s else f"{k} '{s}'")
    return " ".join(out)


def batch_size(model_args: dict, last_step: int) -> int | None:
    if "--global-batch-size" in model_args:
        return int(model_args["--global-batch-size"])
    sched = model_args.get("--step-batch-size-schedule")
    if not sched:
        return None
    steps = [s.split(":") for s in str(sched).split()]
    first = int(steps[0][1])
    if len(steps) > 1:
        # the next threshold (tokens or samples) must lie beyond the logged steps
        thr = steps[1][0]
        scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(thr[-1], 1.0)
        value = float(thr[:-1] if thr[-1] in "KMBT" else thr) * scale
        if value <= last_step * first:
            return None
    return first


def steady(series: dict) -> tuple[int, list[tuple[int, float]]]:
    vals = [(int(k), float(v)) for k, v in series["values"].items()]
    last = max(k for k, _ in vals)
    after = min(WARMUP_STEPS, last // 2)
    return after, [(k, v) for k, v in vals if k > after and not math.isnan(v)]


def rows(mirror: Path, commit: str) -> list[dict]:
    out = []
    seen: dict[str, str] = {}          # blob -> the first case/file holding it
    for case, files in release_files(mirror, commit).items():
        family, name = case.split("/")
        cfg = yaml.safe_load(git(mirror, "show", f"{commit}:{CASES_DIR}/{case}/model_config.yaml"))
        margs = cfg.get("MODEL_ARGS") or {}
        for f in files:
            if not (f.startswith("golden_values_") and f.endswith(".json")):
                continue
            env, _, machine = f[len("golden_values_"):-len(".json")].partition("_")
            blob = git(mirror, "rev-parse", f"{commit}:{CASES_DIR}/{case}/{f}").strip()
            copy_of = seen.setdefault(blob, f"{case}/{f}")
            gold = json.loads(git(mirror, "show", f"{commit}:{CASES_DIR}/{case}/{f}"))
            after, peak = steady(gold["mem-max-allocated-bytes"])
            _, rest = steady(gold["mem-allocated-bytes"])
            _, times = steady(gold["iteration-time"])
            last = max(int(k) for k in gold["mem-max-allocated-bytes"]["values"])
            tokenizer = str(margs.get("--tokenizer-model", "")).rsplit("/", 1)[-1]
            out.append({
                "case": name, "family": family, "environment": env, "machine": machine,
                "gbs": batch_size(margs, last) or "", "n_gpus": "",
                "n_gpus_source": N_GPUS_SOURCE, "mem_rank": MEM_RANK,
                "steady_after_step": after,
                "peak_mem_bytes": int(max(v for _, v in peak)) if peak else "",
                "resting_mem_bytes": int(max(v for _, v in rest)) if rest else "",
                "iteration_time_s": round(statistics.median(v for _, v in times), 5)
                if times else "",
                "time_steps": len(times),
                "tokenizer": tokenizer if "$" not in tokenizer else "",
                "copy_of": "" if copy_of == f"{case}/{f}" else copy_of,
                "megatron_args": command_line(margs),
                "source": f"NVIDIA/Megatron-LM@{commit[:10]} {CASES_DIR}/{case}/{f}"})
    return out


def render(table: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=MIRROR)
    ap.add_argument("--commit", default=COMMIT)
    ap.add_argument("--output", type=Path, default=OUTPUT)
    a = ap.parse_args(argv)
    text = render(rows(a.mirror, a.commit))
    a.output.write_text(text, encoding="utf-8")
    print(f"wrote {a.output} ({text.count(chr(10)) - 1} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
