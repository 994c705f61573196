"""An Optuna study kept in storage and shared: opening it (SQLite in WAL mode;
runs starting together on a new database retry), checking that a rerun is
the same search, which run owns which trial (``OWNER``: ``host:pid``), the
runs going on it now (``RUN_MARK``; a run's rank among them gives it its own
seed), the trials a killed run left RUNNING, and the trials other runs have
finished or asked."""
from __future__ import annotations

import contextlib
import os
import socket

from autopar.io.errors import SpecError

SOURCE = "arguments"     # SpecError source: the storage is an argument of tune


def sqlite_file(url):
    """The database file of a ``sqlite:///PATH`` storage URL (None: another
    storage, none, or a database in memory)."""
    if not isinstance(url, str) or not url.startswith("sqlite:"):
        return None
    import pathlib

    import sqlalchemy
    try:
        db = sqlalchemy.engine.make_url(url).database
    except Exception:          # a malformed URL: the storage's own error says so
        return None
    return pathlib.Path(db).absolute() if db and db != ":memory:" else None


@contextlib.contextmanager
def removed_on_failure(made):
    """A block after which the SQLite database file ``made`` (``sqlite_file``)
    is removed with its journal files if the block fails and the file was not
    there before: a failed run leaves no database it created.  An
    interrupted run keeps it (running again resumes)."""
    made = made if made is not None and not made.exists() else None
    try:
        yield
    except Exception:
        if made is not None:
            for f in (made, *(made.with_name(made.name + x) for x in ("-wal", "-shm", "-journal"))):
                with contextlib.suppress(OSError):
                    f.unlink()
        raise


def sqlite_storage(url: str):
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


def open_study(storage, name):
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
            storage = sqlite_storage(storage)
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


def same_search(study, storage, search: dict) -> None:
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


OWNER = f"{socket.gethostname()}:{os.getpid()}"
RUN_MARK = "autopar_run "   # a study user attribute per run on it: RUN_MARK + OWNER


def join_runs(study) -> int:
    """Note this run in the study (``RUN_MARK + OWNER``: its start time) and
    return its rank among the runs on the study now (0: alone, or the first
    to start).  Each run writes its mark before it reads the others', so of
    two runs starting together the later sees the earlier: their ranks
    differ, and so do their sampler seeds (``samplers.run_seed``)."""
    import time
    study.set_user_attr(RUN_MARK + OWNER, time.time())
    live = sorted((v, k[len(RUN_MARK):]) for k, v in study.user_attrs.items()
                  if k.startswith(RUN_MARK) and v is not None
                  and (k[len(RUN_MARK):] == OWNER or owner_alive(k[len(RUN_MARK):])))
    return [owner for _, owner in live].index(OWNER)


def leave_runs(study) -> None:
    study.set_user_attr(RUN_MARK + OWNER, None)


def other_runs_trials(study) -> set[int]:
    """Numbers of the trials that runs still going on the study (another
    process here, its mark set) asked: theirs to report, not this run's."""
    from optuna.trial import TrialState
    going = {k[len(RUN_MARK):] for k, v in study.user_attrs.items()
             if k.startswith(RUN_MARK) and v is not None and k[len(RUN_MARK):] != OWNER}
    going = {o for o in going if owner_alive(o)}
    if not going:
        return set()
    done = (TrialState.COMPLETE, TrialState.PRUNED)
    return {t.number for t in study.get_trials(deepcopy=False, states=done)
            if t.system_attrs.get("autopar_owner") in going}


def orphaned_trials(study) -> list:
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
    return [n for n, o in owners.items() if not owner_alive(o)]


def owner_alive(owner) -> bool:
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


def others_trials(study, rows: dict) -> int:
    """Trials of the study that other runs on it have finished or asked
    (``rows``: this run's); a skeleton proposed again (``repeat_of``) is a
    trial of the study, not a new one."""
    from optuna.trial import TrialState
    live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=live)
               if "repeat_of" not in t.user_attrs) - len(rows)
