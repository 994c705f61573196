"""Exhaustive search split across two local Ray nodes against one.

Starts a Ray head node (``ray start --head --block``, 1 CPU, token
authentication on) and runs ``autopar.exhaustive(..., address=...)`` on it;
then adds a second node (another raylet, 1 CPU) and runs the same search
again.  Prints both times, the ratio (one node / two nodes) and the in-process
time without Ray for reference; checks that all three agree on the optimum.
Every process it starts is killed at the end by its process group.

    python benchmarks/cluster_exhaustive.py [--space calculon] [--num-procs 4096]
        [--chunk-size 32768]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")   # before Ray is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RAY = str(Path(sys.executable).with_name("ray"))


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


def main() -> int:
    from autopar.search.exhaustive import exhaustive
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/gpt3-175B.json"))
    p.add_argument("--system", default=str(ROOT / "systems/a100_80g.json"))
    p.add_argument("--num-procs", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1536)
    p.add_argument("--datatype", default="float16")
    p.add_argument("--space", default="calculon")
    p.add_argument("--chunk-size", type=int, default=1 << 15)
    a = p.parse_args()

    def search(address):
        t0 = time.perf_counter()
        _, s = exhaustive(a.model, a.system, a.num_procs, a.batch, a.datatype,
                          space=a.space, chunk_size=a.chunk_size, address=address,
                          progress=False)
        return time.perf_counter() - t0, s

    tmp = Path(tempfile.mkdtemp(prefix="apb-"))
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    try:
        with open(tmp / "nodes.log", "w") as log:
            procs.append(_start(["--head", "--port", address.rpartition(":")[2],
                                 "--include-dashboard", "false"], str(tmp / "ray"), log))
            _wait(address, 1)
            search(address)                     # warm-up: runtime_env upload, workers
            t1, s1 = search(address)
            procs.append(_start(["--address", address], str(tmp / "ray"), log))
            _wait(address, 2)
            search(address)
            t2, s2 = search(address)
        t0, s0 = search(None)
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    same = s0["best"] == s1["best"] == s2["best"]
    print(f"space        {s0['space']}: {s0['layouts']:,} layouts, {s0['chunks']} chunks "
          f"of {a.chunk_size}")
    print(f"in process   {t0:.2f} s (no Ray)")
    print(f"1 node       {t1:.2f} s ({s1['layouts'] / t1:,.0f} layouts/s)")
    print(f"2 nodes      {t2:.2f} s ({s2['layouts'] / t2:,.0f} layouts/s)")
    print(f"ratio        {t1 / t2:.2f}x (1 node / 2 nodes)")
    print(f"same optimum {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
