"""The one parallel runner (autopar/search/runner.py): serial, local processes
and Ray tasks give the same results; the shared payload travels once and is
rebuilt once per worker process; exhaustive, compare and the studies use it
and nothing else spreads work."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

import autopar
from autopar.io.specs import SpecError
from autopar.search.runner import TASKS_PER_SLOT, Runner

PKG = Path(autopar.__file__).resolve().parent
CASE = ("models/gpt3-13B.json", "systems/a100_80g.json", 64, 512, "float16")


def _setup(shared):
    import uuid
    return {"base": shared["base"], "token": uuid.uuid4().hex}     # one per build


def _fn(ctx, item):
    if item == "bad":
        raise SpecError("somewhere.yaml", "field", "bad item")
    return ctx["base"] * item, os.getpid(), ctx["token"]


def _add(a, b):
    return a + b


def _sq(ctx, item):
    return item * item


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # tests/ is no package
    from autopar.search.cluster import start_local_ray
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=2)
    yield ray
    if started:
        ray.shutdown()


def _runners(local_ray):
    from autopar.search import runner
    for r in (Runner("serial"), Runner("processes", workers=2), Runner("ray")):
        runner._CONTEXTS.clear()          # no context inherited from the last backend
        yield r


def test_backends_give_identical_results_and_send_the_payload_once(local_ray, monkeypatch):
    puts = []
    real_put = local_ray.put
    monkeypatch.setattr(local_ray, "put", lambda v, **kw: puts.append(1) or real_put(v, **kw))
    items = list(range(1, 24))
    got = {}
    for r in _runners(local_ray):
        with r:
            shared = {"base": 3, "padding": "x" * 10_000}
            first = r.map(_fn, items, shared=shared, setup=_setup, per_task=2)
            again = r.map(_fn, items[::-1], shared=dict(shared), setup=_setup)   # equal payload
            total = r.map(_sq, items, shared=shared, reduce=_add)
            assert r.stats.puts == (0 if r.backend == "serial" else 1)
            assert [x[0] for x in first] == [3 * i for i in items]       # in item order
            assert [x[0] for x in again] == [3 * i for i in items[::-1]]
            # each process built the context once, for both maps
            built: dict = {}
            for _, pid, token in first + again:
                built.setdefault(pid, set()).add(token)
            assert all(len(t) == 1 for t in built.values()), built
            if r.backend != "serial":
                assert os.getpid() not in built       # built where the tasks ran
            # 23 items by 2, then twice TASKS_PER_SLOT tasks per slot (1 serial, 2 here)
            assert len(r.stats.tasks) == 12 + 2 * min(23, TASKS_PER_SLOT * r.slots)
            got[r.backend] = ([x[0] for x in first], total)
            if r.backend == "ray":
                assert r.slots == 2
    assert len(puts) == 1                     # the Ray runner's one put, for three maps
    assert got["serial"] == got["processes"] == got["ray"]
    assert got["serial"][1] == sum(i * i for i in items)


def test_a_worker_error_is_raised_as_itself(local_ray):
    for r in _runners(local_ray):
        with r:
            with pytest.raises(SpecError) as e:
                r.map(_fn, [1, 2, "bad", 4], shared={"base": 1}, setup=_setup)
            assert (e.value.source, e.value.field) == ("somewhere.yaml", "field")


def test_exhaustive_is_the_same_on_every_backend(local_ray):
    from autopar.search.exhaustive import exhaustive
    kw = dict(space="small", top_n=4, chunk_size=100, progress=False)
    table0, s0 = exhaustive(*CASE, **kw)
    assert s0["chunks"] > 8 and s0["best"] is not None
    for r in list(_runners(local_ray))[1:]:
        with r:
            table, s = exhaustive(*CASE, runner=r, **kw)
            # few tasks, each folding several chunks: one counts-and-best per task
            assert 1 < len(r.stats.tasks) < s["chunks"]
            assert all(t.items > 1 for t in r.stats.tasks)
        assert table.equals(table0)
        assert s["runner"] == ("processes" if r.backend == "processes" else "ray:local")
        for k in ("layouts", "feasible", "infeasible", "best", "chunks"):
            assert s[k] == s0[k], k
    # every row kept: one part per task, in enumeration order
    with Runner("ray") as r:
        rows, _ = exhaustive(*CASE, keep_all=True, runner=r, **{**kw, "top_n": 1})
    all0, _ = exhaustive(*CASE, keep_all=True, **{**kw, "top_n": 1})
    assert rows.equals(all0) and len(rows) == s0["layouts"]


def test_unknown_backend_is_one_line():
    with pytest.raises(SpecError) as e:
        Runner("threads")
    assert e.value.field == "parallel" and "threads" in e.value.message


SPREADING = {"ProcessPoolExecutor", "Pool", "remote", "get_context", "Process"}


def test_only_the_runner_spreads_work():
    """No module of search/ or studies/ but the runner starts processes or Ray
    tasks (Ray Tune's trainables in backends/ray_tune.py are Tune's own, not tasks)."""
    found = []
    for layer in ("search", "studies"):
        for path in sorted((PKG / layer).rglob("*.py")):
            if path.name == "runner.py":
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                name = None
                if isinstance(node, ast.Attribute):
                    name = node.attr
                elif isinstance(node, ast.Name):
                    name = node.id
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                    if any(m.split(".")[0] in ("multiprocessing", "concurrent") for m in mods):
                        found.append(f"{path.name}:{node.lineno} imports {mods}")
                if name in SPREADING:
                    found.append(f"{path.name}:{node.lineno} uses {name}")
    assert found == []


def test_interleaved_tasks_take_every_nth_item():
    seen = []
    with Runner("serial") as r:
        r.slots = 2                   # as if two slots
        n = 2 * TASKS_PER_SLOT
        items = list(range(5 * n))
        total = r.map(_sq, items, reduce=_add, interleave=True, on_done=seen.append)
        assert total == sum(i * i for i in items)
        assert seen[0] == sum(i * i for i in items[::n])      # items 0, n, 2n, ...
        assert [t.items for t in r.stats.tasks] == [5] * n
        with pytest.raises(ValueError):
            r.map(_sq, [1, 2], interleave=True)
