"""Exhaustive search in process, on one Ray node and on two (loopback, 1 CPU each).

Starts a Ray head node (``ray start --head --block``, 1 CPU, token
authentication on), joins it once from here (``autopar.search.runner.Runner``,
as a long-lived driver would) and times ``exhaustive(..., runner=...)``; then
adds a second node (another raylet, 1 CPU) and times it again.  The
in-process search (no Ray) is timed between them, alternately, ``--repeat``
times each.  Printed per case: the best and median seconds of each runner,
the ratios in process / two nodes and one node / two nodes, and what the Ray
path costs beyond the model: the payload's size and ``ray.put`` time, the
round trip of an empty task, the tasks' own work seconds against the wall
time, and the first search of a fresh driver (join + worker start, what one
``autopar exhaustive --address`` command pays once).  Checks that every
runner finds the same optimum and counts.  Every process it starts is killed
at the end by its process group.

    python benchmarks/cluster_exhaustive.py [--cases gpt3,mixtral,qwen3] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")   # before Ray is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RAY = str(Path(sys.executable).with_name("ray"))

# name -> (model, system, num_procs, max_batch_size, datatype, space)
CASES = {
    "gpt3": ("models/gpt3-175B.json", "systems/a100_80g.json", 4096, 1536, "float16",
             "calculon"),          # the README's first command
    "mixtral": ("models/mixtral-8x7B.json", "systems/h100_80g_nvl8.json", 16, 512,
                "bfloat16", "moe"),
    "qwen3": ("models/qwen3-30B-A3B.json", "systems/h100_80g_nvl8.json", 16, 512,
              "bfloat16", "moe"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(address: str) -> int:
    code = ("import ray,logging; ray.init(address=%r, logging_level=logging.ERROR); "
            "print(sum(n['Alive'] for n in ray.nodes()))" % address)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return int(r.stdout.strip() or 0) if r.returncode == 0 else 0


def _start(args, temp_dir, log) -> subprocess.Popen:
    return subprocess.Popen(
        [RAY, "start", "--block", "--num-cpus", "1", "--object-store-memory", "200000000",
         "--temp-dir", temp_dir, "--disable-usage-stats", *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(address: str, n: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while _nodes(address) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"the cluster did not reach {n} nodes")
        time.sleep(1)


def _noop(ctx, item):
    return item


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    from autopar.search.exhaustive import _Job, _payload, exhaustive
    from autopar.search.runner import Runner
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="gpt3,mixtral,qwen3",
                   help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per runner and case")
    a = p.parse_args()
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}")

    cpu: dict = {}          # (case, label) -> this process's CPU seconds per search

    def search(case, runner, label=None):
        m, s, n, b, dt, sp = CASES[case]
        t0, c0 = time.perf_counter(), time.process_time()
        _, summ = exhaustive(str(ROOT / m), str(ROOT / s), n, b, dt, space=sp,
                             runner=runner, progress=False)
        cpu.setdefault((case, label), []).append(time.process_time() - c0)
        return time.perf_counter() - t0, summ

    times = {c: {"in process": [], "1 node": [], "2 nodes": []} for c in cases}
    found: dict = {}
    extra: dict = {}
    spread = {(c, lb): [] for c in cases for lb in ("1 node", "2 nodes")}

    def timed(case, label, runner):
        before = len(runner.stats.tasks) if runner is not None else 0
        t, summ = search(case, runner, label)
        times[case][label].append(t)
        key = (summ["best"], summ["feasible"], summ["infeasible"], summ["layouts"])
        found.setdefault(case, set()).add(repr(key))
        if runner is not None:
            tasks = runner.stats.tasks[before:]
            extra[(case, label)] = (t, summ, tasks)
            spread[(case, label)].append(sorted(
                sum(k.node == n for k in tasks) for n in {k.node for k in tasks}))
        return t, summ

    tmp = Path(tempfile.mkdtemp(prefix="apb-"))
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    try:
        with open(tmp / "nodes.log", "w") as log:
            procs.append(_start(["--head", "--port", address.rpartition(":")[2],
                                 "--include-dashboard", "false"], str(tmp / "ray"), log))
            _wait(address, 1)
            # a fresh driver's first search: join, runtime_env, worker start
            t = time.perf_counter()
            with Runner("ray", address=address) as runner:
                cold = time.perf_counter() - t
                cold_search, _ = search(cases[0], runner)
            print(f"fresh driver: join {cold:.2f} s, first search ({cases[0]}) "
                  f"{cold_search:.2f} s", flush=True)
            with Runner("ray", address=address) as runner:
                for c in cases:
                    search(c, runner)                         # warm-up
                # what Ray costs beyond the model
                job = None
                from autopar.io.specs import load_model, load_system
                from autopar.search.space import Case, load_space
                m, s, n, b, dt, sp = CASES[cases[0]]
                model, system = load_model(str(ROOT / m)), load_system(str(ROOT / s))
                job = _Job(model, system, load_space(sp), Case(model, system, n, b, dt), 1, False)
                payload = _payload(job)
                import ray
                t = time.perf_counter()
                ray.put(payload)
                put_s = time.perf_counter() - t
                size = len(pickle.dumps(payload, protocol=5))
                runner.map(_noop, range(40), per_task=1)      # warm
                t = time.perf_counter()
                runner.map(_noop, range(200), per_task=1)
                rtt = (time.perf_counter() - t) / 200
                print(f"payload {size:,} bytes, ray.put {put_s * 1e3:.1f} ms (once per search); "
                      f"empty task {rtt * 1e3:.2f} ms each (200 in sequence of windows)",
                      flush=True)
                for _ in range(a.repeat):
                    for c in cases:
                        timed(c, "in process", None)
                        timed(c, "1 node", runner)
                procs.append(_start(["--address", address], str(tmp / "ray"), log))
                _wait(address, 2)
                for c in cases:
                    search(c, runner)                         # warm-up: the new node's worker
                for _ in range(a.repeat):
                    for c in cases:
                        timed(c, "2 nodes", runner)
                        timed(c, "in process", None)
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    ok = True
    for c in cases:
        m, s, n, b, dt, sp = CASES[c]
        same = len(found[c]) == 1
        ok &= same
        t2, summ2, tasks2 = extra[(c, "2 nodes")]
        print(f"\n{c}: {Path(m).stem} on {n:,} x {Path(s).stem}, batch {b}, space {sp}: "
              f"{summ2['layouts']:,} layouts in {summ2['chunks']} chunks of {summ2['chunk_size']:,}")
        best = {}
        for label, ts in times[c].items():
            best[label] = min(ts)
            rate = summ2["layouts"] / best[label]
            print(f"  {label:<11} best {min(ts):6.2f} s  median {statistics.median(ts):6.2f} s"
                  f"  ({rate:,.0f} layouts/s; runs {', '.join(f'{x:.2f}' for x in ts)})")
        print(f"  ratio       in process / 2 nodes {best['in process'] / best['2 nodes']:.2f}x,"
              f" 1 node / 2 nodes {best['1 node'] / best['2 nodes']:.2f}x (best of each)")
        print(f"  tasks per node, run by run: 2 nodes "
              f"{'; '.join(' + '.join(map(str, x)) for x in spread[(c, '2 nodes')])}")
        for label in ("1 node", "2 nodes"):
            t, _, tasks = extra[(c, label)]
            nodes: dict = {}
            for k in tasks:
                w, u = nodes.get(k.node, (0.0, 0.0))
                nodes[k.node] = (w + k.work_s, u + k.cpu_s)
            busiest = max(w for w, _ in nodes.values()) if nodes else 0.0
            print(f"  {label:<11} last run: {len(tasks)} tasks; per node work "
                  f"{', '.join(f'{w:.2f}' for w, _ in nodes.values())} s wall, "
                  f"{', '.join(f'{u:.2f}' for _, u in nodes.values())} s CPU; search wall "
                  f"{t:.2f} s, {t - busiest:.2f} s beyond the busiest node's work")
        # CPU time does not count the waits for a core that other jobs cause
        _, _, tasks = extra[(c, "2 nodes")]
        per_node: dict = {}
        for k in tasks:
            per_node[k.node] = per_node.get(k.node, 0.0) + k.cpu_s
        c_in = min(cpu[(c, "in process")])
        c_two = max(per_node.values())
        c_half = sum(per_node.values()) / 2
        c_drv = cpu[(c, "2 nodes")][-1]
        print(f"  CPU         in process {c_in:.2f} s (best); 2 nodes' tasks "
              f"{' + '.join(f'{v:.2f}' for v in per_node.values())} s, driver {c_drv:.2f} s: "
              f"in process / (busiest node + driver) {c_in / (c_two + c_drv):.2f}x, "
              f"/ (half the tasks + driver) {c_in / (c_half + c_drv):.2f}x "
              f"(an idle machine, where no core is waited for)")
        print(f"  same optimum and counts on every runner: {same}")
    print(f"\nload average at the end: {_loadavg()} ({os.cpu_count()} CPUs)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
