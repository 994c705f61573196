"""The one parallel runner: ``Runner.map`` in this process, over local processes, or as Ray tasks.

Every caller that spreads work (exhaustive search, sampler comparisons, the
co-design and processor-count studies) hands the runner three things:

* ``shared``: what every item needs (model, system, space, case ...) as plain
  data.  It travels ONCE per runner: a Ray object put once (``ray.put``) whose
  reference the tasks carry, or the pool processes' initializer argument.
* ``setup(shared) -> context``: rebuilds the typed objects from ``shared``;
  it runs once per worker process and the context is kept there (by a digest
  of ``shared`` computed on the driver), so later tasks skip both the
  transfer and the rebuild.
* ``fn(context, item) -> result`` for each item, and optionally
  ``reduce(a, b)``, an associative fold: items are grouped into few, large
  tasks (``per_task`` consecutive items; by default ``TASKS_PER_SLOT``
  tasks per parallel slot, as equal in items as can be, or with
  ``interleave`` every n-th item, so that they cost alike), and with
  ``reduce`` each task folds its own results on the worker and sends back
  one value.

Results come back in item order (task order for folded values) whatever the
backend, so serial, processes and Ray give identical results.  A task's
exception is raised on the caller as itself (a ``SpecError`` from a worker
stays a one-line error).  ``stats`` records per task where it ran and how
long its work took, so overheads can be measured (benchmarks/cluster_exhaustive.py).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from autopar.io.layouts import registered_layouts, restore_layouts
from autopar.io.specs import SpecError

BACKENDS = ("serial", "processes", "ray")
# Tasks per parallel slot when the caller does not say: enough that a slow or
# late worker is balanced by the others, few enough that per-task costs vanish.
TASKS_PER_SLOT = 8

# --------------------------------------------------------------------------
# The worker side (top-level functions: they run in pool processes and Ray tasks)

_CONTEXTS: dict = {}          # setup and digest of shared -> context, in this process
_KEEP_CONTEXTS = 4
_SHARED: dict = {}            # digest -> payload, in a pool's processes


def _context(setup: Callable | None, shared: Any, key: str | None):
    """The context of ``shared`` in this process, built once (``setup``);
    without a key, ``shared`` is the context itself (a serial run's).  A
    pool process has the payload from its initializer (``shared`` None)."""
    if key is None:
        return setup(shared) if setup is not None else shared
    if key in _CONTEXTS:
        return _CONTEXTS[key]
    if shared is None:
        shared = _SHARED[key.rpartition(":")[2]]
    elif _is_ref_box(shared):             # a Ray object: fetched only when not yet known
        import ray
        shared = ray.get(shared[0])
    ctx = setup(shared) if setup is not None else shared
    if len(_CONTEXTS) >= _KEEP_CONTEXTS:
        _CONTEXTS.clear()
    _CONTEXTS[key] = ctx
    return ctx


class _RefBox(list):
    """A Ray reference inside a list, so Ray hands the task the reference
    itself (not its value): a worker that knows the context fetches nothing."""


def _is_ref_box(x) -> bool:
    return isinstance(x, _RefBox)


def _pool_init(shared, data: str) -> None:
    _SHARED.clear()
    _SHARED[data] = shared


def _task(fn: Callable, setup: Callable | None, shared: Any, key: str, items: Sequence,
          reduce: Callable | None, layouts: tuple = ()):
    """One task: its items' results (a list), or their fold with ``reduce``;
    with where it ran and how long it worked.  ``layouts``: the caller's
    explicit pipeline layouts (``autopar.io.layouts.registered_layouts``),
    registered here first so that layout codes mean the same layouts."""
    t0 = time.perf_counter()
    if layouts:
        restore_layouts(layouts)
    ctx = _context(setup, shared, key)
    t1, c1 = time.perf_counter(), time.process_time()
    if reduce is None:
        value = [fn(ctx, it) for it in items]
    else:
        value = None
        for i, it in enumerate(items):
            r = fn(ctx, it)
            value = r if i == 0 else reduce(value, r)
    t2, c2 = time.perf_counter(), time.process_time()
    return value, (_node_id(), os.getpid(), t1 - t0, t2 - t1, c2 - c1, len(items))


def _ray_connected() -> bool:
    """Whether this process is connected to Ray (never imports it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _node_id() -> str:
    if _ray_connected():
        return sys.modules["ray"].get_runtime_context().get_node_id()
    return "local"            # outside Ray the host is the node


# --------------------------------------------------------------------------
# The driver side

@dataclass
class TaskStat:
    """One finished task: where it ran and what it cost."""
    node: str
    pid: int
    setup_s: float            # rebuilding the context (0 where the worker knew it)
    work_s: float             # running fn (and reduce) over its items
    cpu_s: float              # the CPU time of that work (its process's)
    items: int


@dataclass
class Stats:
    tasks: list = field(default_factory=list)       # TaskStat per finished task
    puts: int = 0                                   # shared payloads sent (ray.put / pools)

    def by_node(self) -> dict:
        out: dict = {}
        for t in self.tasks:
            out[t.node] = out.get(t.node, 0) + 1
        return out


def digest(shared: Any) -> str:
    """The key of a shared payload: equal payloads give equal keys."""
    return hashlib.sha1(pickle.dumps(shared, protocol=5)).hexdigest()


def _name(fn) -> str:
    return "-" if fn is None else f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"


def _check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise SpecError("arguments", "parallel",
                        f"expected one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


class Runner:
    """Runs ``fn`` over items serially, in a pool of local processes, or as Ray
    tasks (the cluster at ``address``; else a local Ray on loopback with
    ``workers`` CPUs, or all of them).  Use as a context manager: Ray is
    joined or started on entry (unless this process is already connected,
    which it then keeps) and left on exit; a pool is closed on exit.

    ``workers``: processes of the pool (default 2); for a local Ray, its
    CPUs.  ``retries``: how often Ray runs a task again whose worker or node
    died.  ``slots`` is how many tasks run at once (the pool's processes, the
    cluster's CPUs)."""

    def __init__(self, backend: str = "serial", workers: int | None = 2,
                 address: str | None = None, retries: int = 2):
        self.backend = _check_backend(backend)
        self.workers = max(1, int(workers)) if workers else None
        self.address = address or None
        self.retries = int(retries)
        self.stats = Stats()
        self.slots = 1 if backend == "serial" else (self.workers or 2)
        self._pool = None
        self._pool_key = None
        self._ray_started = False
        self._refs: dict = {}          # digest -> boxed Ray reference of shared
        self._remote = None

    # -- session ------------------------------------------------------------
    def __enter__(self):
        if self.backend == "ray":
            self._start_ray()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = self._pool_key = None
        self._refs.clear()
        if self._ray_started:
            import ray
            ray.shutdown()
            self._ray_started = False

    def _start_ray(self) -> None:
        import ray
        if not ray.is_initialized():
            if self.address:
                from autopar.search.cluster import join
                join(self.address)      # ships the package in the job's runtime_env
            else:
                from autopar.search.cluster import start_local_ray
                start_local_ray(num_cpus=self.workers)
            self._ray_started = True

    def _processes(self, shared, key):
        """The pool for this payload: its processes get it once, from the
        initializer; a different payload gets a new pool."""
        data = key.rpartition(":")[2]
        if self._pool is not None and self._pool_key == data:
            return self._pool
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        # fork where there is one: a spawned worker re-imports the caller's
        # main module (scripts without a __main__ guard break) and pays the
        # imports again; a forked one starts at once.  Not from a process
        # connected to Ray: its children would inherit Ray's threads and
        # signal handlers (and die with them).
        fork = "fork" in mp.get_all_start_methods() and not _ray_connected()
        ctx = mp.get_context("fork" if fork else "spawn")
        self._pool = ProcessPoolExecutor(self.slots, mp_context=ctx, initializer=_pool_init,
                                         initargs=(shared, data))
        self._pool_key = data
        self.stats.puts += 1
        return self._pool

    def _ray_shared(self, shared, key):
        data = key.rpartition(":")[2]          # one object per payload, whatever the setup
        box = self._refs.get(data)
        if box is None:
            import ray
            box = self._refs[data] = _RefBox([ray.put(shared)])
            self.stats.puts += 1
        return box

    # -- work ---------------------------------------------------------------
    def imap(self, fn: Callable, items: Sequence, *, shared: Any = None,
             setup: Callable | None = None, reduce: Callable | None = None,
             per_task: int | None = None, window: int | None = None,
             interleave: bool = False) -> Iterator:
        """Yields one value per task, in task order: the list of its items'
        results, or (with ``reduce``) their fold.  Work is submitted at once
        (``window`` tasks in flight, by default twice the slots: on Ray, 16
        tasks submitted at once all ran on the driver's node of a two-node
        cluster, three times out of three), and the caller may do other
        work before it iterates.  ``interleave`` (with a
        ``reduce`` that does not care about order): task k of n takes items
        k, k + n, k + 2n ..., so tasks cost alike where the cost of items
        drifts along the list (a layout space's expensive regions)."""
        items = list(items)
        if self.backend == "ray":          # nodes may have come or gone since
            import ray
            self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        if interleave and reduce is None:
            raise ValueError("interleave needs a reduce: results would come out of order")
        if per_task is None:        # TASKS_PER_SLOT per slot, as equal as can be
            n = min(len(items), TASKS_PER_SLOT * self.slots)
        else:
            n = -(-len(items) // max(1, int(per_task)))
        if interleave:
            groups = [items[k::n] for k in range(n)]
        elif per_task is None:
            cuts = [len(items) * k // n for k in range(n + 1)] if n else [0]
            groups = [items[a:b] for a, b in zip(cuts, cuts[1:])]
        else:
            step = max(1, int(per_task))
            groups = [items[i:i + step] for i in range(0, len(items), step)]
        # a serial run without setup passes shared as it is: nothing to key
        key = None if self.backend == "serial" and setup is None else \
            f"{_name(setup)}:{digest(shared)}"
        if self.backend == "serial" or (self.backend == "processes" and len(groups) <= 1):
            return self._serial(fn, setup, shared, key, groups, reduce)
        window = max(1, int(window or 2 * self.slots))
        if self.backend == "processes":
            return self._pooled(fn, setup, shared, key, groups, reduce, window)
        return self._ray(fn, setup, shared, key, groups, reduce, window)

    def map(self, fn: Callable, items: Sequence, *, shared: Any = None,
            setup: Callable | None = None, reduce: Callable | None = None,
            per_task: int | None = None, on_done: Callable | None = None,
            interleave: bool = False):
        """Every item's result in item order (a list); with ``reduce``, the
        fold of all of them (None for no items).  ``on_done`` sees each
        task's value as it is taken."""
        out: list = []
        folded, first = None, True
        for value in self.imap(fn, items, shared=shared, setup=setup, reduce=reduce,
                               per_task=per_task, interleave=interleave):
            if on_done is not None:
                on_done(value)
            if reduce is None:
                out.extend(value)
            else:
                folded = value if first else reduce(folded, value)
                first = False
        return out if reduce is None else folded

    def _record(self, info) -> None:
        self.stats.tasks.append(TaskStat(*info))

    def _serial(self, fn, setup, shared, key, groups, reduce):
        for g in groups:
            value, info = _task(fn, setup, shared, key, g, reduce)
            self._record(info)
            yield value

    def _pooled(self, fn, setup, shared, key, groups, reduce, window):
        from concurrent.futures import FIRST_COMPLETED, wait
        pool = self._processes(shared, key)

        layouts = registered_layouts()

        def submit(g):        # the pool's processes have the payload: it stays behind
            return pool.submit(_task, fn, setup, None, key, g, reduce, layouts)

        def first_done(pending):
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            return [(f, f.result()) for f in done]

        return self._in_order(groups, window, submit, first_done, lambda f: f.cancel())

    def _ray(self, fn, setup, shared, key, groups, reduce, window):
        import ray
        if self._remote is None:
            self._remote = ray.remote(num_cpus=1, max_retries=self.retries)(_task)
        box = self._ray_shared(shared, key)
        layouts = registered_layouts()

        def submit(g):
            return self._remote.remote(fn, setup, box, key, g, reduce, layouts)

        def first_done(pending):
            ready, _ = ray.wait(list(pending), num_returns=1)
            out = []
            for r in ready:
                try:
                    out.append((r, ray.get(r)))
                except ray.exceptions.RayTaskError as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, Exception):
                        raise cause from None
                    raise
            return out

        return self._in_order(groups, window, submit, first_done,
                              lambda r: ray.cancel(r, force=False))

    def _in_order(self, groups, window, submit, first_done, cancel):
        """Keep ``window`` tasks in flight (the first ones submitted now);
        yield their values in task order."""
        pending: dict = {}          # handle -> task number
        done: dict = {}             # task number -> value
        nxt = 0

        def fill():
            nonlocal nxt
            while nxt < len(groups) and len(pending) < window:
                pending[submit(groups[nxt])] = nxt
                nxt += 1

        fill()

        def results():
            try:
                for i in range(len(groups)):
                    while i not in done:
                        for handle, (value, info) in first_done(pending):
                            done[pending.pop(handle)] = value
                            self._record(info)
                        fill()
                    yield done.pop(i)
            finally:
                for handle in pending:
                    cancel(handle)
        return results()
