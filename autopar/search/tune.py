"""Sampled search: ``tune(...)`` runs a sampler over a space and returns its trials.

Each trial is one layout, evaluated by the analytical model (see
``autopar.search.trainable``).  A trial ends ``COMPLETE`` (the layout runs; its
``sample_rate`` is the objective, maximised) or ``PRUNED`` (invalid or
infeasible: ``feasible`` is False and ``reason`` says why) -- never as an
error and never as the best.

Backends:

``optuna`` (default)
    An Optuna study in this process: the fastest on one machine.  With
    ``storage`` (any Optuna storage URL, e.g. ``sqlite:///tune.db``) the study
    is kept there, optuna-dashboard can open it, and running the same command
    again resumes it until it holds ``trials`` finished trials (one process
    per study: trials a killed run left RUNNING are marked FAIL and left out;
    SQLite runs in WAL mode).  With ``concurrency`` C, C trials are asked at
    once and evaluated by the model in one vectorised call (random at 1,000
    trials: 82 trials/s alone, 448 with C=32).  The same seed gives the same
    trials.
``ray``
    A Ray Tune ``Tuner`` with the model as a function trainable
    (``autopar.search.trainable.layout_trainable``): a local Ray (loopback only, no
    dashboard) unless ``address`` names a cluster.

Samplers and encodings: see ``autopar.search.samplers`` and ``autopar.search.encodings``.

The table (``TRIAL_COLUMNS``, one row per finished trial, in trial order):
``trial`` (the Optuna trial number; on Ray, the order trials were created),
``state, feasible, reason, sample_rate``, the breakdown (total_time,
memory per tier, efficiencies), the 23 execution fields of the layout,
``node_id`` (the Ray node that ran it; empty on the optuna backend) and
``elapsed_s`` (seconds from the start of the search to the trial's end).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import random
import signal
import sys
import threading
from typing import Mapping

from autopar.search.encodings import ENCODINGS, STATIC_ONLY, Invalid, default_encoding
from autopar.io.layouts import ALL_FIELDS, execution_from_row
from autopar.search.samplers import SAMPLERS
from autopar.io.specs import SpecError
from autopar.search.trainable import BREAKDOWN, METRIC
from autopar.io.experiment import (BACKENDS, DEFAULT_SAMPLER,  # noqa: F401  (file vocabulary)
                                   DEFAULT_SPACE)

TRIAL_COLUMNS: tuple[str, ...] = (
    "trial", "state", "feasible", "reason", METRIC, *BREAKDOWN, *ALL_FIELDS,
    "node_id", "elapsed_s", "layouts",
)
SOURCE = "arguments"     # SpecError source for bad arguments


# --------------------------------------------------------------------------
# Arguments

def _bad(field: str, message: str):
    raise SpecError(SOURCE, field, message)


def _int(name: str, v, minimum: int, optional: bool = False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        _bad(name, f"expected an integer >= {minimum}, got {v!r}")
    return int(v)


def _choice(name: str, v, options) -> str:
    if v not in options:
        _bad(name, f"expected one of {', '.join(options)}, got {v!r}")
    return v


# Optional packages some samplers need: sampler -> (module, pip requirement)
_OPTIONAL = {"bohb": ("hpbandster", "autopar[bohb]"), "cmaes": ("cmaes", "cmaes"),
             "smac": ("smac", "autopar[smac]")}


def _needs(sampler: str) -> None:
    import importlib.util
    if sampler in _OPTIONAL:
        module, req = _OPTIONAL[sampler]
        if importlib.util.find_spec(module) is None:
            _bad("sampler", f"{sampler} needs the package {module} (pip install '{req}')")


def make_case(model, system, num_procs, max_batch_size, datatype, batch_policy=None,
              training=True):
    """Files, dicts or specs -> a validated ``autopar.search.space.Case``."""
    from autopar.search.space import Case
    from autopar.io.specs import load_model, load_system
    m, s = load_model(model), load_system(system)
    num_procs = _int("num_procs", num_procs, 1)
    max_batch_size = _int("max_batch_size", max_batch_size, 1)
    if datatype not in s.datatypes:
        raise SpecError(s.source, "datatype",
                        f"{datatype!r} is not supported by this system "
                        f"(supported: {', '.join(s.datatypes)})")
    return Case(model=m, system=s, num_procs=num_procs, max_batch_size=max_batch_size,
                datatype=datatype, batch_policy=batch_policy, training=training)


# --------------------------------------------------------------------------
# The search

def tune(model, system, num_procs: int, max_batch_size: int, datatype: str,
         sampler: str = DEFAULT_SAMPLER, trials: int = 100, *, space=DEFAULT_SPACE,
         backend: str = "optuna", seed: int | None = None, storage: str | None = None,
         address: str | None = None, concurrency: int | None = None,
         encoding: str | None = None, progress: bool | None = None,
         study_name: str | None = None, batch_policy: str | None = None,
         training: bool = True, storage_path: str | None = None,
         name: str | None = None, max_failures: int = 3, on_start=None,
         return_study: bool = False):
    """Search layouts of ``model`` on ``system`` with a sampler; returns the trials.

    ``model``/``system``: file paths, dicts (Calculon JSON) or specs.
    ``space``: a space file, a name under ``search_spaces/``, a dict or a Space.
    ``progress``: a progress bar on stderr (None: when stderr is a terminal).
    Backend ray: ``storage_path`` keeps the experiment at
    ``storage_path/name`` (resumable with ``resume``; None: a temporary
    folder), ``max_failures`` retries of a failed trial, ``on_start(path)``
    is told where the experiment is kept.
    Returns a pandas DataFrame with ``TRIAL_COLUMNS``; backend optuna: its
    ``attrs`` hold ``study_name`` and ``new_trials`` (0 when a rerun of a
    finished study had nothing to do), and with ``return_study=True`` the
    result is ``(table, study)`` (the ``optuna.Study``).  Bad arguments raise
    ``autopar.io.specs.SpecError``.
    """
    from autopar.search.space import load_space
    from autopar.search.trainable import make_problem

    from autopar.search.skeleton import DEFAULT_BATCH, base_sampler, is_skeleton
    sampler = _choice("sampler", sampler, SAMPLERS)
    backend = _choice("backend", backend, BACKENDS)
    trials = _int("trials", trials, 1)
    seed = _int("seed", seed, 0, optional=True)
    if seed is not None and seed > 2 ** 32 - 1:
        _bad("seed", f"must be between 0 and 2**32-1 (the samplers' seeds), got {seed}")
    concurrency = _int("concurrency", concurrency, 1, optional=True)
    base = base_sampler(sampler)
    encoding = _choice("encoding", encoding or default_encoding(sampler), ENCODINGS)
    if encoding == "named" and base in STATIC_ONLY:
        _bad("encoding", f"{base} needs a static space: use encoding index or flat")
    if base == "smac" and encoding != "flat":
        _bad("encoding", "smac searches the parameter values (its ConfigSpace has the space's "
                         "conditions and forbidden combinations): use encoding flat")
    _needs(base)
    if backend == "optuna" and address:
        _bad("address", "a Ray address needs backend ray")
    if backend == "ray" and storage:
        _bad("storage", "an Optuna storage needs backend optuna")
    if backend == "optuna" and storage_path:
        _bad("storage_path", "a Ray Tune storage path needs backend ray "
                             "(backend optuna keeps its study in storage)")
    max_failures = _int("max_failures", max_failures, 0)
    if return_study and backend != "optuna":
        _bad("return_study", "only backend optuna has an Optuna study to return")
    case = make_case(model, system, num_procs, max_batch_size, datatype, batch_policy, training)
    sp = load_space(space)
    size = sp.size(case)
    if size == 0:
        raise SpecError(sp.source, "space", "has no layout for this case "
                        f"({case.num_procs} procs, batch {case.max_batch_size})")
    if is_skeleton(sampler):
        if not sp.skeleton:
            raise SpecError(sp.source, "skeleton", "no searched parameter forms a skeleton; "
                            "list some under skeleton:")
        prob = make_problem(case, sp, "skeleton-" + encoding)
        prob.encoder.reset()          # each run enumerates the completions it needs
        # distinct skeletons: no more trials than the space has skeletons
        skeletons = len(prob.encoder.all)
        trials = min(trials, skeletons)
        if concurrency is None and backend == "optuna":
            concurrency = DEFAULT_BATCH
    else:
        prob = make_problem(case, sp, encoding)
    grid = grid_params(sp, case, min(trials, size)) if sampler == "grid" else None
    if grid is not None:
        trials = len(grid)

    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = _Progress(trials, sampler, show)
    study, new = None, None
    try:
        if backend == "optuna":
            rows, study, new = _run_optuna(prob, sampler, trials, seed, storage, study_name,
                                           concurrency or 1, grid, bar,
                                           kept=storage is not None or return_study)
        else:
            from autopar.search import tune_ray
            rows = tune_ray.run(prob, sampler, trials, seed, address, concurrency, grid,
                                on_row=bar.update, storage_path=storage_path, name=name,
                                max_failures=max_failures, on_start=on_start)
    finally:
        bar.close()
    table = trials_table(rows)
    if is_skeleton(sampler):
        # every skeleton of the space evaluated: the cache covers the skeleton
        # space and no new trial is possible, whatever the budget asked
        table.attrs.update(skeletons=skeletons,
                           skeleton_space_covered=bool(len(table) >= skeletons))
    if study is not None:
        table.attrs.update(study_name=study.study_name, new_trials=new)
    return (table, study) if return_study else table


def resume(path: str, address: str | None = None):
    """Finish a ray-backend experiment kept at ``path`` (``storage_path/name``);
    returns the trials table of all its trials."""
    from autopar.search import tune_ray
    if not isinstance(path, str) or not path:
        _bad("resume", f"expected an experiment path, got {path!r}")
    if "://" not in path:           # a local folder (Ray reads a relative one as a URI)
        import os
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            _bad("resume", f"{path} is not a folder (expected STORAGE_PATH/NAME of an "
                           "autopar tune --backend ray run)")
    if not tune_ray.can_resume(path):
        _bad("resume", f"{path} holds no Ray Tune experiment (expected "
                       "STORAGE_PATH/NAME of an autopar tune --backend ray run)")
    return trials_table(tune_ray.resume(path, address))


def trials_table(rows: list[dict]):
    """Result rows -> the trials DataFrame (``TRIAL_COLUMNS``, stable dtypes)."""
    import pandas as pd
    table = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
    table["feasible"] = table["feasible"].astype(bool)
    for c in (METRIC, *BREAKDOWN, "elapsed_s"):
        table[c] = table[c].astype(float)
    table["layouts"] = table["layouts"].fillna(1).astype("int64")
    # integer layout fields stay integers (a pruned trial's unproposed field is
    # <NA>, which would otherwise turn the column into floats: dp=128.0)
    from autopar.io.layouts import EXT_INT_FIELDS, INT_FIELDS
    for c in INT_FIELDS | EXT_INT_FIELDS:
        if c in table.columns:
            table[c] = pd.to_numeric(table[c]).round().astype("Int64")
    return table


def grid_params(space, case, n: int) -> list[dict]:
    """``n`` layouts spread evenly over the space's enumeration (stratum centres)."""
    from autopar.io.layouts import record
    size = space.size(case)
    out = []
    for g in range(n):
        i = (2 * g + 1) * size // (2 * n)
        ex = record(space.layouts(case, i, i + 1), 0)
        out.append({p: ex[p] for p in space.searched})
    return out


class _Progress:
    """A tqdm bar with the best sample rate and the pruned count, or nothing."""

    def __init__(self, total: int, label: str, show: bool):
        self.best, self.pruned, self.bar = -math.inf, 0, None
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=f"tune {label}", unit="trial",
                            file=sys.stderr, dynamic_ncols=True)

    def update(self, row: Mapping) -> None:
        if row["state"] == "PRUNED":
            self.pruned += 1
        elif row[METRIC] > self.best:
            self.best = row[METRIC]
        if self.bar is not None:
            best = f"{self.best:.4g}" if self.best > -math.inf else "-"
            self.bar.set_postfix_str(f"best {best}/s, pruned {self.pruned}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------
# The optuna backend

def _add_trials(study, encoder, skeletons: list, rows: list,
                why: str = "nearest_unseen") -> list[int]:
    """Record skeletons the sampler did not propose (``why``: each evaluated
    in place of a repeated proposal, or with the whole space) as finished
    trials of the study, with their result ``rows``; returns their numbers."""
    import optuna
    from optuna.trial import TrialState
    made = []
    for skeleton, row in zip(skeletons, rows):
        params, dists = encoder.trial_params(skeleton)
        ok = row["state"] == "COMPLETE"
        made.append(optuna.trial.create_trial(
            params=params, distributions=dists, value=row[METRIC] if ok else None,
            state=TrialState.COMPLETE if ok else TrialState.PRUNED,
            user_attrs={why: True, **({} if ok else {"reason": row["reason"]})}))
    if not made:
        return []
    study.add_trials(made)
    return [t.number for t in study.get_trials(deepcopy=False)[-len(made):]]


def default_study_name(prob, sampler: str, seed: int | None) -> str:
    c = prob.case
    return (f"autopar-{c.model.name or 'model'}-{c.system.name or 'system'}-"
            f"n{c.num_procs}-b{c.max_batch_size}-{c.datatype}-{prob.space.name}-"
            f"{sampler}-{prob.encoder.encoding}-"
            + (f"seed{seed}-" if seed is not None else "unseeded-") + prob.key[:8])


def _sqlite_storage(url: str):
    """An Optuna RDB storage on SQLite in WAL mode with synchronous=NORMAL.

    Optuna writes every suggested parameter in its own transaction; with
    SQLite's defaults each one waits for a sync to disk (about 160 ms per trial
    of 17 parameters here, 30 ms with these settings).  A killed process loses
    nothing committed (only an operating-system crash could drop the last
    transactions), which is what resuming needs.
    """
    import optuna
    import sqlalchemy

    def pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    storage = optuna.storages.RDBStorage(url)
    sqlalchemy.event.listen(storage.engine, "connect", pragmas)
    storage.engine.dispose()          # pooled connections reopen with the pragmas
    return storage


def _open_study(storage, name):
    """Create or load the study; two runs starting together on one new
    database race at creating its tables and the study: the loser retries."""
    import time
    for attempt in range(6):
        try:
            return _open_study_once(storage, name)
        except SpecError as e:
            racing = any(w in e.message for w in ("UNIQUE constraint", "already exists",
                                                  "database is locked"))
            if not racing or attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))


def _open_study_once(storage, name):
    import optuna
    try:
        if isinstance(storage, str) and storage.startswith("sqlite:"):
            storage = _sqlite_storage(storage)
        try:
            return optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                       sampler=optuna.samplers.RandomSampler(),
                                       load_if_exists=True)
        except optuna.exceptions.DuplicatedStudyError:
            # another run created it between the check and the insert
            return optuna.load_study(storage=storage, study_name=name,
                                     sampler=optuna.samplers.RandomSampler())
    except SpecError:
        raise
    except Exception as e:     # bad URL, unreachable database, wrong direction ...
        msg = " ".join(str(e).split()) or type(e).__name__
        raise SpecError(SOURCE, "storage", f"cannot open study {name!r} in {storage!r}: {msg}") from None


def _same_search(study, storage, search: dict) -> None:
    """A study holds one search: a rerun must be the same case, space, sampler, encoding."""
    had = study.user_attrs.get("autopar")
    if had is None:
        if study.get_trials(deepcopy=False):
            raise SpecError(SOURCE, "storage", f"study {study.study_name!r} in {storage!r} "
                            "holds trials that autopar did not make")
        study.set_user_attr("autopar", search)
    elif had != search:
        diff = ", ".join(k for k in search if had.get(k) != search[k])
        raise SpecError(SOURCE, "storage", f"study {study.study_name!r} in {storage!r} is "
                        f"another search (different {diff}); choose another study name")


OWNER = f"{__import__('socket').gethostname()}:{__import__('os').getpid()}"


def _orphaned_trials(study) -> list:
    """RUNNING trials whose run is gone: their owner (``host:pid``) is not
    alive here.  A live run asks a trial and names itself its owner in two
    writes, so a trial seen without an owner is looked at again a moment
    later: still without one, its run died in between."""
    import time
    from optuna.trial import TrialState

    def running():
        return {t.number: t.system_attrs.get("autopar_owner")
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}

    owners = running()
    if any(o is None for o in owners.values()):
        time.sleep(1.0)
        later = running()
        owners = {n: later[n] if o is None else o for n, o in owners.items() if n in later}
    return [n for n, o in owners.items() if not _owner_alive(o)]


def _owner_alive(owner) -> bool:
    """Whether the run that asked a trial (``host:pid``) is still going here."""
    import os
    import socket
    host, _, pid = str(owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_optuna(prob, sampler: str, trials: int, seed, storage, study_name,
                concurrency: int, grid, bar: _Progress, kept: bool = True) -> list[dict]:
    """The optuna backend's run; ``kept``: the study outlives the run (in
    storage, or returned), so that trials no sampler proposed are recorded
    in it too."""
    import optuna
    from optuna.trial import TrialState
    from autopar.search.samplers import optuna_sampler, resumed_seed
    from autopar.search.skeleton import base_sampler
    from autopar.search.trainable import evaluate_params, is_skeleton_problem

    skeleton = is_skeleton_problem(prob)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        name = study_name or default_study_name(prob, sampler, seed)
        study = _open_study(storage, name)
        _same_search(study, storage, {"problem": prob.key, "sampler": sampler,
                                      "encoding": prob.encoder.encoding,
                                      "grid_points": len(grid) if grid else 0})
        # Trials a killed run left RUNNING cannot finish: fail them (they are
        # not part of the table; their layouts are sampled again).  Those of a
        # run still going on this machine (another `autopar tune` on the same
        # study) are left to it.
        for number in _orphaned_trials(study):
            study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        finished = (TrialState.COMPLETE, TrialState.PRUNED)
        old = study.get_trials(deepcopy=False, states=finished)
        study.sampler = optuna_sampler(base_sampler(sampler), prob.encoder,
                                       resumed_seed(seed, len(old)),
                                       concurrency=concurrency,
                                       grid_points=len(grid) if grid else 0)

        def suggest(trial):
            if grid is not None:
                return grid[trial.suggest_int("grid_point", 0, len(grid) - 1)]
            return prob.encoder.suggest(trial)

        def decode(raw):
            if grid is not None:
                return grid[raw["grid_point"]]
            try:
                return prob.encoder.decode(raw)
            except Invalid as e:
                return e

        def tell(t, row):
            if row["state"] == "COMPLETE":
                study.tell(t, row[METRIC])
            else:
                t.set_user_attr("reason", row["reason"])
                study.tell(t, state=TrialState.PRUNED)

        # Skeleton search: a skeleton proposed again is answered from here
        # (the trial is told the known result and marked ``repeat_of``) and
        # is not a new row; ``trials`` counts distinct skeletons.
        cache: dict = {}
        rows: dict[int, dict] = {}
        unrecorded: dict[int, tuple] = {}     # trial -> (start, end), not in the study
        # an interrupt ends the run at its next step (a second one at once)
        with _interrupts_noted() as noted:
            if old:          # resumed: the finished trials' rows, from their parameters
                distinct = [t for t in old if "repeat_of" not in t.user_attrs]
                for t, row in zip(distinct, evaluate_params(prob, [decode(t.params)
                                                                     for t in distinct])):
                    rows[t.number] = row
                    if skeleton and not isinstance(p := decode(t.params), Invalid):
                        cache[prob.encoder.key(p)] = t.number
            done = start = len(rows)
            for row in rows.values():
                bar.update(row)
            if skeleton and grid is None:
                done += _whole_skeleton_space(study, prob, trials - done, storage, rows, cache,
                                              bar, None if kept else unrecorded)
            rng = random.Random(seed if seed is None else seed + len(old))
            while done < trials:
                if noted:
                    raise KeyboardInterrupt
                if storage is not None:
                    # another run on the same study counts too: together they make
                    # the trials asked for (finished, or asked and not yet told)
                    others = _others_trials(study, rows)
                    if done + others >= trials:
                        break
                    want = min(concurrency, trials - done - others)
                else:
                    want = min(concurrency, trials - done)
                asked = []
                try:
                    for _ in range(want):
                        # a trial is in ``asked`` (failed on an interrupt) as soon
                        # as it exists
                        with _interrupts_held():
                            asked.append(study.ask())
                            if storage is not None:
                                asked[-1].storage.set_trial_system_attr(
                                    asked[-1]._trial_id, "autopar_owner", OWNER)
                    params = [suggest(t) for t in asked]
                    fresh, fresh_params, repeats, near = [], [], [], []
                    for t, p in zip(asked, params):
                        k = (prob.encoder.key(p) if skeleton and not isinstance(p, Invalid)
                             else None)
                        if k is not None and k in cache:
                            repeats.append((t, k))
                            # in its place, the nearest skeleton not yet evaluated
                            sk = prob.encoder.nearest_unseen(k, cache, rng)
                            if sk is not None:
                                cache[sk] = None
                                near.append(sk)
                            continue
                        if k is not None:
                            cache[k] = t.number
                        fresh.append(t)
                        fresh_params.append(p)
                    results = evaluate_params(
                        prob, fresh_params + [dict(zip(prob.encoder.searched, sk)) for sk in near])
                    for t, row in zip(fresh, results):
                        tell(t, row)
                        rows[t.number] = row
                        bar.update(row)
                    for sk, row, number in zip(near, results[len(fresh):], _add_trials(
                            study, prob.encoder, near, results[len(fresh):])):
                        cache[sk] = number
                        rows[number] = row
                        bar.update(row)
                    for t, k in repeats:
                        t.set_user_attr("repeat_of", cache[k])
                        tell(t, rows[cache[k]])
                except BaseException:
                    with _interrupts_held():    # interrupted: leave no trial RUNNING
                        for t in asked:
                            study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
                    raise
                done += len(fresh) + len(near)
                if skeleton and not fresh and not near:
                    break                # every skeleton has been evaluated
            if noted:
                raise KeyboardInterrupt
        new = done - start
        frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
    finally:
        optuna.logging.set_verbosity(verbosity)
    when = {n: (t.datetime_start, t.datetime_complete) for n, t in frozen.items()}
    when.update(unrecorded)
    t0 = min((start for start, _ in when.values() if start), default=None)
    out = []
    for n in sorted(rows):
        end = when[n][1]
        row = {"trial": n, **rows[n], "node_id": "",
               "elapsed_s": (end - t0).total_seconds() if end and t0 else math.nan}
        out.append(row)
    return out, study, max(new, 0)


@contextlib.contextmanager
def _signals_to(make):
    """While the block runs, SIGINT and SIGTERM go to ``make(handler)``
    instead of their handler (where it is Python's, in the main thread)."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if callable(handler):
                saved[sig] = handler
                signal.signal(sig, make(handler))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _interrupts_held():
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first
    that arrived to its handler (which raises KeyboardInterrupt): the block
    is never cut off half-way."""
    arrived = []
    try:
        with _signals_to(lambda handler: lambda signum, frame:
                         arrived.append((handler, signum, frame))):
            yield
    finally:
        if arrived:
            handler, signum, frame = arrived[0]
            handler(signum, frame)


@contextlib.contextmanager
def _interrupts_noted():
    """The first SIGINT or SIGTERM while the block runs is noted in the list
    yielded, and the run loop ends at its next step (not wherever the signal
    lands: Python prints and drops a KeyboardInterrupt raised in a library's
    destructor or callback, and a run once went on after its SIGTERM until
    a second one came); a second signal goes to its handler, which raises
    KeyboardInterrupt at once."""
    noted: list[int] = []

    def noting(handler):
        def note(signum, frame):
            noted.append(signum)
            if len(noted) > 1:
                handler(signum, frame)
        return note
    with _signals_to(noting):
        yield noted


def _others_trials(study, rows: dict) -> int:
    """Trials of the study that other runs on it have finished or asked
    (``rows``: this run's); a skeleton proposed again (``repeat_of``) is a
    trial of the study, not a new one."""
    from optuna.trial import TrialState
    live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=live)
               if "repeat_of" not in t.user_attrs) - len(rows)


def _whole_skeleton_space(study, prob, budget: int, storage, rows: dict, cache: dict,
                          bar, unrecorded: dict | None = None) -> int:
    """When the budget covers every skeleton not yet evaluated, there is
    nothing left for the sampler to choose: evaluate them all, a model call
    per ``WHOLE_SPACE_MAX`` layouts, in the space's enumeration order, and
    record them as trials of the study (``whole_space``), or, given
    ``unrecorded`` (the study ends with the run and no sampler will read
    it), number them as the study would and note their start and end there.
    Returns how many (0, and nothing done, when the budget is smaller or
    another run shares the study)."""
    from autopar.search.skeleton import WHOLE_SPACE_MAX, evaluate_all_skeletons
    from autopar.search.trainable import evaluate_params
    enc = prob.encoder
    unseen = [sk for sk in enc.all if sk not in cache]
    if not unseen or len(unseen) > budget:
        return 0
    if storage is not None and _others_trials(study, rows):
        return 0
    start = datetime.datetime.now()
    got = evaluate_all_skeletons(prob, unseen)      # a small space: one gather, one call
    if got is None:
        per_call = max(1, WHOLE_SPACE_MAX * len(enc.all) // max(1, prob.space.size(prob.case)))
        got = []
        for a in range(0, len(unseen), per_call):
            got += evaluate_params(prob, [dict(zip(enc.searched, sk))
                                          for sk in unseen[a:a + per_call]])
    if unrecorded is None:
        numbers = _add_trials(study, enc, unseen, got, "whole_space")
    else:
        first = len(study.get_trials(deepcopy=False))
        numbers = range(first, first + len(unseen))
        end = datetime.datetime.now()
        unrecorded.update((n, (start, end)) for n in numbers)
    for sk, row, number in zip(unseen, got, numbers):
        cache[sk] = number
        rows[number] = row
        bar.update(row)
    return len(unseen)


# --------------------------------------------------------------------------
# The best trial and the outputs

def best_trial(table, fastest: bool = False):
    """The row of the recommended COMPLETE trial, or None: the highest
    sample_rate, and among the trials within 0.1% of it the simplest (no
    offload, less memory, fewer stages...; ``autopar.search.ranking``),
    first run on ties.  ``fastest``: the highest sample_rate, first run on
    ties (the optimum, as co-design measures a system by)."""
    from autopar.search import ranking
    done = table[table["state"] == "COMPLETE"]
    if done.empty:
        return None
    return done.iloc[ranking.fastest(done) if fastest else int(ranking.order(done)[0])]


def best_execution(table, fastest: bool = False) -> dict | None:
    """The best trial's layout as a Calculon execution dict (23 fields)
    (``best_trial``)."""
    row = best_trial(table, fastest)
    if row is None:
        return None
    return execution_from_row(row)




def write_best(table, path) -> dict | None:
    """Write the best execution (Calculon JSON), atomically; returns it (None: nothing written)."""
    from autopar.io.writers import write_json
    ex = best_execution(table)
    if ex is not None:
        write_json(ex, path)
    return ex


def write_trials(table, path) -> None:
    """Write the trials table as CSV, atomically."""
    from autopar.io.writers import write_atomic_csv
    write_atomic_csv(table, path)
